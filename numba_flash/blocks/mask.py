"""The masking step: which keys each query row sees, written once for every forward family.

A mask kind answers three questions, each a device function of ``mask_rules(kind, BLOCK_K)``:

    kv_tiles(q0, q_end, n_k, shift)    K/V tiles of BLOCK_K keys that rows q0 .. q_end - 1 see at all
                                       (the loop's trip count: tiles past it are never loaded)
    needs_mask(k1, row0, n_k, shift)   whether the tile of keys k1 - BLOCK_K .. k1 - 1 crosses an edge of
                                       the mask for rows row0 and below (only such tiles pay for it)
    hidden(row, col, n_k, shift)       whether score (row, col) is masked, i.e. becomes -inf

shift = n_k - n_q. ``fragment_mask`` applies the per-score rule to mma.sync accumulator fragments (the m16n8 C
layout); mma_forward calls it. The kernels still spell the trip count and the edge test out in these forms
(and tf32 / simt the per-score rule): with the calls their PTX changed (which call, not bisected).
Kinds: "none" (only keys past the sequence end, col >= n_k, are masked), "causal" (also col > row + shift:
the diagonal aligned to the bottom right) and "window" (flash-attn's sliding window: row sees col iff
row + shift - left <= col <= row + shift + right, left and right launch arguments; ``window_bounds``
turns the API's -1 = unbounded into WINDOW_OPEN, and causal with a window is right = 0). A window of
(-1, 0) is causal and (-1, -1) no mask (``window_kind``), so those keep their kernels. The window kind's
rules are ``window_rules``: its tile range has a first tile too (tiles left of every row's window are
never loaded), and its edge test looks at the warp's last row for the left edge.

The dK/dV kernels (Sᵀ: a warp's rows are 16 keys) hide keys past n_k without a compare: their K rows are
zero-filled, so S = 0 there; causal hides them anyway (col >= n_k > row + shift), and without it
``clamps_past_end`` says to take min(x, 0) of each exponent x = S·scale·log2 e − L2. Every visible P is at most
1 (L ≥ the row's max), so the clamp changes no visible score beyond rounding, and it keeps the hidden keys' P
at most 1 too, where exp2(−L2) would overflow for a very negative L (fp16 below −11, fp32 below −89) and
inf · 0 in dQ = dS K would turn dQ into NaN (flash-attention's test_flash_attn_bwd_overflow). Those
keys' dS then meet zero K rows, and their dK / dV rows are never stored. A per-key compare did the same with
more registers: the sm_90 tf32x3 splits kernel spilled 100 bytes instead of 36.
"""
import math

from numba import float32

from ..ptx import inline_device

MASKS = ("none", "causal", "window")
WINDOW_OPEN = 1 << 30  # an unbounded side of the window: past any row + shift (sequences < 2**30)


def mask_kind(causal: bool) -> str:
    return "causal" if causal else "none"


def window_kind(causal: bool, window_size) -> str:
    """The kind of a validated (causal, (left, right)): (-1, 0) is causal, (-1, -1) none, anything else window."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return "none"
    if left < 0 and right == 0:
        return "causal"
    return "window"


def window_bounds(causal: bool, window_size) -> tuple:
    """(left, right) as the window kernels take them: -1 (unbounded) becomes WINDOW_OPEN, causal fixes right = 0."""
    left, right = window_size
    if causal:
        right = 0
    return (WINDOW_OPEN if left < 0 else int(left)), (WINDOW_OPEN if right < 0 else int(right))


def clamps_past_end(kind: str, dq_in_dkdv: bool) -> bool:
    """Whether a dK/dV kernel clamps its exponents at 0 to keep keys past n_k finite (module docstring): only
    where it forms dQ (the only product their dS reaches) and the mask does not hide those keys already (the
    window kind's rule hides col >= n_k itself)."""
    if kind not in MASKS:
        raise ValueError(f"mask {kind!r}: one of {MASKS}")
    return bool(dq_in_dkdv) and kind == "none"


def mask_rules(kind: str, BLOCK_K: int):
    """(kv_tiles, needs_mask, hidden) of mask ``kind`` for tiles of BLOCK_K keys (module docstring)."""
    if kind not in ("none", "causal"):
        raise ValueError(f"mask {kind!r}: one of ('none', 'causal') (the window kind's rules are window_rules)")
    CAUSAL = kind == "causal"  # one boolean, so Numba prunes the other kind's branches before typing

    @inline_device
    def kv_tiles(q0, q_end, n_k, shift):
        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        if CAUSAL:
            visible = q_end + shift  # keys the last row can see
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_K - 1) // BLOCK_K)
        return n_tiles

    @inline_device
    def needs_mask(k1, row0, n_k, shift):
        edge = k1 > n_k
        if CAUSAL:
            edge = edge or (k1 - 1 > row0 + shift)
        return edge

    @inline_device
    def hidden(row, col, n_k, shift):
        return col >= n_k or (CAUSAL and col > row + shift)

    return kv_tiles, needs_mask, hidden


