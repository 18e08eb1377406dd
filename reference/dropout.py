"""Dropout on the attention probabilities, the kernels' way (numba_flash/blocks/rng.py), in NumPy.

    P   = softmax(logits)                         L (the logsumexp) is P's, before dropout
    Z   = keep mask of (b, h, i, j), Philox4x32-10 of the pair's counter (``keep_mask``)
    O   = (Z ∘ P) V · 2^16 / keep16               keep16 = round((1 − dropout_p)·2^16), the kept fraction exactly
    dV  = (Z ∘ P)ᵀ dO · 2^16 / keep16
    dP  = dO Vᵀ,  dS = P ∘ (Z ∘ dP · 2^16 / keep16 − D),  D = rowsum(dO ∘ O)

The generator (``philox``) is checked against the known-answer vectors of the Random123 distribution; the
counter layout (which draw belongs to which (query, key) pair) is ``blocks/rng.py``'s:

    counter = ((j >> 4) << 2 | (j >> 1) & 3,  (i >> 4) << 3 | i & 7,  b·H + h,  offset),  key = seed (64 bits)
    draw    = 16 bits of word ((i >> 3) & 1)·2 + ((j >> 3) & 1): the low half for even j, the high for odd j
"""
from __future__ import annotations

import numpy as np

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
KEEP_BITS = 16
_LOW = np.uint64(0xFFFFFFFF)


def philox(counter, key) -> np.ndarray:
    """Philox4x32-10 of counters (..., 4) under keys (..., 2) (broadcast): uint32 words (..., 4)."""
    counter = np.asarray(counter, dtype=np.uint64)
    key = np.asarray(key, dtype=np.uint64)
    c0, c1, c2, c3 = (counter[..., n] for n in range(4))
    k0, k1 = key[..., 0], key[..., 1]
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W0)) & _LOW
            k1 = (k1 + np.uint64(PHILOX_W1)) & _LOW
        p0 = np.uint64(PHILOX_M0) * c0  # < 2^64: no wrap
        p1 = np.uint64(PHILOX_M1) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _LOW, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _LOW
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


def keep16(dropout_p: float) -> int:
    """round((1 − p)·2^16), at least 1: draws below it keep their score."""
    return max(1, min(1 << KEEP_BITS, int(round((1.0 - float(dropout_p)) * (1 << KEEP_BITS)))))


def keep_scale(dropout_p: float) -> float:
    """What kept values are multiplied by: 2^16 / keep16, the inverse of the kept fraction exactly."""
    return float(1 << KEEP_BITS) / keep16(dropout_p)


def keep_mask(B: int, H: int, n_q: int, n_k: int, dropout_p: float, seed: int, offset: int = 0) -> np.ndarray:
    """Z: (B, H, n_q, n_k) bool, True where the score of query i, key j of batch b, head h is kept."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    b = np.arange(B).reshape(B, 1, 1, 1)
    h = np.arange(H).reshape(1, H, 1, 1)
    i = np.arange(n_q).reshape(1, 1, n_q, 1)
    j = np.arange(n_k).reshape(1, 1, 1, n_k)
    c0 = ((j >> 4) << 2) | ((j >> 1) & 3)
    c1 = ((i >> 4) << 3) | (i & 7)
    c2 = b * H + h
    shape = (B, H, n_q, n_k)
    counter = np.stack([np.broadcast_to(x, shape) for x in (c0, c1, c2, np.full(shape, int(offset) & 0xFFFFFFFF))],
                       axis=-1)
    words = philox(counter, np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64))
    w = np.broadcast_to(((i >> 3) & 1) * 2 + ((j >> 3) & 1), shape)
    word = np.take_along_axis(words, w[..., None], axis=-1)[..., 0]
    draw = (word >> np.broadcast_to((j & 1) * 16, shape).astype(np.uint32)) & np.uint32(0xFFFF)
    return draw < keep16(dropout_p)


def dropout_factor(lead: tuple, n_q: int, n_k: int, dropout_p: float, seed: int, offset: int, dtype) -> np.ndarray:
    """Z · 2^16 / keep16 broadcast to (*lead, n_q, n_k): the factor dropout multiplies P by. The leading dims
    are (..., B, H) with the batch the product of all but the last (one head, one batch where absent)."""
    H = lead[-1] if lead else 1
    B = int(np.prod(lead[:-1], dtype=np.int64)) if len(lead) > 1 else 1
    z = keep_mask(B, H, n_q, n_k, dropout_p, seed, offset).reshape(tuple(lead) + (n_q, n_k))
    return z.astype(dtype) * dtype.type(keep_scale(dropout_p))


def check_dropout(dropout_p, seed) -> float:
    """dropout_p, checked: a float in [0, 1) (keep16 >= 1 always: a p that rounds past it keeps 1 / 2^16); with
    p > 0 the seed must be an int."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.floating, np.integer)) \
            or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1); got {dropout_p!r}")
    if float(dropout_p) and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"dropout_seed must be an int with dropout_p > 0; got {seed!r}")
    return float(dropout_p)
