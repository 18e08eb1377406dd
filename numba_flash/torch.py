"""PyTorch ops for numba_flash: ``attention`` runs ``forward`` and, on ``loss.backward()``, ``backward``.

    from numba_flash.torch import attention
    out = attention(q, k, v, causal=True)    # CUDA tensors, float32 / float16 / bfloat16
    out.float().square().sum().backward()    # q.grad, k.grad, v.grad from numba_flash.backward

The kernels are registered as PyTorch custom ops, so ``torch.compile`` (``fullgraph=True``
included) sees one opaque node per call instead of tracing the Python that launches them. The ops
are what tracing records (torch.compile, dispatch modes such as fake tensors, functorch) and what meta
tensors run; an eager call runs the op's body itself, through an ``autograd.Function`` where inputs
require grad, skipping the dispatcher's ~13 µs per call (~50 with gradients; ``_eager``):

    torch.ops.numba_flash.fwd(q, k, v, causal, softmax_scale, window_left, window_right, softcap,
                              alibi_slopes, deterministic) -> (out, lse)
    torch.ops.numba_flash.bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                              window_left, window_right, softcap, alibi_slopes) -> (dq, dk, dv)
    torch.ops.numba_flash.decode(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, block_table,
                                 cache_batch_idx, cache_leftpad, causal, window_left, window_right, softcap,
                                 alibi_slopes) -> (out, lse)
    torch.ops.numba_flash.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                     deterministic) -> (out, lse)
    torch.ops.numba_flash.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, softmax_scale, deterministic, window_left,
                                     window_right, softcap, alibi_slopes) -> (dq, dk, dv)

Each has a fake (meta) implementation giving the outputs' shapes, dtypes and (contiguous) strides,
``fwd`` has its autograd formula (``bwd``; ``deterministic`` is the backward's switch, carried by
the forward op because autograd sees only its inputs) and none of them mutates an input.
Tensors are viewed, never copied (``__cuda_array_interface__``); every kernel runs on PyTorch's
current stream of the tensors' device and allocates through PyTorch's allocator, with no host
synchronisation, so the calls can be captured in a CUDA graph once each shape has run eagerly
(the first call compiles). The forward saves q, k, v, out and the fp32 logsumexp L (one number
per query row), never the N×N probabilities. Importing this module needs PyTorch; the rest of
numba_flash does not.
"""
from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

try:
    import torch
except ImportError as e:  # a clear message instead of a NameError later
    raise ImportError(
        "numba_flash.torch needs PyTorch (pip install torch); numba_flash.forward and "
        "numba_flash.backward work without it on CuPy, Numba or NumPy arrays"
    ) from e
from torch.autograd.function import once_differentiable  # noqa: E402

from .api import MMA_BWD_MAX_HEAD_DIM, forward, unbounded_past_keys, window_pair
from .backward import backward, smem_blockers
from .blocks.mask import window_kind
from .decode import decode as _decode
from .varlen import varlen_backward, varlen_forward

__all__ = ["attention", "decode", "varlen_attention", "fwd", "bwd", "decode_op", "varlen_fwd", "varlen_bwd"]

Tensor = torch.Tensor


def _fwd_body(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], window_left: int,
              window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """``numba_flash.forward`` as an op: (out, lse). deterministic is unused here (the backward's)."""
    return forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                   softcap=softcap, alibi_slopes=alibi_slopes)


fwd = torch.library.custom_op("numba_flash::fwd", mutates_args=())(_fwd_body)


@fwd.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


