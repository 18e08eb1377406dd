"""The dropout mask the kernels draw (blocks/rng.py), materialised: for tests, flash-attn's return_attn_probs, and
anyone who wants to see which scores a seed drops.

    z = numba_flash.dropout_mask(B, H, n_q, n_k, dropout_p, seed, offset)   # (B, H, n_q, n_k) uint8, 1 = kept

One thread per (query, key) pair, each drawing its pair's Philox call (blocks/rng.keep_one), so it is the
kernels' decision by construction, not a copy of it; reference.dropout.keep_mask is the NumPy twin.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda, uint8, uint32

from .api import check_dropout
from .blocks.rng import keep_one

THREADS = 128


@lru_cache(maxsize=None)
def _kernel():
    @cuda.jit
    def keep_kernel(z, n_heads, seed_lo, seed_hi, offset, keep16):
        j = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        i = cuda.blockIdx.y
        bh = cuda.blockIdx.z
        if j < z.shape[3]:
            b = bh // n_heads
            h = bh - b * n_heads
            z[b, h, i, j] = uint8(1) if keep_one(i, j, bh, offset, seed_lo, seed_hi, uint32(keep16)) else uint8(0)

    return keep_kernel


def dropout_mask(B: int, H: int, n_q: int, n_k: int, dropout_p: float, seed: int, offset: int = 0, stream=0):
    """(B, H, n_q, n_k) uint8 Numba device array: 1 where ``forward(..., dropout_p, dropout_seed=seed,
    dropout_offset=offset)`` keeps the score of query i and key j of batch b, query head h, 0 where it drops it
    (with dropout_p = 0 every score is kept), on Numba's current device and ``stream`` (a Numba stream, e.g.
    cuda.external_stream of a PyTorch stream's handle). Wrap it with torch.as_tensor / cupy.asarray, or
    copy_to_host()."""
    for name, x in (("B", B), ("H", H), ("n_q", n_q), ("n_k", n_k)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be an int >= 0; got {x!r}")
    p, words = check_dropout(dropout_p, seed, offset)
    z = cuda.device_array((B, H, n_q, n_k), dtype="uint8", stream=stream)
    if B * H * n_q * n_k == 0:
        return z
    if not words:
        z.copy_to_device(np.ones((B, H, n_q, n_k), "uint8"), stream=stream)
        return z
    if n_q > 65535 or B * H > 65535:
        raise ValueError(f"dropout_mask: n_q = {n_q} and B*H = {B * H} must each be <= 65535 (the grid's y and z)")
    grid = ((n_k + THREADS - 1) // THREADS, n_q, B * H)
    _kernel()[grid, THREADS, stream](z, H, *words)
    return z
