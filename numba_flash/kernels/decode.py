"""Split-KV decoding (FlashDecoding): a few new queries against a long KV cache.

Maths. Sequence b holds len_b valid keys; its Nq <= 16 new queries are the last Nq positions, so
query i sees key j iff j <= i + len_b - Nq (bottom-right causal alignment; keys >= len_b never).
The keys of each sequence are cut into S splits. For every (batch, kv head, split) one thread
block runs the online softmax (section 3.6.4) over its key range for all G·Nq query rows of the
group (G = H / Hkv), and writes the partial state of each row to fp32 scratch:

    m_s   = max_j s_j                        running maximum          (m of 3.6.4)
    l_s   = sum_j exp(s_j - m_s)             running denominator      (ℓ)
    acc_s = sum_j exp(s_j - m_s) · v_j       running numerator        (O, unnormalised)

A second kernel merges the S states of each row with the logsumexp combine, which is
reference.OnlineSoftmaxState.merge applied to all splits at once:

    m = max_s m_s,   w_s = exp(m_s - m),   l = sum_s w_s l_s,   O = sum_s w_s acc_s / l,   L = m + log l

A split that sees no key has m_s = -inf, l_s = 0 and weight 0; a row that sees no key at all gets
O = 0 and L = -inf. With one split the first kernel writes O and L itself. As in the forward,
scores are scaled by softmax_scale·log2(e) so every exp is an exp2, and m_s stays in base 2.

Why split. One decoding step has too few queries for the forward's grid (one block per Q tile
and head): B·Hkv blocks would each stream a whole cache. Splitting the keys gives enough blocks
to fill every SM, and all G·Nq rows of a group share each K/V tile, so the cache is read once.

Bandwidth. Decoding is memory-bound: per key 2·d·itemsize bytes against 4·d·G·Nq flops. K and V
tiles arrive by cp.async (16-byte copies; consecutive threads copy consecutive chunks of a row,
so every warp request is fully coalesced) into a STAGES-deep ring of shared-memory buffers;
STAGES - 1 tiles are in flight while one is used. For fp16, d = 128, 64-key tiles and 3 stages
that is 64 KiB in flight per block and 2 blocks per SM, 128 KiB per SM: well above the ~40 KB
that Little's law asks at 4.8 TB/s and ~1 µs of latency over 132 SMs. Caches whose rows are not
16-byte aligned take a scalar-load path (same kernel, VEC=False), correct but slower.

Work per tile, from shared memory (rows of the K/V tiles are padded by 16 bytes):
* S = Q·Kᵀ: a quad of lanes per key. Lane 4·kq + p reads words p, p+4, p+8, ... of key kq's row,
  so the 8 keys × 4 lanes of a warp hit 32 different banks; two xor-shuffles add up the quad.
* softmax: one warp per row, maximum and sum over the tile by butterfly shuffles; m_i, l_i and
  alpha of each row live in shared memory.
* acc += P·V: a thread owns word columns c, c + 32, ... of some rows, for one key group; a warp
  reads 32 consecutive words of one V row. The key groups' partial acc are summed once, at the end.

Per 64-key tile that is 2 block barriers, a softmax run by ceil(rows / warps) warps while the
others wait (for one row: 1 of 4 warps, 10 shuffles in a chain), and 16 cp.async per thread, each
with its own bounds and 64-bit address arithmetic: the H200 sweep found it bound by this chain,
not by bytes in flight (benchmarks/DESIGN.md, decode).

Bulk copies (DecodeConfig.bulk, block-wide kernel, sm_90): a (batch, kv head)'s cache rows are
back to back when its last two dims are contiguous and d = head_dim, so keys [k0, k0 + block_n) of
K are one span of block_n·d·itemsize bytes (16 KiB at fp16 d128, 64 keys). Thread 0 issues it,
and the V span, as two cp.async.bulk copies (only the valid rows of a ragged last tile; the rows
past the length are zeroed by all threads), each completing its own mbarrier of the stage after an
arrive.expect_tx of its bytes. Every thread waits with try_wait.parity for phase j // STAGES of
stage j % STAGES's K barrier before S = Q·Kᵀ, and of its V barrier before P·V. The block barrier
at the top of each step (as in the cp.async ring) orders all reads of the previous tile before
its stage is refilled, so no "empty" barrier is needed. The copies hold no registers and cost no
per-thread instructions, so a deep ring (STAGES - 1 tiles in flight) costs only shared memory. Rows land unpadded (a multiple of 32 banks apart), so the S
phase reads lane 4·kq + p's chunks in the order c ^ kq and, for 16-bit caches, q[e] lives at
e ^ ((e >> 5) & 1): both reads stay conflict-free. Caches a bulk copy cannot fetch run the same
config with bulk=False.

Split-in-block (DecodeConfig.warp_split, FlashDecoding++ / FA2 style): warp w takes tiles
t_begin + w, t_begin + w + warps, ... of the split (block_n keys each, one lane per key, or 32 /
block_n lanes per key) through its own cp.async ring, ordered by cp.async.wait_group and
__syncwarp only. S = Q·Kᵀ reads 16 bytes of a K row per LDS.128 (the 8 lanes of a phase read 8
keys' rows, 4 banks apart) against q broadcast from shared memory; m_i stays in registers (the
same on every lane), and l_i as each lane's share, summed once after the loop. The probabilities
go to the warp's slice of shared memory and P·V reads them 4 per LDS.128. At the end each warp
writes (m_w, l_w, acc_w) and the block merges its warps exactly like the merge kernel merges
splits: m = max_w m_w, O = sum_w exp2(m_w - m) acc_w. Per tile: no block barrier, 2 __syncwarp,
log2(block_n) shuffles per row for the maximum (none for ℓ), and full tiles issue each cp.async
as one add to a flat offset.

Shuffles are numba_flash.ptx.shfl_xor_sync (its simulator twin exchanges values between the 32
simulated lanes), so the simulator runs this kernel unchanged. Every sum has a fixed order: the
result is bitwise deterministic for a given num_splits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import config as nb_config
from numba import cuda, float32, int32, types, uint16, uint32, uint64

from .. import ptx
from ..configs import MAX_HEAD_DIM, SMEM_PER_BLOCK_MAX, SMEM_PER_SM, head_dim_bucket
from ..launch import DeviceView, address, unused_slopes
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, bits_from_f32, f16x2_to_f32, f32_from_bits, inline_device, ld_shared_u32x4
from ..blocks.entry import MOD_ARGS, _at_home
from ..blocks.mods import NO_MODS, Mods, alibi_bias, capped, head_slope, launch_args, user_aux_types
from ..jit_cache import compile_kernel

# Indices are cast to unsigned before indexing: Numba then skips its negative-index wraparound code.
U = uint64

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# q and out as the kernel sees them (bfloat16 travels as uint16 bits); K and V are only copied and
# unpacked, so 16-bit caches are plain uint16 words whatever their float type.
Q_STORAGE = {"float32": types.float32, "float16": types.float16, "bfloat16": types.uint16}
KV_STORAGE = {"float32": types.float32, "float16": types.uint16, "bfloat16": types.uint16}
LENS_DTYPES = ("int32", "int64")
FASTMATH = {"contract", "arcp", "afn"}  # never the flags that change -inf / nan: masking needs -inf
MERGE_THREADS = 128


@dataclass(frozen=True)
class CacheMode:
    """How the split kernel finds a sequence's keys and which it shows each query (compile-time switches).

    paged: k / v are (num_pages, Hkv, page_size, d) and key j of sequence b sits in page
    block_table[b, j // page_size], row j % page_size (flash-attn's paged cache, heads first).
    batch_idx: sequence b reads cache row cache_batch_idx[b] (contiguous caches only).
    leftpad: sequence b's keys start at row cache_leftpad[b] of its cache (contiguous caches only);
    cache_seqlens[b] stays the end, so it has cache_seqlens[b] - cache_leftpad[b] keys.
    causal: query i of Nq sees keys j <= i + len - Nq (bottom-right); else every key < len.
    window, softcap, alibi: flash-attn's variants (blocks/mods.py), their values launch arguments
    (MOD_ARGS after scale_log2): with the window, query i at position pos = i + len - Nq sees keys
    pos - left <= j <= pos + right (right = 0 when causal), and tiles left of every row's window
    are never loaded; the softcap caps q·k, then ALiBi subtracts slope·|pos - j|, then the mask.
    user: a blocks.mods.Mods holding the user's mask_mod / score_mod (numba_flash.mods), compiled in and
    called as mod(b, h, q_idx, kv_idx, *aux) with q_idx the query's index in q (0 .. Nq - 1) and kv_idx the
    key's in its sequence (after any left padding), on keys < len only; the score mod after ALiBi, on the scaled
    logit; their aux arrays are launch arguments after MOD_ARGS.
    """

    paged: bool = False
    batch_idx: bool = False
    leftpad: bool = False
    causal: bool = True
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    user: Mods = NO_MODS

    @property
    def mods(self) -> bool:
        """Whether the kernel takes MOD_ARGS (any of window, softcap, alibi, user mods)."""
        return self.window or self.softcap or self.alibi or self.user.user

    @property
    def aux_types(self) -> tuple:
        """The user mods' aux arrays' Numba types (launch arguments after MOD_ARGS)."""
        return user_aux_types(self.user) if self.user.user else ()

    def problems(self) -> list[str]:
        out = []
        if self.paged and (self.batch_idx or self.leftpad):
            out.append("a paged cache takes neither cache_batch_idx nor cache_leftpad (as flash-attn)")
        if self.user.window or self.user.softcap or self.user.alibi or self.user.block_sparse:
            out.append(f"user: only mask_mod / score_mod (the built-in variants are CacheMode's own); got {self.user}")
        return out


PLAIN = CacheMode()


# --------------------------------------------------------------------------------------------
# Tile configuration as data
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """One specialisation of the split (phase-1) kernel.

    rows: query rows per block (G·Nq of a group, padded up; larger groups take several blocks).
    block_n: keys per K/V tile. stages: depth of the cp.async ring (stages - 1 tiles in flight).
    warps: 32-thread warps per block.
    warp_split: each warp streams its own tiles (t_begin + w, + 2·warps, ...) through its own
    ring with its own (m, l, acc) in registers, and the warps' states merge once at the end
    (split-in-block); block_n is then one warp's tile (8..64 keys). False: the block-wide kernel.
    bulk: (block-wide kernel) each K and V tile arrives by one sm_90 bulk copy (cp.async.bulk,
    block_n·d·itemsize bytes, issued by thread 0) into unpadded rows, completing its own mbarrier
    that every thread waits on; all STAGES - 1 tiles in flight cost no registers. Needs
    caches whose rows are contiguous and d = head_dim; the launcher falls back to bulk=False.
    """

    head_dim: int  # compiled (padded) head dim, a multiple of 16
    dtype: str
    rows: int
    block_n: int = 64
    stages: int = 3
    warps: int = 4
    warp_split: bool = False
    bulk: bool = False

    # Sizes in 4-byte words. A word holds 2 elements of a 16-bit dtype or 1 float32.
    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def per_word(self) -> int:
        return 4 // ITEMSIZE[self.dtype]

    @property
    def words(self) -> int:
        return self.head_dim // self.per_word

    @property
    def row_words(self) -> int:
        if self.bulk:
            return self.words  # one bulk copy lands the tile's rows back to back (S reads swizzled)
        return self.words + 4  # +16 bytes: rows 4 banks apart, still 16-byte aligned for cp.async

    @property
    def kq(self) -> int:
        """warp_split: lanes per key in S = Q·Kᵀ (32 // block_n for tiles shorter than a warp)."""
        return max(1, 32 // self.block_n)

    @property
    def keys_per_lane(self) -> int:
        """warp_split: keys whose scores one lane holds."""
        return max(1, self.block_n // 32)

    @property
    def split_keys(self) -> int:
        """Keys the whole block consumes per step: the unit of choose_num_splits' minimum split."""
        return self.block_n * (self.warps if self.warp_split else 1)

    @property
    def chunks(self) -> int:
        return self.words // 4  # 16-byte cp.async copies per row

    @property
    def key_steps(self) -> int:
        return self.block_n // (8 * self.warps)  # 8 keys per warp per step of the S phase

    @property
    def s_rows(self) -> int:
        """Rows whose scores one lane accumulates at once (<= 16 registers of partial sums)."""
        return max(1, min(self.rows, 16 // max(self.key_steps, 1)))

    @property
    def col_threads(self) -> int:
        return math.gcd(self.words, 32)  # threads across a V row in the P·V phase

    @property
    def o_words(self) -> int:
        return self.words // self.col_threads

    @property
    def row_groups(self) -> int:
        """Fewest row groups that keep acc within 64 registers per thread."""
        groups = 1
        while self.rows // groups * self.o_words * self.per_word > 64 and groups < self.rows:
            groups *= 2
        return groups

    @property
    def key_groups(self) -> int:
        return max(1, self.threads // self.col_threads // self.row_groups)

    @property
    def o_rows(self) -> int:
        return max(1, self.rows // self.row_groups)

    @property
    def smem_words(self) -> dict:
        pipeline = self.stages * 2 * self.block_n * self.row_words
        if self.warp_split:
            return {
                "q": self.rows * self.head_dim,
                "s": self.warps * self.rows * self.block_n,  # each warp's P, read back 4 keys at a time
                "m": self.warps * self.rows, "l": self.warps * self.rows, "alpha": 0, "limit": 0,
                # one ring per warp; after the last tile each warp's acc (rows x head_dim)
                "kv": self.warps * max(pipeline, self.rows * self.head_dim),
            }
        return {
            "q": self.rows * self.head_dim,
            "s": self.rows * self.block_n,  # S, then P in place
            "m": self.rows, "l": self.rows, "alpha": self.rows, "limit": self.rows,
            # K/V ring; after the last tile it holds the summed acc (rows x head_dim)
            "kv": max(pipeline, self.rows * self.head_dim),
            "bar": 4 * self.stages if self.bulk else 0,  # 8-byte mbarriers, K's and V's per stage
        }

    @property
    def kv_offset(self) -> int:
        w = self.smem_words
        before = w["q"] + w["s"] + w["m"] + w["l"] + w["alpha"] + w["limit"]
        return -(-before // 4) * 4  # 16-byte aligned for cp.async

    @property
    def smem_bytes(self) -> int:
        return 4 * (self.kv_offset + self.smem_words["kv"] + self.smem_words.get("bar", 0))

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM: shared memory, threads, and an assumed <= 128 registers/thread."""
        by_smem = SMEM_PER_SM // (self.smem_bytes + 1024)
        return max(1, min(by_smem, 2048 // self.threads, 65536 // (128 * self.threads), 32))

    @property
    def bytes_in_flight(self) -> int:
        """K/V bytes one block has requested and not yet used, at steady state."""
        per_ring = (self.stages - 1) * 2 * self.block_n * self.head_dim * ITEMSIZE[self.dtype]
        return per_ring * (self.warps if self.warp_split else 1)

    def problems(self) -> list[str]:
        """Why this config cannot run (empty when it can)."""
        out = []
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r} not in {DTYPES}")
            return out
        if self.head_dim % 16 or not 16 <= self.head_dim <= MAX_HEAD_DIM:
            out.append(f"head_dim={self.head_dim}: a multiple of 16 in [16, {MAX_HEAD_DIM}]")
        if self.rows < 1 or self.rows & (self.rows - 1) or self.rows > 128:
            out.append(f"rows={self.rows}: a power of two <= 128")
        if not 1 <= self.warps <= 32:
            out.append(f"warps={self.warps}: 1..32")
        if self.stages < 2:
            out.append(f"stages={self.stages}: at least 2 (one tile used, one in flight)")
        if self.warp_split:
            if self.bulk:
                out.append("bulk: the block-wide kernel only (warp_split=False)")
            return out + self._warp_split_problems()
        if self.block_n % (8 * self.warps) or self.block_n < 8 * self.warps:
            out.append(f"block_n={self.block_n}: a multiple of 8 keys per warp ({8 * self.warps})")
        if self.rows // self.row_groups * self.o_words * self.per_word > 64:
            out.append(f"{self.rows} rows x head_dim {self.head_dim}: acc needs more than 64 registers "
                       f"per thread even split over {self.row_groups} row groups")
        if self.threads % (self.col_threads * self.row_groups):
            out.append(f"{self.threads} threads do not tile {self.col_threads} columns x {self.row_groups} row groups")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            out.append(f"{self.smem_bytes} B shared memory > {SMEM_PER_BLOCK_MAX}")
        return out


    def _warp_split_problems(self) -> list[str]:
        out = []
        if self.block_n not in (8, 16, 32, 64):
            out.append(f"block_n={self.block_n}: one warp's tile is 8, 16, 32 or 64 keys with warp_split")
        elif self.chunks % self.kq:
            out.append(f"block_n={self.block_n}: {self.kq} lanes per key do not share {self.chunks} 16-byte chunks")
        elif self.block_n // (32 // self.col_threads) % 4:
            out.append(f"block_n={self.block_n}: each of {32 // self.col_threads} key-lane groups needs a "
                       f"multiple of 4 keys")
        if self.rows * self.keys_per_lane > 8:
            out.append(f"rows={self.rows} x {self.keys_per_lane} keys per lane: more than 8 scores per lane")
        if self.rows * self.o_words * self.per_word > 64:
            out.append(f"{self.rows} rows x head_dim {self.head_dim}: acc needs more than 64 registers per lane")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            out.append(f"{self.smem_bytes} B shared memory > {SMEM_PER_BLOCK_MAX}")
        return out


def keep(configs):
    """Only the configs that can run."""
    return [c for c in configs if not c.problems()]


ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@lru_cache(maxsize=512)  # a pure function of its arguments, asked on every decode call
def decode_config(d: int, dtype: str, rows_needed: int) -> DecodeConfig:
    """The shipped config for head dim d, dtype and G·Nq rows: rows padded to a power of two,
    capped where acc would not fit in registers (larger groups then take several blocks).

    16-bit caches, d <= 128, 4 to 8 rows (GQA groups): warp_split, 16-key tiles per warp, 3 stages,
    4 warps (H200, fp16 d128 B8 H32 Hkv8 N32768: 2257 GB/s vs 1955 for the block-wide tile at the
    same 4 splits; results/sweep-decode-2026-11-29-warp-split.txt; 8 rows were not timed).
    Otherwise block-wide: 64-key tiles while a K+V tile is <= 34 KiB, else 32 keys; 2 stages for
    rows of <= 256 B (3561 vs 3460 GB/s for 3 at Hkv32, one split, same sweep; 1957 vs 1955 at
    Hkv8), else 3; 4 warps, 8 for >= 64 rows (more row groups keep acc in registers).
    """
    head_dim = head_dim_bucket(d)
    if ITEMSIZE[dtype] == 2 and head_dim <= 128 and 4 <= rows_needed <= 8:
        cfg = DecodeConfig(head_dim, dtype, 4 if rows_needed <= 4 else 8, block_n=16, stages=3, warps=4,
                           warp_split=True)
        if not cfg.problems():
            return cfg
    row_bytes = head_dim * ITEMSIZE[dtype]
    block_n = 64 if row_bytes <= 256 else 32
    stages = 2 if row_bytes <= 256 else 3  # 2 measured at fp16 d = 128 only; larger rows keep 3
    best = None
    for rows in ROWS_BUCKETS:
        warps = 8 if rows >= 64 else 4
        cfg = DecodeConfig(head_dim, dtype, rows, block_n=max(block_n, 8 * warps), stages=stages, warps=warps)
        if cfg.problems():
            break
        best = cfg
        if rows >= rows_needed:
            break
    assert best is not None, f"no decode config for d={d} {dtype}"
    return best


# --------------------------------------------------------------------------------------------
# Kernel factories
# --------------------------------------------------------------------------------------------
def kernel_signature(dtype: str, lens_dtype: str = "int32", mods: bool = False, aux: tuple = ()):
    """q, k, v, seqlens, block_table, cache_batch_idx, cache_leftpad, out, lse, m_part, l_part, acc_part,
    n_q, d, group, scale_log2 (the three index arrays int32, read only under their CacheMode switch); with
    mods (CacheMode.mods) blocks.entry.MOD_ARGS after them: left, right, cap_a, cap_b, slopes, 1 / scale; then the
    user mods' aux arrays (``aux``: CacheMode.aux_types)."""
    qio = types.Array(Q_STORAGE[dtype], 4, "A")
    kv = types.Array(KV_STORAGE[dtype], 4, "A")
    lens = types.Array(getattr(types, lens_dtype), 1, "A")
    table = types.Array(types.int32, 2, "A")
    index = types.Array(types.int32, 1, "A")
    lse = types.Array(types.float32, 3, "A")
    part = types.Array(types.float32, 4, "A")
    acc = types.Array(types.float32, 5, "A")
    return types.void(qio, kv, kv, lens, table, index, index, qio, lse, part, part, acc, int32, int32, int32, float32,
                      *(MOD_ARGS if mods else ()), *aux)


def element_helpers(dtype: str):
    """(q_to_f32, store_out, unpack): q elements to fp32, fp32 to out's storage, a K/V word to fp32."""
    F32, F16, BF16 = dtype == "float32", dtype == "float16", dtype == "bfloat16"
    ZERO = float32(0.0)
    SIXTEEN = uint32(16)
    HIGH = uint32(0xFFFF0000)

    @inline_device
    def q_to_f32(x):
        if BF16:
            return f32_from_bits(uint32(x) << SIXTEEN)
        return float32(x)

    @inline_device
    def store_out(out, b, h, i, e, x):
        if BF16:  # round to nearest even
            bits = bits_from_f32(x)
            bits = bits + uint32(0x7FFF) + ((bits >> SIXTEEN) & uint32(1))
            out[U(b), U(h), U(i), U(e)] = uint16(bits >> SIXTEEN)
        else:
            out[U(b), U(h), U(i), U(e)] = x

    @inline_device
    def unpack(smem_u, smem_f, addr):
        """Word addr of a K/V tile -> (first, second) element as float32 (second = 0 for fp32)."""
        if F32:
            return smem_f[U(addr)], ZERO
        if F16:
            return f16x2_to_f32(smem_u[U(addr)])
        bits = smem_u[U(addr)]
        return f32_from_bits(bits << SIXTEEN), f32_from_bits(bits & HIGH)

    return q_to_f32, store_out, unpack


def block_helpers(dtype: str, ROWS: int, HEAD_DIM: int, THREADS: int, Q_OFF: int, q_swizzle: bool = False,
                  mode: CacheMode = PLAIN):
    """What both split kernels do first: (block_rows, load_q, page_of, row_limit, key_bounds, row_mods, score).

    block_rows(k, seqlens, table, cache_idx, starts, group, n_q) -> (b, bc, h_kv, r0, rows_total,
    length, start): this block's sequence, its cache row bc (cache_batch_idx[b], else b), kv head
    and first row r0 of the G·Nq rows of the group (blockIdx.y = (b·Hkv + h_kv)·chunks + chunk),
    the number of keys and the cache row of the first (cache_leftpad[b], else 0). Device lengths,
    indices and pages are not checked on the host: clamped here into the arrays (no stray reads).
    page_of(k, table, bc, start, j) -> (p, r): key j is k[p, h, r] (a paged cache's page and row,
    else bc and start + j); the keys of one tile share a page when the page size is a multiple of it.
    row_limit(rg, n_q, length, rows_total, right): the last key row rg of the group sees (-1: none).
    key_bounds(n_q, length, left, right) -> (k_lo, first_limit, last_low): the first key any row sees (a
    window's: tiles before it are never loaded), the least row limit (tiles past it need the mask) and the
    greatest window start (tiles before it need the mask).
    row_mods(rg, n_q, length, rows_total, b, h_kv, group, left, slopes, inv_scale) -> (pos, low, slope): row
    rg's key position i + len - Nq, its window start, ALiBi's slope / scale of its head (mods builds).
    score(s, col, limit, low, pos, slope, needs_mask, scale_log2, cap_a, cap_b, b, hq, iq, length, inv_scale, aux): a
    raw q·k of key col -> its base-2 exponent: softcap, ALiBi, the user's score mod (on the scaled logit s /
    inv_scale, its result back in raw units; keys < length only), then the mask (-inf) where needs_mask and where
    the user's mask_mod hides the key (blocks/mods.py's order). hq, iq: row_ids' (user mods only).
    load_q(...) puts rows r0.. of the group's queries into smem_f[Q_OFF..] as fp32, zero past G·Nq
    and past d; row r0 + r = g·Nq + i is query i of head g of the group. q_swizzle (the bulk
    kernel, 16-bit caches): element e of a row is stored at e ^ ((e >> 5) & 1), see kernel_source."""
    q_to_f32 = element_helpers(dtype)[0]
    ZERO = float32(0.0)
    PAGED, BATCH_IDX, LEFTPAD, CAUSAL = mode.paged, mode.batch_idx, mode.leftpad, mode.causal
    WINDOW, SOFTCAP, ALIBI = mode.window, mode.softcap, mode.alibi
    MASK_MOD, SCORE_MOD = mode.user.mask_mod is not None, mode.user.score_mod is not None
    USER_MODS = MASK_MOD or SCORE_MOD
    mask_call = mode.user.mask_mod.device_call() if MASK_MOD else None
    score_call = (mode.user.score_mod.device_call(len(mode.user.mask_mod.aux_types) if MASK_MOD else 0)
                  if SCORE_MOD else None)
    NEG_INF = float32(-math.inf)

    @inline_device
    def block_rows(k, seqlens, table, cache_idx, starts, group, n_q):
        n_kv_heads = k.shape[1]
        n_max = table.shape[1] * k.shape[2] if PAGED else k.shape[2]
        rows_total = group * n_q
        n_chunks = (rows_total + ROWS - 1) // ROWS
        blk = cuda.blockIdx.y
        bh = blk // n_chunks
        r0 = (blk - bh * n_chunks) * ROWS
        b = bh // n_kv_heads
        h_kv = bh - b * n_kv_heads
        length = n_max
        if seqlens.shape[0] > 0:
            length = min(max(seqlens[U(b)], 0), n_max)
        bc = b
        if BATCH_IDX:
            bc = min(max(cache_idx[U(b)], 0), k.shape[0] - 1)
        start = 0
        if LEFTPAD:
            start = min(max(starts[U(b)], 0), length)
            length -= start
        return b, bc, h_kv, r0, rows_total, length, start

    @inline_device
    def page_of(k, table, bc, start, j):
        if PAGED:
            page_rows = k.shape[2]
            pi = j // page_rows
            return min(max(table[U(bc), U(pi)], 0), k.shape[0] - 1), j - pi * page_rows
        return bc, start + j

    @inline_device
    def row_limit(rg, n_q, length, rows_total, right):
        if rg >= rows_total:
            return -1
        if WINDOW:  # right = 0 when causal (blocks/mask.window_bounds); an open side is 2**30
            return min(rg - (rg // n_q) * n_q + length - n_q + right, length - 1)
        if CAUSAL:
            return rg - (rg // n_q) * n_q + length - n_q
        return length - 1

    @inline_device
    def key_bounds(n_q, length, left, right):
        if WINDOW:
            return max(length - n_q - left, 0), min(length - n_q + right, length - 1), length - 1 - left
        return 0, (length - n_q if CAUSAL else length - 1), -1

    @inline_device
    def row_mods(rg, n_q, length, rows_total, b, h_kv, group, left, slopes, inv_scale):
        rg = min(rg, rows_total - 1)  # a padding row takes a real row's values (its scores are never stored)
        g = rg // n_q
        pos = rg - g * n_q + length - n_q
        slope = head_slope(slopes, b, h_kv * group + g, inv_scale) if ALIBI else ZERO
        return pos, pos - left, slope

    @inline_device
    def row_ids(rg, n_q, rows_total, h_kv, group):
        """(query head, q_idx) of row rg, a padding row clamped to the last real one (its scores are never stored)."""
        rg = min(rg, rows_total - 1)
        g = rg // n_q
        return int32(h_kv * group + g), int32(rg - g * n_q)

    @inline_device
    def score(s, col, limit, low, pos, slope, needs_mask, scale_log2, cap_a, cap_b, b, hq, iq, length, inv_scale,
              aux):
        if SOFTCAP:
            s = capped(s, cap_a, cap_b)
        if ALIBI:
            s -= alibi_bias(slope, pos, col, 0)
        hidden = False
        if USER_MODS and col < length:
            c32 = int32(col)
            if SCORE_MOD:
                s = float32(score_call(s / inv_scale, int32(b), hq, iq, c32, aux)) * inv_scale
            if MASK_MOD:
                hidden = not mask_call(int32(b), hq, iq, c32, aux)
        x = s * scale_log2
        if needs_mask:
            if col > limit or (WINDOW and col < low):
                x = NEG_INF
        if hidden:
            x = NEG_INF
        return x

    Q_SWIZZLE = bool(q_swizzle)

    @inline_device
    def load_q(smem_f, q, b, h_kv, r0, rows_total, group, n_q, d):
        for idx in range(cuda.threadIdx.x, ROWS * HEAD_DIM, THREADS):
            r = idx // HEAD_DIM
            e = idx - r * HEAD_DIM
            rg = r0 + r
            x = ZERO
            if rg < rows_total and e < d:
                g = rg // n_q
                x = q_to_f32(q[U(b), U(h_kv * group + g), U(rg - g * n_q), U(e)])
            if Q_SWIZZLE:  # element e at e ^ ((e >> 5) & 1) (the bulk kernel's conflict-free S phase)
                smem_f[U(Q_OFF + r * HEAD_DIM + (e ^ ((e >> 5) & 1)))] = x
            else:
                smem_f[U(Q_OFF + idx)] = x

    return block_rows, load_q, page_of, row_limit, key_bounds, row_mods, score, row_ids


def split_entry(body, mods: bool, n_aux: int = 0):
    """The phase-1 kernel (before cuda.jit) running ``body``: with mods it takes MOD_ARGS after scale_log2 and
    passes them on (then n_aux user aux arrays, which the body gets as one tuple, its last parameter ``aux``);
    without, the body gets constants for them (lse stands in for the slopes), which its pruned branches never
    read."""
    zero = float32(0.0)
    if n_aux:
        aux = [f"aux{i}" for i in range(n_aux)]
        lead = ("q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group, "
                "scale_log2, left, right, cap_a, cap_b, slopes, inv_scale")
        src = (f"def make(body):\n"
               f"    def decode_split({lead}{''.join(', ' + a for a in aux)}):\n"
               f"        body({lead}, ({''.join(a + ', ' for a in aux)}))\n"
               f"    return decode_split\n")
        scope: dict = {}
        exec(compile(src, "<split_entry user>", "exec"), scope)  # one parameter per aux array
        return _at_home(scope["make"](body), globals(), "decode_split")  # this module's globals, as the body's
    if mods:
        def decode_split(q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
                         scale_log2, left, right, cap_a, cap_b, slopes, inv_scale):
            body(q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
                 scale_log2, left, right, cap_a, cap_b, slopes, inv_scale)
        return decode_split

    def decode_split(q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
                     scale_log2):
        body(q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
             scale_log2, 0, 0, zero, zero, lse, zero)
    return decode_split


def kernel_source(cfg: DecodeConfig, vec: bool, split: bool, mode: CacheMode = PLAIN):
    """The phase-1 kernel for one specialisation (before cuda.jit; compile tests use it).

    vec: K/V rows are 16-byte aligned, copied by cp.async (else scalar loads). split: write the
    partial state (m, l, acc) of split blockIdx.x; else (one split) write O and L directly.
    mode: the cache's layout and the mask (CacheMode).
    """
    if cfg.warp_split:
        return warp_split_source(cfg, vec, split, mode)
    HEAD_DIM, ROWS, BLOCK_N, STAGES = cfg.head_dim, cfg.rows, cfg.block_n, cfg.stages
    WARPS, THREADS = cfg.warps, cfg.threads
    F32 = cfg.dtype == "float32"
    EPW = cfg.per_word  # elements per word
    WORDS, ROW_WORDS, CHUNKS = cfg.words, cfg.row_words, cfg.chunks
    CHUNK_ELEMS = 16 // ITEMSIZE[cfg.dtype]
    ITEM = ITEMSIZE[cfg.dtype]
    KEY_STEPS, S_ROWS = cfg.key_steps, cfg.s_rows
    S_CHUNKS = -(-ROWS // S_ROWS)
    QUAD_STEPS = WORDS // 4
    UNROLL = math.gcd(QUAD_STEPS, 4)
    SM_ROWS = -(-ROWS // WARPS)  # softmax rows per warp
    SM_COLS = -(-BLOCK_N // 32)
    COL_THREADS, O_WORDS, ROW_GROUPS, KEY_GROUPS, O_ROWS = (
        cfg.col_threads, cfg.o_words, cfg.row_groups, cfg.key_groups, cfg.o_rows)
    O_ELEMS = O_WORDS * EPW
    KEYS_PER_GROUP = BLOCK_N // KEY_GROUPS
    PV_UNROLL = math.gcd(KEYS_PER_GROUP, 4)
    words = cfg.smem_words
    Q_OFF = 0
    S_OFF = Q_OFF + words["q"]
    M_OFF = S_OFF + words["s"]
    L_OFF = M_OFF + words["m"]
    A_OFF = L_OFF + words["l"]
    LIM_OFF = A_OFF + words["alpha"]
    KV_OFF = cfg.kv_offset
    O_OFF = KV_OFF  # the summed acc reuses the K/V ring once the last tile is done
    TILE_WORDS = BLOCK_N * ROW_WORDS
    STAGE_WORDS = 2 * TILE_WORDS
    TILE_COPIES = -(-BLOCK_N * CHUNKS // THREADS)
    EXACT_COPIES = BLOCK_N * CHUNKS % THREADS == 0
    TILE_LOADS = -(-BLOCK_N * HEAD_DIM // THREADS)
    WAIT_N = STAGES - 2  # cp.async groups allowed in flight when a tile must have landed
    BULK = cfg.bulk  # tiles by cp.async.bulk + mbarrier (then vec is ignored: rows are contiguous)
    VEC, SPLIT = bool(vec) and not BULK, bool(split)
    BAR_OFF = KV_OFF + words["kv"]  # stage st: K's mbarrier at words BAR_OFF + 4·st, V's at + 2
    ROW_BYTES = HEAD_DIM * ITEM
    # Bulk tiles have unpadded rows (a multiple of 32 banks apart), so the S phase swizzles: lane
    # 4·kq + p reads 16-byte chunk c ^ kq' (kq' = kq mod SWZ) at step c, and the 8 keys of a step
    # hit 8 different chunks' banks. For 16-bit caches q[e] is stored at e ^ ((e >> 5) & 1): the
    # two q floats a lane reads per K word then also sit in 32 different banks.
    SWZ = min(8, QUAD_STEPS & -QUAD_STEPS) if BULK else 1
    S_UNROLL = SWZ if BULK else UNROLL
    Q_FLIP = BULK and EPW == 2
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    FULL = ptx.FULL_MASK
    shfl_xor = ptx.shfl_xor_sync
    syncwarp = ptx.syncwarp
    cp_async = ptx.cp_async_16_zfill
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    cp_bulk = ptx.cp_async_bulk
    bar_init = ptx.mbarrier_init
    bar_fence = ptx.fence_mbarrier_init
    bar_expect = ptx.mbarrier_arrive_expect_tx
    bar_try_wait = ptx.mbarrier_try_wait_parity
    exp2, log2 = math.exp2, math.log2

    @inline_device
    def load_tile(smem_u, smem_h, smem_f, src, table, bc, h, start, k0, length, d, dst):
        """K or V keys [k0, k0 + BLOCK_N) into rows of ROW_WORDS words at word offset dst.

        Keys past length and columns past d are zero-filled, so a masked probability (exactly 0)
        never meets stale cache contents (0 * nan would be nan). Each row finds its page itself:
        a tile may span pages smaller than it.
        """
        tid = cuda.threadIdx.x
        if VEC:
            for it in range(TILE_COPIES):
                c = tid + it * THREADS
                if EXACT_COPIES or c < BLOCK_N * CHUNKS:
                    r = c // CHUNKS
                    ch = c - r * CHUNKS
                    row = k0 + r
                    col = ch * CHUNK_ELEMS
                    nbytes = min(max(d - col, 0), CHUNK_ELEMS) * ITEM if row < length else 0
                    pg, pr = page_of(src, table, bc, start, min(row, length - 1))  # a zero-byte copy still names an address
                    src_col = col if nbytes > 0 else 0
                    cp_async(smem_u, dst + r * ROW_WORDS + ch * 4, src[U(pg), U(h), U(pr)], src_col, nbytes)
        else:
            for it in range(TILE_LOADS):
                idx = tid + it * THREADS
                if idx < BLOCK_N * HEAD_DIM:
                    r = idx // HEAD_DIM
                    e = idx - r * HEAD_DIM
                    row = k0 + r
                    ok = row < length and e < d
                    pg, pr = page_of(src, table, bc, start, min(row, length - 1))
                    if F32:
                        smem_f[U(dst + r * ROW_WORDS + e)] = src[U(pg), U(h), U(pr), U(e)] if ok else ZERO
                    else:
                        x = src[U(pg), U(h), U(pr), U(e)] if ok else uint16(0)
                        smem_h[U(2 * (dst + r * ROW_WORDS) + e)] = x

    @inline_device
    def issue_tile(smem_u, kb, vb, start, k0, length, stage):
        """Thread 0: keys [k0, k0 + BLOCK_N) of K and V (only the valid rows; key j at row start + j
        of kb / vb) into stage, each copy completing its own mbarrier (S waits for K only, P·V for V)
        after an arrival expecting its bytes."""
        nbytes = min(BLOCK_N, length - k0) * ROW_BYTES  # a multiple of 16: head_dim is one of 16
        bar = BAR_OFF + 4 * stage
        dst = KV_OFF + stage * STAGE_WORDS
        bar_expect(smem_u, bar, nbytes)
        cp_bulk(smem_u, dst, kb, (start + k0) * HEAD_DIM, nbytes, smem_u, bar)
        bar_expect(smem_u, bar + 2, nbytes)
        cp_bulk(smem_u, dst + TILE_WORDS, vb, (start + k0) * HEAD_DIM, nbytes, smem_u, bar + 2)

    @inline_device
    def zero_tail(smem_u, k0, length, stage):
        """All threads: rows past length of a ragged last tile are zeroed (the bulk copy skips
        them), so a masked probability (exactly 0) never meets stale or uninitialised bits (0 * nan
        would be nan). No later bulk copy writes this stage: the ragged tile is the last one."""
        valid = min(BLOCK_N, length - k0)
        if valid < BLOCK_N:
            dst = KV_OFF + stage * STAGE_WORDS
            for idx in range(valid * WORDS + cuda.threadIdx.x, BLOCK_N * WORDS, THREADS):
                smem_u[U(dst + idx)] = uint32(0)
                smem_u[U(dst + TILE_WORDS + idx)] = uint32(0)

    @inline_device
    def wait_tile(smem_u, bar, parity):
        """Until phase `parity` of the mbarrier at word bar is over (its bytes have landed)."""
        while bar_try_wait(smem_u, bar, parity) == 0:
            pass

    q_to_f32, store_out, unpack = element_helpers(cfg.dtype)
    block_rows, load_q, page_of, row_limit, key_bounds, row_mods, score, row_ids = block_helpers(
        cfg.dtype, ROWS, HEAD_DIM, THREADS, Q_OFF, q_swizzle=Q_FLIP, mode=mode)
    WINDOW, ROW_MODS, USER = mode.window, mode.window or mode.alibi, mode.user.user

    @inline_device
    def decode_body(q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
                    scale_log2, left, right, cap_a, cap_b, slopes, inv_scale, aux=()):
        smem_f = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)
        smem_u = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)  # same bytes, as bits
        smem_h = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)  # same bytes, as 16-bit words
        smem_i = cuda.shared.array(0, int32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        split_id = cuda.blockIdx.x
        n_splits = cuda.gridDim.x
        b, bc, h_kv, r0, rows_total, length, start = block_rows(k, seqlens, table, cache_idx, starts, group, n_q)

        # Q (fp32); per-row state and visibility limit: row r0 + r = g·Nq + i sees keys <= i + len - Nq.
        load_q(smem_f, q, b, h_kv, r0, rows_total, group, n_q, d)
        for r in range(tid, ROWS, THREADS):
            rg = r0 + r
            smem_f[U(M_OFF + r)] = NEG_INF
            smem_f[U(L_OFF + r)] = ZERO
            smem_i[U(LIM_OFF + r)] = row_limit(rg, n_q, length, rows_total, right)

        # This split's tiles, from the first any row sees: ceil(tiles / n_splits) each; trailing splits may be empty.
        k_lo, first_limit, last_low = key_bounds(n_q, length, left, right)
        t_lo = k_lo // BLOCK_N
        n_tiles = (length + BLOCK_N - 1) // BLOCK_N
        per_split = (n_tiles - t_lo + n_splits - 1) // n_splits
        t_begin = min(t_lo + split_id * per_split, n_tiles)
        t_end = min(t_begin + per_split, n_tiles)

        # S phase: lane 4·kq + p, keys key_base + 8·ks + kq, words p + 4·jw.
        kq = lane >> 2
        p = lane & 3
        key_base = warp * (8 * KEY_STEPS)
        s_acc = cuda.local.array((S_ROWS, KEY_STEPS), float32)
        k_val = cuda.local.array((KEY_STEPS, 2), float32)
        # P·V phase: thread = (key group kg, row group rg, column c); rows rg + i·ROW_GROUPS.
        c = tid % COL_THREADS
        rest = tid // COL_THREADS
        row_group = rest % ROW_GROUPS
        kg = rest // ROW_GROUPS
        acc = cuda.local.array((O_ROWS, O_ELEMS), float32)
        v_val = cuda.local.array(O_ELEMS, float32)
        for i in range(O_ROWS):
            for x in range(O_ELEMS):
                acc[i, x] = ZERO

        sw = kq & (SWZ - 1)  # 0 without bulk
        if BULK:
            kb = k[U(bc), U(h_kv)]  # (Nmax, head_dim) rows of this kv head, back to back (never paged)
            vb = v[U(bc), U(h_kv)]
            if tid == 0:
                for st in range(2 * STAGES):
                    bar_init(smem_u, BAR_OFF + 2 * st, 1)  # one arrival (thread 0's) per phase
                bar_fence()
            cuda.syncthreads()  # the barriers are initialised before anyone waits on them

        # Prologue: the first STAGES - 1 tiles in flight (one commit group each, maybe empty).
        for st in range(STAGES - 1):
            if t_begin + st < t_end:
                k0 = (t_begin + st) * BLOCK_N
                if BULK:
                    if tid == 0:
                        issue_tile(smem_u, kb, vb, start, k0, length, st)
                    zero_tail(smem_u, k0, length, st)
                else:
                    dst = KV_OFF + st * STAGE_WORDS
                    load_tile(smem_u, smem_h, smem_f, k, table, bc, h_kv, start, k0, length, d, dst)
                    load_tile(smem_u, smem_h, smem_f, v, table, bc, h_kv, start, k0, length, d, dst + TILE_WORDS)
            if VEC:
                cp_commit()

        for t in range(t_begin, t_end):
            j = t - t_begin
            if VEC:
                cp_wait(WAIT_N)  # this thread's copies of tile t have landed
            cuda.syncthreads()  # everyone's have; and everyone is done with tile t - 1
            nxt = t + STAGES - 1
            if nxt < t_end:  # refill the stage that tile t - 1 used
                if BULK:
                    if tid == 0:
                        issue_tile(smem_u, kb, vb, start, nxt * BLOCK_N, length, (j + STAGES - 1) % STAGES)
                    zero_tail(smem_u, nxt * BLOCK_N, length, (j + STAGES - 1) % STAGES)
                else:
                    dst = KV_OFF + ((j + STAGES - 1) % STAGES) * STAGE_WORDS
                    load_tile(smem_u, smem_h, smem_f, k, table, bc, h_kv, start, nxt * BLOCK_N, length, d, dst)
                    load_tile(smem_u, smem_h, smem_f, v, table, bc, h_kv, start, nxt * BLOCK_N, length, d,
                              dst + TILE_WORDS)
            if VEC:
                cp_commit()  # always, so that WAIT_N counts tiles
            if BULK:  # tile t's K has landed: phase j // STAGES of its stage's K barrier is over
                wait_tile(smem_u, BAR_OFF + 4 * (j % STAGES), (j // STAGES) & 1)
            k0 = t * BLOCK_N
            k_off = KV_OFF + (j % STAGES) * STAGE_WORDS
            v_off = k_off + TILE_WORDS
            needs_mask = k0 + BLOCK_N - 1 > first_limit
            if WINDOW:
                needs_mask = needs_mask or k0 < last_low

            # S = Q Kᵀ · scale·log2(e), modded and masked to -inf, into shared memory.
            k_lane = k_off + (key_base + kq) * ROW_WORDS + p
            for rc in range(S_CHUNKS):
                for i in range(S_ROWS):
                    for ks in range(KEY_STEPS):
                        s_acc[i, ks] = ZERO
                q_lane = Q_OFF + rc * S_ROWS * HEAD_DIM + EPW * p
                for j0 in range(0, QUAD_STEPS, S_UNROLL):
                    for u in range(S_UNROLL):  # constant trip count: unrolled, addresses become offsets
                        cu = u ^ sw  # the swizzled chunk (bulk: sw = kq mod SWZ; else 0)
                        w4 = 4 * (j0 + cu)
                        for ks in range(KEY_STEPS):
                            k_val[ks, 0], k_val[ks, 1] = unpack(smem_u, smem_f, k_lane + 8 * ks * ROW_WORDS + w4)
                        for i in range(S_ROWS):
                            q_addr = q_lane + i * HEAD_DIM + EPW * w4
                            if Q_FLIP:  # q stored at e ^ ((e >> 5) & 1), e = 2p + 8 (j0 + cu)
                                flip = ((j0 + cu) >> 2) & 1
                                q_lo = smem_f[U(q_addr + flip)]
                                q_hi = smem_f[U(q_addr + 1 - flip)]
                            else:
                                q_lo = smem_f[U(q_addr)]
                                q_hi = smem_f[U(q_addr + 1)] if EPW == 2 else ZERO
                            for ks in range(KEY_STEPS):
                                s_acc[i, ks] = cuda.fma(q_lo, k_val[ks, 0], s_acc[i, ks])
                                if EPW == 2:
                                    s_acc[i, ks] = cuda.fma(q_hi, k_val[ks, 1], s_acc[i, ks])
                for i in range(S_ROWS):
                    for ks in range(KEY_STEPS):
                        x = s_acc[i, ks]
                        x += shfl_xor(FULL, x, 1)
                        x += shfl_xor(FULL, x, 2)
                        s_acc[i, ks] = x
                for i in range(S_ROWS):
                    r = rc * S_ROWS + i
                    if (i & 3) == p and r < ROWS:  # the quad shares the stores
                        limit = smem_i[U(LIM_OFF + r)] if needs_mask else 0
                        pos, low, slope = 0, 0, ZERO
                        if ROW_MODS:
                            pos, low, slope = row_mods(r0 + r, n_q, length, rows_total, b, h_kv, group, left, slopes,
                                                       inv_scale)
                        hq, iq = int32(0), int32(0)
                        if USER:
                            hq, iq = row_ids(r0 + r, n_q, rows_total, h_kv, group)
                        for ks in range(KEY_STEPS):
                            n = key_base + 8 * ks + kq
                            x = score(s_acc[i, ks], k0 + n, limit, low, pos, slope, needs_mask, scale_log2, cap_a,
                                      cap_b, b, hq, iq, length, inv_scale, aux)
                            smem_f[U(S_OFF + r * BLOCK_N + n)] = x
            cuda.syncthreads()

            # Online softmax, one warp per row: m_i, l_i, alpha in shared memory; P over S.
            for si in range(SM_ROWS):
                r = warp + si * WARPS
                if r < ROWS:  # the same for the whole warp, so the shuffles stay converged
                    m_old = smem_f[U(M_OFF + r)]
                    m_tile = NEG_INF
                    for cc in range(SM_COLS):
                        n = lane + 32 * cc
                        if n < BLOCK_N:
                            m_tile = max(m_tile, smem_f[U(S_OFF + r * BLOCK_N + n)])
                    for sh in range(5):
                        m_tile = max(m_tile, shfl_xor(FULL, m_tile, 16 >> sh))
                    m_new = max(m_old, m_tile)
                    # Nothing visible yet: m stays -inf; subtract 0 so exp2 gives 0, not nan.
                    m_use = ZERO if m_new == NEG_INF else m_new
                    alpha = exp2(m_old - m_use)
                    row_sum = ZERO
                    for cc in range(SM_COLS):
                        n = lane + 32 * cc
                        if n < BLOCK_N:
                            pr = exp2(smem_f[U(S_OFF + r * BLOCK_N + n)] - m_use)
                            smem_f[U(S_OFF + r * BLOCK_N + n)] = pr
                            row_sum += pr
                    for sh in range(5):
                        row_sum += shfl_xor(FULL, row_sum, 16 >> sh)
                    syncwarp()  # every lane has read m_old before lane 0 overwrites it (racecheck)
                    if lane == 0:
                        smem_f[U(L_OFF + r)] = alpha * smem_f[U(L_OFF + r)] + row_sum
                        smem_f[U(M_OFF + r)] = m_new
                        smem_f[U(A_OFF + r)] = alpha
            cuda.syncthreads()

            # acc = alpha · acc + P V over this thread's key group.
            if BULK:  # tile t's V has landed
                wait_tile(smem_u, BAR_OFF + 4 * (j % STAGES) + 2, (j // STAGES) & 1)
            for i in range(O_ROWS):
                alpha = smem_f[U(A_OFF + row_group + i * ROW_GROUPS)]
                for x in range(O_ELEMS):
                    acc[i, x] *= alpha
            v_lane = v_off + kg * ROW_WORDS + c
            p_lane = S_OFF + row_group * BLOCK_N + kg
            for t0 in range(0, KEYS_PER_GROUP, PV_UNROLL):
                for u in range(PV_UNROLL):
                    n = (t0 + u) * KEY_GROUPS  # key kg + n of the tile
                    for ow in range(O_WORDS):
                        lo, hi = unpack(smem_u, smem_f, v_lane + n * ROW_WORDS + ow * COL_THREADS)
                        v_val[ow * EPW] = lo
                        if EPW == 2:
                            v_val[ow * EPW + 1] = hi
                    for i in range(O_ROWS):
                        pr = smem_f[U(p_lane + i * ROW_GROUPS * BLOCK_N + n)]
                        for x in range(O_ELEMS):
                            acc[i, x] = cuda.fma(pr, v_val[x], acc[i, x])

        if VEC:
            cp_wait(0)  # nothing may be in flight when the ring is reused or the block exits
        cuda.syncthreads()  # (bulk: every issued tile was waited on, so nothing is in flight)

        # Sum the key groups' acc into shared memory, one group at a time (a fixed order).
        for pass_kg in range(KEY_GROUPS):
            if kg == pass_kg:
                for i in range(O_ROWS):
                    row_off = O_OFF + (row_group + i * ROW_GROUPS) * HEAD_DIM
                    for ow in range(O_WORDS):
                        for e in range(EPW):
                            addr = U(row_off + (c + ow * COL_THREADS) * EPW + e)
                            if pass_kg == 0:
                                smem_f[addr] = acc[i, ow * EPW + e]
                            else:
                                smem_f[addr] += acc[i, ow * EPW + e]
            cuda.syncthreads()

        # Write this block's rows: the partial state, or (one split) O = acc / l and L.
        n_rows = min(ROWS, rows_total - r0)
        for idx in range(tid, n_rows * d, THREADS):
            r = idx // d
            e = idx - r * d
            rg = r0 + r
            g = rg // n_q
            i = rg - g * n_q
            h = h_kv * group + g
            a = smem_f[U(O_OFF + r * HEAD_DIM + e)]
            l_row = smem_f[U(L_OFF + r)]
            if SPLIT:
                acc_part[U(b), U(h), U(i), U(split_id), U(e)] = a
                if e == 0:
                    m_part[U(b), U(h), U(i), U(split_id)] = smem_f[U(M_OFF + r)]
                    l_part[U(b), U(h), U(i), U(split_id)] = l_row
            else:
                # A row that sees no key (l = 0) is defined as O = 0, L = -inf.
                store_out(out, b, h, i, e, a / l_row if l_row != ZERO else ZERO)
                if e == 0:
                    lse[U(b), U(h), U(i)] = (
                        (smem_f[U(M_OFF + r)] + log2(l_row)) * float32(LN2) if l_row != ZERO else NEG_INF)

    return split_entry(decode_body, mode.mods, len(mode.aux_types))


def warp_split_source(cfg: DecodeConfig, vec: bool, split: bool, mode: CacheMode = PLAIN):
    """The split-in-block phase-1 kernel (cfg.warp_split): same signature and outputs as kernel_source.

    Warp w streams tiles t_begin + w, t_begin + w + WARPS, ... of the block's split through its own
    STAGES-deep cp.async ring; cp.async.wait_group + __syncwarp order its tiles, so no block barrier
    runs inside the key loop. m_i, l_i (a lane's share) and acc live in registers; the warps'
    states merge once at the end with the same logsumexp combine as the merge kernel.
    """
    HEAD_DIM, ROWS, BLOCK_N, STAGES = cfg.head_dim, cfg.rows, cfg.block_n, cfg.stages
    WARPS, THREADS = cfg.warps, cfg.threads
    F32, BF16 = cfg.dtype == "float32", cfg.dtype == "bfloat16"
    EPW = cfg.per_word  # elements per word
    ROW_WORDS, CHUNKS = cfg.row_words, cfg.chunks
    CHUNK_ELEMS = 16 // ITEMSIZE[cfg.dtype]
    ITEM = ITEMSIZE[cfg.dtype]
    KQ, KPL = cfg.kq, cfg.keys_per_lane  # lanes per key, keys per lane (S phase)
    LOG_KQ = KQ.bit_length() - 1
    KEYS_PER_PASS = 32 // KQ  # keys one pass of the warp's lanes covers
    LOG_KEYS = KEYS_PER_PASS.bit_length() - 1
    LANE_CHUNKS = CHUNKS // KQ  # 16-byte chunks of a key row one lane multiplies
    QPC = 4 * EPW  # q elements per chunk: one LDS.128 of q per 4 of them
    COL_THREADS, O_WORDS = cfg.col_threads, cfg.o_words
    LOG_COL = COL_THREADS.bit_length() - 1
    O_ELEMS = O_WORDS * EPW
    KPG = BLOCK_N // (32 // COL_THREADS)  # P·V keys per key-lane group
    TILE_WORDS = BLOCK_N * ROW_WORDS
    STAGE_WORDS = 2 * TILE_WORDS
    words = cfg.smem_words
    RING_WORDS = words["kv"] // WARPS
    Q_OFF = 0
    P_OFF = Q_OFF + words["q"]
    M_OFF = P_OFF + words["s"]
    L_OFF = M_OFF + words["m"]
    KV_OFF = cfg.kv_offset
    WARP_COPIES = -(-BLOCK_N * CHUNKS // 32)
    EXACT_COPIES = BLOCK_N * CHUNKS % 32 == 0
    WARP_LOADS = -(-BLOCK_N * HEAD_DIM // 32)
    LANE_FIXED_CHUNK = 32 % CHUNKS == 0 and EXACT_COPIES  # each lane copies one chunk column
    ROWS_PER_PASS = max(1, 32 // CHUNKS)
    WAIT_N = STAGES - 2
    VEC, SPLIT = bool(vec), bool(split)
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    SIXTEEN = uint32(16)
    HIGH = uint32(0xFFFF0000)
    FULL = ptx.FULL_MASK
    shfl_xor = ptx.shfl_xor_sync
    syncwarp = ptx.syncwarp
    cp_async = ptx.cp_async_16_zfill
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    ld4 = ptx.ld_shared_f32x4
    exp2, log2 = math.exp2, math.log2
    q_to_f32, store_out, unpack = element_helpers(cfg.dtype)
    block_rows, load_q, page_of, row_limit, key_bounds, row_mods, score, row_ids = block_helpers(
        cfg.dtype, ROWS, HEAD_DIM, THREADS, Q_OFF, mode=mode)
    WINDOW, ROW_MODS, USER = mode.window, mode.window or mode.alibi, mode.user.user

    @inline_device
    def unpack_bits(bits):
        """A K word (its 32 bits) -> (first, second) element as float32 (second = 0 for fp32)."""
        if F32:
            return f32_from_bits(bits), ZERO
        if BF16:
            return f32_from_bits(bits << SIXTEEN), f32_from_bits(bits & HIGH)
        return f16x2_to_f32(bits)

    @inline_device
    def load_tile(smem_u, smem_h, smem_f, src, row_elems, row0, k0, length, d, dst, lane):
        """One warp: keys [k0, k0 + BLOCK_N) of src (rows of one (cache row or page, kv head); key k0 at
        row row0) to dst; zero past length / d.

        A full tile (the common case) skips the per-copy bounds: a lane's chunk column is fixed, its
        rows step by 32 / CHUNKS, so a copy costs one add to a flat element offset.
        """
        if VEC:
            if LANE_FIXED_CHUNK and k0 + BLOCK_N <= length:
                ch = lane % CHUNKS
                col = ch * CHUNK_ELEMS
                nbytes = min(max(d - col, 0), CHUNK_ELEMS) * ITEM
                off = (row0 + lane // CHUNKS) * row_elems + (col if nbytes > 0 else 0)
                step = ROWS_PER_PASS * row_elems
                s_dst = dst + (lane // CHUNKS) * ROW_WORDS + ch * 4
                for it in range(WARP_COPIES):
                    cp_async(smem_u, s_dst + it * ROWS_PER_PASS * ROW_WORDS, src, off, nbytes)
                    off += step
                return
            for it in range(WARP_COPIES):
                c = lane + 32 * it
                if EXACT_COPIES or c < BLOCK_N * CHUNKS:
                    r = c // CHUNKS
                    ch = c - r * CHUNKS
                    row = k0 + r
                    col = ch * CHUNK_ELEMS
                    nbytes = min(max(d - col, 0), CHUNK_ELEMS) * ITEM if row < length else 0
                    src_row = row0 + min(row, length - 1) - k0  # a zero-byte copy still names an address
                    src_col = col if nbytes > 0 else 0
                    cp_async(smem_u, dst + r * ROW_WORDS + ch * 4, src, src_row * row_elems + src_col, nbytes)
        else:
            for it in range(WARP_LOADS):
                idx = lane + 32 * it
                if idx < BLOCK_N * HEAD_DIM:
                    r = idx // HEAD_DIM
                    e = idx - r * HEAD_DIM
                    row = k0 + r
                    ok = row < length and e < d
                    if F32:
                        smem_f[U(dst + r * ROW_WORDS + e)] = src[U(row0 + r), U(e)] if ok else ZERO
                    else:
                        x = src[U(row0 + r), U(e)] if ok else uint16(0)
                        smem_h[U(2 * (dst + r * ROW_WORDS) + e)] = x

    @inline_device
    def decode_body(q, k, v, seqlens, table, cache_idx, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
                    scale_log2, left, right, cap_a, cap_b, slopes, inv_scale, aux=()):
        smem_f = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)
        smem_u = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)  # same bytes, as bits
        smem_h = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)  # same bytes, as 16-bit words
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        split_id = cuda.blockIdx.x
        n_splits = cuda.gridDim.x
        b, bc, h_kv, r0, rows_total, length, start = block_rows(k, seqlens, table, cache_idx, starts, group, n_q)

        load_q(smem_f, q, b, h_kv, r0, rows_total, group, n_q, d)  # read by every warp
        cuda.syncthreads()  # the only barrier before the merge

        # Row r = query i of head g (r0 + r = g·Nq + i) sees keys <= i + len - Nq; padding rows none.
        limit = cuda.local.array(ROWS, int32)
        low = cuda.local.array(ROWS, int32)  # with mods: each row's window start, key position, ALiBi slope
        pos = cuda.local.array(ROWS, int32)
        slope = cuda.local.array(ROWS, float32)
        hq = cuda.local.array(ROWS, int32)  # with user mods: each row's query head and q_idx
        iq = cuda.local.array(ROWS, int32)
        for i in range(ROWS):
            rg = r0 + i
            limit[i] = row_limit(rg, n_q, length, rows_total, right)
            if ROW_MODS:
                pos[i], low[i], slope[i] = row_mods(rg, n_q, length, rows_total, b, h_kv, group, left, slopes,
                                                    inv_scale)
            if USER:
                hq[i], iq[i] = row_ids(rg, n_q, rows_total, h_kv, group)
        k_lo, first_limit, last_low = key_bounds(n_q, length, left, right)
        t_lo = k_lo // BLOCK_N  # tiles before it are left of every row's window (never loaded)
        n_tiles = (length + BLOCK_N - 1) // BLOCK_N
        per_split = (n_tiles - t_lo + n_splits - 1) // n_splits
        t_begin = min(t_lo + split_id * per_split, n_tiles)
        t_end = min(t_begin + per_split, n_tiles)
        n_mine = (t_end - t_begin - warp + WARPS - 1) // WARPS if t_end - t_begin > warp else 0
        k_row = k.strides[2] // ITEM  # row stride in elements (a multiple of 16 bytes on the cp.async path)
        v_row = v.strides[2] // ITEM
        ring = KV_OFF + warp * RING_WORDS
        p_base = P_OFF + warp * ROWS * BLOCK_N
        # S phase: keys key_lane + KEYS_PER_PASS·kk, chunks part + KQ·jc. The 8 lanes of an LDS.128
        # phase read 8 different keys' rows (4 banks apart), so the reads are conflict-free.
        part = lane // KEYS_PER_PASS
        key_lane = lane - part * KEYS_PER_PASS
        c = lane % COL_THREADS  # P·V phase: word columns c + COL_THREADS·ow, keys kg·KPG + n
        kg = lane // COL_THREADS

        # Online softmax state (m, ℓ, O of 3.6.4): m_i is the warp's, l_i this lane's share of ℓ.
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        acc = cuda.local.array((ROWS, O_ELEMS), float32)
        s_lo = cuda.local.array((ROWS, KPL), float32)  # two FMA chains per score: half the latency
        s_hi = cuda.local.array((ROWS, KPL), float32)
        kx = cuda.local.array((KPL, QPC), float32)
        p4 = cuda.local.array((ROWS, 4), float32)
        v_val = cuda.local.array(O_ELEMS, float32)
        for i in range(ROWS):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for x in range(O_ELEMS):
                acc[i, x] = ZERO

        for st in range(STAGES - 1):  # prologue: this warp's first STAGES - 1 tiles in flight
            if st < n_mine:
                k0 = (t_begin + warp + st * WARPS) * BLOCK_N
                dst = ring + st * STAGE_WORDS
                pg, row0 = page_of(k, table, bc, start, k0)  # the tile's page (a paged cache) and first row
                load_tile(smem_u, smem_h, smem_f, k[U(pg), U(h_kv)], k_row, row0, k0, length, d, dst, lane)
                load_tile(smem_u, smem_h, smem_f, v[U(pg), U(h_kv)], v_row, row0, k0, length, d, dst + TILE_WORDS,
                          lane)
            if VEC:
                cp_commit()

        for j in range(n_mine):
            if VEC:
                cp_wait(WAIT_N)  # this lane's copies of tile j have landed
            syncwarp()  # every lane's have; and every lane is done with tile j - 1 and its P
            if j + STAGES - 1 < n_mine:  # refill the stage that tile j - 1 used
                k0 = (t_begin + warp + (j + STAGES - 1) * WARPS) * BLOCK_N
                dst = ring + ((j + STAGES - 1) % STAGES) * STAGE_WORDS
                pg, row0 = page_of(k, table, bc, start, k0)
                load_tile(smem_u, smem_h, smem_f, k[U(pg), U(h_kv)], k_row, row0, k0, length, d, dst, lane)
                load_tile(smem_u, smem_h, smem_f, v[U(pg), U(h_kv)], v_row, row0, k0, length, d, dst + TILE_WORDS,
                          lane)
            if VEC:
                cp_commit()  # always, so that WAIT_N counts tiles
            k0 = (t_begin + warp + j * WARPS) * BLOCK_N
            k_off = ring + (j % STAGES) * STAGE_WORDS
            v_off = k_off + TILE_WORDS
            needs_mask = k0 + BLOCK_N - 1 > first_limit
            if WINDOW:
                needs_mask = needs_mask or k0 < last_low

            # S = Q Kᵀ: 16 bytes of a K row per LDS.128, q broadcast from shared memory.
            for i in range(ROWS):
                for kk in range(KPL):
                    s_lo[i, kk] = ZERO
                    s_hi[i, kk] = ZERO
            for jc in range(LANE_CHUNKS):
                ch = part + KQ * jc
                for kk in range(KPL):
                    w0, w1, w2, w3 = ld_shared_u32x4(smem_u, k_off + (key_lane + KEYS_PER_PASS * kk) * ROW_WORDS + 4 * ch)
                    lo0, hi0 = unpack_bits(w0)
                    lo1, hi1 = unpack_bits(w1)
                    lo2, hi2 = unpack_bits(w2)
                    lo3, hi3 = unpack_bits(w3)
                    if EPW == 2:
                        kx[kk, 0], kx[kk, 1], kx[kk, 2], kx[kk, 3] = lo0, hi0, lo1, hi1
                        kx[kk, 4], kx[kk, 5], kx[kk, 6], kx[kk, 7] = lo2, hi2, lo3, hi3
                    else:
                        kx[kk, 0], kx[kk, 1], kx[kk, 2], kx[kk, 3] = lo0, lo1, lo2, lo3
                for i in range(ROWS):
                    q_addr = Q_OFF + i * HEAD_DIM + ch * QPC
                    for qv in range(EPW):
                        q0, q1, q2, q3 = ld4(smem_f, q_addr + 4 * qv)
                        for kk in range(KPL):
                            s_lo[i, kk] = cuda.fma(q0, kx[kk, 4 * qv], s_lo[i, kk])
                            s_hi[i, kk] = cuda.fma(q1, kx[kk, 4 * qv + 1], s_hi[i, kk])
                            s_lo[i, kk] = cuda.fma(q2, kx[kk, 4 * qv + 2], s_lo[i, kk])
                            s_hi[i, kk] = cuda.fma(q3, kx[kk, 4 * qv + 3], s_hi[i, kk])

            # Online softmax in registers: KQ lanes finish a score, the warp's maximum by shuffles.
            for i in range(ROWS):
                m_tile = NEG_INF
                for kk in range(KPL):
                    x = s_lo[i, kk] + s_hi[i, kk]
                    for sh in range(LOG_KQ):
                        x += shfl_xor(FULL, x, KEYS_PER_PASS << sh)
                    x = score(x, k0 + key_lane + KEYS_PER_PASS * kk, limit[i], low[i], pos[i], slope[i], needs_mask,
                              scale_log2, cap_a, cap_b, b, hq[i], iq[i], length, inv_scale, aux)
                    s_lo[i, kk] = x
                    m_tile = max(m_tile, x)
                for sh in range(LOG_KEYS):
                    m_tile = max(m_tile, shfl_xor(FULL, m_tile, 1 << sh))
                m_new = max(m_i[i], m_tile)
                m_use = ZERO if m_new == NEG_INF else m_new  # nothing visible yet: exp2 gives 0, not nan
                alpha = exp2(m_i[i] - m_use)
                m_i[i] = m_new
                row_sum = ZERO
                for kk in range(KPL):
                    pr = exp2(s_lo[i, kk] - m_use)
                    row_sum += pr
                    if part == 0:
                        smem_f[U(p_base + i * BLOCK_N + key_lane + KEYS_PER_PASS * kk)] = pr
                l_i[i] = alpha * l_i[i] + row_sum  # lanes are summed once, after the loop
                for x in range(O_ELEMS):
                    acc[i, x] *= alpha
            syncwarp()  # P visible to the warp

            # acc += P V over this lane's key group, 4 probabilities per LDS.128.
            v_lane = v_off + kg * KPG * ROW_WORDS + c
            p_lane = p_base + kg * KPG
            for n4 in range(0, KPG, 4):
                for i in range(ROWS):
                    p4[i, 0], p4[i, 1], p4[i, 2], p4[i, 3] = ld4(smem_f, p_lane + i * BLOCK_N + n4)
                for u in range(4):
                    for ow in range(O_WORDS):
                        lo, hi = unpack(smem_u, smem_f, v_lane + (n4 + u) * ROW_WORDS + ow * COL_THREADS)
                        v_val[ow * EPW] = lo
                        if EPW == 2:
                            v_val[ow * EPW + 1] = hi
                    for i in range(ROWS):
                        pr = p4[i, u]
                        for x in range(O_ELEMS):
                            acc[i, x] = cuda.fma(pr, v_val[x], acc[i, x])

        if VEC:
            cp_wait(0)  # nothing may be in flight when the ring is reused or the block exits
        # The warp's state: l over the lanes of distinct keys, acc over the key-lane groups.
        for i in range(ROWS):
            x = l_i[i]
            for sh in range(LOG_KEYS):
                x += shfl_xor(FULL, x, 1 << sh)
            l_i[i] = x
            for e in range(O_ELEMS):
                a = acc[i, e]
                for sh in range(LOG_COL, 5):
                    a += shfl_xor(FULL, a, 1 << sh)
                acc[i, e] = a
        syncwarp()  # every lane is done with the ring before it holds the warp's acc
        if kg == 0:
            for i in range(ROWS):
                for ow in range(O_WORDS):
                    for e in range(EPW):
                        smem_f[U(ring + i * HEAD_DIM + (c + ow * COL_THREADS) * EPW + e)] = acc[i, ow * EPW + e]
        if lane == 0:
            for i in range(ROWS):
                smem_f[U(M_OFF + warp * ROWS + i)] = m_i[i]
                smem_f[U(L_OFF + warp * ROWS + i)] = l_i[i]
        cuda.syncthreads()

        # Merge the warps (logsumexp combine, a fixed order) and write the block's rows.
        n_rows = min(ROWS, rows_total - r0)
        for idx in range(tid, n_rows * d, THREADS):
            r = idx // d
            e = idx - r * d
            rg = r0 + r
            g = rg // n_q
            i = rg - g * n_q
            h = h_kv * group + g
            m = NEG_INF
            for w in range(WARPS):
                m = max(m, smem_f[U(M_OFF + w * ROWS + r)])
            m_use = ZERO if m == NEG_INF else m
            l_row = ZERO
            a = ZERO
            for w in range(WARPS):
                weight = exp2(smem_f[U(M_OFF + w * ROWS + r)] - m_use)
                l_row = cuda.fma(weight, smem_f[U(L_OFF + w * ROWS + r)], l_row)
                a = cuda.fma(weight, smem_f[U(KV_OFF + w * RING_WORDS + r * HEAD_DIM + e)], a)
            if SPLIT:
                acc_part[U(b), U(h), U(i), U(split_id), U(e)] = a
                if e == 0:
                    m_part[U(b), U(h), U(i), U(split_id)] = m
                    l_part[U(b), U(h), U(i), U(split_id)] = l_row
            else:
                # A row that sees no key (l = 0) is defined as O = 0, L = -inf.
                store_out(out, b, h, i, e, a / l_row if l_row != ZERO else ZERO)
                if e == 0:
                    lse[U(b), U(h), U(i)] = (m + log2(l_row)) * float32(LN2) if l_row != ZERO else NEG_INF

    return split_entry(decode_body, mode.mods, len(mode.aux_types))


def merge_signature(dtype: str):
    """m_part, l_part, acc_part, out, lse."""
    part = types.Array(types.float32, 4, "A")
    return types.void(part, part, types.Array(types.float32, 5, "A"),
                      types.Array(Q_STORAGE[dtype], 4, "A"), types.Array(types.float32, 3, "A"))


def merge_source(dtype: str):
    """Phase 2: one block per (b, h, query) row combines the splits' (m, l, acc)."""
    BF16 = dtype == "bfloat16"
    THREADS = MERGE_THREADS
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    SIXTEEN = uint32(16)

    def decode_merge(m_part, l_part, acc_part, out, lse):
        weight = cuda.shared.array(0, float32)  # w_s = exp2(m_s - m), one per split
        tid = cuda.threadIdx.x
        n_heads, n_q, d = out.shape[1], out.shape[2], out.shape[3]
        n_splits = m_part.shape[3]
        row = cuda.blockIdx.x
        b = row // (n_heads * n_q)
        rest = row - b * n_heads * n_q
        h = rest // n_q
        i = rest - h * n_q
        m = NEG_INF
        for s in range(n_splits):
            m = max(m, m_part[U(b), U(h), U(i), U(s)])
        m_use = ZERO if m == NEG_INF else m  # no split saw a key: every weight is 0, not nan
        for s in range(tid, n_splits, THREADS):
            weight[U(s)] = math.exp2(m_part[U(b), U(h), U(i), U(s)] - m_use)
        cuda.syncthreads()
        l_row = ZERO
        for s in range(n_splits):
            l_row = cuda.fma(weight[U(s)], l_part[U(b), U(h), U(i), U(s)], l_row)
        inv_l = float32(1.0) / l_row if l_row != ZERO else ZERO
        for e in range(tid, d, THREADS):
            a = ZERO
            for s in range(n_splits):
                a = cuda.fma(weight[U(s)], acc_part[U(b), U(h), U(i), U(s), U(e)], a)
            o = a * inv_l
            if BF16:
                bits = bits_from_f32(o)
                bits = bits + uint32(0x7FFF) + ((bits >> SIXTEEN) & uint32(1))
                out[U(b), U(h), U(i), U(e)] = uint16(bits >> SIXTEEN)
            else:
                out[U(b), U(h), U(i), U(e)] = o
        if tid == 0:
            lse[U(b), U(h), U(i)] = (m + math.log2(l_row)) * float32(LN2) if l_row != ZERO else NEG_INF

    return decode_merge


@lru_cache(maxsize=None)
def make_split_kernel(cfg: DecodeConfig, vec: bool, split: bool, lens_dtype: str = "int32",
                      mode: CacheMode = PLAIN):
    """The compiled phase-1 kernel for one specialisation; cached so each compiles once."""
    bad = cfg.problems() + mode.problems()
    if mode.paged and cfg.bulk:
        bad.append("bulk copies read a contiguous cache, not pages")
    if bad:
        raise ValueError(f"decode config {cfg} with {mode} cannot run: {'; '.join(bad)}")
    if lens_dtype not in LENS_DTYPES:
        raise ValueError(f"cache_seqlens dtype {lens_dtype!r} not in {LENS_DTYPES}")
    key = ("decode.split", cfg, bool(vec), bool(split), lens_dtype) + (() if mode == PLAIN else (mode,))
    return compile_kernel(key, kernel_signature(cfg.dtype, lens_dtype, mode.mods, mode.aux_types),
                          kernel_source(cfg, bool(vec), bool(split), mode), fastmath=FASTMATH)


@lru_cache(maxsize=None)
def make_merge_kernel(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {DTYPES}")
    return compile_kernel(("decode.merge", dtype), merge_signature(dtype), merge_source(dtype), fastmath=FASTMATH)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def cp_async_ok(x, d: int) -> bool:
    """Can cp.async copy x's rows: unit last stride, other strides and the base 16-byte aligned."""
    shape, strides = tuple(x.shape), tuple(x.strides)  # tuples: simulator arrays refuse index -1
    if shape[-1] > 1 and strides[-1] != x.dtype.itemsize:
        return False
    outer = [s for s, n in zip(strides[:-1], shape[:-1]) if n > 1]
    return all(s % 16 == 0 for s in outer) and address(x) % 16 == 0


def bulk_ok(x, d: int, head_dim: int) -> bool:
    """Can one bulk copy fetch a tile of x's rows: cp_async_ok, d = head_dim (no padding columns)
    and rows back to back (row stride = d elements), so block_n rows are one contiguous span."""
    shape, strides = tuple(x.shape), tuple(x.strides)
    if d != head_dim or not cp_async_ok(x, d):
        return False
    return shape[-2] <= 1 or strides[-2] == d * x.dtype.itemsize


def scratch_shapes(B: int, H: int, n_q: int, num_splits: int, d: int) -> tuple:
    """Shapes of (m_part, l_part, acc_part), all float32."""
    return (B, H, n_q, num_splits), (B, H, n_q, num_splits), (B, H, n_q, num_splits, d)


def n_row_chunks(cfg: DecodeConfig, group: int, n_q: int) -> int:
    return -(-group * n_q // cfg.rows)


def _absent(ndim: int):
    """An empty int32 array for an index argument the kernel's CacheMode never reads."""
    if nb_config.ENABLE_CUDASIM:
        return cuda.device_array((0,) * ndim, dtype=np.int32)
    return DeviceView(0, (0,) * ndim, (4,) * ndim, np.int32)


def launch(cfg: DecodeConfig, q, k, v, seqlens, out, lse, *, softmax_scale: float, d: int,
           num_splits: int, partials=None, stream=0, block_table=None, cache_batch_idx=None,
           cache_leftpad=None, causal: bool = True, window=None, softcap: float = 0.0, alibi=None, user=NO_MODS,
           aux=()) -> None:
    """Run both phases on device arrays (``launch.DeviceView``s, Numba device arrays, or anything with
    ``__cuda_array_interface__``); the caller has validated the problem.

    q, out: (B, H, Nq, d) in Q_STORAGE[cfg.dtype]; k, v: (B, Hkv, Nmax, d) in KV_STORAGE (16-bit
    caches as uint16 words); seqlens: (B,) int32/int64, or a 0-length array meaning Nmax for all;
    lse: (B, H, Nq) float32. partials: (m_part, l_part, acc_part) of scratch_shapes(), needed
    when num_splits > 1. softmax_scale multiplies q·kᵀ. block_table ((B, pages) int32: k, v are then
    (num_pages, Hkv, page_size, d)), cache_batch_idx, cache_leftpad ((B,) int32) and causal as
    CacheMode says; page_size must be a multiple of a warp_split config's block_n (one page per
    tile). window: None, or (left, right) as blocks/mask.window_bounds gives them (a window kind: not
    (-1, -1) and not causal's (-1, 0)); softcap > 0 caps the scores; alibi: float32 (Ba, H) slopes, Ba = 1
    or B; user: a Mods with the user's mask_mod / score_mod (CacheMode.user), aux their arrays. Any strides; rows that cp.async cannot
    copy (see cp_async_ok) take the scalar-load kernel, and a cfg.bulk config whose caches one bulk
    copy per tile cannot fetch (see bulk_ok), or on a GPU below sm_90 (no cp.async.bulk), runs as
    the same config with bulk=False.
    """
    B, H, n_q, _ = q.shape
    Hkv = k.shape[1]
    if B * H * n_q == 0:
        return
    group = H // Hkv
    split = num_splits > 1
    mode = CacheMode(paged=block_table is not None, batch_idx=cache_batch_idx is not None,
                     leftpad=cache_leftpad is not None, causal=bool(causal), window=window is not None,
                     softcap=softcap > 0, alibi=alibi is not None, user=user)
    if cfg.bulk and (mode.paged or not (ptx.current_sm90() and bulk_ok(k, d, cfg.head_dim)
                                        and bulk_ok(v, d, cfg.head_dim))):
        cfg = replace(cfg, bulk=False)
    if mode.paged and cfg.warp_split and k.shape[2] % cfg.block_n:
        raise ValueError(f"page size {k.shape[2]} is not a multiple of the warp_split tile's {cfg.block_n} keys")
    vec = cp_async_ok(k, d) and cp_async_ok(v, d)
    lens_dtype = str(seqlens.dtype)
    kernel = make_split_kernel(cfg, vec, split, lens_dtype, mode)
    blocks_y = B * Hkv * n_row_chunks(cfg, group, n_q)
    if blocks_y > 65535:
        raise ValueError(f"B·Hkv·row chunks = {blocks_y} exceeds the grid's y limit of 65535")
    if split:
        m_part, l_part, acc_part = partials
    else:  # never written: any arrays of the right types will do
        m_part = l_part = lse.reshape((B, H, n_q, 1))
        acc_part = lse.reshape((B, H, n_q, 1, 1))
    table = _absent(2) if block_table is None else block_table
    index, starts = (_absent(1) if x is None else x for x in (cache_batch_idx, cache_leftpad))
    mod_args = launch_args(window or (0, 0), softcap, softmax_scale, alibi, unused_slopes(lse)) if mode.mods else ()
    if len(aux) != len(mode.aux_types):
        raise ValueError(f"decode: {len(aux)} aux arrays for user mods that take {len(mode.aux_types)}")
    mod_args += tuple(aux)
    launch_kernel(kernel, (num_splits, blocks_y), cfg.threads, stream, cfg.smem_bytes,
                  q, k, v, seqlens, table, index, starts, out, lse, m_part, l_part, acc_part, n_q, d, group,
                  float32(softmax_scale * LOG2E), *mod_args)
    if split:
        merge = make_merge_kernel(cfg.dtype)
        launch_kernel(merge, B * H * n_q, MERGE_THREADS, stream, 4 * num_splits, m_part, l_part, acc_part, out, lse)
