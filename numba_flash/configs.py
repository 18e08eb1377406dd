"""Tile configurations as data.

A config fixes everything a kernel specialisation needs at compile time. The tables below are
the shipped choices; ``keep`` drops any that would not fit the hardware budget, so a bad edit
fails loudly at import (and in tests) rather than at launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .tiles import Tile

MAX_HEAD_DIM = 256
SMEM_PER_BLOCK_MAX = 227 * 1024  # sm_80 / sm_90 opt-in maximum of dynamic shared memory per block
SMEM_PER_SM = 228 * 1024  # H100 / H200; 1 KiB of it is reserved per resident block
SMEM_STATIC_MAX = 48 * 1024      # above this a kernel must opt in (cuFuncSetAttribute)
REGS_PER_SM = 65536


# Compiled head dims (buckets): a user head dim d is zero-padded up to the next one.
HEAD_DIMS = (16, 32, 64, 96, 128, 192, 256)


def head_dim_bucket(d: int) -> int:
    """The compiled head dim for a user head dim d (1 <= d <= MAX_HEAD_DIM)."""
    return next(h for h in HEAD_DIMS if h >= d)


@dataclass(frozen=True)
class SimtConfig:
    """One SIMT forward specialisation.

    The thread block is a ROW_THREADS x COL_THREADS grid. Thread (tr, tc) owns groups of 4
    consecutive query rows (rows 4·tr .. 4·tr+3, then the same + 4·ROW_THREADS, ...), groups of
    4 consecutive S columns (4·tc .., + 4·COL_THREADS, ...) and of 4 consecutive O columns
    likewise: each operand step is one 16-byte shared-memory load per group.
    """

    block_q: int
    block_k: int
    row_threads: int
    col_threads: int
    head_dim: int  # compiled (padded) head dim
    share_kv: bool = False  # V reuses K's buffer once S is computed: less smem, more blocks per SM
    max_registers: int | None = None  # cap (ptxas -maxrregcount) so that 2 blocks fit on an SM
    # K/V tile copies (global -> shared). A "trip" is one thread's 4-element group of a tile (one
    # 16-byte shared store); a d=128 64-row tile is 8 trips per thread at 256 threads.
    # stage_trips = 0 and prefetch_trips = 0: the original per-trip loop (load 4, store, repeat).
    # stage_trips > 0: the tile's global loads go out in batches of stage_trips trips before their
    # shared stores (read-only ld.global.nc, in-bounds tiles without per-element checks).
    # prefetch_trips > 0: the first prefetch_trips trips of V_j are loaded into registers before
    # S_j = Q K_jᵀ is computed and those of K_{j+1} before P V_j, so the global latency hides
    # behind the GEMMs; the rest of each tile is copied, staged, where it is stored.
    stage_trips: int = 0
    prefetch_trips: int = 0

    @property
    def threads(self) -> int:
        return self.row_threads * self.col_threads

    @property
    def rows_per_thread(self) -> int:
        return self.block_q // self.row_threads

    @property
    def s_cols_per_thread(self) -> int:
        return self.block_k // self.col_threads

    @property
    def o_cols_per_thread(self) -> int:
        return self.head_dim // self.col_threads

    # Shared-memory layout, in 4-byte words. Q and K are stored transposed (head dim major) and
    # P transposed (key major) so a thread's 4 rows / columns are adjacent; every row stride is
    # a multiple of 4 (16-byte vectors) plus 4, which spreads the transposing stores over banks.
    @property
    def strides(self) -> dict:
        return {"qt": self.block_q + 4, "kt": self.block_k + 4, "v": self.head_dim + 4,
                "pt": self.block_q + 4}

    @property
    def smem_words(self) -> dict:
        st = self.strides
        k = self.head_dim * st["kt"]
        v = self.block_k * st["v"]
        return {
            "q": self.head_dim * st["qt"],
            "k": max(k, v) if self.share_kv else k,
            "v": 0 if self.share_kv else v,
            "p": self.block_k * st["pt"],
            "red": self.block_q * self.col_threads,  # per-row partial maxima / sums
        }

    @property
    def smem_bytes(self) -> int:
        return 4 * sum(self.smem_words.values())

    @property
    def accumulators_per_thread(self) -> int:
        """Registers the maths needs per thread: S tile, O tile, m_i, l_i (a lower bound)."""
        r = self.rows_per_thread
        return r * self.s_cols_per_thread + r * self.o_cols_per_thread + 2 * r

    def problems(self) -> list[str]:
        """Why this config cannot run (empty when it can)."""
        out = []
        for name, total, parts in (("block_q", self.block_q, self.row_threads),
                                   ("block_k", self.block_k, self.col_threads),
                                   ("head_dim", self.head_dim, self.col_threads)):
            if total % (4 * parts):
                out.append(f"{name}={total} not a multiple of 4 x {parts} threads (16-byte groups)")
        if not 1 <= self.threads <= 1024:
            out.append(f"{self.threads} threads per block (1..1024 allowed)")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            out.append(f"{self.smem_bytes} B shared memory > {SMEM_PER_BLOCK_MAX}")
        if self.max_registers is not None and self.max_registers * self.threads > REGS_PER_SM:
            out.append(f"max_registers={self.max_registers} x {self.threads} threads > {REGS_PER_SM}")
        if self.stage_trips < 0 or self.prefetch_trips < 0:
            out.append(f"stage_trips={self.stage_trips}, prefetch_trips={self.prefetch_trips}: must be >= 0")
        if self.accumulators_per_thread > 160:
            out.append(f"{self.accumulators_per_thread} accumulator registers per thread > 160")
        return out


def keep(configs):
    """Triton-style filter: only configs that fit the shared-memory and register budget."""
    return [c for c in configs if not c.problems()]


# head_dim: (block_q, block_k, row_threads, col_threads, share_kv[, max_registers[, stage_trips[, prefetch_trips]]])
# d = 64 and 128 copy K/V tiles as the H200 sweep chose (results/sweep-simt-2026-11-29-copy.txt, fp32 B4
# H16 N4096): d = 128 stage4 30.4 vs 27.1 TFLOP/s (causal 28.4 vs 25.1; stage8 31.2 spills 36 B),
# d = 64 pre4 31.2 vs 24.5 (pre4 + 128-register cap 31.5 spills 76 B). Other head dims: not swept.
_SIMT_TABLE = {
    16: (128, 32, 32, 4, False),
    32: (64, 64, 16, 8, True),
    64: (128, 64, 16, 16, True, None, 0, 4),
    96: (64, 64, 16, 8, True),
    128: (64, 64, 16, 16, True, 128, 4),  # capped: 2 blocks/SM; 27.1 vs 24.2 TFLOP/s uncapped 128x64
    192: (64, 64, 16, 16, True),
    256: (64, 64, 16, 16, True),
}


# Tensor-core forward (kernels/mma_forward.py), (head dim, causal): Tile. H200 sweep v6
# (results/sweep-mma-2026-11-29-v6.txt): FA2's 128x64 tile with 4 warps x 32 rows, in 64 KiB of dynamic shared
# memory at d = 128: 307.8 TFLOP/s vs 274.5 (64x32) non-causal, 251.0 vs 232.4 (64x64) causal, 344.5 vs 297.3
# bf16 N16384. Flags by sweep v7 (results/sweep-mma-2026-11-29-v7.txt, fp16 B4 H16 N4096, kernel launches, one
# run): smem_epilogue (O through shared memory, 16-byte stores) d128 314.5 vs 301.6; grid_bh_x (every head's
# heaviest causal tile first) and warp_skip (a warp skips the products of tiles its rows cannot see): d64 causal
# 128x64 grid+skip+epi 229.0 vs the 64x64 tile before, 169.5. Double-buffered K/V (stages=2) and lazy rescaling
# (blocks/softmax.py) on every row, by scripts/ab_mma.py, 5 interleaved rounds (the A/B results of def24ef and
# its parent, git show def24ef): d128 kv2 + epi + lazy 346.1 vs epi + lazy 338.0, bf16 N16384 390.2
# vs 382.7; d64 kv2 + epi + lazy 302.4 vs kv2 + epi 287.3; causal d128 grid + kv2 + epi + lazy 332.8 vs grid +
# epi + prologue + lazy 322.1; d64 grid + skip + kv2 + epi + lazy 261.2 vs 240.5 (SDPA FA2 293.2 / 247.5).
MMA_TABLE = {
    (64, False): Tile(128, 64, 64, warps=4, stages=2, flags={"smem_epilogue"}),
    (64, True): Tile(128, 64, 64, warps=4, stages=2, flags={"grid_bh_x", "warp_skip", "smem_epilogue"}),
    (128, False): Tile(128, 64, 128, warps=4, stages=2, flags={"smem_epilogue"}),
    (128, True): Tile(128, 64, 128, warps=4, stages=2, flags={"grid_bh_x", "smem_epilogue"}),
    # d = 192 and 256: one m-tile per warp (acc alone is HEAD_DIM / 2 fp32 per lane), 8 warps x 16 rows, one block
    # per SM (192 KiB of shared memory at d = 256). H200 sweep (results/sweep-mma-2026-12-03-d192-d256.txt, fp16
    # B4 H16 N4096, TFLOP/s): d256 128x64 epi 319.2 vs 64x32 (2 blocks/SM) 297.3, no epi 308.0, 128x32 279.5,
    # 64x64 271.8; causal grid+epi 299.2 (+skip 300.1, within the spread); d192 128x64 epi 314.2 vs 64x32 293.8
    # and d192 run on the d256 build 235.1; causal grid+epi 290.5. SDPA's default (cuDNN) in the same run: 703.3
    # / 616.3 (d256), 674.7 / 589.0 (d192).
    (192, False): Tile(128, 64, 192, warps=8, stages=2, flags={"smem_epilogue"}),
    (192, True): Tile(128, 64, 192, warps=8, stages=2, flags={"grid_bh_x", "smem_epilogue"}),
    (256, False): Tile(128, 64, 256, warps=8, stages=2, flags={"smem_epilogue"}),
    (256, True): Tile(128, 64, 256, warps=8, stages=2, flags={"grid_bh_x", "smem_epilogue"}),
}
# GPUs with less shared memory per block than MMA_TABLE's d = 192 / 256 tiles need (sm_80 163 KiB, sm_86 / sm_89
# 99 KiB): 4 warps of 16 rows x 32 keys in 72 / 96 KiB, the sweep's best tile that fits (H200: d256 297.3, causal with
# grid_bh_x 286.0; d192 293.8, causal 271.4 TFLOP/s). Not measured on those GPUs.
MMA_SMALL_SMEM = {
    (192, False): Tile(64, 32, 192, warps=4, stages=2, flags={"smem_epilogue"}),
    (192, True): Tile(64, 32, 192, warps=4, stages=2, flags={"grid_bh_x", "smem_epilogue"}),
    (256, False): Tile(64, 32, 256, warps=4, stages=2, flags={"smem_epilogue"}),
    (256, True): Tile(64, 32, 256, warps=4, stages=2, flags={"grid_bh_x", "smem_epilogue"}),
}
# sm_90 (H100 / H200) overrides MMA_TABLE with the forward on warpgroup MMA (kernels/wgmma_forward.py; flag "wgmma":
# wgmma is sm_90a only), two warpgroups of 64 rows. H200 sweep (results/sweep-mma-2026-12-03-wgmma.txt, fp16 B4 H16
# N4096 unless noted, TFLOP/s, the mma.sync tile of MMA_TABLE in the same run): d128 128x128 422.3 vs 381.3 (128x176
# 419.9, 128x64 389.6); bf16 B1 N16384 d128 468.3 vs 401.9; causal d128 128x64 + grid_bh_x 311.7 vs 309.3 (128x128
# 298.3); d64 128x64 347.2 vs 304.5 (128x128 294.4), causal 288.3 vs 257.2; d192 128x96 434.9 vs 290.5, causal 364.8
# vs 291.8; d256 128x64 469.4 vs 284.2 (bf16 474.7 vs 308.7), causal 128x80 391.1 vs 303.2 (128x64 389.9). SDPA's
# default (cuDNN) in that run: 642.1 / 683.8 / 535.6 (d128), 458.6 / 387.4 (d64), 665.6 / 582.2 (d192), 696.0 /
# 608.5 (d256).
MMA_WGMMA = {
    (64, False): Tile(128, 64, 64, warps=8, stages=2, flags={"wgmma"}),
    (64, True): Tile(128, 64, 64, warps=8, stages=2, flags={"wgmma", "grid_bh_x"}),
    (128, False): Tile(128, 128, 128, warps=8, stages=2, flags={"wgmma"}),
    (128, True): Tile(128, 64, 128, warps=8, stages=2, flags={"wgmma", "grid_bh_x"}),
    (192, False): Tile(128, 96, 192, warps=8, stages=2, flags={"wgmma"}),
    (192, True): Tile(128, 96, 192, warps=8, stages=2, flags={"wgmma", "grid_bh_x"}),
    (256, False): Tile(128, 64, 256, warps=8, stages=2, flags={"wgmma"}),
    (256, True): Tile(128, 80, 256, warps=8, stages=2, flags={"wgmma", "grid_bh_x"}),
}
# sm_90's forward, masks, mods and varlen included (q, k, v and O TMA-addressable; api.ws_blockers):
# kernels/wgmma_ws_forward.py (flag "ws": a producer warpgroup loading by TMA into an mbarrier ring, two consumer
# warpgroups of 64 rows on wgmma; the other flags are that kernel's). H100 sweep, results/sweep-wgmma-ws-2026-12-05-
# h100-full.txt, B4 H16 N4096, TFLOP/s fp16 / bf16, beside MMA_WGMMA's tile and SDPA cuDNN in the same run:
#   d64     128x192 + tma_store        336.8 / 338.0   MMA_WGMMA 306.9 / 311.1   cuDNN 429.3 / 417.4
#   d96     (the d128 tile)            417.2 (fp16)              303.4                   448.1
#   d128    128x128 + tma_store        530.9 / 581.5             388.2 / 414.2           606.4 / 630.5
#   causal  128x128 + tma_store        412.0 / 443.3             286.7 / 298.3           498.6 / 503.8
#   d192    128x112 + tma_store        634.1 (fp16)              423.3                   645.4
#   causal  128x96 + tma_store         458.6 (fp16)              340.1                   554.0
#   d256    128x80, no tma_store       613.7 / 625.8             441.2 / 437.5           680.5 / 692.7
#   causal  128x64 + tma_store         473.7 / 510.8             351.6 / 363.4           358.3 / 601.7
# (d256: 128x80 with tma_store ran 665.2 in fp16 but 467.5 in bf16, so the tile without it, the best worst case.)
# d64 causal stays on MMA_WGMMA's tile: 237.1 / 266.5 against the best ws tile's 256.2 / 257.1.
_WS = frozenset({"ws", "setmaxnreg", "overlap", "pingpong"})
MMA_WGMMA_WS = {
    (64, False): Tile(128, 192, 64, warps=12, stages=2, flags=_WS | {"tma_store"}),
    (128, False): Tile(128, 128, 128, warps=12, stages=2, flags=_WS | {"tma_store"}),
    (128, True): Tile(128, 128, 128, warps=12, stages=2, flags=_WS | {"tma_store", "grid_bh_x"}),
    (192, False): Tile(128, 112, 192, warps=12, stages=2, flags=_WS | {"tma_store"}),
    (192, True): Tile(128, 96, 192, warps=12, stages=2, flags=_WS | {"tma_store", "grid_bh_x"}),
    (256, False): Tile(128, 80, 256, warps=12, stages=2, flags=_WS),
    (256, True): Tile(128, 64, 256, warps=12, stages=2, flags=_WS | {"tma_store", "grid_bh_x"}),
}
MMA_HEAD_DIMS = sorted({hd for hd, _ in MMA_TABLE})  # the forward's compiled head dims: d is padded up to one
# (block_q, block_k, head_dim, m-tiles per warp): spill bytes (ptxas 13.0, sm_90, worst of causal / not, f16 /
# bf16) of a shipped tile measured faster anyway: d128 causal 24 B (stored and loaded, f16 and bf16); the
# others spill nothing. The allowance is exactly that.
MMA_SPILL_OK = {(128, 64, 128, 2): 24}

# fp32 on tensor cores (kernels/tf32_forward.py, 3xTF32), (head dim, causal): Tile. H200 sweeps
# (results/sweep-tf32-2026-11-29-*.json, fp32 B4 H16 N4096, kernel launches): d128 128x64 with K/V split once per
# tile (presplit) 54.2 TFLOP/s vs 45.5 for 64x64 re-splitting per warp (SDPA memory-efficient 44.8, SIMT 30.6 in
# the same run); causal 128x32 presplit + grid_bh_x 42.2 (SDPA 43.0), re-run 37.8 (SDPA 44.2) with 128x64 at
# 37.7 (results/sweep-tf32-2026-11-29-causal-recheck.json): the causal choice is within the spread; d64 128x64
# presplit 51.0 (SDPA 34.8), causal + grid_bh_x 49.1 (SDPA 31.6). Head dim 32 takes d64's tiles (not swept).
TF32_TABLE = {
    (32, False): Tile(128, 64, 32, warps=8, flags={"presplit"}),
    (32, True): Tile(128, 64, 32, warps=8, flags={"presplit", "grid_bh_x"}),
    (64, False): Tile(128, 64, 64, warps=8, flags={"presplit"}),
    (64, True): Tile(128, 64, 64, warps=8, flags={"presplit", "grid_bh_x"}),
    (128, False): Tile(128, 64, 128, warps=8, flags={"presplit"}),
    (128, True): Tile(128, 32, 128, warps=8, flags={"presplit", "grid_bh_x"}),
}

# The backward tables, (kernel, head dim[, causal]): Tile. The kernels: "dkdv" (dK, dV; the block owns block_k
# keys and streams block_q-row query tiles), "dq" (owns block_q queries, streams block_k keys) and "dkdv_atomic"
# (the dkdv kernel that also forms dQ: backward(deterministic=False)'s atomic grid, and the deterministic
# splits where its flag "deterministic_splits" is set, else deterministic=True takes the dkdv and dq kernels).
# sm_90's "dkdv_atomic" flags: "wgmma" (kernels/wgmma_backward.py), "defer_dq_atomic" / "defer_dq_splits" (its
# DEFER_DQ in that dQ scheme). backward_plan.config_from_tiles turns an entry into the launches' plan.
#
# Tensor-core backward, fp16 / bf16. dkdv holds dK and dV (2 x HEAD_DIM/2 fp32 per lane) plus Sᵀ and dPᵀ
# (2 x block_q/2).
# H200 sweep (results/backward-2026-11-29-mma-sweep.md, fp16 B4 H16 N4096, each kernel alone): d = 128
# dkdv 64x64 257.0 vs 64x32 244.6 TFLOP/s (causal 205.9 vs 192.8) although ptxas spills 92 B of it,
# dq 64x64 269.3 (next 128x64 264.6); d = 64 64x64 best for both (242.5, 249.1). Re-swept at d128 non-causal
# after the streamed tiles became whole-tile copies (results/backward-2026-12-01-sweep-copies.md): the same tiles win
# (dkdv 64x64 3.630 ms vs 64x32 3.927; dq 64x64 2.647 vs 128x64 2.895; atomic 128x64 5.770 vs 64x64 6.451).
# "dkdv_atomic": the dkdv tile of backward(deterministic=False) (atomic dQ, red.global.add.v2.f32;
# results/backward-2026-11-29-atomic-v2.md, kernel alone incl. the dq conversion): d = 128 128 keys
# (8 warps, FA2's layout) 6.31 ms vs 64 keys 7.33 (causal 3.65 vs 4.08); d = 64 64 keys 3.41 vs 3.66.
# 3xTF32 backward, fp32 (kernels/tf32_backward.py), (kernel, head dim, causal): Tile (keys x queries below
# are dkdv's block_k x block_q, queries x keys dq's block_q x block_k). H200 sweeps (scripts/sweep_tf32_backward.py, results/sweep-tf32-backward-2026-12-01*.txt; fp32
# B4 H16 N4096, each kernel alone, ms), best vs the first guess (the largest tiles that built unspilled):
#   d128: dkdv 128x32 in one pass 30.2 (causal 16.6) vs 64x64 as a dV pass and a dK pass 73.3;
#         dq 128x32 24.4 (causal 13.7) vs 64x64 30.2 (15.9)
#   d64:  dkdv 128x64 14.3 (causal 8.2) vs 64x32 16.9 (9.5); dq 64x32 11.9, but causal 128x64 5.7 vs 6.9
#   d32:  dkdv 128x64 7.8 vs 64x64 8.4, causal 64x32 4.5 vs 5.0; dq 128x32 5.4 (causal 3.3) vs 64x64 5.4 (3.8)
# "dkdv_atomic" (every entry with "deterministic_splits"): dQ formed in the dkdv kernel (the dkdv tile, plus
# the dQ phase), as MMA_BWD_TABLE's; the dq kernel then does not run. Direct calls vs the dkdv + dq kernels
# (results/ab-backward-2026-12-01-tf32-dq-in-dkdv*.txt; deterministic splits / atomic grid, ms): d128 39.4 /
# 39.3 vs 55.0 (causal 22.0 / 21.9 vs 30.5), d64 19.9 / 19.5 vs 26.4 (causal 11.3 / 11.0 vs 14.2), d32 12.9 /
# 12.8 vs 13.4 (causal 6.0 / 5.7 vs 8.0).
def _tf32_bwd(head_dim, causal, dkdv, dq):
    """One tf32x3 entry: dkdv and dq tiles, and dQ formed in the dkdv kernel on the dkdv tile, by the splits."""
    key = (head_dim, causal)
    return {("dkdv", *key): dkdv, ("dq", *key): dq, ("dkdv_atomic", *key): dkdv.with_(flags={"deterministic_splits"})}


TF32_BWD_TABLE = {
    **_tf32_bwd(32, False, Tile(64, 128, 32), Tile(128, 32, 32)),
    **_tf32_bwd(32, True, Tile(32, 64, 32), Tile(128, 32, 32)),
    **_tf32_bwd(64, False, Tile(64, 128, 64), Tile(64, 32, 64)),
    **_tf32_bwd(64, True, Tile(64, 128, 64), Tile(128, 64, 64)),
    **_tf32_bwd(128, False, Tile(32, 128, 128), Tile(128, 32, 128)),
    **_tf32_bwd(128, True, Tile(32, 128, 128), Tile(128, 32, 128)),
}
# (kernel, own, streamed, HEAD_DIM, causal): spill bytes (ptxas 13.0, sm_90) of a shipped tf32x3 config
# the sweeps measured fastest anyway (measured on the cvt.rna builds): d64 dkdv 128x64 14.3 ms vs 128x32 15.9
# (unspilled); d128 causal dkdv 128x32 16.6 ms vs 128x16 19.4 (56 B) (without the mask the same tile did not
# spill then). Since then the sm_90 builds split operands by cvt.rn (one F2FP) instead of cvt.rna
# (four instructions), and ptxas allocates anew: the figures below are the cvt.rn builds' (cvt.rna's were
# dkdv d64 80 / 32, d128 0 / 216; dkdv-atomic d64 24 / 68, d128 32 / 104; splits d64 24 / 124, d128 24 / 116,
# non-causal / causal). Timed cvt.rn against cvt.rna, B4 H16 N4096 (the splits builds at d32-d128, the dkdv + dq
# plan at d128, whose dkdv spills 272 B: 55.6 -> 43.3 ms), cvt.rn was faster in every case:
# results/ab-split-round-2026-12-0{1,2}-cvt-rn*. The atomic builds (deterministic=False) were not timed.
TF32_BWD_SPILL_OK = {("dkdv", 128, 64, 64, False): 56, ("dkdv", 128, 64, 64, True): 56,
                     ("dkdv", 128, 32, 128, False): 272, ("dkdv", 128, 32, 128, True): 256,
                     # the dQ-in-dkdv builds: atomic grid, later splits, first split (stores); timed faster
                     # than the dkdv + dq kernels they replace (results/ab-backward-2026-12-01-tf32-dq-in-dkdv*.txt),
                     # spills and all
                     ("dkdv-atomic", 128, 64, 64, False): 36, ("dkdv-splits", 128, 64, 64, False): 36,
                     ("dkdv-splits-first", 128, 64, 64, False): 36,
                     ("dkdv-atomic", 128, 64, 64, True): 80, ("dkdv-splits", 128, 64, 64, True): 88,
                     ("dkdv-splits-first", 128, 64, 64, True): 88,
                     # (d128 non-causal: with the exponent clamp of blocks/mask.py's clamps_past_end)
                     ("dkdv-atomic", 128, 32, 128, False): 8, ("dkdv-splits", 128, 32, 128, False): 28,
                     ("dkdv-splits-first", 128, 32, 128, False): 28,
                     ("dkdv-atomic", 128, 32, 128, True): 120, ("dkdv-splits", 128, 32, 128, True): 120,
                     ("dkdv-splits-first", 128, 32, 128, True): 120}
# "deterministic_splits" (a "dkdv_atomic" flag): backward(deterministic=True) forms dQ by the splits (the
# dkdv_atomic kernel adding into per-block fp32 planes, FA2's deterministic scheme; backward.dq_scheme falls back
# to the dq kernel where too few blocks would run); without it, by the separate dq kernel (7 tile products
# instead of 5). Direct calls, fp16
# B4 H16 N4096 (results/ab-backward-2026-12-01-dq-splits*.txt): d128 splits 5.80 ms vs the dq kernel 6.31 (that
# dq-kernel figure predates the vectorised prep, which later gained the dq-kernel path 0.10-0.14 ms at d64 and
# d128 causal; not re-timed non-causal), causal 3.41 vs 3.47 (both with the vectorised prep; a 1.7 % margin,
# within the spread between runs); d64 splits (the 64-key atomic dkdv, 4 splits) 4.84 vs 3.50
# (results/ab-backward-2026-12-01-dq-splits-kernel-loop.txt, an earlier build): the dq kernel.
MMA_BWD_TABLE = {
    ("dkdv", 64): Tile(64, 64, 64), ("dq", 64): Tile(64, 64, 64), ("dkdv_atomic", 64): Tile(64, 64, 64),
    ("dkdv", 128): Tile(64, 64, 128), ("dq", 128): Tile(64, 64, 128),
    ("dkdv_atomic", 128): Tile(64, 128, 128, flags={"deterministic_splits"}),
    # d = 192 and 256 (head dims 129..256 padded up to one): dkdv in the split layout (mma_dkdv.col_split: two warps
    # per 16 keys, each with Sᵀ / dPᵀ of half the queries and dK / dV of half the columns, Pᵀ and dSᵀ through
    # shared memory), FA2's d = 256 tile of 64 keys x 64 queries on 8 warps: 128 accumulator registers a lane,
    # 209 KiB of shared memory at d = 256 (161.5 KiB at d = 192), one block per SM; ptxas: 232-254 registers, no
    # spills. dq: 64 queries x 32 keys on 4 warps (dQ_w of 16 rows x d: d / 2 fp32 a lane, so 32-key S and dP),
    # 128 KiB at d = 256, 251-255 registers (d192 causal spills 136 B: MMA_BWD_SPILL_OK). d = 256 timed on the H200
    # (results/backward-2026-12-04-sweep-d256.md, fp16 B4 H16 N4096, TFLOP/s non-causal / causal): dkdv 64x64 257.6 /
    # 235.9 over 32x64's 208.2 / 191.1; the atomic 64x64 202.5 / 188.0 over 138.1 / 131.2; dq 64x32 247.8 / 246.9, where
    # 128x32 read 275.5 / 261.0 (a candidate; the shipped tile is the one the GPU tests ran). d = 192: by construction, not timed.
    ("dkdv", 192): Tile(64, 64, 192), ("dq", 192): Tile(64, 32, 192),
    ("dkdv_atomic", 192): Tile(64, 64, 192, flags={"deterministic_splits"}),
    ("dkdv", 256): Tile(64, 64, 256), ("dq", 256): Tile(64, 32, 256),
    ("dkdv_atomic", 256): Tile(64, 64, 256, flags={"deterministic_splits"}),
}
# sm_90 (H100 / H200) overrides MMA_BWD_TABLE's entries with these: the dQ-in-dkdv kernel on warpgroup MMA
# (kernels/wgmma_backward.py; wgmma is sm_90a only), 128 keys x 64 queries, and the deterministic splits at
# d = 64 too. A/B against the mma.sync kernels in one run (B4 H16 N4096 fp16, direct calls,
# deterministic / deterministic=False, ms): d128 5.78 / 5.55 -> 4.63 / 3.79, causal 3.40 / 3.28 -> 2.74 / 2.35,
# d64 3.32 / 3.16 -> 2.57 / 2.46, causal 1.91 / 1.99 -> 1.61 / 1.56 (results/ab-backward-2026-12-02-wgmma.txt).
# defer_dq_atomic / defer_dq_splits: the dQ schemes (deterministic=False's grid, the splits) whose builds leave
# each step's dQ product in flight through the next step's barrier (wgmma_backward's DEFER_DQ). A/B against the
# builds without it (results/ab-backward-2026-12-02-wgmma-defer-dq.txt, ms): atomic d128 3.96 -> 3.72, causal
# 2.36 -> 2.21, d64 2.41 -> 2.28; splits d128 4.75 -> 4.84 (slower: off there), causal 2.74 -> 2.77, d64
# 2.51 -> 2.46.
MMA_BWD_WGMMA = {
    ("dkdv_atomic", 64): Tile(64, 128, 64, flags={"wgmma", "deterministic_splits", "defer_dq_atomic",
                                                  "defer_dq_splits"}),
    ("dkdv_atomic", 128): Tile(64, 128, 128, flags={"wgmma", "deterministic_splits", "defer_dq_atomic"}),
}
# (kernel, own, streamed, HEAD_DIM): spill bytes (ptxas 13.0, sm_90, worst of causal / not) of a
# shipped config the sweep measured fastest anyway; the build test allows exactly these. The streamed
# tiles' whole-tile copies freed registers (dkdv d128 104 -> 100, the atomic 128-key dkdv
# 56 -> 0) except in the causal dq at d128 (48 -> 56); re-swept: results/backward-2026-12-01-sweep-copies.md.
# Then the atomic dQ phase's two passes were written out: 0 -> 16 B (44 causal), and 4.8 % faster
# non-causal, equal causal (results/ab-backward-2026-12-01-dq-passes.txt).
MMA_BWD_SPILL_OK = {("dkdv", 64, 64, 128): 100, ("dq", 64, 64, 128): 56,
                    # the atomic-dQ dkdv of backward(deterministic=False) with red.v2 adds, 64 or 128 keys
                    # (worst of causal / not; timed in results/backward-2026-11-29-atomic-v2.md)
                    ("dkdv-atomic", 64, 64, 64): 44, ("dkdv-atomic", 64, 64, 128): 100,
                    ("dkdv-atomic", 128, 64, 64): 40, ("dkdv-atomic", 128, 64, 128): 44,
                    # the deterministic splits' builds (worst of causal / not, adds / stores: the first
                    # launch's store build, non-causal; results/sass-loop-2026-12-01-dq-splits.txt)
                    ("dkdv-splits", 128, 64, 128): 36,
                    # d192 dq 64x32, causal (not causal: 234 registers, none): chosen over 64x16 (169 registers,
                    # unspilled) by construction, twice the products per barrier; not timed (the sweep has both)
                    ("dq", 64, 32, 192): 136}


def _simt_for(head_dim: int) -> SimtConfig:
    entry = _SIMT_TABLE[head_dim]
    bq, bk, rt, ct, share, cap, stage, prefetch = entry + (None, 0, 0)[len(entry) - 5:]
    return SimtConfig(bq, bk, rt, ct, head_dim, share_kv=share, max_registers=cap, stage_trips=stage,
                      prefetch_trips=prefetch)


SIMT_CONFIGS = {d: _simt_for(d) for d in HEAD_DIMS}

_bad = {d: c.problems() for d, c in SIMT_CONFIGS.items() if c.problems()}
if _bad:  # a table edit that does not fit is a bug, not a runtime surprise
    raise AssertionError(f"shipped SIMT configs that cannot run: {_bad}")


def simt_config(d: int) -> SimtConfig:
    return SIMT_CONFIGS[head_dim_bucket(d)]
