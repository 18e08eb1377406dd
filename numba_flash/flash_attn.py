"""flash-attn 2.x's public functions on numba_flash: same names, arguments, defaults, layouts and returns.

    from numba_flash.flash_attn import flash_attn_func, flash_attn_with_kvcache
    out = flash_attn_func(q, k, v, causal=True)          # (batch, seqlen, nheads, headdim) PyTorch CUDA tensors

Layouts are flash-attn's: q (B, Nq, H, d), k / v (B, Nk, Hkv, d), kv (B, Nk, 2, Hkv, d), qkv (B, N, 3, H, d);
caches (B, Nmax, Hkv, d). They are viewed as numba_flash's (B, H, N, d) without copies (the kernels read any
strides); the output comes back contiguous in flash-attn's layout (one copy of out: flash-attn returns it
contiguous and callers .view() it). softmax_lse is (B, H, Nq) float32, as flash-attn's.

The varlen functions take packed (total, nheads, headdim) tensors with cu_seqlens and return the packed out
and softmax_lse (H, total_q), as flash-attn's; their offsets are checked on the device (torch._assert_async).

Differences from flash-attn, all raised as NotImplementedError naming the argument, never ignored:
dropout_p > 0 in the varlen functions, a varlen block_table (paged KV), and in flash_attn_with_kvcache rotary with
cache_leftpad. dropout_p in flash_attn_func / kvpacked / qkvpacked runs in the kernels (numba_flash.torch.attention's
dropout, on the mma.sync forward: a seed per call from PyTorch's default generator, so torch.manual_seed makes it repeatable); with it,
return_attn_probs=True gives flash-attn's S_dmask (B, H, Nq, Nk) in q's dtype: exp(s - the row's max) of each
visible score, negated where dropout dropped it, 0 where the mask hides it (flash-attn's layout with its key
blocks one block wide; materialised by PyTorch in fp32: for tests, O(Nq·Nk) memory).
flash_attn_with_kvcache takes window_size, softcap and alibi_slopes (applied in the decode kernel), paged
caches (block_table, page sizes multiples of 16, not only flash-attn 2's multiples of 256), cache_batch_idx,
cache_leftpad, any number of queries, causal or not, num_splits, and rotary embeddings (applied by PyTorch
ops before the kernel, not fused). return_attn_probs=True returns (out, softmax_lse, None): the
probabilities are never materialised. causal=True makes window_size's right 0, as
flash-attn's kernels do (whatever right was passed; numba_flash.forward itself refuses a right other than 0 or
-1 with causal). deterministic defaults to False here as there.
"""
from __future__ import annotations

import torch

from .api import window_pair
from .decode import check_cache_combination
from .dropout import dropout_mask
from .torch import attention, decode, draw_seed, varlen_attention

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]



def _unsupported(what: str):
    raise NotImplementedError(f"numba_flash.flash_attn: {what} is not supported (the kernels do not have it)")


def _heads_first(x):
    return x.transpose(-3, -2)  # (B, N, H, d) <-> (B, H, N, d), a view


def _check_layout(name, x, ndim):
    if not isinstance(x, torch.Tensor) or x.dim() != ndim:
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise ValueError(f"{name} must be a {ndim}-D torch tensor in flash-attn's layout; got {shape}")


def _window(causal, window_size):
    """flash-attn's rule: causal is right = 0 (its interface sets it so before the kernels)."""
    left, right = window_pair(window_size)
    return (left, 0) if causal else (left, right)


def _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs):
    window_size = _window(causal, window_size)
    seed = draw_seed() if dropout_p else None
    out, lse = attention(_heads_first(q), _heads_first(k), _heads_first(v), causal=causal, softmax_scale=softmax_scale,
                         deterministic=deterministic, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, return_lse=True, dropout_p=dropout_p, dropout_seed=seed)
    out = _heads_first(out).contiguous()
    if not return_attn_probs:
        return out
    s_dmask = None
    if dropout_p:
        s_dmask = _s_dmask(q, k, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed)
    return out, lse, s_dmask