def window_rules(BLOCK_K: int, ROWS: int):
    """(kv_range, needs_mask, hidden) of the window kind for tiles of BLOCK_K keys and edge tests over ROWS rows:

        kv_range(q0, q_end, n_k, shift, left, right)   (first, stop) K/V tiles rows q0 .. q_end - 1 see
        needs_mask(k0, k1, row0, n_k, shift, left, right)  whether keys k0 .. k1 - 1 cross an edge for one of rows
                                                       row0 .. row0 + ROWS - 1 (the left edge binds the last row)
        hidden(row, col, n_k, shift, left, right)      score (row, col) is masked
    """

    @inline_device
    def kv_range(q0, q_end, n_k, shift, left, right):
        k_lo = max(q0 + shift - left, 0)  # the first row's first key
        k_hi = min(q_end - 1 + shift + right + 1, n_k)  # one past the last row's last key
        stop = (max(k_hi, 0) + BLOCK_K - 1) // BLOCK_K
        return min(k_lo // BLOCK_K, stop), stop

    @inline_device
    def needs_mask(k0, k1, row0, n_k, shift, left, right):
        return k1 > n_k or k1 - 1 > row0 + shift + right or k0 < row0 + ROWS - 1 + shift - left

    @inline_device
    def hidden(row, col, n_k, shift, left, right):
        return col >= n_k or col > row + shift + right or col < row + shift - left

    return kv_range, needs_mask, hidden


def fragment_window(BLOCK_K: int, M_TILES: int):
    """window_tile(s, k0, row0, n_k, shift, left, right, g, t): fragment_mask's per-score rule of the window kind."""
    S_TILES = BLOCK_K // 8
    NEG_INF = float32(-math.inf)

    @inline_device
    def window_tile(s, k0, row0, n_k, shift, left, right, g, t):
        for mt in range(M_TILES):
            for r in range(4):
                diag = row0 + 16 * mt + g + 8 * (r >> 1) + shift  # the row's key on its diagonal
                lo = max(diag - left, 0)
                hi = min(diag + right, n_k - 1)
                for nt in range(S_TILES):
                    col = k0 + nt * 8 + 2 * t + (r & 1)
                    if col < lo or col > hi:
                        s[mt * S_TILES + nt, r] = NEG_INF

    return window_tile


def fragment_mask(kind: str, BLOCK_K: int, M_TILES: int):
    """mask_tile(s, k0, row0, n_k, shift, g, t): -inf into the masked scores of a warp's S fragments, M_TILES
    m-tiles of 16 rows from row0 (s[mt·S_TILES + nt] holds rows row0 + 16 mt + g (+8), keys k0 + 8 nt + 2t (+1)).
    Kinds none and causal (the window kind is fragment_window)."""
    if kind not in ("none", "causal"):
        raise ValueError(f"fragment_mask: kind {kind!r} is one of ('none', 'causal'); 'window' has fragment_window")
    CAUSAL = kind == "causal"
    S_TILES = BLOCK_K // 8
    NEG_INF = float32(-math.inf)

    @inline_device
    def mask_tile(s, k0, row0, n_k, shift, g, t):
        for mt in range(M_TILES):
            row_g = row0 + 16 * mt + g
            for nt in range(S_TILES):
                for r in range(4):
                    col = k0 + nt * 8 + 2 * t + (r & 1)
                    if col >= n_k or (CAUSAL and col > row_g + 8 * (r >> 1) + shift):  # hidden(), spelled out: its PTX
                        s[mt * S_TILES + nt, r] = NEG_INF

    return mask_tile