def _bwd_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
              softmax_scale: Optional[float], deterministic: bool, window_left: int, window_right: int, softcap: float,
              alibi_slopes: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``numba_flash.backward`` as an op: (dq, dk, dv)."""
    # The kernels read any strides correctly, so a strided dout is used in place. Only a last dim that is
    # not contiguous (e.g. the all-zero strides of the gradient of out.sum(), an expanded scalar) is
    # copied: there each lane would read a scattered element.
    if dout.shape[-1] > 1 and dout.stride(-1) != 1:
        dout = dout.contiguous()
    return backward(q, k, v, out, lse, dout, causal=causal, softmax_scale=softmax_scale,
                    deterministic=deterministic, window_size=(window_left, window_right), softcap=softcap,
                    alibi_slopes=alibi_slopes)


bwd = torch.library.custom_op("numba_flash::bwd", mutates_args=())(_bwd_body)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left, window_right, softcap,
              alibi_slopes):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic = inputs
    out, lse = output
    # the slopes as saved tensors too: autograd then notices an in-place change before the backward
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.args = (causal, softmax_scale, deterministic, window_left, window_right, softcap)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse, run=bwd):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    causal, softmax_scale, deterministic, window_left, window_right, softcap = ctx.args
    dq, dk, dv = run(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left, window_right,
                     softcap, alibi_slopes)
    return dq, dk, dv, None, None, None, None, None, None, None


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _eager_function(name, body, setup_context, backward, backward_body):
    """An autograd.Function for an op's eager path with its gradient (see ``_eager``): the op's body, its
    setup_context, and its autograd formula running ``backward_body`` (the backward op's body) in place of the op."""

    def forward(ctx, *inputs):
        output = body(*inputs)
        setup_context(ctx, inputs, output)
        return output

    @once_differentiable
    def run_backward(ctx, dout, dlse):
        return backward(ctx, dout, dlse, backward_body)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(run_backward)})


_Attention = _eager_function("_Attention", _fwd_body, _fwd_setup_context, _fwd_backward, _bwd_body)


def _user_fwd_body(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic,
                   mask_mod, score_mod, dropout_p=0.0, dropout_seed=None):
    """_fwd_body with user mods (Python functions) or dropout (a seed per call): no op, the eager
    autograd.Function only."""
    return forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                   softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
                   dropout_p=dropout_p, dropout_seed=dropout_seed)


def _user_setup_context(ctx, inputs, output):
    _fwd_setup_context(ctx, inputs[:10], output)
    ctx.user_mods = inputs[10:12]
    ctx.dropout = inputs[12:14]


def _user_backward(ctx, dout, _dlse, run=None):
    """_fwd_backward with the user mods (numba_flash.backward's mask_mod / score_mod: the score mod's grad)."""
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    causal, softmax_scale, deterministic, window_left, window_right, softcap = ctx.args
    mask_mod, score_mod = ctx.user_mods
    dropout_p, dropout_seed = ctx.dropout
    if dout.shape[-1] > 1 and dout.stride(-1) != 1:  # as _bwd_body
        dout = dout.contiguous()
    dq, dk, dv = backward(q, k, v, out, lse, dout, causal=causal, softmax_scale=softmax_scale,
                          deterministic=deterministic, window_size=(window_left, window_right), softcap=softcap,
                          alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod, dropout_p=dropout_p,
                          dropout_seed=dropout_seed)
    return (dq, dk, dv) + (None,) * 11


_UserModAttention = _eager_function("_UserModAttention", _user_fwd_body, _user_setup_context, _user_backward, None)


def _decode_body(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
                 softmax_scale: Optional[float], num_splits: Optional[int], block_table: Optional[Tensor] = None,
                 cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                 causal: bool = True, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                 alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``numba_flash.decode`` as an op: (out, lse)."""
    return _decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                   num_splits=num_splits, block_table=block_table, cache_batch_idx=cache_batch_idx,
                   cache_leftpad=cache_leftpad, causal=causal, window_size=(window_left, window_right),
                   softcap=softcap, alibi_slopes=alibi_slopes)


decode_op = torch.library.custom_op("numba_flash::decode", mutates_args=())(_decode_body)


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, softmax_scale, num_splits, block_table=None,
                 cache_batch_idx=None, cache_leftpad=None, causal=True, window_left=-1, window_right=-1, softcap=0.0,
                 alibi_slopes=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


def _varlen_fwd_body(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
               softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """``numba_flash.varlen_forward`` as an op: (out, lse (H, total_q)). The offsets are not read back here
    (varlen_attention asserts them on the device); deterministic is the backward's."""
    return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                          softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
                          alibi_slopes=alibi_slopes, check_seqlens=False)


