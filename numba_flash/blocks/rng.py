"""Dropout's random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11),
a counter-based generator, so any thread can make the bits of any (query, key) pair from the pair's indices
alone, the forward and the backward make the same ones, and the order the tiles are visited in does not matter.

One Philox call gives four 32-bit words: eight 16-bit draws, eight dropout decisions. Which pair each draw
belongs to is the *counter layout*, chosen so that a call serves a whole piece of an mma.sync / wgmma
accumulator fragment (C layout: lane (g, t) holds rows g, g + 8 and columns 8 n + 2t, 8 n + 2t + 1):

    counter = (c0, c1, c2, c3) = ((j >> 4) << 2 | (j >> 1) & 3,   (i >> 4) << 3 | i & 7,   b·H + h,   offset)
    key     = (seed_lo, seed_hi)
    draw    = word ((i >> 3) & 1)·2 + ((j >> 3) & 1), its low 16 bits for even j, high 16 for odd j
    keep    = draw < keep16                                   (query i, key j of batch b, query head h)

so one call holds rows {i, i + 8} x keys {j, j + 1, j + 8, j + 9} of a 16 x 16 block: in the forward's
orientation (rows = queries, ``fragment_dropout``) exactly one lane's share of two n-tiles, no draw
wasted; in the dK/dV kernels' transposed one (rows = keys, ``fragment_dropout_t``) a lane uses half of each
call it makes. c3 is the call's offset: a caller that draws one seed and steps the offset (PyTorch's
Philox state does) gets fresh bits per call.

keep16 = round(keep · 2^16), keep = 1 − dropout_p: the kept fraction is keep16 / 2^16 exactly (the kernels
scale kept values by 2^16 / keep16, so E[dropped P] = P with no quantisation bias; flash-attn 2 draws 8 bits
and scales by 1 / keep). ``reference/dropout.py`` is the same generator in NumPy, checked against the
known-answer vectors of the Random123 distribution.
"""
from __future__ import annotations

from numba import float32, int32, types, uint32, uint64

from ..ptx import inline_device

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # the golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
ROUNDS = 10
KEEP_BITS = 16  # bits per draw: 8 draws per call
DROPOUT_TYPES = (types.uint32,) * 4  # a dropout build's last aux arguments: seed_lo, seed_hi, offset, keep16
LOW32 = uint64(0xFFFFFFFF)
SHIFT32 = uint64(32)


@inline_device
def philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox4x32 round: two 32 x 32 -> 64-bit products (mul.wide.u32), their halves XORed with the other
    counter words and the key."""
    p0 = uint64(PHILOX_M0) * uint64(c0)
    p1 = uint64(PHILOX_M1) * uint64(c2)
    hi0, lo0 = uint32(p0 >> SHIFT32), uint32(p0 & LOW32)
    hi1, lo1 = uint32(p1 >> SHIFT32), uint32(p1 & LOW32)
    return uint32(hi1 ^ c1 ^ k0), lo1, uint32(hi0 ^ c3 ^ k1), lo0


@inline_device
def philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1): four uint32 words."""
    c0, c1, c2, c3 = uint32(c0), uint32(c1), uint32(c2), uint32(c3)
    k0, k1 = uint32(k0), uint32(k1)
    for _ in range(ROUNDS - 1):
        c0, c1, c2, c3 = philox_round(c0, c1, c2, c3, k0, k1)
        k0 = uint32((uint64(k0) + uint64(PHILOX_W0)) & LOW32)  # the Weyl sequence of the key
        k1 = uint32((uint64(k1) + uint64(PHILOX_W1)) & LOW32)
    return philox_round(c0, c1, c2, c3, k0, k1)


@inline_device
def key_word(j):
    """c0 of key j: its 16-key block and its column pair within each 8 (the lane's t)."""
    return uint32(((j >> 4) << 2) | ((j >> 1) & 3))


@inline_device
def row_word(i):
    """c1 of query i: its 16-row block and its row within each 8 (the lane's g)."""
    return uint32(((i >> 4) << 3) | (i & 7))


@inline_device
def kept(word, odd, keep16):
    """Whether the draw in ``word``'s low (odd = 0) or high (odd = 1) 16 bits keeps its score."""
    return ((word >> uint32(16 * odd)) & uint32(0xFFFF)) < keep16


