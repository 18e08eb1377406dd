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
    "check_window_size",
    "check_softcap",
    "check_alibi_slopes",
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
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        x = math.inf
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{name} must be a finite number >= 0{units}, got {value!r}")
    return x


def check_causal(causal) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")
    return bool(causal)


_WINDOW_ACCEPTED = "accepted: a pair (left, right) of ints, each -1 (no bound on that side) or >= 0"


def check_window_size(window_size, causal: bool, *, causal_by: str = "causal=True", n_k=None) -> tuple[int, int]:
    """flash-attn's ``window_size = (left, right)`` as the pair of Python ints the mask uses.

    With ``n_k`` (the number of keys), a side >= n_k becomes -1, unbounded, as flash-attn's API does before
    its kernels see the window (it differs from the bound as written only for right >= Nk with Nq > Nk + right).

    Each side is an int (Python or NumPy integer, not a bool), −1 for no bound or >= 0; ``(left, right)``
    may be a tuple, a list or a 1-D integer array. Causal masking is the window's right = 0: with
    ``causal`` a right of −1 or 0 gives 0 and any other right is refused (flash-attn overrides it
    silently). ``causal_by`` names what makes the mask causal, for that message.
    """
    if isinstance(window_size, np.ndarray) and window_size.ndim == 1:
        pair = list(window_size)
    elif isinstance(window_size, (tuple, list)):
        pair = list(window_size)
    else:
        raise TypeError(
            f"window_size must be a pair (left, right), got {window_size!r} of type "
            f"{type(window_size).__name__}; {_WINDOW_ACCEPTED}"
        )
    if len(pair) != 2:
        raise ValueError(
            f"window_size must have 2 entries (left, right), got {len(pair)}: {window_size!r}; {_WINDOW_ACCEPTED}"
        )
    sides = []
    for side, value in zip(("left", "right"), pair):
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"window_size {side} must be an int, got the bool {value!r}; {_WINDOW_ACCEPTED}")
        try:
            n = operator.index(value)
        except TypeError as exc:
            raise TypeError(
                f"window_size {side} must be an int, got {value!r} of type {type(value).__name__}; {_WINDOW_ACCEPTED}"
            ) from exc
        if n < -1:
            raise ValueError(f"window_size {side} = {n} in window_size={window_size!r}; {_WINDOW_ACCEPTED}")
        sides.append(int(n))
    left, right = sides
    if causal:
        if right not in (-1, 0):
            raise ValueError(
                f"window_size={window_size!r} with {causal_by}: causal masking fixes the window's right = 0; "
                "accepted with it: right = -1 or 0 (flash-attn overrides any other right silently; "
                "this reference refuses it)"
            )
        right = 0
    if n_k is not None:
        left = -1 if left >= n_k else left
        right = -1 if right >= n_k else right
    return left, right


def check_softcap(softcap) -> float:
    """flash-attn's ``softcap``: a finite real >= 0 (bools refused); 0.0 means no capping."""
    return check_nonnegative_real("softcap", softcap, "0.0: no capping")


def check_alibi_slopes(alibi_slopes, q_shape: tuple):
    """``alibi_slopes`` as an ndarray of shape (H,) or (B, H), or None.

    H = q_shape[−3] (the query heads) and B = q_shape[−4] (the batch): (H,) needs q to have a heads
    axis, (B, H) a batch axis too. Values must be finite (any sign); integer dtypes are accepted.
    """
    if alibi_slopes is None:
        return None
    slopes = as_real_array("alibi_slopes", alibi_slopes)
    if len(q_shape) < 3:
        raise ValueError(
            f"alibi_slopes has shape {slopes.shape}, but q of shape {q_shape} has no heads axis; accepted: "
            "q (H, Nq, d) with slopes (H,), or q (..., B, H, Nq, d) with slopes (H,) or (B, H)"
        )
    accepted = [q_shape[-3:-2]] + ([q_shape[-4:-2]] if len(q_shape) >= 4 else [])
    if slopes.shape not in accepted:
        names = " or ".join(f"{n} = {s}" for n, s in zip(("(H,)", "(B, H)"), accepted))
        raise ValueError(
            f"alibi_slopes has shape {slopes.shape}; accepted for q of shape {q_shape}: {names} "
            "(H = q.shape[-3] query heads, B = q.shape[-4])"
        )
    check_finite("alibi_slopes", slopes)
    return slopes


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