varlen_fwd = torch.library.custom_op("numba_flash::varlen_fwd", mutates_args=())(_varlen_fwd_body)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     window_left, window_right, softcap, alibi_slopes, deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _varlen_bwd_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
               deterministic: bool, window_left: int, window_right: int, softcap: float,
               alibi_slopes: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``numba_flash.varlen_backward`` as an op: (dq, dk, dv)."""
    # varlen runs on the mma kernels only (no SIMT fallback to take a dout cp.async cannot read): rows that are
    # not 16-byte aligned are copied
    item = dout.element_size()
    if dout.stride(-1) != 1 or dout.data_ptr() % 16 or any(st * item % 16 for st in dout.stride()[:-1]):
        dout = dout.contiguous()
    return varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                           window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                           check_seqlens=False)


varlen_bwd = torch.library.custom_op("numba_flash::varlen_bwd", mutates_args=())(_varlen_bwd_body)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, deterministic, window_left, window_right, softcap, alibi_slopes):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
     deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes)
    ctx.args = (max_q, max_k, causal, softmax_scale, deterministic, window_left, window_right, softcap)
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, _dlse, run=varlen_bwd):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    max_q, max_k, causal, softmax_scale, deterministic, window_left, window_right, softcap = ctx.args
    dq, dk, dv = run(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale, deterministic,
                     window_left, window_right, softcap, alibi_slopes)
    return (dq, dk, dv) + (None,) * 11


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


_VarlenAttention = _eager_function("_VarlenAttention", _varlen_fwd_body, _varlen_setup_context, _varlen_backward,
                                   _varlen_bwd_body)


def _eager(*tensors) -> bool:
    """Whether a call may skip the op dispatcher and run the op's body (or ``_Attention``) itself: nothing traces or
    intercepts it (torch.compile, torch.jit tracing, dispatch modes such as fake tensors and make_fx, torch function
    modes, functorch transforms) and every tensor is a plain one holding data (a meta tensor takes the op's fake).
    The dispatcher costs ~13 us per call, ~50 us with inputs that require grad (scripts/probe_op_overhead.py); the
    op stays what tracing records, so compiled graphs, CUDA graphs and opcheck see the same op."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or \
            torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state() is not None or \
            torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for x in tensors:
        if x is not None and (type(x) is not torch.Tensor or x.is_meta):
            return False
    return True


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _run(op, function, body, args, inputs, extra):
    """An op with gradients by its path (``_eager``): the op under tracing, else the autograd.Function where q, k,
    v (``inputs``) need gradients, else the op's body; ``extra``: the other tensors ``_eager`` looks at."""
    if not _eager(*inputs, *extra):
        return op(*args)
    return function.apply(*args) if _needs_grad(*inputs) else body(*args)


def _refuse_backward_without_kernel(what: str, q, check_dtype: bool = True) -> None:
    """Say at the call, not at loss.backward(), that the backward ``what`` needs is not built for q's head dim on
    this GPU (the mma kernels: head dim <= MMA_BWD_MAX_HEAD_DIM, tiles within the block's shared memory) or q's
    dtype (check_dtype=False: the op refuses other dtypes itself)."""
    d = q.shape[-1]
    blockers = [f"head dim {d} > {MMA_BWD_MAX_HEAD_DIM}"] if d > MMA_BWD_MAX_HEAD_DIM else smem_blockers(d)
    if check_dtype and q.dtype not in (torch.float16, torch.bfloat16):
        blockers.insert(0, f"dtype {q.dtype}, not float16 / bfloat16")
    if blockers:
        raise NotImplementedError(f"{what} with gradients: the backward builds it into the mma kernels only; here "
                                  f"{'; '.join(blockers)} (the forward alone runs it, under torch.no_grad())")


def _check_bool(name, x):
    if x is True or x is False:
        return x
    if isinstance(x, np.bool_):
        return bool(x)
    if not isinstance(x, bool):  # the op schema takes a bool; say so before torch's schema error
        raise TypeError(f"{name} must be a bool; got {x!r}")
    return x


def _check_scale(softmax_scale):
    if softmax_scale is None or type(softmax_scale) is float:
        return softmax_scale
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {softmax_scale!r}")
    return float(softmax_scale)  # forward's validation checks the range (an int past float's raises here)


def _check_mods(softcap, alibi_slopes):
    """softcap a real number and alibi_slopes a torch tensor without grad (the op schema's types), before the op."""
    if alibi_slopes is None and type(softcap) is float:  # the common case, without the ABC checks below
        return
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0.0: off); got {softcap!r}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch tensor of shape (H,) or (B, H), on q's device; "
                        f"got {type(alibi_slopes).__name__}")
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes requires grad; the kernels give none for the slopes (as flash-attn): pass "
                         "alibi_slopes.detach()")