@inline_device
def keep_one(i, j, bh, offset, seed_lo, seed_hi, keep16):
    """The decision of one (query i, key j) pair (the SIMT kernels' form: one call per score)."""
    w0, w1, w2, w3 = philox(key_word(j), row_word(i), bh, offset, seed_lo, seed_hi)
    w = (i >> 3) & 1
    if (j >> 3) & 1:
        word = w3 if w else w1
    else:
        word = w2 if w else w0
    return kept(word, j & 1, keep16)


def _fragment_draws(S_TILES: int, M_TILES: int, name: str, mark):
    """tile(x, k0, row0, g, t, bh, offset, seed_lo, seed_hi, keep16) over a warp's mma.sync fragments x[mt·S_TILES +
    nt] (rows row0 + 16 mt + g (+8), keys k0 + 8 nt + 2t (+1); row0 and k0 multiples of 16): x[., r] = mark(x[., r],
    kept). One Philox call per m-tile and pair of n-tiles: exactly the lane's 8 entries there."""
    if S_TILES % 2:
        raise ValueError(f"{name}: {S_TILES} n-tiles; the counter layout covers pairs (16 keys)")

    @inline_device
    def tile(x, k0, row0, g, t, bh, offset, seed_lo, seed_hi, keep16):
        for mt in range(M_TILES):
            c1 = uint32((((row0 + 16 * mt) >> 4) << 3) | g)
            for np2 in range(S_TILES // 2):
                c0 = uint32((((k0 + 16 * np2) >> 4) << 2) | t)
                w0, w1, w2, w3 = philox(c0, c1, bh, offset, seed_lo, seed_hi)
                nt = mt * S_TILES + 2 * np2
                # (row g | g + 8) x (n-tile 2 np2 | 2 np2 + 1): words 0, 1, 2, 3; column 2t (+1): low (high) half
                for r in range(2):
                    x[nt, r] = mark(x[nt, r], kept(w0, r, keep16))
                    x[nt + 1, r] = mark(x[nt + 1, r], kept(w1, r, keep16))
                    x[nt, 2 + r] = mark(x[nt, 2 + r], kept(w2, r, keep16))
                    x[nt + 1, 2 + r] = mark(x[nt + 1, 2 + r], kept(w3, r, keep16))

    return tile


@inline_device
def _zero_dropped(x, keep):
    return x if keep else float32(0.0)


@inline_device
def _keep_flag(x, keep):
    return float32(1.0) if keep else float32(0.0)


def fragment_dropout(S_TILES: int, M_TILES: int):
    """drop_tile(s, k0, row0, g, t, bh, offset, seed_lo, seed_hi, keep16): zero the dropped entries of P in place
    (_fragment_draws' layout). The kept entries keep their value (the 2^16 / keep16 scale goes on O at the end, as
    l_i sums the undropped P)."""
    return _fragment_draws(S_TILES, M_TILES, "fragment_dropout", _zero_dropped)


def fragment_dropout_t(Q_TILES: int):
    """keep_tile(z, key0, i0, g, t, bh, offset, seed_lo, seed_hi, keep16): the transposed layout of the dK/dV
    kernels (rows = keys key0 + g (+8), columns = queries i0 + 8 nt + 2t (+1); key0 and i0 multiples of 16):
    z[nt, r] = 1 where the score is kept, 0 where dropped. Two Philox calls per pair of n-tiles (one per query
    column 2t, 2t + 1), half of each call used."""
    if Q_TILES % 2:
        raise ValueError(f"fragment_dropout_t: {Q_TILES} n-tiles; the counter layout covers pairs (16 queries)")

    @inline_device
    def keep_tile(z, key0, i0, g, t, bh, offset, seed_lo, seed_hi, keep16):
        c0 = uint32(((key0 >> 4) << 2) | ((g >> 1) & 3))
        odd = g & 1  # the key's parity: which half of each word
        for np2 in range(Q_TILES // 2):
            for e in range(2):
                c1 = uint32((((i0 + 16 * np2) >> 4) << 3) | (2 * t + e))
                w0, w1, w2, w3 = philox(c0, c1, bh, offset, seed_lo, seed_hi)
                # words: (query row within 8 | + 8) x (key g | g + 8) = (n-tile 2 np2 | 2 np2 + 1) x (r >> 1)
                z[2 * np2, e] = float32(1.0) if kept(w0, odd, keep16) else float32(0.0)
                z[2 * np2, 2 + e] = float32(1.0) if kept(w1, odd, keep16) else float32(0.0)
                z[2 * np2 + 1, e] = float32(1.0) if kept(w2, odd, keep16) else float32(0.0)
                z[2 * np2 + 1, 2 + e] = float32(1.0) if kept(w3, odd, keep16) else float32(0.0)

    return keep_tile


def fragment_keep(S_TILES: int, M_TILES: int):
    """keep_tile(z, k0, row0, g, t, bh, offset, seed_lo, seed_hi, keep16): fragment_dropout's decisions as a
    mask, z[mt·S_TILES + nt, r] = 1 where kept, 0 where dropped (the dq kernel multiplies dP by it)."""
    return _fragment_draws(S_TILES, M_TILES, "fragment_keep", _keep_flag)


def fragment_dropout_t_bits(Q_TILES: int):
    """keep_bits(key0, i0, g, t, bh, offset, seed_lo, seed_hi, keep16) -> uint32: fragment_dropout_t's decisions
    as one register, bit 4·nt + r set where score (nt, r) is kept (Q_TILES <= 8): for kernels whose registers
    cannot hold a float per score (the wgmma dK/dV kernel)."""
    if Q_TILES % 2 or Q_TILES > 8:
        raise ValueError(f"fragment_dropout_t_bits: {Q_TILES} n-tiles; pairs of them, at most 8 (32 bits)")

    @inline_device
    def keep_bits(key0, i0, g, t, bh, offset, seed_lo, seed_hi, keep16):
        c0 = uint32(((key0 >> 4) << 2) | ((g >> 1) & 3))
        odd = g & 1
        bits = uint32(0)
        for np2 in range(Q_TILES // 2):
            for e in range(2):
                c1 = uint32((((i0 + 16 * np2) >> 4) << 3) | (2 * t + e))
                w0, w1, w2, w3 = philox(c0, c1, bh, offset, seed_lo, seed_hi)
                # as fragment_dropout_t: (n-tile 2 np2 | 2 np2 + 1) x (r = e | 2 + e)
                if kept(w0, odd, keep16):
                    bits |= uint32(1 << (8 * np2 + e))
                if kept(w1, odd, keep16):
                    bits |= uint32(1 << (8 * np2 + 2 + e))
                if kept(w2, odd, keep16):
                    bits |= uint32(1 << (8 * np2 + 4 + e))
                if kept(w3, odd, keep16):
                    bits |= uint32(1 << (8 * np2 + 6 + e))
        return bits

    return keep_bits


def words_of(first: int):
    """words(aux) -> (seed_lo, seed_hi, offset, keep16, scale): a dropout build's four words from aux[first..] and
    the kept values' scale 2^16 / keep16 (fp32: exact for the power-of-two numerator, one rounding)."""
    scope: dict = {"float32": float32}
    exec(compile(f"def words(aux):\n    return (aux[{first}], aux[{first + 1}], aux[{first + 2}], aux[{first + 3}], "
                 f"float32(65536.0) / float32(aux[{first + 3}]))\n", "<words_of>", "exec"), scope)
    return inline_device(scope["words"])


def keep16_of(dropout_p: float) -> int:
    """The 16-bit keep threshold of a dropout probability: round((1 − p)·2^16), clamped to [1, 2^16] (api.check_dropout
    refuses p > 1 − 2^-16, which would round to keeping nothing; a p below 2^-17 rounds to keeping every draw, as
    p = 0 would, and still runs the dropout build)."""
    return max(1, min(1 << KEEP_BITS, int(round((1.0 - float(dropout_p)) * (1 << KEEP_BITS)))))


def seed_words(seed: int) -> tuple:
    """(seed_lo, seed_hi) of a 64-bit seed."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & 0xFFFFFFFF, seed >> 32


__all__ = ["DROPOUT_TYPES", "philox", "philox_round", "keep_one", "kept", "key_word", "row_word", "fragment_dropout",
           "fragment_keep", "fragment_dropout_t", "fragment_dropout_t_bits", "words_of", "keep16_of", "seed_words"]
