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
* Masks (flash-attn 2.x's names and defaults). With shift = Nk − Nq and ``window_size = (left,
  right)`` (default (−1, −1)), query i sees key j iff 0 ≤ j < Nk, (left = −1 or j ≥ i + shift − left)
  and (right = −1 or j ≤ i + shift + right): the mask is aligned to the bottom-right corner
  (flash-attention ≥ 2.1), query i with key i + shift, the last query with the last key.
  ``causal=True`` is the window's right = 0: query i sees keys j ≤ i + shift, so with Nq < Nk the
  last query sees every key and with Nq > Nk the first Nq − Nk queries see no key at all. With
  ``causal`` the window's right must be −1 or 0 (both mean 0); any other right is a ValueError
  (flash-attn overrides it silently). left and right are ints (Python or NumPy integers, not bools),
  each −1 (no bound) or ≥ 0; a side ≥ Nk is −1 (unbounded), as flash-attn's API makes it before its
  kernels see the window (for left the same mask; for a right ≥ Nk with Nq > Nk + right the first
  rows then see every key). ``window_size=(-1, -1)`` without causal is no mask. Decoding (``reference.decode``) is
  causal with each sequence's own shift, len_b − Nq.
* Logits, per (batch b, head h, query i, key j), in this order:
  s = softmax_scale · q_i·k_j (``softmax_scale`` defaults to 1/sqrt(d), otherwise a finite real > 0);
  with ``softcap`` > 0, s ← softcap · tanh(s / softcap) (``softcap`` a finite real ≥ 0; 0.0 is off);
  with ``alibi_slopes``, s ← s − slope[b, h] · |i + shift − j| (after the softcap, as flash-attn);
  then hidden keys → −inf. P = softmax of each row, O = P V.
* ``alibi_slopes``: a real array of shape (H,) or (B, H), H = q.shape[−3] (the query heads) and
  B = q.shape[−4]; finite values of any sign (flash-attn uses positive ones). q of shape (H, Nq, d)
  takes (H,) only, q of shape (Nq, d) (no heads axis) none. The slopes follow q's heads: where q's
  leading dims broadcast against k's, every output row uses the slope of the q head it comes from.
  The bias is exact, so L includes it: flash-attn's causal kernels add only slope·j (they drop
  slope·(i + shift), constant along a row), so their L is this L + slope·(i + shift); O and the
  gradients agree. There is no gradient for ``alibi_slopes`` (flash-attn has none).
* User mods (FlexAttention's semantics, numba_flash.mods'): ``score_mod(score, b, h, i, j, *score_aux) ->
  score`` on the logit after softcap and ALiBi, and ``mask_mod(b, h, i, j, *mask_aux) -> bool`` (True: key j
  visible to query i), ANDed with the window / causal mask; i and j are absolute, b and h the leading
  indices (batch, then query head; leading shapes of at most 2 dims). The same Python functions the kernels
  compile, called per element (``np.vectorize``: any Python a mod may hold). ``score_mod_grad`` (same
  arguments) is d score_mod / d score, which the backward needs with a score_mod.
* ``L`` is the logsumexp of the final logits of each query row, natural log: L = m + log ℓ.
* A fully masked query row has O = 0, L = −inf, and zero gradients.
* NaN and ±inf: IEEE arithmetic, the kernels' policy. A row whose visible scores hold a nan or +inf
  gets nan in O and L (and its gradients); −inf scores are masked keys. A nan or inf in v reaches the
  O (not L) of every row that sees its key; rows that do not see it may get nan too (0·nan = nan) where
  the product P·V still includes that key: here ``standard_attention`` includes every key, tiled
  versions (``flash_attention``, the kernels) only the key tiles a row's tile visits. With a softcap,
  tanh(±inf) = ±1, so a ±inf score before the cap becomes ±softcap; nan stays nan.
