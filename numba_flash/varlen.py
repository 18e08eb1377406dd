"""Packed sequences (flash-attn's varlen): attention over B sequences of different lengths in one call.

    out, lse = numba_flash.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal=True)
    dq, dk, dv = numba_flash.varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, causal=True)

q is (total_q, H, d) and k, v (total_k, Hkv, d): the rows of the sequences one after the other, as flash-attn
packs them; sequence b has rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and keys cu_seqlens_k[b] ..
cu_seqlens_k[b + 1] - 1. Nothing is padded or copied: the kernels are the dense tensor-core kernels with a
varlen entry (blocks.entry.varlen_entry) that finds each block's sequence and runs the dense body on it, so
causal (bottom-right per sequence), sliding windows, softcap and ALiBi ((H,) or (B, H) slopes) mean per
sequence what they mean for one dense sequence. The grids cover max_seqlen_q rows (keys) of every sequence;
blocks whose tile lies past their sequence's end return at once (the backward's prep and convert run every block:
they write the padding rows of the scratch).
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import arrays, backward_plan
from .api import (MMA_BWD_MAX_HEAD_DIM, MMA_MAX_HEAD_DIM, _on_device, choose_kernel, launch_mma_forward, side_array,
                  window_pair)
from .api import validate as _validate
from .backward import choose_backward, dq_scheme, tensor_core_scratch, validate_backward
from .blocks import schedule
from .blocks.mask import window_bounds

__all__ = ["varlen_forward", "varlen_backward", "check_seqlens"]


def _check_max(name: str, x: Any) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0 (the longest sequence's length); got {x!r}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0; got {x}")
    return int(x)


def _check_cu(name: str, cu: Any, kind_q: str, device) -> int:
    """B, the number of sequences, of a cu_seqlens array: int32, 1-D, B + 1 >= 2 entries, where q is."""
    shape = side_array(name, cu, kind_q, device, "int32", "(B + 1,)")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name} has shape {shape}; accepted: (B + 1,) with B >= 1 sequences")
    return shape[0] - 1


def _host_ints(cu: Any) -> np.ndarray:
    """cu_seqlens on the host (device arrays: one copy, which waits for the stream)."""
    kind = arrays.kind_of(cu)
    if kind == arrays.NUMPY:
        return np.asarray(cu)
    if kind == arrays.TORCH:
        return cu.detach().cpu().numpy()
    if kind == arrays.CUPY:
        return cu.get()
    from numba import cuda

    return cuda.as_cuda_array(cu).copy_to_host()


def check_seqlens(name: str, cu: np.ndarray, total: int, max_seqlen: int, max_name: str) -> None:
    """ValueError unless cu (host int32 offsets) starts at 0, never decreases, ends at ``total`` (the packed
    rows) and has no sequence longer than max_seqlen (the grid covers that many rows of each)."""
    if cu[0] != 0:
        raise ValueError(f"{name}[0] = {int(cu[0])}; the offsets start at 0")
    lens = np.diff(cu.astype(np.int64))
    if (lens < 0).any():
        b = int(np.argmax(lens < 0))
        raise ValueError(f"{name} decreases at sequence {b} ({int(cu[b])} -> {int(cu[b + 1])}); the offsets never "
                         "decrease")
    if cu[-1] != total:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} but the packed arrays hold {total} rows; they must be equal")
    if len(lens) and lens.max() > max_seqlen:
        b = int(np.argmax(lens))
        raise ValueError(f"sequence {b} has {int(lens[b])} rows by {name} but {max_name} = {max_seqlen}; "
                         f"{max_name} must be at least the longest sequence")


def _problem(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size, softcap, alibi_slopes,
             check: bool, out=None, lse=None, dout=None):
    """The validated Problem of a varlen call (B sequences, n_q / n_k the longest), cu_seqlens checked."""
    max_q = _check_max("max_seqlen_q", max_q)
    max_k = _check_max("max_seqlen_k", max_k)
    kind_q = arrays.kind_of(q)
    if kind_q is None or (kind_q == arrays.TORCH and not q.is_cuda):  # before the offsets are compared with it
        _validate(q, k, v)  # raises, naming q and what is accepted
    device = arrays.device_of(q)
    B = _check_cu("cu_seqlens_q", cu_q, kind_q, device)
    Bk = _check_cu("cu_seqlens_k", cu_k, kind_q, device)
    if Bk != B:
        raise ValueError(f"cu_seqlens_q holds {B} sequences and cu_seqlens_k {Bk}; they must hold the same number")
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, packed=(B, max_q, max_k))
    if out is None:
        p = _validate(q, k, v, **kw)
    else:
        p = validate_backward(q, k, v, out, lse, dout, **kw)
    if not isinstance(check, (bool, np.bool_)):
        raise TypeError(f"check_seqlens must be a bool; got {check!r}")
    if check:
        check_seqlens("cu_seqlens_q", _host_ints(cu_q), p.q_shape[0], max_q, "max_seqlen_q")
        check_seqlens("cu_seqlens_k", _host_ints(cu_k), arrays.shape_of(k)[0], max_k, "max_seqlen_k")
    return p


def _refuse(p, family: str, reasons: list, what: str) -> None:
    """NotImplementedError unless the dispatch chose the mma kernels (the only ones with a varlen entry)."""
    if family != "mma":
        raise NotImplementedError(
            f"varlen {what}: built into the 'mma' tensor-core kernels only (float16/bfloat16, head dim <= "
            f"{MMA_BWD_MAX_HEAD_DIM if what == 'backward' else MMA_MAX_HEAD_DIM}, "
            f"sm_80+, 16-byte aligned rows); this call would run {family!r}: {reasons[-1]}")


SCRATCH_PER_DQ = 4  # the dQ planes may take at most this many times the packed dQ's fp32 bytes (or 1 GiB)


def dq_for_pack(p, cfg, deterministic: bool) -> tuple:
    """backward.dq_scheme for a pack, whose scratch is that of B sequences of the longest length.

    A long pack's plane passes the dense splits' 1 GiB budget at once (64 sequences of up to 8192 rows, H16
    d128: 4.3 GB), which would send it to the dq kernel: at 0.78 of the dense forward+backward's TFLOP/s where
    one split ran at 0.93 (benchmarks/DESIGN.md). So the splits may take one plane past that budget, and every
    dQ-in-dkdv scheme at most SCRATCH_PER_DQ times the packed dQ (fp32) or 1 GiB: a lopsided pack (one long
    sequence among many short ones), whose plane is mostly padding, takes the dq kernel (no planes) instead,
    with deterministic=False too."""
    plane = p.B * p.H * schedule.padded_rows(p.n_q) * cfg["head_dim"] * 4
    cap = max(schedule.DQ_SCRATCH_MAX_BYTES, SCRATCH_PER_DQ * p.q_shape[0] * p.H * cfg["head_dim"] * 4)
    if plane > cap and "dkdv_atomic" in cfg:
        return "kernel", None, (f"dQ: a separate dq kernel over Q tiles: one fp32 plane of dQ for {p.B} sequences "
                                f"of {p.n_q} rows ({plane} B) is past {SCRATCH_PER_DQ} x the packed dQ's fp32 "
                                f"bytes or 1 GiB ({cap} B)")
    return dq_scheme(p, cfg, deterministic, scratch_max=max(schedule.DQ_SCRATCH_MAX_BYTES, plane))


def _views(xs, stream, B):
    """Device views of packed (total, heads, d) arrays as batches of B sequences (arrays.packed_as_batch)."""
    return tuple(arrays.packed_as_batch(arrays.to_device_view(x, stream, ndim=3), B) for x in xs)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                   softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, check_seqlens=True):
    """Exact attention over packed sequences: (out, lse).

    Args:
        q: (total_q, H, d) float16 / bfloat16; k, v: (total_k, Hkv, d), H % Hkv == 0 (GQA / MQA). Arrays as
            ``numba_flash.forward`` takes them (device arrays are viewed, NumPy copied).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,), where q is: sequence b's rows and keys start at entry b and end
            before entry b + 1 (0 first, the packed totals last).
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's query (key) count; the grids cover that
            many rows of every sequence, so a tight value saves empty blocks.
        causal, softmax_scale, window_size, softcap, alibi_slopes: as ``numba_flash.forward``, per sequence
            (causal aligned bottom-right: query i of sequence b sees its key j iff j <= i + Nk_b - Nq_b;
            alibi_slopes (H,) or (B, H)).
        check_seqlens: True (default) reads the offsets and checks them (0 first, never decreasing, the totals
            last, no sequence past its max): device offsets are copied to the host, which waits for the stream.
            False skips that (as flash-attn, which never checks): wrong offsets are then not an error but
            reads and writes outside the arrays (an offset past the packed total), or rows left as whatever
            the allocator returned (rows no sequence covers). numba_flash.torch checks on the device instead
            (asynchronous asserts).

    Returns:
        out (total_q, H, d) of q's dtype and kind, and lse float32 (H, total_q) (flash-attn's packed layout;
        natural log, -inf for a row that sees no key, whose out row is 0).

    Raises:
        NotImplementedError where the tensor-core kernels cannot run it (float32, head dim > 256; the backward
        above d = 128 where the GPU's blocks lack the tiles' shared memory; unaligned rows, GPUs below sm_80): varlen has no SIMT or tf32x3 kernel. TypeError / ValueError for bad arguments.
    """
    left, right = window_pair(window_size)
    p = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 (left, right), softcap, alibi_slopes, check_seqlens)
    with _on_device(p.device):
        stream = arrays.current_stream(q)
        out_obj, out_dev = arrays.empty_like_kind(p.kind, q, p.q_shape, p.dtype, stream)
        lse_obj, lse_dev = arrays.empty_like_kind(p.kind, q, p.lse_shape, "float32", stream)
        if not (p.q_shape[0] * p.H and arrays.shape_of(k)[0]):  # no kernel runs; one that cannot take it refuses
            _refuse(p, *choose_kernel(p, "auto")[::2], "forward")
        if p.q_shape[0] * p.H and not arrays.shape_of(k)[0]:  # no keys at all: every row sees none
            out_obj = arrays.alloc_like_kind(p.kind, q, p.q_shape, p.dtype, stream, zeroed=True)[0]
            lse_obj = arrays.full_like_kind(p.kind, q, p.lse_shape, "float32", -np.inf, stream)[0]
        elif p.q_shape[0] * p.H:
            qd, kd, vd = _views((q, k, v), stream, p.B)
            family, cfg, reasons = choose_kernel(p, "auto", (qd, kd, vd))
            _refuse(p, family, reasons, "forward")
            cu = tuple(arrays.to_device_view(x, stream, ndim=1) for x in (cu_seqlens_q, cu_seqlens_k))
            alibi = None if alibi_slopes is None else arrays.to_device_view(alibi_slopes, stream, 2)
            out_b, lse_b = arrays.packed_as_batch(out_dev, p.B), arrays.packed_as_batch(lse_dev, p.B)
            mods = p.mods
            launch_mma_forward(qd, kd, vd, out_b, lse_b, cfg, causal=p.mask_causal, softmax_scale=p.softmax_scale,
                               stream=stream, layout_checked=True, mods=mods,
                               window=window_bounds(p.causal, p.window_size) if mods.window else (0, 0),
                               softcap=p.softcap, alibi=alibi, varlen=(*cu, p.n_q, p.n_k))
        return (arrays.to_host_kind(p.kind, out_obj, p.dtype, stream),
                arrays.to_host_kind(p.kind, lse_obj, "float32", stream))


def varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal=False, softmax_scale=None, deterministic=True, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, check_seqlens=True):
    """Gradients (dq, dk, dv) of ``varlen_forward``, packed as q, k, v.

    Arguments as ``varlen_forward`` plus its out and lse ((H, total_q) float32) and dout (q's shape and dtype).
    deterministic: as ``numba_flash.backward`` (True: bitwise repeatable, the deterministic dQ splits or the dq
    kernel; False: dQ by atomic adds). dk, dv are summed over each GQA group. The scratch is that of a dense
    batch of B sequences of max_seqlen_q rows: two fp32 numbers per row, plus where the dK/dV kernel forms dQ
    one fp32 (B·H, max_seqlen_q padded to 128, 64, 128, 192 or 256) plane per split (64 sequences of up to 8192 rows,
    H = 16: 4.3 GB a plane; ``dq_for_pack`` says how many, and where the planes would be mostly padding, none).
    """
    left, right = window_pair(window_size)
    p = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                 (left, right), softcap, alibi_slopes, check_seqlens, out, lse, dout)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")
    kv_shape = arrays.shape_of(k)
    kinds = (p.kind, arrays.kind_of(k), arrays.kind_of(v))
    with _on_device(p.device):
        stream = arrays.current_stream(q)
        # every packed row belongs to a sequence (check_seqlens), whose blocks write all its rows; with no
        # queries or no keys at all no kernel runs and the gradients are zeros
        run = bool(p.q_shape[0] * p.H and kv_shape[0])
        if not run:  # no kernel runs, but one that cannot take the inputs is refused all the same
            _refuse(p, *choose_backward(p, "auto")[::2], "backward")
        alloc = arrays.empty_like_kind if run else arrays.zeros_like_kind
        dq_obj, dq_dev = alloc(kinds[0], q, p.q_shape, p.dtype, stream)
        dk_obj, dk_dev = alloc(kinds[1], k, kv_shape, p.dtype, stream)
        dv_obj, dv_dev = alloc(kinds[2], v, kv_shape, p.dtype, stream)
        if run:
            qd, kd, vd, od, dod = _views((q, k, v, out, dout), stream, p.B)
            family, cfg, reasons = choose_backward(p, "auto", (qd, kd, vd, dod))
            _refuse(p, family, reasons, "backward")
            cu = tuple(arrays.to_device_view(x, stream, ndim=1) for x in (cu_seqlens_q, cu_seqlens_k))
            lse_b = arrays.packed_as_batch(arrays.to_device_view(lse, stream, ndim=2), p.B)
            grads = tuple(arrays.packed_as_batch(x, p.B) for x in (dq_dev, dk_dev, dv_dev))
            scheme, splits, _ = dq_for_pack(p, cfg, deterministic)
            # a dense batch's scratch for B sequences of the longest length; the planes zeroed
            l2, dd, dq_acc = tensor_core_scratch(p, q, cfg, scheme, splits, stream)
            alibi = None if alibi_slopes is None else arrays.to_device_view(alibi_slopes, stream, 2)
            mods = p.mods
            backward_plan.launch_mma(qd, kd, vd, od, dod, lse_b, l2, dd, *grads, causal=p.mask_causal,
                                     softmax_scale=p.softmax_scale, dtype=p.dtype, d=p.d, config=cfg, stream=stream,
                                     dq_acc=dq_acc, dq_splits=splits, mods=mods,
                                     window=window_bounds(p.causal, p.window_size) if mods.window else (0, 0),
                                     softcap=p.softcap, alibi=alibi, varlen=(*cu, p.n_q, p.n_k))
        return tuple(arrays.to_host_kind(kind, obj, p.dtype, stream)
                     for kind, obj in zip(kinds, (dq_obj, dk_obj, dv_obj)))

