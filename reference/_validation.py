"""Input checks shared by the reference functions.

Every check lives here so that each message says what was given and what is accepted, in one
voice. Nothing here computes attention.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import numpy as np

__all__ = [
    "as_real_array",
    "compute_dtype",
    "check_positive_int",
    "check_softmax_scale",
    "check_causal",
    "block_bounds",
    "resolve_order",
    "check_no_nan_or_posinf",
    "check_finite",
]


def as_real_array(name: str, x) -> np.ndarray:
    """Return ``x`` as an ndarray of a real floating or integer dtype, else raise TypeError.

    Integers are accepted so that ``[1, 3, 2, 5]`` works; they become floats in ``compute_dtype``.
    """
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise TypeError(
            f"{name} has dtype {arr.dtype}; accepted: a real floating dtype "
            "(float16, float32, float64, longdouble) or an integer dtype"
        )
    return arr


def compute_dtype(dtype, *arrays: np.ndarray) -> np.dtype:
    """The dtype to compute in: ``dtype`` if the caller gave one, else at least float64.

    With ``dtype=None`` the inputs are promoted together with float64, so float16/float32 inputs
    are computed in float64 and a longdouble input is never truncated to float64.
    """
    if dtype is None:
        return np.result_type(*arrays, np.float64)
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype={dtype!r} is not a NumPy dtype; accepted: a real floating dtype") from exc
    if not np.issubdtype(dt, np.floating):
        raise TypeError(
            f"dtype={dt} is not a real floating dtype; accepted: float16, float32, float64, longdouble"
        )
    return dt


def check_positive_int(name: str, value) -> int:
    """``value`` as a Python int >= 1 (bools refused: ``True`` is not a block size)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int >= 1, got the bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError as exc:
        raise TypeError(f"{name} must be an int >= 1, got {value!r} of type {type(value).__name__}") from exc
    if n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {n}")
    return n


def check_softmax_scale(softmax_scale, d: int) -> float:
    """The scale applied to Q Kᵀ: ``1/sqrt(d)`` when None, else a finite real number > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a real number or None, got {softmax_scale!r} "
            f"of type {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0 (or None for 1/sqrt(d)), got {softmax_scale!r}")
    return scale


def check_nonnegative_real(name: str, value, what: str = "") -> float:
    """``value`` as a float, finite and >= 0 (bools refused); ``what`` adds its units to the messages."""
    units = f" ({what})" if what else ""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number{units}, got {value!r} of type {type(value).__name__}")
    x = float(value)
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be a finite number >= 0{units}, got {value!r}")
    return x


def check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")
    return bool(causal)


def block_bounds(n: int, blocks, *, what: str = "keys") -> list[tuple[int, int]]:
    """Split ``range(n)`` into consecutive ``(start, stop)`` blocks.

    ``blocks`` is either one int (every block that size, the last one shorter if it does not
    divide ``n``) or a sequence of sizes >= 1 that must sum to ``n``.
    """
    if isinstance(blocks, Sequence) or isinstance(blocks, np.ndarray):
        sizes = [check_positive_int("each block size", b) for b in blocks]
        if not sizes:
            raise ValueError(f"blocks must not be empty; there are {n} {what} to split")
        if sum(sizes) != n:
            raise ValueError(
                f"blocks {tuple(sizes)} sum to {sum(sizes)}, but there are {n} {what}; "
                f"the block sizes must sum to {n}"
            )
    else:
        size = check_positive_int("blocks", blocks)
        sizes = [min(size, n - start) for start in range(0, n, size)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def resolve_order(order, n_blocks: int, *, name: str = "order") -> list[int]:
    """Turn an order argument into a list that is a permutation of ``range(n_blocks)``.

    Accepted: None or ``"natural"`` (0, 1, ...), ``"reverse"``, a sequence of block indices, or a
    callable ``f(n_blocks)`` returning such a sequence (e.g. ``lambda n: rng.permutation(n)``).
    """
    if order is None or (isinstance(order, str) and order == "natural"):
        return list(range(n_blocks))
    if isinstance(order, str):
        if order == "reverse":
            return list(range(n_blocks - 1, -1, -1))
        raise ValueError(
            f"{name}={order!r} is not understood; accepted: None, 'natural', 'reverse', "
            f"a permutation of range({n_blocks}), or a callable n -> permutation"
        )
    if callable(order) and not isinstance(order, (Sequence, np.ndarray)):
        order = order(n_blocks)
    try:
        perm = [operator.index(j) for j in order]
    except TypeError as exc:
        raise TypeError(f"{name} must be a sequence of block indices, got {order!r}") from exc
    if sorted(perm) != list(range(n_blocks)):
        raise ValueError(f"{name}={perm} is not a permutation of range({n_blocks}) (there are {n_blocks} blocks)")
    return perm


def check_no_nan_or_posinf(name: str, x: np.ndarray) -> None:
    """Scores may hold -inf (a masked key) but not nan or +inf, which have no softmax."""
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError(f"{name} contains nan or +inf; accepted: finite values, or -inf for a masked entry")


def check_finite(name: str, x: np.ndarray) -> None:
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contains non-finite values (nan or inf); accepted: finite values")