* Tile plan (the kernels' loop bounds): :func:`kv_block_range` gives the K/V blocks a Q block visits and
  :func:`q_block_range` the Q blocks that visit a K/V block (the backward's loop); blocks outside are
  never loaded. :func:`tile_needs_mask` says which visited tiles need :func:`visible_mask` (True where a
  key is SEEN; the kernels' ``hidden`` is its negation); the others are used unmasked.
  :func:`causal_mask` (True where hidden), :func:`kv_blocks_to_visit` and :func:`first_q_block_to_visit`
  are the causal cases.
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
    check_alibi_slopes,
    check_causal,
    check_nonnegative_real,
    check_positive_int,
    check_softcap,
    check_softmax_scale,
    check_window_size,
    compute_dtype,
    resolve_order,
)
from .dropout import check_dropout, dropout_factor
from .softmax import _finalize, logsumexp, online_softmax_step, standard_softmax

__all__ = [
    "block_mask",
    "standard_attention",
    "flash_attention",
    "visible_mask",
    "kv_block_range",
    "q_block_range",
    "tile_needs_mask",
    "causal_mask",
    "kv_blocks_to_visit",
    "first_q_block_to_visit",
]


@dataclass(frozen=True)
class _Prepared:
    """Validated inputs, already broadcast (and GQA-expanded) to a common leading shape."""

    q: np.ndarray  # (*lead, Nq, d)
    k: np.ndarray  # (*lead, Nk, d)
    v: np.ndarray  # (*lead, Nk, d)
    scale: float
    causal: bool
    window: tuple  # (left, right) as the mask uses it: right = 0 under causal, -1 for no bound
    softcap: float  # 0.0: off
    alibi: np.ndarray | None  # (*lead,) slopes, or None
    user: "_UserMods | None"  # mask_mod / score_mod, or None
    dtype: np.dtype
    lead: tuple
    n_q: int
    n_k: int
    d: int
    gqa_group: int  # H // Hkv, 1 without GQA
    q_shape: tuple  # the caller's shapes, to reduce gradients back to
    kv_shape: tuple

    @property
    def shift(self) -> int:
        """Nk − Nq: query i is aligned with key i + shift (bottom right)."""
        return self.n_k - self.n_q

    @property
    def masked(self) -> bool:
        """Whether the mask has a bound (causal, a window side or a mask_mod); without one every key is seen."""
        return self.window != (-1, -1) or (self.user is not None and self.user.mask_mod is not None)

    def logits(self, q_start: int, q_stop: int, k_start: int, k_stop: int, *, mask: bool):
        """The tile's final logits and ds/ds₀ (:func:`_final_logits`); ``mask``: apply the visibility mask (a
        mask_mod's always: it has no tile plan)."""
        s0 = (self.q[..., q_start:q_stop, :] @ np.swapaxes(self.k[..., k_start:k_stop, :], -1, -2)) * self.scale
        return _final_logits(s0, np.arange(q_start, q_stop), np.arange(k_start, k_stop), self.n_k, self.shift,
                             self.window, self.softcap, self.alibi, mask=mask, user=self.user)

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


@dataclass(frozen=True)
class _UserMods:
    """The user's mods and their aux arrays (module docstring), with the leading shape they index."""

    mask_mod: object
    score_mod: object
    score_mod_grad: object
    mask_aux: tuple
    score_aux: tuple
    lead: tuple

    def indices(self, rows: np.ndarray, cols: np.ndarray) -> tuple:
        """(b, h, i, j) index arrays broadcasting to (*lead, R, C)."""
        n = len(self.lead)
        grids = [np.arange(m).reshape((m,) + (1,) * (n - a - 1) + (1, 1)) for a, m in enumerate(self.lead)]
        b, h = ([0] * (2 - n) + grids)[-2:]
        return b, h, rows[:, None], cols[None, :]

    def score(self, s: np.ndarray, rows, cols) -> tuple:
        """(score_mod(s), d score_mod / d s or None) on a tile of logits."""
        b, h, i, j = self.indices(rows, cols)
        fn, grad, aux = self.score_mod, self.score_mod_grad, self.score_aux
        out = np.vectorize(lambda x, b_, h_, i_, j_: fn(x, b_, h_, i_, j_, *aux), otypes=[s.dtype])(s, b, h, i, j)
        d = None
        if grad is not None:
            d = np.vectorize(lambda x, b_, h_, i_, j_: grad(x, b_, h_, i_, j_, *aux), otypes=[s.dtype])(s, b, h, i, j)
        return out, d

    def visible(self, shape: tuple, rows, cols) -> np.ndarray:
        """mask_mod over a tile, broadcast to ``shape`` (*lead, R, C)."""
        b, h, i, j = self.indices(rows, cols)
        fn, aux = self.mask_mod, self.mask_aux
        seen = np.vectorize(lambda b_, h_, i_, j_: bool(fn(b_, h_, i_, j_, *aux)), otypes=[bool])(b, h, i, j)
        return np.broadcast_to(seen, shape)


def _user_mods(mask_mod, score_mod, score_mod_grad, mask_aux, score_aux, lead) -> _UserMods | None:
    """Checked user mods, or None without any."""
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod), ("score_mod_grad", score_mod_grad)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function (or None); got {type(fn).__name__}")
    for name, aux in (("mask_aux", mask_aux), ("score_aux", score_aux)):
        if not isinstance(aux, (tuple, list)):
            raise TypeError(f"{name} must be a tuple of arrays passed to the mod after its indices; got "
                            f"{type(aux).__name__}")
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad without score_mod: pass the score_mod it differentiates")
    if mask_mod is None and score_mod is None:
        return None
    if len(lead) > 2:
        raise ValueError(f"mask_mod / score_mod index (b, h): leading dims of at most 2 (batch, heads); got {lead}")
    return _UserMods(mask_mod, score_mod, score_mod_grad, tuple(mask_aux), tuple(score_aux), tuple(lead))


def _prepare(q, k, v, *, causal, softmax_scale, dtype, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             extra=(), mask_mod=None, score_mod=None, score_mod_grad=None, mask_aux=(), score_aux=()) -> _Prepared:
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
    window = check_window_size(window_size, causal, n_k=n_k)
    softcap = check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, q_shape)
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
    # (H,) or (B, H) is a suffix of q's leading shape, which broadcasts to lead: q's slope for every row
    alibi = None if slopes is None else np.broadcast_to(slopes.astype(dt, copy=False), lead)
    user = _user_mods(mask_mod, score_mod, score_mod_grad, mask_aux, score_aux, lead)
    return _Prepared(q, k, v, scale, causal, window, softcap, alibi, user, dt, lead, n_q, n_k, d, g, q_shape,
                     kv_shape)


