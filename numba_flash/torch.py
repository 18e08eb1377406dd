"""PyTorch autograd for numba_flash: ``attention`` runs ``forward`` and, on ``loss.backward()``, ``backward``.

    from numba_flash.torch import attention
    out = attention(q, k, v, causal=True)    # CUDA tensors, float32 / float16 / bfloat16
    out.float().square().sum().backward()    # q.grad, k.grad, v.grad from numba_flash.backward

Tensors are viewed, never copied (``__cuda_array_interface__``), and every kernel runs on
PyTorch's current stream of the tensors' device. The forward saves q, k, v, out and the fp32
logsumexp L (one number per query row), never the N×N probabilities. Importing this module
needs PyTorch; the rest of numba_flash does not.
"""
from __future__ import annotations

try:
    import torch
except ImportError as e:  # a clear message instead of a NameError later
    raise ImportError(
        "numba_flash.torch needs PyTorch (pip install torch); numba_flash.forward and "
        "numba_flash.backward work without it on CuPy, Numba or NumPy arrays"
    ) from e

from .api import forward, window_pair
from .blocks.mask import window_kind
from .backward import backward

__all__ = ["attention", "FlashAttentionFunction"]


class FlashAttentionFunction(torch.autograd.Function):
    """out = softmax(Q Kᵀ · scale) V with a recomputing (FA2) backward; see ``attention``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic=True, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None):
        out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, alibi_slopes=alibi_slopes)
        # the slopes as saved tensors too: autograd then notices an in-place change before the backward
        ctx.save_for_backward(q, k, v, out, lse, *(() if alibi_slopes is None else (alibi_slopes,)))
        ctx.causal = causal
        ctx.softmax_scale = softmax_scale
        ctx.deterministic = deterministic
        ctx.mods = dict(window_size=window_size, softcap=softcap)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, *slopes = ctx.saved_tensors
        # The kernels read any strides correctly, so a strided dout is used in place. Only a last
        # dim that is not contiguous (e.g. the all-zero strides of the gradient of out.sum(),
        # an expanded scalar) is copied: there each lane would read a scattered element.
        if dout.shape[-1] > 1 and dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = backward(q, k, v, out, lse, dout, causal=ctx.causal, softmax_scale=ctx.softmax_scale,
                              deterministic=ctx.deterministic, alibi_slopes=slopes[0] if slopes else None, **ctx.mods)
        return dq, dk, dv, None, None, None, None, None, None


def attention(q, k, v, *, causal=False, softmax_scale=None, deterministic=True, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None):
    """Differentiable exact attention on PyTorch CUDA tensors.

    Arguments, shapes (including GQA/MQA and the batch-less forms), dtypes, the bottom-right
    causal alignment and the default scale are those of ``numba_flash.forward``; returns out
    (q's shape and dtype). Gradients flow to q, k and v through ``numba_flash.backward``
    (fp32 accumulation; fp16/bf16, and fp32 as 3xTF32, on tensor cores where ``forward`` would use
    them, see ``numba_flash.explain_backward``). deterministic=True (default): bitwise repeatable
    gradients (FA2's deterministic dQ splits, or a separate dQ kernel); False: dq by FA2's atomic adds
    on the tensor-core paths (last bits vary run to run; fp16 d128 3 % faster than the default on an
    H200), as ``numba_flash.backward``. window_size, softcap, alibi_slopes: flash-attn's sliding window,
    softcapping and ALiBi, as ``numba_flash.forward`` (no gradient for the slopes: they are constants, as
    in flash-attn).
    Double backward is not supported.
    """
    if alibi_slopes is not None and getattr(alibi_slopes, "requires_grad", False):
        raise ValueError("alibi_slopes requires grad; the kernels give none for the slopes (as flash-attn): pass "
                         "alibi_slopes.detach()")
    n_k = k.shape[-2] if hasattr(k, "shape") and len(k.shape) >= 2 else 0
    window = tuple(-1 if side >= n_k else side for side in window_pair(window_size))  # as api.validate has it
    try:
        causal_flag = bool(causal)
    except (TypeError, ValueError):  # not a bool: forward's validation says what is accepted
        causal_flag = False
    mods = window_kind(causal_flag, window) == "window" or softcap or alibi_slopes is not None
    if mods and torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in (q, k, v)):
        # the backward has the mods on the mma kernels only: say so now, not at loss.backward()
        if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 128:
            raise NotImplementedError(
                f"window_size / softcap / alibi_slopes with gradients: the backward builds them into the mma "
                f"kernels only (float16/bfloat16, head dim <= 128); got {q.dtype}, head dim {q.shape[-1]} (the "
                "forward alone runs them, under torch.no_grad())")
    return FlashAttentionFunction.apply(q, k, v, causal, softmax_scale, deterministic, window_size, softcap,
                                        alibi_slopes)
