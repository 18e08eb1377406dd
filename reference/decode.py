"""Split-KV decoding (FlashDecoding) in NumPy: the maths of numba_flash.kernels.decode.

A decoding step has Nq (small) new queries per sequence and a KV cache of Nmax slots of which the
first len_b are valid. The queries are the last Nq positions of the sequence, so query i sees key
j iff j <= i + len_b - Nq (bottom-right causal alignment); keys >= len_b are never seen.

flash-attn's variants take ``reference.attention``'s rule with each sequence's own shift,
shift_b = len_b − Nq (the alignment above): decoding is causal, so ``window_size``'s right must
be −1 or 0, and a left >= 0 also hides the keys j < i + shift_b − left; ``softcap`` caps the
scaled scores; ``alibi_slopes`` ((H,) or (B, H)) subtracts slope[b, h] · |i + shift_b − j|.
Each split masks its own keys; a kernel need not load the tiles outside every row's window.
With ``causal=False`` every query sees all len_b keys (chunked prefill or a verification step
that needs no mask).

Cache layouts (flash-attn's, heads first): contiguous caches (B, Hkv, Nmax, d); with
``cache_batch_idx`` sequence b reads cache row cache_batch_idx[b] of (Bc, Hkv, Nmax, d); with
``cache_leftpad`` its keys are rows [pad_b, cache_seqlens[b]) (len_b = cache_seqlens[b] − pad_b);
with ``block_table`` (B, max_pages) the caches are pages (num_pages, Hkv, page_size, d) and key j
of sequence b is row j % page_size of page block_table[b, j // page_size].

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
from .attention import _final_logits, _user_mods
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


def _index(name, x, shape):
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer) or x.shape != shape:
        raise TypeError(f"{name} has dtype {x.dtype} and shape {x.shape}; accepted: an integer array of shape {shape}")
    return x.astype(np.int64)


def _sequence_caches(k_cache, v_cache, B, block_table, cache_batch_idx, cache_leftpad):
    """Each sequence's cache rows in key order, (Hkv, Nmax_b, d) views or gathers, the rows before
    its left padding dropped; returns (ks, vs, Nmax, pads): Nmax as cache_seqlens counts it."""
    Bk, Hkv, n_rows, d = k_cache.shape
    if block_table is not None:  # (num_pages, Hkv, page_size, d): key j in page table[b, j // page_size]
        if cache_batch_idx is not None or cache_leftpad is not None:
            raise ValueError("block_table takes neither cache_batch_idx nor cache_leftpad (as flash-attn)")
        table = np.asarray(block_table)
        if table.ndim != 2 or table.shape[0] != B or not np.issubdtype(table.dtype, np.integer):
            raise TypeError(f"block_table has shape {table.shape}, dtype {table.dtype}; accepted: integers (B, max_pages)")
        # entries past a sequence's keys may be anything (_prepare checks the used ones): NaN pages stand in
        ok = (table >= 0) & (table < Bk)
        nan = np.full((1,) + k_cache.shape[1:], np.nan, k_cache.dtype)
        kx, vx = np.concatenate([k_cache, nan]), np.concatenate([v_cache, nan])
        safe = np.where(ok, table, Bk)
        ks = [np.concatenate(list(kx[safe[b]]), axis=1) for b in range(B)]
        vs = [np.concatenate(list(vx[safe[b]]), axis=1) for b in range(B)]
        return ks, vs, table.shape[1] * n_rows, np.zeros(B, dtype=np.int64)
    rows = np.arange(B) if cache_batch_idx is None else _index("cache_batch_idx", cache_batch_idx, (B,))
    if cache_batch_idx is None and Bk != B:
        raise ValueError(f"q has B = {B} and the caches {Bk} rows; pass cache_batch_idx to pick rows")
    if ((rows < 0) | (rows >= Bk)).any():
        raise ValueError(f"cache_batch_idx {rows.tolist()} outside [0, {Bk})")
    pads = np.zeros(B, dtype=np.int64) if cache_leftpad is None else _index("cache_leftpad", cache_leftpad, (B,))
    if ((pads < 0) | (pads > n_rows)).any():
        raise ValueError(f"cache_leftpad {pads.tolist()} outside [0, {n_rows}]")
    return ([k_cache[r][:, p:] for r, p in zip(rows, pads)], [v_cache[r][:, p:] for r, p in zip(rows, pads)], n_rows,
            pads)


def _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, dtype, window_size, softcap, alibi_slopes,
             block_table=None, cache_batch_idx=None, cache_leftpad=None, causal=True):
    """Checked inputs: (q, ks, vs, lens, scale, dt, window, softcap, slopes), ks / vs each sequence's keys in
    order (index b: (Hkv, >= len_b, d)), lens their numbers (cache_seqlens minus the left padding)."""
    q = as_real_array("q", q)
    k_cache = as_real_array("k_cache", k_cache)
    v_cache = as_real_array("v_cache", v_cache)
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"need q (B, H, Nq, d) and caches (B, Hkv, Nmax, d); got q {q.shape}, k_cache {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got {k_cache.shape} and {v_cache.shape}")
    B, H, n_q, d = q.shape
    _, Hkv, _, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q {q.shape} and caches {k_cache.shape} must share d")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q has H = {H} heads and the caches Hkv = {Hkv}; H must be a positive multiple of Hkv")
    if d < 1:
        raise ValueError(f"head dim d must be >= 1; got q of shape {q.shape}")
    dt = compute_dtype(dtype, q, k_cache, v_cache)
    q, k_cache, v_cache = (x.astype(dt, copy=False) for x in (q, k_cache, v_cache))
    ks, vs, n_max, pads = _sequence_caches(k_cache, v_cache, B, block_table, cache_batch_idx, cache_leftpad)
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
    if (pads > lens).any():
        raise ValueError(f"cache_leftpad {pads.tolist()} past cache_seqlens {lens.tolist()}")
    if block_table is not None:
        page = k_cache.shape[2]
        table = np.asarray(block_table)
        used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page)
        if (used & ((table < 0) | (table >= k_cache.shape[0]))).any():
            raise ValueError(f"block_table holds pages outside [0, {k_cache.shape[0]}) among those with keys")
    lens = lens - pads
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    window = check_window_size(window_size, bool(causal), causal_by="decoding (causal to the end of each cache)")
    softcap = check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, q.shape)
    scale = check_softmax_scale(softmax_scale, d)
    if slopes is not None:
        slopes = np.broadcast_to(slopes.astype(dt, copy=False), (B, H))
    return q, ks, vs, lens, scale, dt, window, softcap, slopes


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
                    block_n: int = 1, dtype=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    block_table=None, cache_batch_idx=None, cache_leftpad=None, causal=True, mask_mod=None,
                    score_mod=None, mask_aux=(), score_aux=()):
    """Phase 1: one online-softmax state per (sequence, query head, split), as arrays.

    ``splits``: an int (that many splits by :func:`split_bounds` with ``block_n``), a sequence of
    cut points inside [0, len_b] (sorted; repeated points make empty splits), or a callable
    ``(b, length) -> int or cut points`` (per-sequence splits). Every sequence must get the same
    number of splits. Scores are the natural-log final logits (the kernel keeps m in base 2).
    ``window_size`` (right −1 or 0: decoding is causal), ``softcap``, ``alibi_slopes`` ((H,) or
    (B, H)): flash-attn's variants with shift_b = len_b − Nq (the module docstring).
    ``block_table``, ``cache_batch_idx``, ``cache_leftpad``: flash-attn's cache layouts, the module
    docstring; lengths and splits count the keys after the left padding. ``causal=False``: every
    query sees all len_b keys. ``mask_mod`` / ``score_mod`` (with ``mask_aux`` / ``score_aux``): the user's
    mods as ``reference.attention``'s, called as mod(b, h, q_idx, kv_idx, *aux) with q_idx the query's index
    in q and kv_idx the key's in its sequence; the score mod after ALiBi, the mask ANDed with the others.

    Returns ``(m, l, acc)`` with shapes (B, H, Nq, S), (B, H, Nq, S), (B, H, Nq, S, d): split s of
    query i of head h holds m = max of its visible scores (−inf if none), ℓ = Σ exp(s − m) and
    acc = Σ exp(s − m)·v.
    """
    q, ks, vs, lens, scale, dt, window, softcap, slopes = _prepare(
        q, k_cache, v_cache, cache_seqlens, softmax_scale, dtype, window_size, softcap, alibi_slopes, block_table,
        cache_batch_idx, cache_leftpad, causal)
    block_n = check_positive_int("block_n", block_n)
    B, H, n_q, d = q.shape
    group = H // np.shape(k_cache)[1]
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
            k_h, v_h = ks[b][h // group], vs[b][h // group]
            slope = None if slopes is None else slopes[b, h]
            user = _user_mods(_at(mask_mod, b, h), _at(score_mod, b, h, score=True), None, mask_aux, score_aux, ())
            for s, (start, stop) in enumerate(per_b[b]):
                state = OnlineSoftmaxState(n_q, d, dtype=dt)
                if stop > start:
                    scores, _ = _final_logits((q[b, h] @ k_h[start:stop].T) * scale, rows, np.arange(start, stop),
                                              length, shift, window, softcap, slope, user=user)
                    state.update(scores, v_h[start:stop])
                m[b, h, :, s], l[b, h, :, s], acc[b, h, :, s] = state.m, state.l, state.acc
    return m, l, acc


def _at(mod, b: int, h: int, score: bool = False):
    """A user mod with its (b, h) fixed: the (batch, head) of one sequence's head, which _final_logits' leading-dim
    indices (none here) would not give."""
    if mod is None:
        return None
    if score:
        return lambda x, _b, _h, i, j, *aux: mod(x, b, h, i, j, *aux)
    return lambda _b, _h, i, j, *aux: mod(b, h, i, j, *aux)


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
                     block_n: int = 1, dtype=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                     block_table=None, cache_batch_idx=None, cache_leftpad=None, causal=True, mask_mod=None,
                     score_mod=None, mask_aux=(), score_aux=()):
    """Split-KV decoding, both phases: ``merge_partials(*decode_partials(...))``.

    Arguments as :func:`decode_partials`. Returns ``(O, L)``: O (B, H, Nq, d), L (B, H, Nq).
    Equal, up to rounding, to ``standard_attention(q[b], keys_b, values_b, causal=causal,
    window_size=window_size, softcap=softcap, alibi_slopes=slopes_b)`` for every sequence b, whatever
    the splits, with keys_b its len_b keys (cache rows [pad_b, cache_seqlens[b]) of its cache row
    or pages) and slopes_b the slopes of sequence b, shape (H,).
    """
    args = dict(cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
                cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, causal=causal, mask_mod=mask_mod,
                score_mod=score_mod, mask_aux=mask_aux, score_aux=score_aux)
    q, *_, dt, _, _, _ = _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, dtype, window_size, softcap,
                                  alibi_slopes, block_table, cache_batch_idx, cache_leftpad, causal)
    if 0 in q.shape[:3]:  # no sequences, heads or queries: nothing to split
        return np.zeros(q.shape, dtype=dt), np.full(q.shape[:-1], -np.inf, dtype=dt)
    return merge_partials(*decode_partials(q, k_cache, v_cache, splits=splits, block_n=block_n, **args))
