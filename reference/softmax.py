"""Softmax three ways: naive, standard (max-subtracted) and online (section 3.6.4).

The online recurrence lives in one function, :func:`online_softmax_step`. The state object
(:class:`OnlineSoftmaxState`), :func:`online_softmax_attention`, the tile loop in
``reference.attention.flash_attention`` and the trace all call it, so there is one copy of the
maths to check. Its names are the kernels' names: ``m_i``, ``l_i``, ``acc`` are the textbook's
m, ℓ, O of 3.6.4 (running max, running sum of exp(x − m), running unnormalised output).

Masking convention: a score of −inf is a masked key; nan or +inf in a row makes that row nan
(IEEE arithmetic, the kernels' policy; the trace alone refuses them). A row whose scores are all −inf (fully
masked) has no softmax; here it gives weights 0, output O = 0 and logsumexp L = −inf, as
flash-attention does. The guard is the one flash-attention uses: where the running max is −inf,
subtract 0 instead, so that exp(−inf − 0) = 0 rather than exp(−inf − (−inf)) = nan.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._validation import (
    as_real_array,
    block_bounds,
    check_positive_int,
    compute_dtype,
    resolve_order,
)

__all__ = [
    "standard_softmax",
    "naive_softmax",
    "logsumexp",
    "OnlineStep",
    "online_softmax_step",
    "OnlineSoftmaxState",
    "online_softmax_attention",
]


def _safe_max(m: np.ndarray) -> np.ndarray:
    """The max to subtract: m itself, or 0 where m is −inf (fully masked so far)."""
    return np.where(np.isneginf(m), 0.0, m).astype(m.dtype, copy=False)


def standard_softmax(x, axis: int = -1, *, dtype=None) -> np.ndarray:
    """Softmax along ``axis`` with the row max subtracted first (3.6.2), so exp never overflows.

    ``x``: any shape, real floating or integer dtype; −inf marks a masked entry; a row holding nan
    or +inf gives nan (IEEE arithmetic, as the kernels). The axis must not be empty. Computed in float64 (or in the inputs'
    wider dtype) unless ``dtype=`` asks for another floating dtype. A fully masked row (all −inf)
    gives all zeros. Returns an array of ``x``'s shape.
    """
    x = as_real_array("x", x)
    dt = compute_dtype(dtype, x)
    x = x.astype(dt, copy=False)
    if x.ndim == 0 or x.shape[axis] == 0:
        raise ValueError(f"x must have at least one entry along axis {axis}; got shape {x.shape}")
    m = _safe_max(np.max(x, axis=axis, keepdims=True))
    p = np.exp(x - m)
    l = np.sum(p, axis=axis, keepdims=True)
    # l is 0 only for a fully masked row; divide by 1 there so its zeros stay zeros
    return p / np.where(l == 0, 1.0, l).astype(dt, copy=False)


def naive_softmax(x, axis: int = -1, *, dtype=None) -> np.ndarray:
    """exp(x) / sum(exp(x)) with no max subtraction: the version the chapter warns about.

    For float64, exp overflows to inf once x > ~709.78 (for float16 once x > ~11.09), and the row
    becomes inf/inf = nan. That overflow is the point of this function, so it is left to happen
    (NumPy's overflow and invalid-value warnings are silenced). Same arguments as
    :func:`standard_softmax`, but values are not checked.
    """
    x = as_real_array("x", x)
    dt = compute_dtype(dtype, x)
    x = x.astype(dt, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(x)
        return p / np.sum(p, axis=axis, keepdims=True)


def logsumexp(x, axis: int = -1, *, dtype=None) -> np.ndarray:
    """log(sum(exp(x))) along ``axis`` as m + log ℓ (natural log); −inf for a fully masked row."""
    x = as_real_array("x", x)
    dt = compute_dtype(dtype, x)
    x = x.astype(dt, copy=False)
    if x.ndim == 0 or x.shape[axis] == 0:
        raise ValueError(f"x must have at least one entry along axis {axis}; got shape {x.shape}")
    m = np.max(x, axis=axis)
    l = np.sum(np.exp(x - np.expand_dims(_safe_max(m), axis)), axis=axis)
    with np.errstate(divide="ignore"):
        return m + np.log(l)  # fully masked: -inf + log 0 = -inf


class OnlineStep(NamedTuple):
    """What one step of the 3.6.4 recurrence computed (the trace prints these)."""

    m_tilde: np.ndarray  # m̃: max of this block's scores, per row
    m_new: np.ndarray  # max(m_old, m̃)
    alpha: np.ndarray  # exp(m_old − m_new): rescales both the old ℓ and the old O
    p: np.ndarray  # exp(s − m_new), the block's unnormalised weights
    l_i: np.ndarray  # ℓ_new = α·ℓ_old + Σp
    acc: np.ndarray  # O_new = α·O_old + p·V_blk


def online_softmax_step(m_i, l_i, acc, s_ij, v_j, *, rescale_threshold: float = 0.0) -> OnlineStep:
    """One block of the online softmax (3.6.4), for any number of rows at once.

    Shapes, with ``...`` any leading (batch) dims and Bk >= 1 keys in the block:
    ``m_i``, ``l_i``: (..., R); ``acc``: (..., R, d); ``s_ij``: (..., R, Bk) scores, −inf = masked;
    ``v_j``: (..., Bk, d). Pure function: returns the new state (and the intermediates) as an
    :class:`OnlineStep`; the inputs are not modified. No validation (callers validate).

    ``rescale_threshold`` (>= 0, natural-log units; the kernels' LAZY_RESCALE uses 8·ln 2): a row's
    running max moves only when the block's max exceeds it by more than this, so α = 1 (no rescale of
    ℓ and O) on most blocks while each p stays <= exp(threshold). Any m gives the same softmax as long
    as ℓ, O and L use the same one; 0 is the textbook recurrence (m_new = max(m_old, m̃)).
    """
    m_tilde = np.max(s_ij, axis=-1)
    if rescale_threshold:  # −inf + threshold is −inf: a row's first visible key always sets m
        m_new = np.where(m_tilde > m_i + rescale_threshold, m_tilde, m_i)
    else:
        m_new = np.maximum(m_i, m_tilde)
    m_sub = _safe_max(m_new)  # m_new = -inf: every key so far masked; -inf - -inf would be nan
    alpha = np.exp(m_i - m_sub)
    p = np.exp(s_ij - m_sub[..., None])
    l_new = alpha * l_i + np.sum(p, axis=-1)
    acc_new = alpha[..., None] * acc + p @ v_j  # α rescales O too, not only ℓ (3.6.10 pitfall)
    return OnlineStep(m_tilde, m_new, alpha, p, l_new, acc_new)


def _finalize(m_i, l_i, acc):
    """(O, L) from a state: O = acc/ℓ, L = m + log ℓ; a fully masked row (ℓ = 0) gives 0 and −inf."""
    empty = l_i == 0
    O = acc / np.where(empty, 1.0, l_i).astype(l_i.dtype, copy=False)[..., None]
    with np.errstate(divide="ignore"):
        L = np.where(empty, -np.inf, m_i + np.log(np.where(empty, 1.0, l_i))).astype(l_i.dtype, copy=False)
    return O, L


class OnlineSoftmaxState:
    """Running online-softmax state for R rows with d-dimensional values (3.6.4).

    Attributes (the textbook's m, ℓ, O): ``m`` (R,) running max, starts at −inf; ``l`` (R,)
    running sum of exp(score − m), starts at 0; ``acc`` (R, d) running unnormalised output
    Σ exp(score − m)·v, starts at 0. ``dtype`` (default float64) is fixed at construction.

    * :meth:`update` consumes one block of keys in place.
    * :meth:`merge` combines two states built from disjoint sets of keys into a new state.
    * :meth:`finalize` returns ``(O, L)``: O = acc/ℓ (R, d), L = m + log ℓ (R,), natural log;
      a fully masked row gives O = 0, L = −inf.
    """

    def __init__(self, rows: int, d: int, *, dtype=np.float64):
        rows = check_positive_int("rows", rows)
        d = check_positive_int("d", d)
        dt = compute_dtype(dtype)
        self.m = np.full(rows, -np.inf, dtype=dt)
        self.l = np.zeros(rows, dtype=dt)
        self.acc = np.zeros((rows, d), dtype=dt)

    @property
    def rows(self) -> int:
        return self.m.shape[0]

    @property
    def d(self) -> int:
        return self.acc.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self.m.dtype

    @classmethod
    def from_arrays(cls, m, l, acc) -> "OnlineSoftmaxState":
        """A state holding copies of ``m`` (R,), ``l`` (R,), ``acc`` (R, d) of one floating dtype."""
        m, l, acc = (np.array(a) for a in (m, l, acc))
        if m.ndim != 1 or l.shape != m.shape or acc.ndim != 2 or acc.shape[0] != m.shape[0]:
            raise ValueError(
                f"need m (R,), l (R,), acc (R, d); got shapes {m.shape}, {l.shape}, {acc.shape}"
            )
        dt = np.result_type(m, l, acc)
        if not np.issubdtype(dt, np.floating):
            raise TypeError(f"m, l, acc must have a floating dtype, got {dt}")
        state = cls(max(m.shape[0], 1), max(acc.shape[1], 1), dtype=dt)
        state.m, state.l, state.acc = m.astype(dt), l.astype(dt), acc.astype(dt)
        return state

    def copy(self) -> "OnlineSoftmaxState":
        return OnlineSoftmaxState.from_arrays(self.m, self.l, self.acc)

    def _block(self, name: str, x, shape: tuple) -> np.ndarray:
        x = as_real_array(name, x)
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}; this state needs {shape}")
        if not np.can_cast(x.dtype, self.dtype, "safe"):
            raise TypeError(
                f"{name} has dtype {x.dtype}, which the state's {self.dtype} would truncate; "
                f"build the state with dtype={x.dtype} or cast the block yourself"
            )
        return x.astype(self.dtype, copy=False)

    def update(self, scores_block, values_block) -> OnlineStep:
        """Consume one block of Bk >= 1 keys, in place, by the 3.6.4 recurrence.

        ``scores_block``: (R, Bk), −inf for a masked key (nan or +inf: nan rows). ``values_block``: (Bk, d).
        Returns the step's intermediates (m̃, m_new, α, p, ℓ, O) as an :class:`OnlineStep`.
        """
        s = as_real_array("scores_block", scores_block)
        if s.ndim != 2 or s.shape[0] != self.rows or s.shape[1] < 1:
            raise ValueError(f"scores_block has shape {s.shape}; this state needs ({self.rows}, Bk) with Bk >= 1")
        s = self._block("scores_block", s, s.shape)
        v = self._block("values_block", values_block, (s.shape[1], self.d))
        step = online_softmax_step(self.m, self.l, self.acc, s, v)
        self.m, self.l, self.acc = step.m_new, step.l_i, step.acc
        return step

    def merge(self, other: "OnlineSoftmaxState") -> "OnlineSoftmaxState":
        """Combine with a state built from a disjoint set of keys (logsumexp combine).

        m = max(m_a, m_b); each side is rescaled by exp(m_side − m) before ℓ and acc are added.
        Returns a new state; neither input changes. Exactly commutative; associative up to
        rounding. Works when either side (or both) has seen only masked keys (m = −inf).
        """
        if not isinstance(other, OnlineSoftmaxState):
            raise TypeError(f"can only merge with an OnlineSoftmaxState, got {type(other).__name__}")
        if other.acc.shape != self.acc.shape or other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge a state of shape {other.acc.shape} and dtype {other.dtype} into one of "
                f"shape {self.acc.shape} and dtype {self.dtype}; they must match"
            )
        m_new = np.maximum(self.m, other.m)
        m_sub = _safe_max(m_new)  # both sides fully masked: keep 0 weights, not nan
        alpha_self = np.exp(self.m - m_sub)
        alpha_other = np.exp(other.m - m_sub)
        return OnlineSoftmaxState.from_arrays(
            m_new,
            alpha_self * self.l + alpha_other * other.l,
            alpha_self[:, None] * self.acc + alpha_other[:, None] * other.acc,
        )

    def finalize(self) -> tuple[np.ndarray, np.ndarray]:
        """``(O, L)``: O = acc/ℓ of shape (R, d), L = m + log ℓ of shape (R,); masked row: 0, −inf."""
        return _finalize(self.m, self.l, self.acc)

    def __repr__(self) -> str:
        return f"OnlineSoftmaxState(rows={self.rows}, d={self.d}, dtype={self.dtype})"


def online_softmax_attention(scores, values, *, blocks, order=None, dtype=None):
    """Softmax-weighted sum of ``values`` computed block by block over the key axis (3.6.4).

    ``scores``: (R, N) or (N,) — one row per query, −inf for a masked key, no nan/+inf.
    ``values``: (N, d) or (N,). ``blocks``: the key-axis split: a sequence of sizes >= 1 summing
    to N (uneven sizes allowed), or one int (that size, last block shorter). ``order``: the order
    the blocks are consumed in: None/'natural', 'reverse', a permutation of the block indices, or
    a callable n_blocks -> permutation. ``dtype``: compute dtype (default float64, or wider).

    Returns ``(O, L)``: O of shape (R, d) and L = m + log ℓ of shape (R,); a 1-D ``scores`` drops
    the R axis and a 1-D ``values`` drops the d axis. Raises ValueError if the block sizes do not
    sum to N or the order is not a permutation.
    """
    scores = as_real_array("scores", scores)
    values = as_real_array("values", values)
    if scores.ndim not in (1, 2) or values.ndim not in (1, 2):
        raise ValueError(
            f"scores must be (R, N) or (N,) and values (N, d) or (N,); got shapes {scores.shape}, {values.shape}"
        )
    s2 = np.atleast_2d(scores)
    v2 = values[:, None] if values.ndim == 1 else values
    n = s2.shape[1]
    if v2.shape[0] != n:
        raise ValueError(f"scores has {n} keys (last axis) but values has {v2.shape[0]} rows; they must match")
    if n < 1 or s2.shape[0] < 1 or v2.shape[1] < 1:
        raise ValueError(f"need at least one row, one key and d >= 1; got shapes {scores.shape}, {values.shape}")
    dt = compute_dtype(dtype, scores, values)
    s2, v2 = s2.astype(dt, copy=False), v2.astype(dt, copy=False)
    bounds = block_bounds(n, blocks, what="keys (last axis of scores)")
    state = OnlineSoftmaxState(s2.shape[0], v2.shape[1], dtype=dt)
    for j in resolve_order(order, len(bounds)):
        start, stop = bounds[j]
        state.update(s2[:, start:stop], v2[start:stop])
    O, L = state.finalize()
    if values.ndim == 1:
        O = O[:, 0]
    if scores.ndim == 1:
        O, L = O[0], L[0]
    return O, L