def attention(q, k, v, *, causal=False, softmax_scale=None, deterministic=True, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, return_lse=False, mask_mod=None, score_mod=None, block_mask=None, dropout_p=0.0,
              generator=None, dropout_seed=None):
    """Differentiable exact attention on PyTorch CUDA tensors (``torch.ops.numba_flash.fwd``).

    Arguments, shapes (including GQA/MQA and the batch-less forms), dtypes, the bottom-right
    causal alignment and the default scale are those of ``numba_flash.forward``; returns out
    (q's shape and dtype), or (out, lse) with return_lse=True (lse float32 of shape q.shape[:-1],
    natural log, no gradient: as flash-attn's softmax_lse). Gradients flow to q, k and v through
    ``numba_flash.backward`` (fp32 accumulation; fp16/bf16, and fp32 as 3xTF32, on tensor cores where
    ``forward`` would use them, see ``numba_flash.explain_backward``). deterministic=True (default):
    bitwise repeatable gradients (FA2's deterministic dQ splits, or a separate dQ kernel); False: dq by
    FA2's atomic adds on the tensor-core paths (last bits vary run to run), as ``numba_flash.backward``.
    window_size, softcap, alibi_slopes: flash-attn's sliding window, softcapping and ALiBi, as
    ``numba_flash.forward`` (no gradient for the slopes: they are constants, as in flash-attn).
    causal, deterministic and return_lse are bools, softmax_scale and softcap real numbers (the op
    schema's types: Python bool and float). Works under ``torch.compile(fullgraph=True)`` and in CUDA graphs.
    Double backward is not supported.

    mask_mod, score_mod (numba_flash.mods; aux arrays as CUDA tensors, which get no gradient): eager mode only. A
    custom op cannot take Python functions, so the call runs ``numba_flash.forward`` directly, and with inputs
    that require grad an autograd.Function whose backward is ``numba_flash.backward`` with the same mods (a
    score_mod then needs ``ScoreMod(fn, grad=fn_grad)``: a ValueError naming grad at the call otherwise; the
    backward's mma kernels only: NotImplementedError at the call where they cannot run). Under
    ``torch.compile`` it raises NotImplementedError (call it outside the compiled region).
    block_mask (a numba_flash.BlockMask, carrying its mask_mod): as ``numba_flash.forward``'s; eager and forward
    only (the backward kernels do not walk block lists: NotImplementedError with gradients).
    dropout_p (0 <= p < 1; pass 0.0 outside training, as for F.scaled_dot_product_attention): dropout on the
    probabilities in the kernels (``numba_flash.forward``'s, flash-attn's scaling), the backward regenerating the
    same mask. Each call draws a 62-bit seed from ``generator`` (a torch.Generator; None: PyTorch's default CPU
    generator, so torch.manual_seed makes runs repeatable), or takes ``dropout_seed`` (an int < 2**64) where given
    (``numba_flash.dropout_mask(B, H, Nq, Nk, dropout_p, seed)`` then rebuilds the mask). Eager mode only, as the
    user mods (the seed is drawn in Python): NotImplementedError under torch.compile / tracing. float16 / bfloat16
    on the mma.sync kernels.
    """
    if mask_mod is not None or score_mod is not None or block_mask is not None or dropout_p:
        return _attention_user_mods(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse,
                                    mask_mod, score_mod, deterministic, block_mask, dropout_p, generator,
                                    dropout_seed)
    if dropout_seed is not None:
        raise ValueError("dropout_seed is the dropout's; with dropout_p = 0 it would be ignored: pass None")
    if generator is not None:
        raise ValueError("generator is the dropout's; with dropout_p = 0 it would be ignored: pass generator=None")
    causal = _check_bool("causal", causal)
    deterministic = _check_bool("deterministic", deterministic)
    _check_bool("return_lse", return_lse)
    scale = _check_scale(softmax_scale)
    _check_mods(softcap, alibi_slopes)
    left, right = window_pair(window_size)
    mods = softcap != 0 or alibi_slopes is not None
    if not mods and (left != -1 or right != -1):
        n_k = k.shape[-2] if len(k.shape) >= 2 else 0
        mods = window_kind(causal, unbounded_past_keys((left, right), n_k)) == "window"
    if mods and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # the backward has the mods on the mma kernels only: say so now, not at loss.backward()
        _refuse_backward_without_kernel("window_size / softcap / alibi_slopes", q)
    args = (q, k, v, causal, scale, left, right, float(softcap), alibi_slopes, deterministic)
    out, lse = _run(fwd, _Attention, _fwd_body, args, (q, k, v), (alibi_slopes,))
    return (out, lse) if return_lse else out


