"""Split-KV decoding (FlashDecoding) in NumPy: the maths of numba_flash.kernels.decode.

A decoding step has Nq (small) new queries per sequence and a KV cache of Nmax slots of which the
first len_b are valid. The queries are the last Nq positions of the sequence, so query i sees key
j iff j <= i + len_b - Nq (bottom-right causal alignment); keys >= len_b are never seen.

flash-attn's variants take ``reference.attention``'s rule with each sequence's own shift,
shift_b = len_b − Nq (the alignment above): decoding is causal, so ``window_size``'s right must
be −1 or 0, and a left >= 0 also hides the keys j < i + shift_b − left; ``softcap`` caps the
scaled scores; ``alibi_slopes`` ((H,) or (B, H)) subtracts slope[b, h] · |i + shift_b − j|.
Each split masks its own keys; a kernel need not load the tiles outside every row's window.

The keys [0, len_b) of each sequence are cut into splits. Each split builds an
:class:`~reference.softmax.OnlineSoftmaxState` (m, ℓ, acc) over its keys alone — one thread block
of the kernel — and the states are then combined with :meth:`OnlineSoftmaxState.merge`, the
logsumexp combine m = max(m_a, m_b), ℓ = Σ exp(m_side − m)·ℓ_side, acc likewise. Because the
merge is exact up to rounding, any number of splits and any boundaries give standard attention on
the valid prefix; an empty split (no keys) is a state with m = −inf, ℓ = 0, acc = 0, which the
merge ignores.

Functions:

* :func:`split_bounds` — the kernel's split of [0, length): whole tiles of ``block_n`` keys,
  ceil(tiles / num_splits) tiles per split, trailing splits empty.
* :func:`decode_partials` — phase 1: the per-split states, as arrays (m, ℓ, acc) like the
  kernel's scratch buffers.
* :func:`merge_partials` — phase 2: merge them, return (O, L).
* :func:`decode_attention` — both phases.

Conventions as in ``reference.attention``: computation in float64 (or wider) unless ``dtype=``;
L is the natural-log logsumexp; a query that sees no key gets O = 0 and L = −inf.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import numpy as np

from ._validation import (
    as_real_array,
    check_alibi_slopes,
    check_positive_int,
    check_softcap,
    check_softmax_scale,
    check_window_size,
    compute_dtype,
)
from .attention import _final_logits
from .softmax import OnlineSoftmaxState

__all__ = ["split_bounds", "decode_partials", "merge_partials", "decode_attention"]


def split_bounds(length: int, num_splits: int, block_n: int = 1) -> list[tuple[int, int]]:
    """The kernel's split of keys [0, length) into ``num_splits`` ranges (some maybe empty).

    Keys are grouped in tiles of ``block_n``; each split takes ceil(n_tiles / num_splits) whole
    tiles, the last tile may be short, and splits past the last tile are empty (start == stop).
    """
    length = operator.index(length)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    num_splits = check_positive_int("num_splits", num_splits)
    block_n = check_positive_int("block_n", block_n)
    n_tiles = -(-length // block_n)
    per_split = -(-n_tiles // num_splits)
    out = []
    for s in range(num_splits):
        t0 = min(s * per_split, n_tiles)
        t1 = min(t0 + per_split, n_tiles)
        out.append((min(t0 * block_n, length), min(t1 * block_n, length)))
    return out


def _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, dtype, window_size, softcap, alibi_slopes):
    q = as_real_array("q", q)
    k_cache = as_real_array("k_cache", k_cache)
    v_cache = as_real_array("v_cache", v_cache)
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"need q (B, H, Nq, d) and caches (B, Hkv, Nmax, d); got q {q.shape}, k_cache {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got {k_cache.shape} and {v_cache.shape}")
    B, H, n_q, d = q.shape
    Bk, Hkv, n_max, dk = k_cache.shape
    if Bk != B or dk != d:
        raise ValueError(f"q {q.shape} and caches {k_cache.shape} must share B and d")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q has H = {H} heads and the caches Hkv = {Hkv}; H must be a positive multiple of Hkv")
    if d < 1:
        raise ValueError(f"head dim d must be >= 1; got q of shape {q.shape}")
    if cache_seqlens is None:
        lens = np.full(B, n_max, dtype=np.int64)
    else:
        lens = np.asarray(cache_seqlens)
        if not np.issubdtype(lens.dtype, np.integer):
            raise TypeError(f"cache_seqlens has dtype {lens.dtype}; accepted: an integer array of shape (B,)")
        if lens.shape != (B,):
            raise ValueError(f"cache_seqlens has shape {lens.shape}; accepted: (B,) = ({B},)")
        if ((lens < 0) | (lens > n_max)).any():
            raise ValueError(f"cache_seqlens {lens.tolist()} out of range; accepted: 0 <= length <= Nmax = {n_max}")
        lens = lens.astype(np.int64)
    window = check_window_size(window_size, True, causal_by="decoding (causal to the end of each cache)")
    softcap = check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, q.shape)
    scale = check_softmax_scale(softmax_scale, d)
    dt = compute_dtype(dtype, q, k_cache, v_cache)
    q, k_cache, v_cache = (x.astype(dt, copy=False) for x in (q, k_cache, v_cache))
    if slopes is not None:
        slopes = np.broadcast_to(slopes.astype(dt, copy=False), (B, H))
    return q, k_cache, v_cache, lens, scale, dt, window, softcap, slopes


def _resolve_splits(splits, length: int, b: int, block_n: int) -> list[tuple[int, int]]:
    """``splits`` as (start, stop) ranges covering [0, length) in order."""
    if isinstance(splits, Callable):
        splits = splits(b, length)
    if isinstance(splits, (int, np.integer)) and not isinstance(splits, bool):
        return split_bounds(length, int(splits), block_n)
    if (isinstance(splits, Sequence) and not isinstance(splits, str)) or isinstance(splits, np.ndarray):
        cuts = [operator.index(c) for c in splits]
        if cuts != sorted(cuts) or any(not 0 <= c <= length for c in cuts):
            raise ValueError(f"split points {cuts} for sequence {b}: accepted: sorted cut points in [0, {length}]")
        edges = [0, *cuts, length]
        return list(zip(edges[:-1], edges[1:]))
    raise TypeError(f"splits must be an int (number of splits), a sequence of cut points, or a callable "
                    f"(b, length) -> either; got {splits!r}")


def decode_partials(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, splits=1,
                    block_n: int = 1, dtype=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """Phase 1: one online-softmax state per (sequence, query head, split), as arrays.

    ``splits``: an int (that many splits by :func:`split_bounds` with ``block_n``), a sequence of
    cut points inside [0, len_b] (sorted; repeated points make empty splits), or a callable
    ``(b, length) -> int or cut points`` (per-sequence splits). Every sequence must get the same
    number of splits. Scores are the natural-log final logits (the kernel keeps m in base 2).
    ``window_size`` (right −1 or 0: decoding is causal), ``softcap``, ``alibi_slopes`` ((H,) or
    (B, H)): flash-attn's variants with shift_b = len_b − Nq (the module docstring).

    Returns ``(m, l, acc)`` with shapes (B, H, Nq, S), (B, H, Nq, S), (B, H, Nq, S, d): split s of
    query i of head h holds m = max of its visible scores (−inf if none), ℓ = Σ exp(s − m) and
    acc = Σ exp(s − m)·v.
    """
    q, k_cache, v_cache, lens, scale, dt, window, softcap, slopes = _prepare(
        q, k_cache, v_cache, cache_seqlens, softmax_scale, dtype, window_size, softcap, alibi_slopes)
    block_n = check_positive_int("block_n", block_n)
    B, H, n_q, d = q.shape
    group = H // k_cache.shape[1]
    per_b = [_resolve_splits(splits, int(lens[b]), b, block_n) for b in range(B)]
    n_splits = {len(r) for r in per_b}
    if len(n_splits) != 1:
        raise ValueError(f"every sequence needs the same number of splits; got {[len(r) for r in per_b]}")
    S = n_splits.pop()
    m = np.full((B, H, n_q, S), -np.inf, dtype=dt)
    l = np.zeros((B, H, n_q, S), dtype=dt)
    acc = np.zeros((B, H, n_q, S, d), dtype=dt)
    rows = np.arange(n_q)
    for b in range(B):
        length = int(lens[b])
        shift = length - n_q  # query i sits at key i + shift: it sees keys j <= i + shift (and the window's left)
        for h in range(H):
            k_h, v_h = k_cache[b, h // group], v_cache[b, h // group]
            slope = None if slopes is None else slopes[b, h]
            for s, (start, stop) in enumerate(per_b[b]):
                state = OnlineSoftmaxState(n_q, d, dtype=dt)
                if stop > start:
                    scores, _ = _final_logits((q[b, h] @ k_h[start:stop].T) * scale, rows, np.arange(start, stop),
                                              length, shift, window, softcap, slope)
                    state.update(scores, v_h[start:stop])
                m[b, h, :, s], l[b, h, :, s], acc[b, h, :, s] = state.m, state.l, state.acc
    return m, l, acc


def merge_partials(m, l, acc):
    """Phase 2: merge the S split states of every row (OnlineSoftmaxState.merge, left to right).

    ``m``, ``l``: (..., S); ``acc``: (..., S, d), as :func:`decode_partials` returns them.
    Returns ``(O, L)`` of shapes (..., d) and (...,); a row no split saw gets O = 0, L = −inf.
    """
    m, l, acc = (np.asarray(x) for x in (m, l, acc))
    if m.shape != l.shape or acc.shape[:-1] != m.shape or m.ndim < 1 or m.shape[-1] < 1:
        raise ValueError(f"need m (..., S), l (..., S), acc (..., S, d) with S >= 1; got {m.shape}, {l.shape}, {acc.shape}")
    lead, S, d = m.shape[:-1], m.shape[-1], acc.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    m2, l2, acc2 = m.reshape(rows, S), l.reshape(rows, S), acc.reshape(rows, S, d)
    merged = OnlineSoftmaxState.from_arrays(m2[:, 0], l2[:, 0], acc2[:, 0])
    for s in range(1, S):
        merged = merged.merge(OnlineSoftmaxState.from_arrays(m2[:, s], l2[:, s], acc2[:, s]))
    O, L = merged.finalize()
    return O.reshape(lead + (d,)), L.reshape(lead)


def decode_attention(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, splits=1,
                     block_n: int = 1, dtype=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None):
    """Split-KV decoding, both phases: ``merge_partials(*decode_partials(...))``.

    Arguments as :func:`decode_partials`. Returns ``(O, L)``: O (B, H, Nq, d), L (B, H, Nq).
    Equal, up to rounding, to ``standard_attention(q[b], k_cache[b, :, :len_b], v_cache[b, :,
    :len_b], causal=True, window_size=window_size, softcap=softcap, alibi_slopes=slopes_b)`` for
    every sequence b, whatever the splits, with slopes_b the slopes of sequence b, shape (H,).
    """
    q, k_cache, v_cache, lens, scale, dt, window, softcap, slopes = _prepare(
        q, k_cache, v_cache, cache_seqlens, softmax_scale, dtype, window_size, softcap, alibi_slopes)
    if 0 in q.shape[:3]:  # no sequences, heads or queries: nothing to split
        return np.zeros(q.shape, dtype=dt), np.full(q.shape[:-1], -np.inf, dtype=dt)
    return merge_partials(*decode_partials(q, k_cache, v_cache, cache_seqlens=lens, softmax_scale=scale,
                                           splits=splits, block_n=block_n, dtype=dt, window_size=window,
                                           softcap=softcap, alibi_slopes=slopes))