def _visible(rows: np.ndarray, cols: np.ndarray, n_k: int, shift: int, left: int, right: int) -> np.ndarray:
    """(len(rows), len(cols)) booleans: True where query rows[a] sees key cols[b] (module docstring)."""
    i, j = rows[:, None], cols[None, :]
    seen = np.ones((rows.size, cols.size), dtype=bool)
    seen &= (j >= 0) & (j < n_k)
    if left >= 0:
        seen &= j >= i + shift - left
    if right >= 0:
        seen &= j <= i + shift + right
    return seen


def _final_logits(s0, rows, cols, n_k, shift, window, softcap, slopes, *, mask=True, user=None):
    """The final logits of a tile from its scaled scores s₀ = softmax_scale · q·k (module docstring).

    ``s0``: (..., R, C); ``rows``, ``cols``: the tile's absolute query and key indices (R,), (C,);
    ``window``: (left, right) with right = 0 under causal; ``softcap``: 0.0 for none; ``slopes``:
    broadcastable to s0.shape[:-2], or None. In order: s = softcap · tanh(s₀ / softcap), then
    s ← s − slope · |i + shift − j|, then s ← score_mod(s) (``user``: _UserMods or None), then s = −inf where
    key j is hidden from query i (only with ``mask``; a mask_mod's hidden keys always).

    Returns ``(s, dcap)``: dcap = ds/ds₀, 1 − tanh²(s₀ / softcap) with a softcap times score_mod_grad with a
    score_mod (ValueError when that has none), None without either.
    """
    dt = s0.dtype
    if softcap:
        with np.errstate(over="ignore"):  # s₀/softcap may overflow; tanh(±inf) = ±1 is the limit
            t = np.tanh(s0 / softcap)
        s, dcap = softcap * t, 1 - t * t
    else:
        s, dcap = s0, None
    if slopes is not None:
        distance = np.abs(rows[:, None] + shift - cols[None, :]).astype(dt)
        s = s - np.asarray(slopes, dtype=dt)[..., None, None] * distance
    if user is not None and user.score_mod is not None:
        s, dmod = user.score(s, rows, cols)
        dcap = dmod if dcap is None or dmod is None else dcap * dmod
        if dmod is None:
            dcap = _NoGrad()
    if mask:
        s = np.where(_visible(rows, cols, n_k, shift, *window), s, dt.type(-np.inf))
    if user is not None and user.mask_mod is not None:
        s = np.where(user.visible(s.shape, rows, cols), s, dt.type(-np.inf))
    return s, dcap