def _attention_user_mods(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse, mask_mod,
                         score_mod, deterministic=True, block_mask=None, dropout_p=0.0, generator=None,
                         dropout_seed=None):
    """attention with user mods or dropout: numba_flash.forward in eager mode, and its backward with them where q, k
    or v need gradients (attention's docstring)."""
    what = "dropout_p" if dropout_p and mask_mod is None and score_mod is None else "mask_mod / score_mod"
    if not _eager(q, k, v):  # first: the checks below ask the driver for the device, which tracing cannot follow
        raise NotImplementedError(f"{what} under torch.compile, tracing, fake tensors or a dispatch mode: a custom "
                                  "op cannot take Python functions or a seed drawn per call; call "
                                  "numba_flash.torch.attention with them outside the compiled or traced region, on "
                                  "plain CUDA tensors")
    grads = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v))
    if grads and block_mask is not None:
        raise NotImplementedError("block_mask with gradients: the backward kernels do not walk block lists (run the "
                                  "forward under torch.no_grad(), or pass mask_mod= alone for gradients)")
    if grads and (mask_mod is not None or score_mod is not None):
        _check_user_mods_for_grad(q, mask_mod, score_mod)
    elif grads:
        _refuse_backward_without_kernel("dropout_p", q)
    _check_bool("return_lse", return_lse)
    seed = dropout_seed
    if dropout_p and seed is None:
        seed = draw_seed(generator)
    elif dropout_p and generator is not None:
        raise ValueError("pass generator or dropout_seed, not both (the seed would not come from the generator)")
    elif not dropout_p and (generator is not None or dropout_seed is not None):
        raise ValueError("generator / dropout_seed are the dropout's; with dropout_p = 0 they would be ignored")
    if grads:
        _check_mods(softcap, alibi_slopes)
        left, right = window_pair(window_size)
        out, lse = _UserModAttention.apply(q, k, v, _check_bool("causal", causal), _check_scale(softmax_scale), left,
                                           right, float(softcap), alibi_slopes, _check_bool("deterministic",
                                                                                            deterministic),
                                           mask_mod, score_mod, dropout_p, seed)
        return (out, lse) if return_lse else out
    out, lse = forward(q, k, v, causal=_check_bool("causal", causal), softmax_scale=_check_scale(softmax_scale),
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                       score_mod=score_mod, block_mask=block_mask, dropout_p=dropout_p, dropout_seed=seed)
    return (out, lse) if return_lse else out


