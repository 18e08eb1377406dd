"""Attention forward: the materialising version (3.6.2) and the FA2 tile loop (3.6.6).

Conventions (shared by every function in ``reference`` and by the numba_flash kernels):

* Shapes. ``q``: (..., Nq, d); ``k``, ``v``: (..., Nk, d) with the same d (v's head dim must
  equal q's). The leading dims are batch/heads and broadcast against each other; the output has
  the broadcast leading shape. Kernels use q (B, H, N, d) and k, v (B, Hkv, N, d).
* GQA / MQA. If q and k both have a heads axis (axis −3) with H and Hkv heads, Hkv ≠ H, Hkv > 1
  and H % Hkv == 0, query head h uses K/V head h // (H // Hkv), as flash-attention does (the
  reference repeats the K/V heads; a kernel indexes them). Hkv == 1 is ordinary broadcasting.
  In the backward, dk and dv are summed over the query heads of each group (and over any
  broadcast leading dim), so they have k's and v's shapes.
* ``softmax_scale`` defaults to 1/sqrt(d); otherwise it must be a finite real > 0.
  S = softmax_scale · Q Kᵀ.
* ``L`` is the logsumexp of the scaled scores of each query row, natural log: L = m + log ℓ.
* ``causal=True`` masks key j for query i unless j ≤ i + Nk − Nq: the mask is aligned to the
  bottom-right corner (flash-attention ≥ 2.1), so with Nq < Nk the last query sees every key,
  and with Nq > Nk the first Nq − Nk queries see no key at all.
* A fully masked query row has O = 0, L = −inf, and zero gradients.
* NaN and ±inf: IEEE arithmetic, the kernels' policy. A row whose visible scores hold a nan or +inf
  gets nan in O and L (and its gradients); −inf scores are masked keys. A nan or inf in v reaches the
  O (not L) of every row that sees its key; rows that do not see it may get nan too (0·nan = nan) where
  the product P·V still includes that key: here ``standard_attention`` includes every key, tiled
  versions (``flash_attention``, the kernels) only the key tiles a row's tile visits.
* Dtypes. Inputs may be any real floating (or integer) dtype. Computation and outputs are in
  float64 — or wider, e.g. longdouble inputs stay longdouble — unless ``dtype=`` asks for a
  floating dtype (say float32, to see a kernel's rounding). Nothing is silently truncated.
* Errors: TypeError for a wrong type or dtype, ValueError for a wrong shape or value; the message
  says what was given and what is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validation import (
    as_real_array,
    check_causal,
    check_nonnegative_real,
    check_positive_int,
    check_softmax_scale,
    compute_dtype,
    resolve_order,
)
from .softmax import _finalize, logsumexp, online_softmax_step, standard_softmax

__all__ = [
    "standard_attention",
    "flash_attention",
    "causal_mask",
    "kv_blocks_to_visit",
    "first_q_block_to_visit",
    "tile_needs_mask",
]


@dataclass(frozen=True)
class _Prepared:
    """Validated inputs, already broadcast (and GQA-expanded) to a common leading shape."""

    q: np.ndarray  # (*lead, Nq, d)
    k: np.ndarray  # (*lead, Nk, d)
    v: np.ndarray  # (*lead, Nk, d)
    scale: float
    causal: bool
    dtype: np.dtype
    lead: tuple
    n_q: int
    n_k: int
    d: int
    gqa_group: int  # H // Hkv, 1 without GQA
    q_shape: tuple  # the caller's shapes, to reduce gradients back to
    kv_shape: tuple

    def reduce_dq(self, dq: np.ndarray) -> np.ndarray:
        """Sum a gradient of the broadcast q back to q's own shape."""
        return _unbroadcast(dq, self.q_shape)

    def reduce_dkv(self, dk: np.ndarray) -> np.ndarray:
        """Sum a gradient of the broadcast, GQA-repeated k (or v) back to k's own shape."""
        g = self.gqa_group
        if g == 1:
            return _unbroadcast(dk, self.kv_shape)
        repeated = self.kv_shape[:-3] + (self.kv_shape[-3] * g,) + self.kv_shape[-2:]
        dk = _unbroadcast(dk, repeated)
        # query head h used K/V head h // g: sum each group of g consecutive heads
        return dk.reshape(self.kv_shape[:-3] + (self.kv_shape[-3], g) + self.kv_shape[-2:]).sum(axis=-3)


def _unbroadcast(x: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum ``x`` over the axes that broadcasting added or stretched, giving ``shape``."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape)))) if x.ndim > len(shape) else x
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=stretched, keepdims=True) if stretched else x


def _expand_kv_heads(k: np.ndarray, v: np.ndarray, q_shape: tuple) -> tuple[np.ndarray, np.ndarray, int]:
    """Repeat K/V heads for GQA (see the module docstring); returns (k, v, group size)."""
    if len(q_shape) < 3 or k.ndim < 3:
        return k, v, 1
    h, h_kv = q_shape[-3], k.shape[-3]
    if h == h_kv or h_kv == 1 or h == 1:
        return k, v, 1
    if h % h_kv != 0:
        raise ValueError(
            f"q has {h} heads (axis -3) and k/v have {h_kv}; for grouped-query attention the number of "
            f"K/V heads must divide the number of query heads (or be 1)"
        )
    g = h // h_kv
    return np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3), g