class _NoGrad:
    """ds/ds₀ of a score_mod given without score_mod_grad: the forward never reads it; the backward's product
    with it raises."""

    __array_ufunc__ = None  # NumPy defers ndarray * _NoGrad() to __rmul__

    def __mul__(self, other):
        raise ValueError("the backward of a score_mod needs its derivative: pass score_mod_grad(score, b, h, q_idx, "
                         "kv_idx, *score_aux) -> d score_mod / d score")

    __rmul__ = __mul__


def visible_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, n_q: int, n_k: int,
                 causal: bool = False, window_size=(-1, -1)) -> np.ndarray:
    """Boolean (q_stop−q_start, k_stop−k_start) tile, True where query i SEES key j.

    With shift = Nk − Nq and (left, right) = ``window_size`` (right = 0 under ``causal``): i sees j iff
    0 ≤ j < Nk, (left = −1 or j ≥ i + shift − left) and (right = −1 or j ≤ i + shift + right). The
    kernels' per-score rule ``hidden(row, col, n_k, shift)`` is its negation.
    """
    left, right = check_window_size(window_size, check_causal(causal), n_k=n_k)
    return _visible(np.arange(q_start, q_stop), np.arange(k_start, k_stop), n_k, n_k - n_q, left, right)


def kv_block_range(q_start: int, q_stop: int, n_q: int, n_k: int, block_k: int, causal: bool = False,
                   window_size=(-1, -1)) -> tuple[int, int]:
    """``(first, stop)``: the K/V blocks of ``block_k`` keys that query rows [q_start, q_stop) visit.

    A block is in the range iff some row of the Q block sees some key of it; the blocks outside are
    skipped, never loaded. Both edges of a row's keys grow with the row, so the keys the Q block sees
    are one run: from max(0, q_start + shift − left) (0 without a left bound) to
    min(Nk − 1, q_stop − 1 + shift + right) (Nk − 1 without a right bound; right = 0 under causal).
    ``(0, 0)`` when no row of the block sees any key.
    """
    left, right = check_window_size(window_size, check_causal(causal), n_k=n_k)
    shift = n_k - n_q
    first_key = 0 if left < 0 else max(0, q_start + shift - left)
    last_key = n_k - 1 if right < 0 else min(n_k - 1, q_stop - 1 + shift + right)
    if q_stop <= q_start or first_key > last_key:
        return 0, 0
    return first_key // block_k, last_key // block_k + 1


def q_block_range(k_start: int, k_stop: int, n_q: int, n_k: int, block_q: int, causal: bool = False,
                  window_size=(-1, -1)) -> tuple[int, int]:
    """``(first, stop)``: the Q blocks of ``block_q`` rows that see any key of [k_start, k_stop).

    The backward's inner loop: a K/V block visits these Q blocks and skips the others. Key j is seen
    by rows j − shift − right .. j − shift + left (no bound for a side of −1; right = 0 under causal),
    clipped to [0, Nq). ``(0, 0)`` when no row sees any key of the block.
    """
    left, right = check_window_size(window_size, check_causal(causal), n_k=n_k)
    shift = n_k - n_q
    k_stop = min(k_stop, n_k)
    first_row = 0 if right < 0 else max(0, k_start - shift - right)
    last_row = n_q - 1 if left < 0 else min(n_q - 1, k_stop - 1 - shift + left)
    if k_stop <= k_start or first_row > last_row:
        return 0, 0
    return first_row // block_q, last_row // block_q + 1


