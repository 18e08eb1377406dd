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

Shuffles are numba_flash.ptx.shfl_xor_sync (its simulator twin exchanges values between the 32
simulated lanes), so the simulator runs this kernel unchanged. Every sum has a fixed order: the
result is bitwise deterministic for a given num_splits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, types, uint16, uint32, uint64
from numba.cuda.extending import intrinsic

from .. import ptx
from ..configs import MAX_HEAD_DIM, SMEM_PER_BLOCK_MAX, head_dim_bucket
from ..launch import address
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device

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
SMEM_PER_SM = 228 * 1024  # H100 / H200; 1 KiB of it is reserved per resident block
MERGE_THREADS = 128


# --------------------------------------------------------------------------------------------
# Bit casts (no conversion instruction, just a new type for the same 32 bits), with twins.
# --------------------------------------------------------------------------------------------
@intrinsic
def _f32_from_bits_intrinsic(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(word, ir.FloatType())

    return sig, codegen


@intrinsic
def _bits_from_f32_intrinsic(typingctx, x):
    if not isinstance(x, (types.Float, types.Integer)):
        return None
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(value, ir.IntType(32))

    return sig, codegen


@intrinsic
def _f16x2_to_f32_intrinsic(typingctx, word):
    """Two packed halves (lower index in the low 16 bits) -> (float32, float32): two cvt.f32.f16."""
    if not isinstance(word, types.Integer):
        return None
    sig = types.UniTuple(types.float32, 2)(word)

    def codegen(context, builder, sig, args):
        w = context.cast(builder, args[0], sig.args[0], types.uint32)
        pair = builder.bitcast(w, ir.VectorType(ir.HalfType(), 2))
        lo, hi = (builder.fpext(builder.extract_element(pair, ir.Constant(ir.IntType(32), i)), ir.FloatType())
                  for i in (0, 1))
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return sig, codegen


def _f32_from_bits_twin(bits):
    return np.array(int(bits) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


def _bits_from_f32_twin(x):
    return np.array(x, dtype=np.float32).view(np.uint32)[()]


def _f16x2_to_f32_twin(word):
    lo, hi = np.array(int(word) & 0xFFFFFFFF, dtype=np.uint32).reshape(1).view(np.float16)
    return np.float32(lo), np.float32(hi)


if ptx.SIMULATOR:
    f32_from_bits, bits_from_f32, f16x2_to_f32 = _f32_from_bits_twin, _bits_from_f32_twin, _f16x2_to_f32_twin
else:
    f32_from_bits, bits_from_f32 = _f32_from_bits_intrinsic, _bits_from_f32_intrinsic
    f16x2_to_f32 = _f16x2_to_f32_intrinsic


# --------------------------------------------------------------------------------------------
# Tile configuration as data
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """One specialisation of the split (phase-1) kernel.

    rows: query rows per block (G·Nq of a group, padded up; larger groups take several blocks).
    block_n: keys per K/V tile. stages: depth of the cp.async ring (stages - 1 tiles in flight).
    warps: 32-thread warps per block.
    """

    head_dim: int  # compiled (padded) head dim, a multiple of 16
    dtype: str
    rows: int
    block_n: int = 64
    stages: int = 3
    warps: int = 4

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
        return self.words + 4  # +16 bytes: rows 4 banks apart, still 16-byte aligned for cp.async

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
        return {
            "q": self.rows * self.head_dim,
            "s": self.rows * self.block_n,  # S, then P in place
            "m": self.rows, "l": self.rows, "alpha": self.rows, "limit": self.rows,
            # K/V ring; after the last tile it holds the summed acc (rows x head_dim)
            "kv": max(pipeline, self.rows * self.head_dim),
        }

    @property
    def kv_offset(self) -> int:
        w = self.smem_words
        before = w["q"] + w["s"] + w["m"] + w["l"] + w["alpha"] + w["limit"]
        return -(-before // 4) * 4  # 16-byte aligned for cp.async

    @property
    def smem_bytes(self) -> int:
        return 4 * (self.kv_offset + self.smem_words["kv"])

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM: shared memory, threads, and an assumed <= 128 registers/thread."""
        by_smem = SMEM_PER_SM // (self.smem_bytes + 1024)
        return max(1, min(by_smem, 2048 // self.threads, 65536 // (128 * self.threads), 32))

    @property
    def bytes_in_flight(self) -> int:
        """K/V bytes one block has requested and not yet used, at steady state."""
        return (self.stages - 1) * 2 * self.block_n * self.head_dim * ITEMSIZE[self.dtype]

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
        if self.block_n % (8 * self.warps) or self.block_n < 8 * self.warps:
            out.append(f"block_n={self.block_n}: a multiple of 8 keys per warp ({8 * self.warps})")
        if self.stages < 2:
            out.append(f"stages={self.stages}: at least 2 (one tile used, one in flight)")
        if self.rows // self.row_groups * self.o_words * self.per_word > 64:
            out.append(f"{self.rows} rows x head_dim {self.head_dim}: acc needs more than 64 registers "
                       f"per thread even split over {self.row_groups} row groups")
        if self.threads % (self.col_threads * self.row_groups):
            out.append(f"{self.threads} threads do not tile {self.col_threads} columns x {self.row_groups} row groups")
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

    64-key tiles while a K+V tile is <= 34 KiB, else 32 keys; 3 stages; 4 warps, 8 for >= 64 rows
    (more row groups keep acc in registers).
    """
    head_dim = head_dim_bucket(d)
    row_bytes = head_dim * ITEMSIZE[dtype]
    block_n = 64 if row_bytes <= 256 else 32
    best = None
    for rows in ROWS_BUCKETS:
        warps = 8 if rows >= 64 else 4
        cfg = DecodeConfig(head_dim, dtype, rows, block_n=max(block_n, 8 * warps), stages=3, warps=warps)
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
def kernel_signature(dtype: str, lens_dtype: str = "int32"):
    """q, k, v, seqlens, out, lse, m_part, l_part, acc_part, n_q, d, group, scale_log2."""
    qio = types.Array(Q_STORAGE[dtype], 4, "A")
    kv = types.Array(KV_STORAGE[dtype], 4, "A")
    lens = types.Array(getattr(types, lens_dtype), 1, "A")
    lse = types.Array(types.float32, 3, "A")
    part = types.Array(types.float32, 4, "A")
    acc = types.Array(types.float32, 5, "A")
    return types.void(qio, kv, kv, lens, qio, lse, part, part, acc, int32, int32, int32, float32)


def kernel_source(cfg: DecodeConfig, vec: bool, split: bool):
    """The phase-1 kernel for one specialisation (before cuda.jit; compile tests use it).

    vec: K/V rows are 16-byte aligned, copied by cp.async (else scalar loads). split: write the
    partial state (m, l, acc) of split blockIdx.x; else (one split) write O and L directly.
    """
    HEAD_DIM, ROWS, BLOCK_N, STAGES = cfg.head_dim, cfg.rows, cfg.block_n, cfg.stages
    WARPS, THREADS = cfg.warps, cfg.threads
    F32, F16, BF16 = cfg.dtype == "float32", cfg.dtype == "float16", cfg.dtype == "bfloat16"
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
    exp2, log2 = math.exp2, math.log2

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
    def load_tile(smem_u, smem_h, smem_f, src, b, h, k0, length, d, dst):
        """K or V keys [k0, k0 + BLOCK_N) into rows of ROW_WORDS words at word offset dst.

        Keys past length and columns past d are zero-filled, so a masked probability (exactly 0)
        never meets stale cache contents (0 * nan would be nan).
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
                    src_row = min(row, length - 1)  # a zero-byte copy still names an address
                    src_col = col if nbytes > 0 else 0
                    cp_async(smem_u, dst + r * ROW_WORDS + ch * 4, src[U(b), U(h), U(src_row)], src_col, nbytes)
        else:
            for it in range(TILE_LOADS):
                idx = tid + it * THREADS
                if idx < BLOCK_N * HEAD_DIM:
                    r = idx // HEAD_DIM
                    e = idx - r * HEAD_DIM
                    row = k0 + r
                    ok = row < length and e < d
                    if F32:
                        smem_f[U(dst + r * ROW_WORDS + e)] = src[U(b), U(h), U(row), U(e)] if ok else ZERO
                    else:
                        x = src[U(b), U(h), U(row), U(e)] if ok else uint16(0)
                        smem_h[U(2 * (dst + r * ROW_WORDS) + e)] = x

    @inline_device
    def unpack(smem_u, smem_f, addr):
        """Word addr of a K/V tile -> (first, second) element as float32 (second = 0 for fp32)."""
        if F32:
            return smem_f[U(addr)], ZERO
        if F16:
            return f16x2_to_f32(smem_u[U(addr)])
        bits = smem_u[U(addr)]
        return f32_from_bits(bits << SIXTEEN), f32_from_bits(bits & HIGH)

    def decode_split(q, k, v, seqlens, out, lse, m_part, l_part, acc_part, n_q, d, group, scale_log2):
        smem_f = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)
        smem_u = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)  # same bytes, as bits
        smem_h = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)  # same bytes, as 16-bit words
        smem_i = cuda.shared.array(0, int32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        split_id = cuda.blockIdx.x
        n_splits = cuda.gridDim.x
        n_kv_heads = k.shape[1]
        n_max = k.shape[2]
        rows_total = group * n_q
        n_chunks = (rows_total + ROWS - 1) // ROWS
        blk = cuda.blockIdx.y
        bh = blk // n_chunks
        r0 = (blk - bh * n_chunks) * ROWS  # first row (of G·Nq) of this block
        b = bh // n_kv_heads
        h_kv = bh - b * n_kv_heads
        # Device lengths are not checked on the host (that would need a copy and a sync): clamp.
        length = n_max
        if seqlens.shape[0] > 0:
            length = min(max(seqlens[U(b)], 0), n_max)

        # Q (fp32, zero rows past G·Nq and columns past d); per-row state and visibility limit.
        # Row r is query i of head g of the group, r0 + r = g·Nq + i; it sees keys <= i + len - Nq.
        for idx in range(tid, ROWS * HEAD_DIM, THREADS):
            r = idx // HEAD_DIM
            e = idx - r * HEAD_DIM
            rg = r0 + r
            x = ZERO
            if rg < rows_total and e < d:
                g = rg // n_q
                x = q_to_f32(q[U(b), U(h_kv * group + g), U(rg - g * n_q), U(e)])
            smem_f[U(Q_OFF + idx)] = x
        for r in range(tid, ROWS, THREADS):
            rg = r0 + r
            smem_f[U(M_OFF + r)] = NEG_INF
            smem_f[U(L_OFF + r)] = ZERO
            smem_i[U(LIM_OFF + r)] = rg - (rg // n_q) * n_q + length - n_q if rg < rows_total else -1

        # This split's tiles: ceil(n_tiles / n_splits) each; trailing splits may be empty.
        n_tiles = (length + BLOCK_N - 1) // BLOCK_N
        per_split = (n_tiles + n_splits - 1) // n_splits
        t_begin = min(split_id * per_split, n_tiles)
        t_end = min(t_begin + per_split, n_tiles)
        first_limit = length - n_q  # row i = 0 sees keys <= this; tiles past it need the mask

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

        # Prologue: the first STAGES - 1 tiles in flight (one commit group each, maybe empty).
        for st in range(STAGES - 1):
            if t_begin + st < t_end:
                k0 = (t_begin + st) * BLOCK_N
                dst = KV_OFF + st * STAGE_WORDS
                load_tile(smem_u, smem_h, smem_f, k, b, h_kv, k0, length, d, dst)
                load_tile(smem_u, smem_h, smem_f, v, b, h_kv, k0, length, d, dst + TILE_WORDS)
            if VEC:
                cp_commit()

        for t in range(t_begin, t_end):
            j = t - t_begin
            if VEC:
                cp_wait(WAIT_N)  # this thread's copies of tile t have landed
            cuda.syncthreads()  # everyone's have; and everyone is done with tile t - 1
            nxt = t + STAGES - 1
            if nxt < t_end:  # refill the stage that tile t - 1 used
                dst = KV_OFF + ((j + STAGES - 1) % STAGES) * STAGE_WORDS
                load_tile(smem_u, smem_h, smem_f, k, b, h_kv, nxt * BLOCK_N, length, d, dst)
                load_tile(smem_u, smem_h, smem_f, v, b, h_kv, nxt * BLOCK_N, length, d, dst + TILE_WORDS)
            if VEC:
                cp_commit()  # always, so that WAIT_N counts tiles
            k0 = t * BLOCK_N
            k_off = KV_OFF + (j % STAGES) * STAGE_WORDS
            v_off = k_off + TILE_WORDS
            needs_mask = k0 + BLOCK_N - 1 > first_limit

            # S = Q Kᵀ · scale·log2(e), masked to -inf, into shared memory.
            k_lane = k_off + (key_base + kq) * ROW_WORDS + p
            for rc in range(S_CHUNKS):
                for i in range(S_ROWS):
                    for ks in range(KEY_STEPS):
                        s_acc[i, ks] = ZERO
                q_lane = Q_OFF + rc * S_ROWS * HEAD_DIM + EPW * p
                for j0 in range(0, QUAD_STEPS, UNROLL):
                    for u in range(UNROLL):  # constant trip count: unrolled, addresses become offsets
                        w4 = 4 * (j0 + u)
                        for ks in range(KEY_STEPS):
                            k_val[ks, 0], k_val[ks, 1] = unpack(smem_u, smem_f, k_lane + 8 * ks * ROW_WORDS + w4)
                        for i in range(S_ROWS):
                            q_addr = q_lane + i * HEAD_DIM + EPW * w4
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
                        for ks in range(KEY_STEPS):
                            n = key_base + 8 * ks + kq
                            x = s_acc[i, ks] * scale_log2
                            if needs_mask and k0 + n > limit:
                                x = NEG_INF
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
        cuda.syncthreads()

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
                store_out(out, b, h, i, e, a / l_row if l_row > ZERO else ZERO)
                if e == 0:
                    lse[U(b), U(h), U(i)] = (
                        (smem_f[U(M_OFF + r)] + log2(l_row)) * float32(LN2) if l_row > ZERO else NEG_INF)

    return decode_split


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
        inv_l = float32(1.0) / l_row if l_row > ZERO else ZERO
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
            lse[U(b), U(h), U(i)] = (m + math.log2(l_row)) * float32(LN2) if l_row > ZERO else NEG_INF

    return decode_merge


@lru_cache(maxsize=None)
def make_split_kernel(cfg: DecodeConfig, vec: bool, split: bool, lens_dtype: str = "int32"):
    """The compiled phase-1 kernel for one specialisation; cached so each compiles once."""
    bad = cfg.problems()
    if bad:
        raise ValueError(f"decode config {cfg} cannot run: {'; '.join(bad)}")
    if lens_dtype not in LENS_DTYPES:
        raise ValueError(f"cache_seqlens dtype {lens_dtype!r} not in {LENS_DTYPES}")
    return cuda.jit(kernel_signature(cfg.dtype, lens_dtype), fastmath=FASTMATH)(
        kernel_source(cfg, bool(vec), bool(split)))


@lru_cache(maxsize=None)
def make_merge_kernel(dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {DTYPES}")
    return cuda.jit(merge_signature(dtype), fastmath=FASTMATH)(merge_source(dtype))


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


def scratch_shapes(B: int, H: int, n_q: int, num_splits: int, d: int) -> tuple:
    """Shapes of (m_part, l_part, acc_part), all float32."""
    return (B, H, n_q, num_splits), (B, H, n_q, num_splits), (B, H, n_q, num_splits, d)


def n_row_chunks(cfg: DecodeConfig, group: int, n_q: int) -> int:
    return -(-group * n_q // cfg.rows)


def launch(cfg: DecodeConfig, q, k, v, seqlens, out, lse, *, softmax_scale: float, d: int,
           num_splits: int, partials=None, stream=0) -> None:
    """Run both phases on device arrays (``launch.DeviceView``s, Numba device arrays, or anything with
    ``__cuda_array_interface__``); the caller has validated the problem.

    q, out: (B, H, Nq, d) in Q_STORAGE[cfg.dtype]; k, v: (B, Hkv, Nmax, d) in KV_STORAGE (16-bit
    caches as uint16 words); seqlens: (B,) int32/int64, or a 0-length array meaning Nmax for all;
    lse: (B, H, Nq) float32. partials: (m_part, l_part, acc_part) of scratch_shapes(), needed
    when num_splits > 1. softmax_scale multiplies q·kᵀ. Any strides; rows that cp.async cannot
    copy (see cp_async_ok) take the scalar-load kernel.
    """
    B, H, n_q, _ = q.shape
    Hkv = k.shape[1]
    if B * H * n_q == 0:
        return
    group = H // Hkv
    split = num_splits > 1
    vec = cp_async_ok(k, d) and cp_async_ok(v, d)
    lens_dtype = str(seqlens.dtype)
    kernel = make_split_kernel(cfg, vec, split, lens_dtype)
    blocks_y = B * Hkv * n_row_chunks(cfg, group, n_q)
    if blocks_y > 65535:
        raise ValueError(f"B·Hkv·row chunks = {blocks_y} exceeds the grid's y limit of 65535")
    if split:
        m_part, l_part, acc_part = partials
    else:  # never written: any arrays of the right types will do
        m_part = l_part = lse.reshape((B, H, n_q, 1))
        acc_part = lse.reshape((B, H, n_q, 1, 1))
    launch_kernel(kernel, (num_splits, blocks_y), cfg.threads, stream, cfg.smem_bytes,
                  q, k, v, seqlens, out, lse, m_part, l_part, acc_part, n_q, d, group, float32(softmax_scale * LOG2E))
    if split:
        merge = make_merge_kernel(cfg.dtype)
        launch_kernel(merge, B * H * n_q, MERGE_THREADS, stream, 4 * num_splits, m_part, l_part, acc_part, out, lse)
