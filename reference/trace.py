"""A step-by-step record of the online softmax, for hand calculation (3.6.5).

:func:`online_softmax_trace` drives :class:`reference.softmax.OnlineSoftmaxState` block by block
over one row of scores and records, per step, what the chapter writes down: the block, m̃, m_old,
m_new, α, p, ℓ and O (unnormalised). Beside it, the standard computation of the same row.
:func:`format_trace` prints it as a table. ``scripts/hand_calc.py`` and the ``numba-flash trace``
command are thin wrappers over these two functions.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field

import numpy as np

from ._validation import as_real_array, block_bounds, check_no_nan_or_posinf, compute_dtype, resolve_order
from .softmax import OnlineSoftmaxState

__all__ = ["TraceStep", "OnlineSoftmaxTrace", "online_softmax_trace", "format_trace"]


@dataclass(frozen=True)
class TraceStep:
    """One block of the recurrence. Values are floats, or tuples of floats where they are vectors."""

    step: int  # 0, 1, ... in the order consumed
    block: int  # index of the block in the natural split
    keys: tuple[int, int]  # (start, stop) of its keys
    x: tuple  # the block's scores
    v: tuple  # the block's values (floats when d = 1, else tuples of d floats)
    m_tilde: float  # m̃ = max of the block
    m_old: float
    m_new: float  # max(m_old, m̃)
    alpha: float  # exp(m_old − m_new): rescales the old ℓ and O
    p: tuple  # exp(x − m_new)
    l: float  # ℓ after the step: α·ℓ_old + Σp
    O: float | tuple  # O after the step (unnormalised): α·O_old + p·v


@dataclass(frozen=True)
class OnlineSoftmaxTrace:
    """The steps, the online result, and the standard computation of the same row."""

    x: tuple
    v: tuple
    blocks: tuple  # ((start, stop), ...) in natural order
    order: tuple  # block indices in the order consumed
    steps: tuple[TraceStep, ...]
    m: float  # online final state
    l: float
    O_acc: float | tuple  # unnormalised O before the final division
    O: float | tuple  # O_final = O_acc / ℓ
    L: float  # m + log ℓ
    standard_m: float  # standard (whole row at once)
    standard_p: tuple  # exp(x − m)
    standard_l: float
    standard_weighted_sum: float | tuple  # Σ p·v
    standard_O: float | tuple
    standard_L: float
    d: int = field(default=1)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict; ±inf and nan become the strings '-inf', 'inf', 'nan'."""
        out = {k: _jsonable(getattr(self, k)) for k in self.__dataclass_fields__ if k != "steps"}
        out["steps"] = [{k: _jsonable(getattr(s, k)) for k in s.__dataclass_fields__} for s in self.steps]
        return out