def _prepare(q, k, v, *, causal, softmax_scale, dtype, extra=()) -> _Prepared:
    """All checks of the attention entry points, then broadcast to one leading shape."""
    q = as_real_array("q", q)
    k = as_real_array("k", k)
    v = as_real_array("v", v)
    q_shape, kv_shape = q.shape, k.shape
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape (..., N, d) with at least 2 dims; got shape {x.shape}")
    d = q.shape[-1]
    if d < 1:
        raise ValueError(f"the head dim d = q.shape[-1] must be >= 1; got q of shape {q.shape}")
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(
            f"q, k and v must share the head dim d; got q {q.shape}, k {k.shape}, v {v.shape} "
            f"(this reference does not support a v head dim different from q's)"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (..., Nk, d); got k {k.shape}, v {v.shape}")
    n_q, n_k = q.shape[-2], k.shape[-2]
    if n_q < 1 or n_k < 1:
        raise ValueError(f"need Nq >= 1 and Nk >= 1; got q {q.shape}, k {k.shape}")
    causal = check_causal(causal)
    scale = check_softmax_scale(softmax_scale, d)
    dt = compute_dtype(dtype, q, k, v, *extra)
    k, v, g = _expand_kv_heads(k, v, q.shape)
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except ValueError as exc:
        raise ValueError(
            f"the leading (batch/head) dims of q {q.shape[:-2]} and k/v {k.shape[:-2]} do not broadcast; "
            "accepted: broadcast-compatible dims, or K/V heads dividing the query heads on axis -3 (GQA)"
        ) from exc
    q = np.broadcast_to(q.astype(dt, copy=False), lead + (n_q, d))
    k = np.broadcast_to(k.astype(dt, copy=False), lead + (n_k, d))
    v = np.broadcast_to(v.astype(dt, copy=False), lead + (n_k, d))
    return _Prepared(q, k, v, scale, causal, dt, lead, n_q, n_k, d, g, q_shape, kv_shape)


def causal_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, n_q: int, n_k: int) -> np.ndarray:
    """Boolean (q_stop−q_start, k_stop−k_start) tile mask, True where key j is hidden from query i.

    Bottom-right alignment: query i sees key j iff j ≤ i + Nk − Nq.
    """
    i = np.arange(q_start, q_stop)[:, None]
    j = np.arange(k_start, k_stop)[None, :]
    return j > i + (n_k - n_q)