def _s_dmask(q, k, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed):
    """flash-attn's S_dmask for return_attn_probs (module docstring): the scores recomputed in fp32 with the same
    scale, softcap, ALiBi and window, exp(s - row max) where visible, negated where the kernels' dropout mask
    (numba_flash.dropout_mask, the same seed) drops the score."""
    B, n_q, H, d = q.shape
    n_k, Hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    qh = _heads_first(q).float()
    kh = _heads_first(k).float().repeat_interleave(H // Hkv, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)  # the query's bottom-right aligned position
    j = torch.arange(n_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1 if alibi_slopes.dim() == 1 else B, H)
        s = s - slopes.reshape(slopes.shape[0], H, 1, 1) * (i - j).abs()
    left, right = window_size
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    a = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))  # a row that sees nothing: all 0
    if q.is_cuda:  # on q's device and PyTorch's current stream there, which then reads it
        from numba import cuda as nb_cuda

        with nb_cuda.gpus[q.device.index]:
            stream = nb_cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
            kept = torch.as_tensor(dropout_mask(B, H, n_q, n_k, dropout_p, seed, stream=stream), device=q.device)
    else:
        kept = torch.as_tensor(dropout_mask(B, H, n_q, n_k, dropout_p, seed), device=q.device)
    kept = kept.bool()
    return torch.where(kept, a, -a).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (B, Nq, H, d), k / v (B, Nk, Hkv, d) -> out (B, Nq, H, d) [, softmax_lse (B, H, Nq), None]."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, x, 4)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (B, Nq, H, d), kv (B, Nk, 2, Hkv, d)."""
    _check_layout("q", q, 4)
    _check_layout("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must be (B, Nk, 2, Hkv, d); got {tuple(kv.shape)}")
    return _attend(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (B, N, 3, H, d)."""
    _check_layout("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (B, N, 3, H, d); got {tuple(qkv.shape)}")
    return _attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs)


def _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs):
    if dropout_p:
        _unsupported(f"dropout_p={dropout_p} with varlen")
    window_size = _window(causal, window_size)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, deterministic=deterministic, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, H, d), k / v (total_k, Hkv, d), cu_seqlens int32 (B + 1,) -> out (total_q, H, d)
    [, softmax_lse (H, total_q), None]: numba_flash.torch.varlen_attention, per sequence as flash-attn."""
    if block_table is not None:  # before the layout: a paged cache is (num_blocks, page, Hkv, d)
        _unsupported("flash_attn_varlen_func block_table (a paged KV cache)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, x, 3)
    return _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                          causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, H, d), kv (total_k, 2, Hkv, d)."""
    _check_layout("q", q, 3)
    _check_layout("kv", kv, 4)
    if kv.shape[1] != 2:
        raise ValueError(f"kv must be (total_k, 2, Hkv, d); got {tuple(kv.shape)}")
    return _attend_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                          softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, H, d), one cu_seqlens for queries and keys."""
    _check_layout("qkv", qkv, 4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total, 3, H, d); got {tuple(qkv.shape)}")
    return _attend_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                          softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q (B, Nq, H, d) against k_cache / v_cache (B_cache, Nmax, Hkv, d), or with block_table (B, max_pages) int32
    the pages (num_pages, page_size, Hkv, d), page_size a multiple of 16; cache_seqlens (int or (B,) int32) ends
    each sequence's keys, cache_leftpad ((B,) int32) starts them, cache_batch_idx ((B,) int32) picks the cache
    row of each sequence.

    k / v (B, Nnew, Hkv, d), if given, are written into the caches in place at positions cache_seqlens[b] ...
    + Nnew - 1 first (flash-attn's append; through the block table for a paged cache, into row
    cache_batch_idx[b] with it), and attended to with the rest. The queries are the last Nq positions of each
    sequence: causal is bottom-right aligned, causal=False lets every query see every key. Runs
    ``numba_flash.decode`` (any Nq; num_splits = 0 chooses, 1 does not split).

    rotary_cos / rotary_sin ((seqlen_ro, rotary_dim / 2)), as flash-attn: the new k rotated at positions
    cache_seqlens[b] + t, q at cache_seqlens[b] + i when causal, else all at cache_seqlens[b]; interleaved
    (GPT-J) or half-split (GPT-NeoX) pairs. Applied by PyTorch elementwise ops before the append and the kernel
    (not fused into the kernel); not with cache_leftpad.
    """
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_layout(name, x, 4)
    B = q.shape[0]
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass both k and v (the new keys and values) or neither")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"flash_attn_with_kvcache: num_splits must be an int >= 0 (0: chosen); got {num_splits!r}")
    if cache_seqlens is None:
        lens = None
    elif isinstance(cache_seqlens, int):
        lens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        lens = cache_seqlens
    else:
        raise TypeError(f"cache_seqlens must be an int or a (B,) int32 tensor; got {type(cache_seqlens).__name__}")
    if k is not None:
        _check_layout("k", k, 4)
        _check_layout("v", v, 4)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flash_attn_with_kvcache: pass both rotary_cos and rotary_sin or neither")
    if rotary_cos is not None:
        if cache_leftpad is not None:
            _unsupported("flash_attn_with_kvcache rotary_cos / rotary_sin with cache_leftpad")
        if lens is None:
            raise ValueError("flash_attn_with_kvcache: rotary positions start at cache_seqlens; pass cache_seqlens")
        start = lens
        q_pos = start.long()[:, None] + (torch.arange(q.shape[1], device=q.device) if causal else 0)
        q = _rotary(q, rotary_cos, rotary_sin, q_pos.expand(B, q.shape[1]), rotary_interleaved)
        if k is not None:
            k_pos = start.long()[:, None] + torch.arange(k.shape[1], device=k.device)
            k = _rotary(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)
    if lens is not None:  # before the append: a refused call leaves the cache as it was
        _check_capacity(cache_seqlens if isinstance(cache_seqlens, int) else lens, 0 if k is None else k.shape[1],
                        k_cache, block_table)
    if k is not None:
        if lens is None:
            raise ValueError("flash_attn_with_kvcache: k / v are appended at cache_seqlens; pass cache_seqlens")
        check_cache_combination(block_table, cache_batch_idx, cache_leftpad)  # a refused call leaves the cache as is
        _append(k_cache, v_cache, k, v, lens, block_table, cache_batch_idx)
        lens = (lens + k.shape[1]).to(torch.int32)
    out, lse = decode(_heads_first(q), _heads_first(k_cache), _heads_first(v_cache), cache_seqlens=lens,
                      softmax_scale=softmax_scale, num_splits=num_splits or None, block_table=block_table,
                      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, causal=bool(causal),
                      window_size=_window(causal, window_size), softcap=softcap, alibi_slopes=alibi_slopes)
    out = _heads_first(out).contiguous()
    return (out, lse) if return_softmax_lse else out


def _rotary(x, cos, sin, pos, interleaved):
    """flash-attn's rotary embedding of x (B, N, H, d) at positions pos (B, N): the first rotary_dim = 2 ·
    cos.shape[1] features, pairs (2j, 2j + 1) if interleaved else (j, j + rotary_dim / 2), rotated by the
    angle whose cos / sin are row pos of the tables, in float32 and rounded to x's dtype as flash-attn's."""
    if cos.dim() != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"flash_attn_with_kvcache: rotary_cos / rotary_sin must be (seqlen_ro, rotary_dim / 2) with "
                         f"rotary_dim <= headdim = {x.shape[-1]}; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rd = 2 * cos.shape[1]
    c, s = (t.float()[pos][:, :, None, :] for t in (cos, sin))  # (B, N, 1, rd / 2)
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def _check_capacity(lens, n_new, k_cache, block_table):
    """RuntimeError where a sequence's keys (cache_seqlens[b] + the Nnew appended) run past what its cache holds:
    Nmax rows, or block_table's pages x page size (flash-attn's guard: the kernel would read the block table, and
    the append write, out of bounds). An int cache_seqlens is checked on the host; a tensor costs one host sync per
    call, as flash-attn's check does, except while a CUDA graph is captured or torch.compile traces (no sync is
    possible there: the bound is then the caller's to keep)."""
    paged = block_table is not None and isinstance(block_table, torch.Tensor) and block_table.dim() == 2
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if isinstance(lens, int):
        longest = lens + n_new
    elif torch.compiler.is_compiling() or (lens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    else:
        longest = int(lens.max()) + n_new if lens.numel() else 0
    if longest > capacity:
        where = (f"block_table's {block_table.shape[1]} pages x {k_cache.shape[1]} tokens" if paged
                 else f"the cache's {capacity} rows")
        raise RuntimeError(f"flash_attn_with_kvcache: cache_seqlens + new keys reach {longest} tokens, past the "
                           f"capacity of {where} = {capacity}; accepted: cache_seqlens[b] + k.shape[1] <= "
                           f"{capacity} (a larger block_table or cache)")


def _append(k_cache, v_cache, k, v, lens, block_table, cache_batch_idx):
    """flash-attn's in-place append: new token t of sequence b at position lens[b] + t of its cache (through the
    block table for pages); _check_capacity has made sure every position is inside."""
    pos = lens.long()[:, None] + torch.arange(k.shape[1], device=k.device)  # (B, Nnew)
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise TypeError("flash_attn_with_kvcache: block_table must be a (B, max_pages) int32 tensor")
        page_size = k_cache.shape[1]
        where = (block_table.long().gather(1, pos // page_size), pos % page_size)
    else:
        rows = (torch.arange(k.shape[0], device=k.device) if cache_batch_idx is None
                else cache_batch_idx.long())
        where = (rows[:, None].expand_as(pos), pos)
    k_cache.index_put_(where, k)  # (B, Nnew) index pairs -> rows of (Hkv, d)
    v_cache.index_put_(where, v)
