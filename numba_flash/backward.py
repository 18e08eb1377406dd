"""Public ``backward``: gradients of attention from the forward's outputs (FA2, section 3.6.7).

    out, lse = numba_flash.forward(q, k, v, causal=True)
    dq, dk, dv = numba_flash.backward(q, k, v, out, lse, dout, causal=True)

The forward's checks (``api.validate``) plus the backward's own arguments, then the three SIMT
kernels of ``kernels.simt_backward`` (D, dK/dV, dQ). For PyTorch autograd see ``numba_flash.torch``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from . import arrays
from .api import _ACCEPTED_ARRAYS, Problem, _on_device, validate
from .kernels import simt_backward


def validate_backward(q, k, v, out, lse, dout, *, causal: Any = False, softmax_scale: Any = None) -> Problem:
    """``api.validate`` for q, k, v, then: out and dout like q, lse float32 of shape q.shape[:-1]."""
    p = validate(q, k, v, causal=causal, softmax_scale=softmax_scale)
    wanted = (
        ("out", out, p.q_shape, p.dtype, "q's shape", "q's dtype"),
        ("dout", dout, p.q_shape, p.dtype, "q's shape", "q's dtype"),
        ("lse", lse, p.lse_shape, "float32", "q.shape[:-1]", "float32, as forward returns it"),
    )
    for name, x, shape, dtype, shape_why, dtype_why in wanted:
        kind = arrays.kind_of(x)
        if kind is None:
            raise TypeError(f"{name} must be {_ACCEPTED_ARRAYS}; got {type(x).__module__}.{type(x).__name__}")
        if kind == arrays.TORCH and not x.is_cuda:
            raise TypeError(f"{name} is a PyTorch tensor on {x.device}; pass a CUDA tensor (or a NumPy array)")
        if (kind == arrays.NUMPY) != (p.kind == arrays.NUMPY):
            raise TypeError(
                f"{name} is a {kind} array but q is a {p.kind} array; all six must be on the GPU "
                f"or all be NumPy arrays"
            )
        dt = arrays.dtype_name(x)
        if dt != dtype:
            raise TypeError(f"{name} has dtype {dt}; accepted: {dtype} ({dtype_why})")
        shp = arrays.shape_of(x)
        if shp != shape:
            raise ValueError(f"{name} has shape {shp}; accepted: {shape} ({shape_why}, q is {p.q_shape})")
        dev = arrays.device_of(x)
        if dev is not None and p.device is not None and dev != p.device:
            raise ValueError(f"{name} is on device {dev} but q, k, v are on device {p.device}; put them on one GPU")
    return p


def explain_backward(q, k, v, *, causal=False, softmax_scale=None) -> str:
    """Which kernels ``backward`` runs for inputs like these, their tile configs, and why."""
    p = validate(q, k, v, causal=causal, softmax_scale=softmax_scale)
    cfg_kv, cfg_q = simt_backward.backward_configs(p.d)
    lines = [
        "simt backward: D = rowsum(dO∘O), then dK/dV over K/V tiles, then dQ over Q tiles (no atomics)",
        f"dkdv: {cfg_kv.block_k}-row K/V tiles x {cfg_kv.block_q}-row Q tiles, {cfg_kv.threads} threads, "
        f"{cfg_kv.smem_bytes} B shared memory",
        f"dq: {cfg_q.block_q}-row Q tiles x {cfg_q.block_k}-row K/V tiles, {cfg_q.threads} threads, "
        f"{cfg_q.smem_bytes} B shared memory",
    ]
    if cfg_kv.head_dim != p.d:
        lines.append(f"head dim {p.d} is zero-padded to {cfg_kv.head_dim} inside the kernels")
    if p.dtype in ("float16", "bfloat16"):
        lines.append(f"{p.dtype}: widened to fp32 and computed on the SIMT cores (no tensor-core backward)")
    if p.H != p.Hkv:
        lines.append(f"GQA: each dK/dV block loops over the {p.H // p.Hkv} query heads of its group")
    return "\n".join(lines)


def _zeros_like_kind(kind: str, ref: Any, shape: tuple, dtype: str, stream):
    """Zero gradients for the degenerate cases (no queries or no keys): no kernel runs."""
    if kind == arrays.TORCH:
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=ref.device)
    if kind == arrays.CUPY:
        import cupy

        with cupy.cuda.Device(ref.device.id):
            return cupy.zeros(shape, dtype=dtype)
    storage = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    dev = cuda.to_device(np.zeros(shape, storage), stream=stream)
    return arrays.to_host_kind(kind, dev, dtype, stream)


def backward(q, k, v, out, lse, dout, *, causal=False, softmax_scale=None):
    """Gradients (dq, dk, dv) of attention, recomputing P tile by tile from the saved L.

    Args:
        q, k, v: the forward's inputs, exactly as for ``forward`` (shapes (B, H, Nq, d) and
            (B, Hkv, Nk, d) or the batch-less forms; GQA/MQA with H % Hkv == 0; float32,
            float16 or bfloat16; CuPy / PyTorch CUDA / Numba / ``__cuda_array_interface__``
            arrays viewed without copies, or NumPy arrays copied to the GPU and back).
        out, lse: the forward's outputs for these q, k, v and the same ``causal`` and
            ``softmax_scale``: out of q's shape and dtype, lse float32 of shape q.shape[:-1]
            (natural-log logsumexp; -inf marks a fully masked row).
        dout: the gradient of the loss with respect to out, q's shape and dtype. Any strides
            are read correctly; a last dim that is not contiguous costs coalescing.
        causal, softmax_scale: as for ``forward`` (mask aligned bottom-right: query i sees key
            j iff j <= i + Nk - Nq; scale defaults to 1/sqrt(d)).

    Returns:
        (dq, dk, dv) with the shape, dtype and kind of q, k and v respectively. For GQA/MQA,
        dk and dv are summed over the query heads of each group. A fully masked query row
        contributes nothing and gets dq = 0; keys no query sees get dk = dv = 0. Nq = 0 or
        Nk = 0 give zero (or empty) gradients.

    Method: FA2 (section 3.6.7). D = rowsum(dO ∘ O); a kernel over K/V tiles keeps dK, dV in
    registers while recomputing P = exp(S·scale - L) and dS = P ∘ (dO Vᵀ - D) over the Q tiles;
    a second kernel over Q tiles recomputes P and dS and accumulates dQ = scale·dS K. No atomic
    adds anywhere, so the same inputs give bitwise the same gradients every run. Accumulation
    is fp32. float16 / bfloat16 are widened to fp32 and run on the SIMT cores: there is no
    tensor-core backward yet, so half precision is not faster than float32 (``explain_backward``
    says which configs run). Head dims are zero-padded to the next compiled size as in forward.

    Stream: as ``forward`` (the inputs' framework stream; device inputs return without
    synchronising, NumPy inputs after the copy back). Scratch: one fp32 array of lse's size.

    Raises:
        TypeError / ValueError naming what was given and what is accepted: the forward's checks
        for q, k, v, plus out / dout shape and dtype (q's), lse shape (q.shape[:-1]) and dtype
        (float32), all six on one device (or all NumPy).
    """
    p = validate_backward(q, k, v, out, lse, dout, causal=causal, softmax_scale=softmax_scale)
    cfgs = simt_backward.backward_configs(p.d)
    kv_shape = arrays.shape_of(k)
    kinds = (p.kind, arrays.kind_of(k), arrays.kind_of(v))
    with _on_device(p.device):
        stream = arrays.current_stream(q)
        if p.B * p.H * p.n_q * p.n_k == 0:
            return tuple(_zeros_like_kind(kind, ref, shape, p.dtype, stream)
                         for kind, ref, shape in zip(kinds, (q, k, v), (p.q_shape, kv_shape, kv_shape)))
        dq_obj, dq_dev = arrays.empty_like_kind(kinds[0], q, p.q_shape, p.dtype, stream)
        dk_obj, dk_dev = arrays.empty_like_kind(kinds[1], k, kv_shape, p.dtype, stream)
        dv_obj, dv_dev = arrays.empty_like_kind(kinds[2], v, kv_shape, p.dtype, stream)
        _, delta = arrays.empty_like_kind(p.kind, q, (p.B, p.H, p.n_q), "float32", stream)  # D, scratch
        qd, kd, vd, od, dod = (arrays.to_device_view(x, stream) for x in (q, k, v, out, dout))
        lse_d = arrays.to_device_view(lse, stream, ndim=3)
        simt_backward.launch(
            cfgs, qd, kd, vd, od, dod, lse_d, delta, arrays.as_4d(dq_dev), arrays.as_4d(dk_dev),
            arrays.as_4d(dv_dev),
            causal=p.causal, softmax_scale=p.softmax_scale, dtype=p.dtype, d=p.d, stream=stream,
        )
        return tuple(arrays.to_host_kind(kind, obj, p.dtype, stream)
                     for kind, obj in zip(kinds, (dq_obj, dk_obj, dv_obj)))