def kv_blocks_to_visit(q_start: int, q_stop: int, n_q: int, n_k: int, block_k: int, causal: bool) -> int:
    """How many K/V blocks (counted from block 0) the Q rows [q_start, q_stop) must visit.

    Without causal masking: all ceil(Nk / block_k). With it, a K/V block is skipped when even the
    last row of the Q block sees none of its keys (it lies entirely above the diagonal); the
    last row q_stop − 1 sees keys 0 .. q_stop − 1 + Nk − Nq.
    """
    n_blocks = -(-n_k // block_k)
    if not causal:
        return n_blocks
    visible_keys = min(n_k, max(0, q_stop + n_k - n_q))  # keys seen by the last row of the block
    return -(-visible_keys // block_k)


def first_q_block_to_visit(k_start: int, n_q: int, n_k: int, block_q: int, causal: bool) -> int:
    """Index of the first Q block that sees any key of a K/V block starting at ``k_start``.

    The backward's outer loop runs over K/V blocks; with causal masking the Q blocks before this
    one lie entirely above the diagonal and are skipped. The first query seeing key k_start is
    k_start − (Nk − Nq).
    """
    if not causal:
        return 0
    first_row = max(0, k_start - (n_k - n_q))
    return min(first_row, n_q) // block_q


def tile_needs_mask(q_start: int, k_stop: int, n_q: int, n_k: int, causal: bool) -> bool:
    """True when some key of the tile is hidden from some query of it: a diagonal tile.

    The first row q_start sees keys up to q_start + Nk − Nq; if the tile's last key is beyond
    that, the tile needs the mask. Tiles entirely below the diagonal are used unmasked.
    """
    return causal and (k_stop - 1 > q_start + (n_k - n_q))


def standard_attention(q, k, v, *, causal: bool = False, softmax_scale=None, dtype=None):
    """Attention that materialises the Nq×Nk matrices S and P, as in 3.6.2.

    S = softmax_scale · Q Kᵀ (masked to −inf when ``causal``), P = softmax(S) row by row (max
    subtracted), O = P V, L = logsumexp of each row of S.

    Arguments: ``q`` (..., Nq, d); ``k``, ``v`` (..., Nk, d); leading dims broadcast, GQA on
    axis −3 (see the module docstring). ``causal``: bottom-right aligned mask. ``softmax_scale``:
    default 1/sqrt(d). ``dtype``: compute dtype, default float64 (or wider). NaN / inf: the module docstring.

    Returns ``(O, L)``: O (*lead, Nq, d), L (*lead, Nq). Fully masked rows: O = 0, L = −inf.
    Memory: O(Nq·Nk) per (batch, head) — this is the version that runs out of memory.
    """
    pr = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype)
    S = (pr.q @ np.swapaxes(pr.k, -1, -2)) * pr.scale
    if pr.causal:
        S = np.where(causal_mask(0, pr.n_q, 0, pr.n_k, pr.n_q, pr.n_k), -np.inf, S)
    P = standard_softmax(S, axis=-1, dtype=pr.dtype)
    O = P @ pr.v
    return O, logsumexp(S, axis=-1, dtype=pr.dtype)


def flash_attention(
    q,
    k,
    v,
    *,
    block_q: int,
    block_k: int,
    causal: bool = False,
    softmax_scale=None,
    kv_order=None,
    q_rows: slice | None = None,
    dtype=None,
    rescale_threshold: float = 0.0,
):
    """The FA2 tile loop of 3.6.6 in NumPy: never builds an Nq×Nk array.

    Q blocks of ``block_q`` rows on the outside (a kernel runs them in parallel, one thread block
    each), K/V blocks of ``block_k`` keys inside, each consumed by the online-softmax step with
    the running state ``m_i``, ``l_i``, ``acc``. With ``causal``, K/V blocks entirely above the
    diagonal are skipped and only diagonal tiles are masked. The last block of either kind may be
    shorter. The largest temporary is one (*lead, block_q, block_k) tile.

    Arguments as :func:`standard_attention`, plus:

    * ``block_q``, ``block_k``: ints >= 1.
    * ``kv_order``: the order in which every Q block visits the K/V blocks: None/'natural',
      'reverse', a permutation of range(ceil(Nk / block_k)), or a callable n -> permutation
      (e.g. ``lambda n: rng.permutation(n)``). The result does not depend on it beyond rounding.
    * ``q_rows``: a ``slice`` (step 1) of query rows to compute, as a launch of only part of the
      grid would; the causal alignment still uses the full Nq. Q blocks start at the slice start.
      Default: all rows.
    * ``rescale_threshold``: the running max moves only when a block beats it by more than this
      (natural-log units; see ``online_softmax_step``): the kernels' LAZY_RESCALE with 8·ln 2.

    Returns ``(O, L)`` for the selected rows: O (*lead, rows, d), L (*lead, rows).
    """
    pr = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype)
    block_q = check_positive_int("block_q", block_q)
    block_k = check_positive_int("block_k", block_k)
    rescale_threshold = check_nonnegative_real("rescale_threshold", rescale_threshold, "natural-log units")
    if q_rows is None:
        row_start, row_stop = 0, pr.n_q
    else:
        if not isinstance(q_rows, slice) or q_rows.step not in (None, 1):
            raise TypeError(f"q_rows must be a slice with step 1 (or None), got {q_rows!r}")
        row_start, row_stop, _ = q_rows.indices(pr.n_q)
        row_stop = max(row_start, row_stop)
    n_kv_blocks = -(-pr.n_k // block_k)
    order = resolve_order(kv_order, n_kv_blocks, name="kv_order")
    n_rows = row_stop - row_start
    O = np.empty(pr.lead + (n_rows, pr.d), dtype=pr.dtype)
    L = np.empty(pr.lead + (n_rows,), dtype=pr.dtype)

    for q_start in range(row_start, row_stop, block_q):  # one thread block per Q block
        q_stop = min(q_start + block_q, row_stop)
        q_i = pr.q[..., q_start:q_stop, :]
        m_i = np.full(pr.lead + (q_stop - q_start,), -np.inf, dtype=pr.dtype)
        l_i = np.zeros(pr.lead + (q_stop - q_start,), dtype=pr.dtype)
        acc = np.zeros(pr.lead + (q_stop - q_start, pr.d), dtype=pr.dtype)
        n_visit = kv_blocks_to_visit(q_start, q_stop, pr.n_q, pr.n_k, block_k, pr.causal)
        for j in order:
            if j >= n_visit:
                continue  # entirely above the causal diagonal
            k_start, k_stop = j * block_k, min((j + 1) * block_k, pr.n_k)
            s_ij = (q_i @ np.swapaxes(pr.k[..., k_start:k_stop, :], -1, -2)) * pr.scale
            if tile_needs_mask(q_start, k_stop, pr.n_q, pr.n_k, pr.causal):
                s_ij[..., causal_mask(q_start, q_stop, k_start, k_stop, pr.n_q, pr.n_k)] = -np.inf
            step = online_softmax_step(m_i, l_i, acc, s_ij, pr.v[..., k_start:k_stop, :],
                                       rescale_threshold=rescale_threshold)
            m_i, l_i, acc = step.m_new, step.l_i, step.acc
        O_i, L_i = _finalize(m_i, l_i, acc)  # O_i = acc / l_i once, at the end
        O[..., q_start - row_start : q_stop - row_start, :] = O_i
        L[..., q_start - row_start : q_stop - row_start] = L_i
    return O, L
