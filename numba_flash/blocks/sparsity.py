"""The walk of a BlockMask's key-tile lists, written once for the tensor-core forwards (mma.sync and wgmma).

A block_sparse build (blocks.mods.Mods.block_sparse) visits only the key tiles listed for its (b, h, query tile),
in list order, instead of every tile of its causal / window range. Two int32 arrays carry the lists (launch
arguments after the user mods' aux arrays, LIST_TYPES):

    counts  (B, H, Q tiles)             how many key tiles the query tile visits
    entries (B, H, Q tiles, K tiles)    entry i = 2·(key tile) + (1 if the tile is FULL), then -1

``host_lists`` builds them from the BlockMask's classes and intersects them with causal / window on the host:
tiles no row of the query tile sees under causal / window are dropped, so the kernel computes no tile range of
its own; a kept tile that crosses the diagonal or the window's edge still gets its per-score mask there, and
the last key tile its sequence-end mask. A FULL tile skips the per-score mask_mod call (its score mod, if any,
still runs); a PARTIAL one calls it. reference.host_lists is the same construction.
"""
from __future__ import annotations

import numpy as np
from numba import int32, types

from ..ptx import inline_device

EMPTY, PARTIAL, FULL = 0, 1, 2  # numba_flash.sparsity's (and reference.block_mask's) classes
LIST_TYPES = (types.Array(types.int32, 3, "A"), types.Array(types.int32, 4, "A"))  # counts, entries


def lists_of(first: int):
    """lists(aux) -> (counts, entries): the two list arrays at aux[first], aux[first + 1] (a tuple of arrays of
    different types takes literal indices only, so the indices are written into the source)."""
    scope: dict = {}
    exec(compile(f"def lists(aux):\n    return aux[{int(first)}], aux[{int(first) + 1}]\n", "<lists_of>", "exec"),
         scope)
    return inline_device(scope["lists"])


@inline_device
def list_length(counts, b, h, q_tile):
    """How many key tiles query tile q_tile of (b, h) visits."""
    return int32(counts[b, h, q_tile])


@inline_device
def entry(entries, b, h, q_tile, i):
    """The i-th listed key tile of (b, h, q_tile), encoded (tile_of, is_full read it)."""
    return entries[b, h, q_tile, i]


@inline_device
def tile_of(e):
    """The key tile of an entry."""
    return int32(e >> 1)


@inline_device
def is_full(e):
    """Whether an entry's tile is FULL (no per-score mask_mod call)."""
    return (e & 1) != 0


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def tile_range(q0: int, q_end: int, n_q: int, n_k: int, block_k: int, causal: bool, window) -> tuple:
    """(first, stop): the key tiles rows q0 .. q_end - 1 see under causal / window (flash-attn's (left, right), -1
    unbounded; causal is right = 0), bottom-right aligned; the kernels' own tile range (blocks/mask.py)."""
    left, right = window
    if causal:
        right = 0
    shift = n_k - n_q
    k_lo = 0 if left < 0 else max(q0 + shift - left, 0)
    k_hi = n_k if right < 0 else min(q_end - 1 + shift + right + 1, n_k)
    stop = (max(k_hi, 0) + block_k - 1) // block_k
    return min(k_lo // block_k, stop), stop


def host_lists(classes: np.ndarray, n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = False,
               window=(-1, -1)) -> tuple:
    """(counts, entries) of the module docstring from a BlockMask's ``classes`` (B, H, Q tiles, K tiles): the
    non-EMPTY tiles of each query tile inside its causal / window range, in ascending order, FULL flagged."""
    classes = np.asarray(classes)
    n_kb = classes.shape[-1]
    keep = classes != EMPTY
    for a in range(classes.shape[2]):
        first, stop = tile_range(a * block_q, min((a + 1) * block_q, n_q), n_q, n_k, block_k, causal, window)
        keep[:, :, a, :first] = False
        keep[:, :, a, stop:] = False
    counts = keep.sum(-1).astype(np.int32)
    code = 2 * np.arange(n_kb, dtype=np.int32) + (classes == FULL).astype(np.int32)
    order = np.argsort(~keep, axis=-1, kind="stable")  # kept tiles first, in order
    picked = np.take_along_axis(np.broadcast_to(code, classes.shape), order, -1)
    entries = np.where(np.arange(n_kb) < counts[..., None], picked, np.int32(-1)).astype(np.int32)
    return np.ascontiguousarray(counts), np.ascontiguousarray(entries)