def tile_needs_mask(q_start: int, k_stop: int, n_q: int, n_k: int, causal: bool = False, window_size=(-1, -1),
                    *, q_stop: int | None = None, k_start: int | None = None) -> bool:
    """True when some key of the tile (rows [q_start, q_stop), keys [k_start, k_stop)) is hidden from some row.

    Tiles stop at Nk here (the last one is short), so the end of the keys never needs the mask; the
    kernels' padded last tile does (their ``needs_mask`` adds k1 > n_k). The window's edges:

    * right (right = 0 under causal): the first row q_start sees keys up to q_start + shift + right,
      so the tile crosses that edge iff k_stop − 1 > q_start + shift + right (``q_start``, ``k_stop``);
    * left: the last row q_stop − 1 sees keys from q_stop − 1 + shift − left, so the tile crosses it iff
      k_start < q_stop − 1 + shift − left; this needs ``q_stop`` and ``k_start`` (keywords), which
      a window without a left bound (causal alone) does not.

    Tiles of a visited block that need no mask are used unmasked.
    """
    left, right = check_window_size(window_size, check_causal(causal), n_k=n_k)
    shift = n_k - n_q
    edge = right >= 0 and k_stop - 1 > q_start + shift + right
    if left >= 0:
        if q_stop is None or k_start is None:
            raise TypeError(
                f"tile_needs_mask with a left window bound (window_size={window_size!r}) needs q_stop= and "
                f"k_start=; got q_stop={q_stop!r}, k_start={k_start!r}"
            )
        edge = edge or k_start < q_stop - 1 + shift - left
    return bool(edge)


def causal_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, n_q: int, n_k: int) -> np.ndarray:
    """Boolean (q_stop−q_start, k_stop−k_start) tile mask, True where key j is hidden from query i.

    The causal case for keys < Nk, in the opposite sense to :func:`visible_mask`: query i sees key j
    iff j ≤ i + Nk − Nq (bottom-right alignment).
    """
    i = np.arange(q_start, q_stop)[:, None]
    j = np.arange(k_start, k_stop)[None, :]
    return j > i + (n_k - n_q)


def kv_blocks_to_visit(q_start: int, q_stop: int, n_q: int, n_k: int, block_k: int, causal: bool) -> int:
    """How many K/V blocks (counted from block 0) the Q rows [q_start, q_stop) must visit.

    The stop of :func:`kv_block_range` without a window (whose first block is then 0): all
    ceil(Nk / block_k) without causal masking; with it, the blocks up to the one holding the last
    key seen by the last row, q_stop − 1 + Nk − Nq.
    """
    return kv_block_range(q_start, q_stop, n_q, n_k, block_k, causal)[1]


def first_q_block_to_visit(k_start: int, n_q: int, n_k: int, block_q: int, causal: bool) -> int:
    """Index of the first Q block that sees any key of a K/V block starting at ``k_start``.

    The first of :func:`q_block_range` without a window (its stop is then the last Q block + 1): 0
    without causal masking; with it, the block of the first query seeing key k_start, k_start − (Nk − Nq).
    """
    return q_block_range(k_start, k_start + 1, n_q, n_k, block_q, causal)[0]


EMPTY, PARTIAL, FULL = 0, 1, 2  # block_mask's classes


