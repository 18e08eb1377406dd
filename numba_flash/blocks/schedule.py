"""Schedules of the backward: the padded scratch rows, where the deterministic dQ splits' planes start, and
how many splits a problem takes.

The tensor-core backwards keep L2 = L·log2(e) and D = rowsum(dO ∘ O) in fp32 scratch rows of shape
(B·H, NQ_PAD), NQ_PAD = padded_rows(Nq) a multiple of ROW_PAD, so every query tile (BLOCK_M <= ROW_PAD)
reads inside them. The deterministic splits (FA2's deterministic scheme) run the dK/dV kernel that also
forms dQ as ceil(key blocks / S) launches of S key blocks per kv head, block x of each adding into fp32
plane x; ``dq_splits`` picks S by a greedy list schedule of the blocks onto the GPU's block slots.
"""
from __future__ import annotations

import heapq
from functools import lru_cache

from ..ptx import inline_device

ROW_PAD = 128  # scratch rows padded to this: every query tile (BLOCK_M <= 128) reads inside them


def padded_rows(n_q: int) -> int:
    """NQ_PAD: the scratch row length for n_q queries."""
    return -(-n_q // ROW_PAD) * ROW_PAD


@inline_device
def plane_first_row(p, n_q, n_k, block_n, block_m, causal):
    """The first row plane p of the deterministic splits holds (rows before it were never written: the
    launch that starts the plane, key block p, stores from its first Q tile on). Causal: the first Q tile
    that sees key p·block_n (rows that see no key at all are never written in any plane); else 0. With one
    zeroed plane (deterministic=False) the rows before it are zeros anyway."""
    if causal == 0:
        return 0
    n_qt = (n_q + block_m - 1) // block_m
    return min(max(p * block_n - (n_k - n_q), 0) // block_m, n_qt) * block_m


MAX_DQ_SPLITS = 8  # fp32 dQ scratch planes at most (8 x dq's size in fp32) ...
DQ_SCRATCH_MAX_BYTES = 1 << 30  # ... and at most 1 GiB of them: longer problems take the dq kernel (no scratch)
LAUNCH_GAP_STEPS = 0.5  # the idle time between two launches on a stream (~3 us), in d128 steps (~6 us)
SPLITS_SLOWER_OK = 1.10  # splits run where their predicted time is within this of the atomic grid's


def _makespan(works, slots):
    """Greedy list schedule of blocks (works, in launch order) onto ``slots`` resident-block slots:
    when the last slot finishes (what the hardware's block scheduler does, to first order)."""
    if len(works) <= slots:
        return max(works)
    free = [0] * slots
    for w in works:
        heapq.heapreplace(free, free[0] + w)
    return max(free)


@lru_cache(maxsize=256)
def dq_splits(n_q, n_k, block_n, block_m, causal, group, n_kv_heads, slots, max_splits=MAX_DQ_SPLITS):
    """(S, predicted time of S splits / the atomic grid's): the deterministic splits for one problem.

    A block of key block j costs its steps, group · (Q tiles that see j), plus one for its prologue and
    epilogue. S splits run ceil(n_kb / S) launches one after another, launch r holding key blocks rS ..
    rS + S - 1 of each kv head (n_kv_heads = B·Hkv rows of blocks); the atomic grid is one launch of every key
    block. Blocks are scheduled greedily onto the GPU's ``slots`` (SMs x blocks per SM); S is the smallest
    within 1 % of the best, so no more fp32 scratch than the time needs."""
    n_qt = -(-n_q // block_m)
    n_kb = -(-n_k // block_n)
    shift = n_k - n_q
    work = [group * (n_qt - (min(max(j * block_n - shift, 0) // block_m, n_qt) if causal else 0)) + 1
            for j in range(n_kb)]
    atomic = _makespan(work * n_kv_heads, slots)
    times = {}
    for splits in range(1, min(n_kb, max_splits) + 1):
        times[splits] = sum(_makespan(work[kb0:kb0 + splits] * n_kv_heads, slots) + LAUNCH_GAP_STEPS
                            for kb0 in range(0, n_kb, splits))
    best = min(times.values())
    splits = min(x for x, t in times.items() if t <= 1.01 * best)
    return splits, times[splits] / atomic