def _jsonable(x):
    if isinstance(x, (tuple, list)):
        return [_jsonable(y) for y in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _vals(a: np.ndarray):
    """A 0-d array as a float, a 1-d array as a tuple of floats, 2-d as a tuple of tuples."""
    a = np.asarray(a, dtype=float)
    if a.ndim == 0:
        return float(a)
    return tuple(_vals(row) for row in a)


def online_softmax_trace(x, v, *, blocks, order=None, dtype=None) -> OnlineSoftmaxTrace:
    """Trace the online softmax of one row of scores ``x`` (n,) against values ``v`` (n,) or (n, d).

    ``blocks``: block sizes summing to n (or one int); ``order``: None/'natural', 'reverse', a
    permutation of the block indices, or a callable n_blocks -> permutation. ``dtype``: compute
    dtype, float64 by default. Returns an :class:`OnlineSoftmaxTrace`; with d = 1 (``v`` 1-D) the
    values and outputs are plain floats.
    """
    x = as_real_array("x", x)
    v = as_real_array("v", v)
    if x.ndim != 1 or v.ndim not in (1, 2) or v.shape[0] != x.shape[0] or x.shape[0] < 1:
        raise ValueError(f"need x of shape (n,) with n >= 1 and v of shape (n,) or (n, d); got {x.shape}, {v.shape}")
    dt = compute_dtype(dtype, x, v)
    x = x.astype(dt, copy=False)
    check_no_nan_or_posinf("x", x)
    scalar = v.ndim == 1
    v2 = (v[:, None] if scalar else v).astype(dt, copy=False)
    if v2.shape[1] < 1:
        raise ValueError(f"v must have d >= 1 columns; got shape {v.shape}")
    out = (lambda a: _vals(a[..., 0])) if scalar else _vals
    bounds = block_bounds(x.shape[0], blocks, what="scores in x")
    perm = resolve_order(order, len(bounds))

    state = OnlineSoftmaxState(1, v2.shape[1], dtype=dt)
    steps = []
    for n, j in enumerate(perm):
        start, stop = bounds[j]
        m_old = float(state.m[0])
        st = state.update(x[None, start:stop], v2[start:stop])
        steps.append(
            TraceStep(
                step=n,
                block=j,
                keys=(start, stop),
                x=_vals(x[start:stop]),
                v=out(v2[start:stop]),
                m_tilde=float(st.m_tilde[0]),
                m_old=m_old,
                m_new=float(st.m_new[0]),
                alpha=float(st.alpha[0]),
                p=_vals(st.p[0]),
                l=float(st.l_i[0]),
                O=out(st.acc[0]),
            )
        )
    O, L = state.finalize()

    # the standard computation of 3.6.2 on the whole row, written out as the chapter does
    m = np.max(x)
    p = np.exp(x - (m if np.isfinite(m) else 0.0))
    l = np.sum(p)
    weighted = p @ v2
    with np.errstate(divide="ignore"):
        standard_L = m + np.log(l)
    return OnlineSoftmaxTrace(
        x=_vals(x),
        v=out(v2),
        blocks=tuple(bounds),
        order=tuple(perm),
        steps=tuple(steps),
        m=float(state.m[0]),
        l=float(state.l[0]),
        O_acc=out(state.acc[0]),
        O=out(O[0]),
        L=float(L[0]),
        standard_m=float(m),
        standard_p=_vals(p),
        standard_l=float(l),
        standard_weighted_sum=out(weighted),
        standard_O=out(weighted / l if l > 0 else np.zeros_like(weighted)),
        standard_L=float(standard_L) if l > 0 else -math.inf,
        d=v2.shape[1],
    )


def _width(s: str) -> int:
    """Printed width: a combining mark (the tilde of m̃) takes no column."""
    return sum(not unicodedata.combining(ch) for ch in s)


def _fmt(x, digits: int) -> str:
    if isinstance(x, tuple):
        return "[" + ", ".join(_fmt(y, digits) for y in x) + "]"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.{digits}f}"


def format_trace(trace: OnlineSoftmaxTrace, *, digits: int = 4) -> str:
    """The trace as a printable table, then the online and the standard results side by side."""
    header = ("step", "block", "x", "v", "m̃", "m_old", "m_new", "α", "p", "ℓ", "O")
    rows = [header]
    for s in trace.steps:
        rows.append(
            (
                str(s.step + 1),
                str(s.block),
                _fmt(s.x, digits),
                _fmt(s.v, digits),
                _fmt(s.m_tilde, digits),
                _fmt(s.m_old, digits),
                _fmt(s.m_new, digits),
                _fmt(s.alpha, digits),
                _fmt(s.p, digits),
                _fmt(s.l, digits),
                _fmt(s.O, digits),
            )
        )
    widths = [max(_width(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(" " * (w - _width(cell)) + cell for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    f = lambda y: _fmt(y, digits)  # noqa: E731
    lines += [
        "",
        f"online   (order {list(trace.order)}): m = {f(trace.m)}, ℓ = {f(trace.l)}, "
        f"O = {f(trace.O_acc)} / {f(trace.l)} = {f(trace.O)}, L = m + log ℓ = {f(trace.L)}",
        f"standard (whole row):  m = {f(trace.standard_m)}, exp(x − m) = {f(trace.standard_p)}, "
        f"ℓ = {f(trace.standard_l)}, Σp·v = {f(trace.standard_weighted_sum)}, O = {f(trace.standard_O)}, "
        f"L = {f(trace.standard_L)}",
    ]
    return "\n".join(lines)