def block_mask(mask_mod, B: int, H: int, n_q: int, n_k: int, block_q: int, block_k: int, mask_aux=()):
    """FlexAttention's BlockMask idea: one class per (b, h, Q block, K/V block) from ``mask_mod`` alone (the
    causal / window mask is not in it): EMPTY (no visible score: the block is never loaded), FULL (every score
    visible: no per-score mask) or PARTIAL. Returns (classes (B, H, Q blocks, K/V blocks) int8, kv_num_blocks
    (B, H, Q blocks): the non-empty K/V blocks of each Q block, kv_indices (B, H, Q blocks, K/V blocks): their
    indices first, in order, then -1)."""
    for name, x in (("B", B), ("H", H), ("n_q", n_q), ("n_k", n_k), ("block_q", block_q), ("block_k", block_k)):
        check_positive_int(name, x)
    user = _user_mods(mask_mod, None, None, mask_aux, (), (B, H))
    if user is None:
        raise TypeError("block_mask needs a mask_mod")
    seen = user.visible((B, H, n_q, n_k), np.arange(n_q), np.arange(n_k))
    n_qb, n_kb = -(-n_q // block_q), -(-n_k // block_k)
    classes = np.empty((B, H, n_qb, n_kb), np.int8)
    for a in range(n_qb):
        for c in range(n_kb):
            tile = seen[..., a * block_q:(a + 1) * block_q, c * block_k:(c + 1) * block_k]
            classes[..., a, c] = np.where(tile.all((-1, -2)), FULL, np.where(tile.any((-1, -2)), PARTIAL, EMPTY))
    kv_num_blocks = (classes != EMPTY).sum(-1)
    kv_indices = np.full(classes.shape, -1, np.int64)
    for idx in np.ndindex(*classes.shape[:3]):
        nz = np.flatnonzero(classes[idx] != EMPTY)
        kv_indices[idx][: nz.size] = nz
    return classes, kv_num_blocks, kv_indices


def host_lists(classes, n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False, window_size=(-1, -1)):
    """The key-tile lists a block-sparse forward walks (numba_flash.blocks.sparsity.host_lists, name for name):
    from :func:`block_mask`'s classes (B, H, Q blocks, K/V blocks), the non-EMPTY K/V blocks of each Q block that
    lie in its causal / window range (:func:`kv_block_range`), in ascending order. Returns (counts (B, H, Q
    blocks) int32, entries (B, H, Q blocks, K/V blocks) int32): entry = 2·block + (1 if FULL), then -1."""
    classes = np.asarray(classes)
    window = check_window_size(window_size, check_causal(causal), n_k=n_k)
    counts = np.zeros(classes.shape[:3], np.int32)
    entries = np.full(classes.shape, -1, np.int32)
    for a in range(classes.shape[2]):
        first, stop = kv_block_range(a * block_q, min((a + 1) * block_q, n_q), n_q, n_k, block_k, causal,
                                     window)
        for idx in np.ndindex(*classes.shape[:2]):
            listed = [2 * j + int(classes[idx][a, j] == FULL) for j in range(first, stop)
                      if classes[idx][a, j] != EMPTY]
            counts[idx][a] = len(listed)
            entries[idx][a, : len(listed)] = listed
    return counts, entries


def block_sparse_attention(q, k, v, counts, entries, *, block_q: int, block_k: int, causal: bool = False,
                           softmax_scale=None, dtype=None, window_size=(-1, -1), softcap: float = 0.0,
                           alibi_slopes=None, mask_mod=None, score_mod=None, mask_aux=(), score_aux=(),
                           rescale_threshold: float = 0.0):
    """The block-sparse forward's walk (kernels with numba_flash's block_mask): q (B, H, Nq, d), k, v (B, Hkv, Nk,
    d); each (b, h, Q block) visits only the K/V blocks its list names (:func:`host_lists`), in list order, by the
    online softmax; a FULL entry skips the mask_mod (the causal / window and sequence-end masks still apply), a
    PARTIAL one applies it. With the lists of the mask's own :func:`block_mask` this is standard_attention (the
    lists drop only invisible blocks and FULL means no score is hidden); with other lists it is what the kernel
    computes from them. Arguments otherwise as :func:`flash_attention`. Returns (O, L)."""
    if np.ndim(q) != 4:
        raise ValueError(f"block_sparse_attention: q must be (B, H, Nq, d); got shape {np.shape(q)}")
    pr = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
                  mask_aux=mask_aux, score_aux=score_aux)
    block_q = check_positive_int("block_q", block_q)
    block_k = check_positive_int("block_k", block_k)
    counts, entries = np.asarray(counts), np.asarray(entries)
    n_qb, n_kb = -(-pr.n_q // block_q), -(-pr.n_k // block_k)
    if counts.shape != pr.lead + (n_qb,) or entries.shape != pr.lead + (n_qb, n_kb):
        raise ValueError(f"counts {counts.shape} / entries {entries.shape}: need {pr.lead + (n_qb,)} / "
                         f"{pr.lead + (n_qb, n_kb)} for (B, H) = {pr.lead} and {block_q}x{block_k} blocks")
    no_user_mask = pr.user
    if pr.user is not None and pr.user.mask_mod is not None:
        no_user_mask = _UserMods(None, pr.user.score_mod, pr.user.score_mod_grad, (), pr.user.score_aux, pr.lead)
    O = np.empty(pr.lead + (pr.n_q, pr.d), dtype=pr.dtype)
    L = np.empty(pr.lead + (pr.n_q,), dtype=pr.dtype)
    for a in range(n_qb):
        q_start, q_stop = a * block_q, min((a + 1) * block_q, pr.n_q)
        tiles = {}  # (block, full) -> the tile's logits over every (b, h)
        for idx in np.ndindex(*pr.lead):
            m_i = np.full((q_stop - q_start,), -np.inf, dtype=pr.dtype)
            l_i = np.zeros((q_stop - q_start,), dtype=pr.dtype)
            acc = np.zeros((q_stop - q_start, pr.d), dtype=pr.dtype)
            for e in entries[idx][a, : counts[idx][a]]:
                j, full = int(e) >> 1, bool(e & 1)
                k_start, k_stop = j * block_k, min((j + 1) * block_k, pr.n_k)
                if (j, full) not in tiles:
                    s0 = (pr.q[..., q_start:q_stop, :] @ np.swapaxes(pr.k[..., k_start:k_stop, :], -1, -2)) * pr.scale
                    tiles[j, full] = _final_logits(s0, np.arange(q_start, q_stop), np.arange(k_start, k_stop),
                                                   pr.n_k, pr.shift, pr.window, pr.softcap, pr.alibi, mask=True,
                                                   user=no_user_mask if full else pr.user)[0]
                step = online_softmax_step(m_i, l_i, acc, tiles[j, full][idx], pr.v[idx][k_start:k_stop],
                                           rescale_threshold=rescale_threshold)
                m_i, l_i, acc = step.m_new, step.l_i, step.acc
            O[idx][q_start:q_stop], L[idx][q_start:q_stop] = _finalize(m_i, l_i, acc)
    return O, L


def standard_attention(q, k, v, *, causal: bool = False, softmax_scale=None, dtype=None, window_size=(-1, -1),
                       softcap: float = 0.0, alibi_slopes=None, mask_mod=None, score_mod=None, mask_aux=(),
                       score_aux=(), dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0):
    """Attention that materialises the Nq×Nk matrices S and P, as in 3.6.2.

    S = the final logits (module docstring): softmax_scale · Q Kᵀ, then the softcap
    softcap · tanh(S / softcap), then the ALiBi bias − slope · |i + shift − j|, then −inf where the
    mask (causal, window) hides the key. P = softmax(S) row by row (max subtracted), O = P V,
    L = logsumexp of each row of S.

    Arguments: ``q`` (..., Nq, d); ``k``, ``v`` (..., Nk, d); leading dims broadcast, GQA on
    axis −3 (see the module docstring). ``causal``: bottom-right aligned mask. ``softmax_scale``:
    default 1/sqrt(d). ``dtype``: compute dtype, default float64 (or wider). flash-attn's variants,
    with its names and defaults: ``window_size`` = (left, right), (−1, −1) for none; ``softcap``, 0.0
    for none; ``alibi_slopes``, (H,) or (B, H), None for none. NaN / inf: the module docstring. User mods:
    ``mask_mod``, ``score_mod`` with their ``mask_aux``, ``score_aux`` (module docstring).

    Dropout (``dropout_p`` > 0): O = (Z ∘ P) V · 2^16 / keep16 with the kernels' keep mask Z of
    (``dropout_seed``, ``dropout_offset``) (reference.dropout); L stays the logsumexp of S.

    Returns ``(O, L)``: O (*lead, Nq, d), L (*lead, Nq). Fully masked rows: O = 0, L = −inf.
    Memory: O(Nq·Nk) per (batch, head) — this is the version that runs out of memory.
    """
    dropout_p = check_dropout(dropout_p, dropout_seed)
    pr = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
                  mask_aux=mask_aux, score_aux=score_aux)
    S, _ = pr.logits(0, pr.n_q, 0, pr.n_k, mask=pr.masked)
    P = standard_softmax(S, axis=-1, dtype=pr.dtype)
    if dropout_p:
        P = P * dropout_factor(pr.lead, pr.n_q, pr.n_k, dropout_p, dropout_seed, dropout_offset, pr.dtype)
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
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    mask_mod=None,
    score_mod=None,
    mask_aux=(),
    score_aux=(),
    block_classes=None,
):
    """The FA2 tile loop of 3.6.6 in NumPy: never builds an Nq×Nk array.

    Q blocks of ``block_q`` rows on the outside (a kernel runs them in parallel, one thread block
    each), K/V blocks of ``block_k`` keys inside, each consumed by the online-softmax step with
    the running state ``m_i``, ``l_i``, ``acc``. A Q block visits only the K/V blocks of
    :func:`kv_block_range` (with causal masking or a window, the others are never loaded), and
    only the tiles of :func:`tile_needs_mask` are masked. The last block of either kind may be
    shorter. The largest temporary is one (*lead, block_q, block_k) tile.

    Arguments as :func:`standard_attention`, plus:

    * ``block_q``, ``block_k``: ints >= 1.
    * ``kv_order``: the order in which every Q block visits the K/V blocks: None/'natural',
      'reverse', a permutation of range(ceil(Nk / block_k)), or a callable n -> permutation
      (e.g. ``lambda n: rng.permutation(n)``); a Q block skips the blocks outside its range. The
      result does not depend on it beyond rounding.
    * ``q_rows``: a ``slice`` (step 1) of query rows to compute, as a launch of only part of the
      grid would; the mask's alignment still uses the full Nq. Q blocks start at the slice start.
      Default: all rows.
    * ``rescale_threshold``: the running max moves only when a block beats it by more than this
      (natural-log units; see ``online_softmax_step``): the kernels' LAZY_RESCALE with 8·ln 2.

    * ``block_classes``: :func:`block_mask`'s classes of ``mask_mod`` at (block_q, block_k) (q_rows None): a
      tile EMPTY for every (b, h) is never visited, and one FULL for every (b, h) skips the mask_mod (its
      causal / window mask still applies). The result is the same as without it.

    Returns ``(O, L)`` for the selected rows: O (*lead, rows, d), L (*lead, rows).
    """
    pr = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
                  mask_aux=mask_aux, score_aux=score_aux)
    no_user_mask = pr.user
    if pr.user is not None and pr.user.mask_mod is not None:
        no_user_mask = _UserMods(None, pr.user.score_mod, pr.user.score_mod_grad, (), pr.user.score_aux, pr.lead)
    if block_classes is not None:
        if pr.user is None or pr.user.mask_mod is None or q_rows is not None:
            raise ValueError("block_classes needs the mask_mod it was computed from, and q_rows=None")
        block_classes = np.asarray(block_classes).reshape((-1,) + np.shape(block_classes)[-2:])
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
        m_i = np.full(pr.lead + (q_stop - q_start,), -np.inf, dtype=pr.dtype)
        l_i = np.zeros(pr.lead + (q_stop - q_start,), dtype=pr.dtype)
        acc = np.zeros(pr.lead + (q_stop - q_start, pr.d), dtype=pr.dtype)
        first, stop = kv_block_range(q_start, q_stop, pr.n_q, pr.n_k, block_k, pr.causal, pr.window)
        for j in order:
            if not first <= j < stop:
                continue  # no row of this Q block sees a key of block j: never loaded
            tile_class = None if block_classes is None else block_classes[:, q_start // block_q, j]
            if tile_class is not None and (tile_class == EMPTY).all():
                continue  # the mask_mod hides the whole tile: never loaded
            k_start, k_stop = j * block_k, min((j + 1) * block_k, pr.n_k)
            edge = tile_needs_mask(q_start, k_stop, pr.n_q, pr.n_k, pr.causal, pr.window,
                                   q_stop=q_stop, k_start=k_start)
            if tile_class is not None and (tile_class == FULL).all():  # no mask_mod call on this tile
                s0 = (pr.q[..., q_start:q_stop, :] @ np.swapaxes(pr.k[..., k_start:k_stop, :], -1, -2)) * pr.scale
                s_ij, _ = _final_logits(s0, np.arange(q_start, q_stop), np.arange(k_start, k_stop), pr.n_k,
                                        pr.shift, pr.window, pr.softcap, pr.alibi, mask=edge, user=no_user_mask)
            else:
                s_ij, _ = pr.logits(q_start, q_stop, k_start, k_stop, mask=edge)
            step = online_softmax_step(m_i, l_i, acc, s_ij, pr.v[..., k_start:k_stop, :],
                                       rescale_threshold=rescale_threshold)
            m_i, l_i, acc = step.m_new, step.l_i, step.acc
        O_i, L_i = _finalize(m_i, l_i, acc)  # O_i = acc / l_i once, at the end
        O[..., q_start - row_start : q_stop - row_start, :] = O_i
        L[..., q_start - row_start : q_stop - row_start] = L_i
    return O, L