def draw_seed(generator=None) -> int:
    """A 62-bit dropout seed from ``generator`` (a torch.Generator; None: PyTorch's default CPU generator)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {type(generator).__name__}")
    gen = torch.default_generator if generator is None else generator
    return int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device).item())


def _check_user_mods_for_grad(q, mask_mod, score_mod):
    """Say at the call, not at loss.backward(), what the backward with user mods cannot take: a score_mod without
    its grad, an aux tensor that requires grad (the mods' arrays get none), a problem off the mma kernels."""
    from .mods import as_mask_mod, as_score_mod

    sm = as_score_mod(score_mod)
    if sm is not None and sm.grad is None:
        raise ValueError("score_mod with gradients needs its derivative: pass numba_flash.mods.ScoreMod(fn, "
                         "grad=fn_grad), fn_grad(score, b, h, q_idx, kv_idx, *aux) -> d fn / d score (or run "
                         "under torch.no_grad())")
    for name, mod in (("mask_mod", as_mask_mod(mask_mod)), ("score_mod", sm)):
        for i, x in enumerate(() if mod is None else mod.aux):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise ValueError(f"{name} aux[{i}] requires grad; the kernels give the aux arrays none: pass "
                                 f"it .detach()ed")
    _refuse_backward_without_kernel("mask_mod / score_mod", q)


def decode(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, num_splits=None, block_table=None,
           cache_batch_idx=None, cache_leftpad=None, causal=True, window_size=(-1, -1), softcap=0.0,
           alibi_slopes=None, mask_mod=None, score_mod=None):
    """``numba_flash.decode`` on PyTorch CUDA tensors through ``torch.ops.numba_flash.decode``: (out, lse).

    Arguments as ``numba_flash.decode`` (q (B, H, Nq, d) against the caches (B, Hkv, Nmax, d), or pages
    (num_pages, Hkv, page_size, d) with block_table; cache_seqlens, block_table, cache_batch_idx and
    cache_leftpad CUDA tensors or None; window_size, softcap and alibi_slopes (a float32 CUDA tensor) as
    ``attention``); no gradient. The tile config override of ``numba_flash.decode`` is not an op argument.
    mask_mod / score_mod (numba_flash.decode's): Python functions, which no op can take, so eager only (plain
    CUDA tensors, outside torch.compile and tracing; NotImplementedError there).
    """
    for name, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table),
                    ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                    ("alibi_slopes", alibi_slopes)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor (int32, or int64 for cache_seqlens, on q's device) or "
                            f"None; got {type(x).__name__}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be a Python int >= 1 or None; got {num_splits!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if _needs_grad(*(x for x in (q, k_cache, v_cache) if isinstance(x, torch.Tensor))):
        raise NotImplementedError("numba_flash.torch.decode has no gradient: call it under torch.no_grad() (or on "
                                  "tensors that do not require grad); for training use attention / varlen_attention")
    if mask_mod is not None or score_mod is not None:
        if not _eager(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, alibi_slopes):
            raise NotImplementedError("numba_flash.torch.decode with mask_mod / score_mod under torch.compile, tracing, "
                                      "fake tensors or a dispatch mode: a custom op cannot take Python functions; "
                                      "call it outside the compiled or traced region, on plain CUDA tensors")
        _check_mods(softcap, alibi_slopes)
        return _decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=_check_scale(softmax_scale),
                       num_splits=num_splits, block_table=block_table, cache_batch_idx=cache_batch_idx,
                       cache_leftpad=cache_leftpad, causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod)
    _check_mods(softcap, alibi_slopes)
    left, right = window_pair(window_size)
    args = (q, k_cache, v_cache, cache_seqlens, _check_scale(softmax_scale), num_splits, block_table,
            cache_batch_idx, cache_leftpad, causal, left, right, float(softcap), alibi_slopes)
    eager = _eager(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, alibi_slopes)
    return _decode_body(*args) if eager else decode_op(*args)


def _assert_offsets(name, cu, total, max_seqlen, max_name):
    """The offsets' checks of numba_flash.varlen.check_seqlens as device-side asserts (no host sync)."""
    lens = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (lens >= 0).all() & (lens <= max_seqlen).all()
    torch._assert_async(ok, f"numba_flash.varlen_attention: {name} must start at 0, never decrease, end at the "
                            f"packed total ({total}) and hold no sequence longer than {max_name} ({max_seqlen})")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, deterministic=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     return_lse=False):
    """Differentiable attention over packed sequences (``torch.ops.numba_flash.varlen_fwd``).

    q (total_q, H, d), k / v (total_k, Hkv, d) float16 / bfloat16 CUDA tensors; cu_seqlens_q / cu_seqlens_k int32
    CUDA tensors (B + 1,); max_seqlen_q / max_seqlen_k ints (flash-attn's varlen arguments; see
    ``numba_flash.varlen_forward`` for the rest). Returns out (total_q, H, d), or (out, lse (H, total_q)) with
    return_lse=True. The offsets are checked on the device by ``torch._assert_async`` (a bad one fails the
    stream's next synchronisation with a device-side assert), never read back, so the call works under
    ``torch.compile(fullgraph=True)`` and in CUDA graphs. Gradients through ``numba_flash.varlen_backward``.
    """
    causal = _check_bool("causal", causal)
    deterministic = _check_bool("deterministic", deterministic)
    _check_bool("return_lse", return_lse)
    scale = _check_scale(softmax_scale)
    _check_mods(softcap, alibi_slopes)
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.dim() != 1 or x.shape[0] < 2:
            what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be an int32 torch tensor of shape (B + 1,) on q's device; got {what}")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int (the longest sequence's length); got {x!r}")
    left, right = unbounded_past_keys(window_pair(window_size), max_seqlen_k)
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v)):
        _refuse_backward_without_kernel("varlen_attention", q, check_dtype=False)
    if q.dim() == 3 and k.dim() == 3:  # (validation of the rest is the op's, with the offsets' shapes)
        _assert_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        _assert_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, left, right,
            float(softcap), alibi_slopes, deterministic)
    out, lse = _run(varlen_fwd, _VarlenAttention, _varlen_fwd_body, args, (q, k, v),
                    (cu_seqlens_q, cu_seqlens_k, alibi_slopes))
    return (out, lse) if return_lse else out
