"""Tensor-core FlashAttention-2 forward (fp16 / bf16 in, fp32 accumulation) on mma.sync m16n8k16.

Maths (section 3.6.4), per query row, for each K/V tile j with scores s = q·kᵀ:

    m_new = max(m_i, rowmax(s))           running maximum          (m of 3.6.4)
    alpha = exp(m_i - m_new)              rescales the old state
    p     = exp(s - m_new)
    l_i   = alpha * l_i + rowsum(p)       running denominator      (ℓ)
    acc   = alpha * acc + p @ V_j         running numerator        (O)

then O = acc / l_i and L = m_i + log(l_i). The kernel keeps m_i in base-2 units of the scaled
scores (m_i = max s · softmax_scale·log2(e)) while S stays raw, so each p is one FFMA and one
``ex2.approx`` (valid for softmax_scale > 0); L is converted back to the natural log.

Work split (FA2): one thread block of WARPS = BLOCK_Q / 16 warps per (Q tile, batch·head); warp w
owns query rows 16w..16w+15 of the tile, so each row's softmax lives inside one warp and the only
cross-thread reductions are over the 4 lanes of a quad (shuffles). Per K/V tile, each warp runs

    S (16 x BLOCK_K)  = Q_w (16 x HEAD_DIM) · K_jᵀ          HEAD_DIM/16 x BLOCK_K/8 mma
    O (16 x HEAD_DIM) += P (16 x BLOCK_K) · V_j             BLOCK_K/16 x HEAD_DIM/8 mma

with the m16n8k16 fragment layouts of numba_flash.ptx (g = lane >> 2, t = lane % 4):

* Q_w comes from shared memory by ldmatrix as A fragments ``q_frag[kk]``: once, kept in registers
  (``Q_IN_REGS``, the d = 64 default), or re-read per k-step of every tile (d = 128: saves the 32
  registers that made it spill).
* K_j rows are the B operand of S as stored (k-major per key): plain ldmatrix.
* S accumulators ``s[nt]`` hold S[g, 8nt+2t+{0,1}] and S[g+8, 8nt+2t+{0,1}]. Exactly these are
  the A operand of P·V for the k-step kk when taken from the n-tiles 2kk and 2kk+1, so P is only
  re-packed to f16x2/bf16x2 in registers, never written to shared memory.
* V_j is stored key-major, so its B fragments come from ldmatrix.trans.
* acc[dt] holds O[g, 8dt+2t+{0,1}], O[g+8, ...]: the same layout, so alpha scales registers 0,1
  by row g's factor and 2,3 by row g+8's.

Shared memory holds the Q, K and V tiles as 16-bit words, rows of HEAD_DIM, with the 16-byte
chunks of row r XOR-swizzled by r % 8: the 8 row addresses of each ldmatrix phase then fall in 8
different bank groups (no padding). Each lane keeps four byte addresses per tile (lane_rows) and
every ldmatrix adds a constant to one of them, which ptxas folds into the instruction. Tiles arrive
by cp.async (16 bytes per copy; rows past the sequence and columns past d are zero-filled by the
ignore-src operand, or by src-size when d % 8 != 0). Pipeline: V_j is copied while S = Q·K_jᵀ and
the softmax run, and K_{j+1} while P·V_j runs (two cp.async groups per tile, one buffer each); the
shipped configs double-buffer K and V instead (KV_STAGES=2: tile j+1 is copied under all of tile j).

Causal masking aligns to the bottom right: query i sees key j iff j <= i + Nk - Nq. Tiles wholly
above the diagonal are never loaded; only tiles that cross it or the end of the keys pay for the
mask. A row that sees no key gets O = 0 and L = -inf.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import address
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from ..blocks.copies import atom_offset, tile_copies
from ..blocks.numerics import LN2, LOG2E

# LAZY_RESCALE: M moves only when a tile's maximum exceeds it by more than this (log2 units), so every
# p <= 2^8 = 256 (FA4's threshold: far from overflow in fp32 acc/l and in f16/bf16 P).
RESCALE_LOG2 = 8.0
DTYPES = ("float16", "bfloat16")  # bf16 arrays travel as uint16 bit patterns; f16 as float16
WORD, F16, F32 = np.dtype(np.uint16), np.dtype(np.float16), np.dtype(np.float32)


def kernel_signature(SPLIT_TAIL=False):
    """Every specialisation takes q, k, v, out as 16-bit words (any strides, last dim unit); SPLIT_TAIL's
    also the partial results o_part (slots·BLOCK_Q, HEAD_DIM) and l_part (slots·BLOCK_Q), fp32, and the
    block split n_dp, n_sk (split_tail_plan)."""
    io = types.Array(types.uint16, 4, "A")
    lse = types.Array(types.float32, 3, "A")
    base = (io, io, io, io, lse, int32, int32, int32, int32, float32)
    if SPLIT_TAIL:
        base += (types.Array(types.float32, 2, "A"), types.Array(types.float32, 1, "A"), int32, int32)
    return types.void(*base)


def smem_bytes(BLOCK_Q, BLOCK_K, HEAD_DIM, KV_STAGES=1):
    """Q tile plus KV_STAGES (K, V) tile pairs, 16-bit words."""
    return 2 * HEAD_DIM * (BLOCK_Q + 2 * BLOCK_K * KV_STAGES)


def threads_per_block(BLOCK_Q, M_TILES=1):
    """32 threads per warp, one warp per 16 M_TILES query rows."""
    return 32 * (BLOCK_Q // (16 * M_TILES))


def problems(BLOCK_Q, BLOCK_K, HEAD_DIM, DTYPE, M_TILES=1, KV_STAGES=1):
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    if M_TILES not in (1, 2):
        out.append(f"M_TILES={M_TILES}: 1 or 2 m-tiles of 16 rows per warp")
    elif BLOCK_Q % (16 * M_TILES) or not 16 * M_TILES <= BLOCK_Q <= 256 * M_TILES:
        out.append(f"BLOCK_Q={BLOCK_Q}: one warp per {16 * M_TILES} query rows, 1..16 warps")
    if BLOCK_K % 16 or BLOCK_K < 16:
        out.append(f"BLOCK_K={BLOCK_K}: a multiple of 16 (the k of m16n8k16 for P·V)")
    if HEAD_DIM % 64 or HEAD_DIM <= 0:
        out.append(f"HEAD_DIM={HEAD_DIM}: a multiple of 64 (the 8-chunk XOR swizzle)")
    if DTYPE not in DTYPES:
        out.append(f"DTYPE={DTYPE!r} not in {DTYPES}")
    threads = threads_per_block(BLOCK_Q, M_TILES) if M_TILES in (1, 2) else 0
    for name, rows in (("Q", BLOCK_Q), ("K/V", BLOCK_K)):
        if (rows * HEAD_DIM // 8) % max(threads, 1):
            out.append(f"{name} tile of {rows}x{HEAD_DIM} is not a whole number of 16-byte copies per thread")
    if KV_STAGES not in (1, 2):
        out.append(f"KV_STAGES={KV_STAGES}: 1 or 2 K/V buffers")
    elif smem_bytes(BLOCK_Q, BLOCK_K, HEAD_DIM, KV_STAGES) > SMEM_PER_BLOCK_MAX:
        out.append(f"{smem_bytes(BLOCK_Q, BLOCK_K, HEAD_DIM, KV_STAGES)} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def kernel_source(BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, DTYPE, Q_IN_REGS=None, FAST_LOADS=True, UNROLL_QK=True,
                  M_TILES=1, TWO_SYNCS=True, GRID_BH_X=False, SMEM_EPILOGUE=False, PROLOGUE_V=False, KV_STAGES=1,
                  WARP_SKIP=False, LAZY_RESCALE=False, SPLIT_TAIL=False, PARTIAL_CHUNK=False):
    """The Python kernel for one specialisation (before cuda.jit; compile tests use it).

    FAST_LOADS: each thread's cp.async source offsets are computed once (a 64-bit base, the row
    stride, the column's byte count); a tile then costs one add per copy, and only a tile that
    crosses the end of the sequence pays for row checks (v3 recomputed row, clamp, zero fill and a
    per-row array view for every copy of every tile: FAST_LOADS=False, tile_copies' load_tile). UNROLL_QK: the k-steps of S = Q·Kᵀ are written
    out one call each (NVVM left that loop rolled, so every ldmatrix address was 64-bit arithmetic
    on a loop counter and ptxas could not schedule loads of step kk+1 under the mma of step kk).
    M_TILES: 16-row m-tiles per warp (warps = BLOCK_Q / (16 M_TILES)); with 2, every K and V
    fragment loaded by ldmatrix feeds two m-tiles' mma (FA2's 4 warps x 32 rows).
    TWO_SYNCS: two barriers per K/V tile instead of three: V_j is issued after the barrier at the
    top of the tile (which already proves every warp finished P·V_{j-1}), so the barrier that
    guarded V's buffer at the end of the tile goes; the overlap (V_j under Q·K_jᵀ and softmax,
    K_{j+1} under P·V_j) is unchanged.

    Sweep variants (issue #4; all off by default, and off they leave the PTX as it was):
    GRID_BH_X: the grid is (B·H, Q tiles) instead of (Q tiles, B·H), Q tiles reversed on y, so the
    heaviest causal tile of *every* head is dispatched before any lighter one (longest job first
    over the whole grid, not only within a head); launch() builds the matching grid.
    SMEM_EPILOGUE: O is normalised, packed and written by 32-bit shared stores into the warp's own
    rows of the Q tile (only that warp ever reads them), then copied out as 16-byte rows (ld.shared.v4
    + st.global.v4, each row's chunks on consecutive lanes) instead of 2-byte stores from the fragments;
    launch() requires out's rows 16-byte aligned for it.
    PROLOGUE_V: Q and K_0 go out as one cp.async group and V_0 right behind them as a second, so
    V_0 is not issued only after K_0 has landed, and the prologue barrier that waited for Q alone goes
    (kept only when Q_IN_REGS loads Q fragments before the loop).
    KV_STAGES=2: K and V double-buffered (Q | K0 | V0 | K1 | V1): at the top of tile j one barrier
    (K_j and V_j landed, every warp left tile j-1) and K_{j+1}, V_{j+1} are issued into the other
    buffers at once, so each tile has one barrier instead of two and its loads a whole tile of time.
    WARP_SKIP (causal): a warp runs the K/V loop only over the tiles its own rows see; with BLOCK_Q >
    BLOCK_K a Q tile's last tiles lie wholly above the diagonal for its first warps, which then only
    take part in those tiles' barriers and copies (a second loop), skipping Q·K_jᵀ, softmax and P·V_j
    (exact: there p would be 0 and alpha 1). The main loop body is unchanged; only its bound is per warp.
    LAZY_RESCALE: a row's running maximum M moves only when a tile's maximum exceeds it by more than
    RESCALE_LOG2 (FA4's conditional rescaling, see softmax_lazy), so the rescale of acc and l_i by alpha
    (HEAD_DIM/4 FMUL per lane and m-tile per tile) is skipped on almost every tile.
    PARTIAL_CHUNK (launch() sets it when d % 8 != 0): copies name their source bytes (cp.async's src-size),
    so the 16-byte chunk holding column d - 1 is part data, part zeros; otherwise every chunk is all data or
    all zeros, and FAST_LOADS copies use the ignore-src form, which ptxas issues without address arithmetic.

    SPLIT_TAIL (non-causal; not shipped: measured slower, benchmarks/mma_ladder.md v8): the kernel of a 1-D
    grid whose first n_dp blocks take a whole Q tile each and whose next n_sk blocks share the remaining
    tiles' K/V tiles in equal ranges (split_units), writing fp32 parts that merge_kernel combines.
    """
    WARP_SKIP = bool(WARP_SKIP and CAUSAL)
    if SPLIT_TAIL and (CAUSAL or WARP_SKIP or GRID_BH_X or not (TWO_SYNCS and FAST_LOADS)):
        raise ValueError("SPLIT_TAIL is for the non-causal kernel (equal Q tiles), on TWO_SYNCS=True, FAST_LOADS=True")
    if WARP_SKIP and not (TWO_SYNCS and FAST_LOADS):
        raise ValueError("WARP_SKIP is built on TWO_SYNCS=True, FAST_LOADS=True")
    if (PROLOGUE_V or KV_STAGES == 2) and not (TWO_SYNCS and FAST_LOADS):
        raise ValueError("PROLOGUE_V and KV_STAGES=2 are built on TWO_SYNCS=True, FAST_LOADS=True")
    if PROLOGUE_V and KV_STAGES == 2:
        raise ValueError("KV_STAGES=2 issues V_0 with K_0 already; PROLOGUE_V is for one stage")
    if Q_IN_REGS is None:  # d = 128 keeps Q in shared memory: its 32 registers would spill
        Q_IN_REGS = HEAD_DIM <= 64
    FAST_LOADS, UNROLL_QK = bool(FAST_LOADS), bool(UNROLL_QK)
    ROWS_W = 16 * M_TILES  # query rows per warp
    WARPS = BLOCK_Q // ROWS_W
    THREADS = 32 * WARPS
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks per row
    Q_COPIES = BLOCK_Q * CHUNKS // THREADS  # cp.async per thread per tile
    KV_COPIES = BLOCK_K * CHUNKS // THREADS
    QK_STEPS = HEAD_DIM // 16  # k-steps of S = Q Kᵀ
    S_TILES = BLOCK_K // 8  # n-tiles of S
    PV_STEPS = BLOCK_K // 16  # k-steps of O += P V
    O_TILES = HEAD_DIM // 8  # n-tiles of O
    if UNROLL_QK and QK_STEPS > 16:
        UNROLL_QK = False
    CAUSAL = bool(CAUSAL)
    Q_FRAGS = QK_STEPS if Q_IN_REGS else 1  # per m-tile
    MT_Q = 16 * HEAD_DIM  # shared offset between a warp's m-tiles of Q (16 rows: same row % 8)
    Q_SLOTS, S_ALL, O_ALL, ROWS_L = M_TILES * Q_FRAGS, M_TILES * S_TILES, M_TILES * O_TILES, 2 * M_TILES
    SQ, SK, SV = 0, BLOCK_Q * HEAD_DIM, (BLOCK_Q + BLOCK_K) * HEAD_DIM  # word offsets of the tiles in smem
    KV_WORDS = 2 * BLOCK_K * HEAD_DIM  # KV_STAGES=2: offset of the second (K, V) pair
    # Single booleans, so Numba prunes the branches of the variants that are off before typing them
    # (the default kernel's PTX then stays byte-identical to the kernel before the variants existed).
    TWO_STAGES = KV_STAGES == 2
    EARLY_KV = bool(PROLOGUE_V or TWO_STAGES)
    WAIT_Q = 1 if PROLOGUE_V else 0
    # O goes into Q's rows, which other threads' cp.async filled; without a prologue barrier only the
    # loop's barriers prove those copies landed, so a block with no K/V tile needs one of its own.
    EPI_SYNC = bool(SMEM_EPILOGUE and EARLY_KV and not Q_IN_REGS)
    O_STORES = ROWS_W * CHUNKS // 32  # SMEM_EPILOGUE: 16-byte stores per lane (a warp's rows)
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    shfl_xor = ptx.shfl_xor_sync
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    st_shared_b32, ld_shared_v4, st_global_v4, syncwarp = ptx.st_shared_b32, ptx.ld_shared_v4, ptx.st_global_v4, ptx.syncwarp
    ldsm_t_at = ptx.ldmatrix_x4_trans_at
    ldsm_at = ptx.ldmatrix_x4_at
    FULL = ptx.FULL_MASK
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    RESCALE = float32(RESCALE_LOG2)  # a Python float would make the comparison fp64 (cvt + add.f64 per row)

    swizzle, load_tile, copy_plan, load_tile_fast = tile_copies(HEAD_DIM, THREADS, PARTIAL_CHUNK)

    @inline_device
    def lane_rows(addr, smem_b, row, chunk):
        """addr[0..3] = byte addresses of this lane's ldmatrix row ``row`` (first chunk ``chunk``) for k-steps 0..3.
        Swizzled chunk (2kk + c) ^ (row % 8) = 2kk ^ (c ^ row % 8): k-step kk reads entry kk % 4 plus
        kk // 4 · 128 bytes (whole 8-chunk groups), and rows 16 further down are 32·HEAD_DIM bytes on,
        so every load of the loop is one of these four registers plus an immediate."""
        x = chunk ^ (row & 7)
        for i in range(4):
            addr[i] = smem_b + 2 * (row * HEAD_DIM + (((2 * i) ^ x) << 3))

    @inline_device
    def copy_next(smem, tile0, src, off, row_stride, step, col_bytes, dst0, row0, n_rows):
        """K or V rows row0.. into the tile at word tile0 (load_tile_fast, FAST_LOADS); returns the offset
        stepped to the next tile, so each copied tile moves it exactly once."""
        load_tile_fast(smem, tile0, src, off, row_stride, col_bytes, dst0, row0, n_rows, KV_COPIES)
        return off + step

    @inline_device
    def qk_step(s, q_frag, smem, kk, q_at, k_at, kv_bytes):
        """k-step kk of S += Q_w K_jᵀ; q_at, k_at: lane_rows of the Q and K tiles, kv_bytes: the
        (K, V) buffer's byte offset."""
        step = (kk >> 2) * 128
        if not Q_IN_REGS:  # re-read this k-step of Q: 4 registers per m-tile instead of 4 * QK_STEPS
            for mt in range(M_TILES):
                a0, a1, a2, a3 = ldsm_at(smem, q_at[kk & 3] + step + mt * (2 * MT_Q))
                q_frag[mt, 0] = a0
                q_frag[mt, 1] = a1
                q_frag[mt, 2] = a2
                q_frag[mt, 3] = a3
        for np2 in range(S_TILES // 2):
            b0, b1, b2, b3 = ldsm_at(smem, k_at[kk & 3] + kv_bytes + step + np2 * (32 * HEAD_DIM))
            for mt in range(M_TILES):  # one K fragment, M_TILES m-tiles
                qk = mt * Q_FRAGS + (kk if Q_IN_REGS else 0)
                nt = mt * S_TILES + 2 * np2
                s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3] = mma(
                    q_frag[qk, 0], q_frag[qk, 1], q_frag[qk, 2], q_frag[qk, 3], b0, b1,
                    s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3])
                s[nt + 1, 0], s[nt + 1, 1], s[nt + 1, 2], s[nt + 1, 3] = mma(
                    q_frag[qk, 0], q_frag[qk, 1], q_frag[qk, 2], q_frag[qk, 3], b2, b3,
                    s[nt + 1, 0], s[nt + 1, 1], s[nt + 1, 2], s[nt + 1, 3])

    @inline_device
    def tile_row_max(s, mr):
        """Row g + 8 (mr % 2) of m-tile mr // 2: the maximum of this tile's raw scores, over the quad."""
        half = mr & 1
        s0 = (mr >> 1) * S_TILES
        m_tile = NEG_INF
        for nt in range(S_TILES):
            m_tile = max(m_tile, max(s[s0 + nt, 2 * half], s[s0 + nt, 2 * half + 1]))
        m_tile = max(m_tile, shfl_xor(FULL, m_tile, 1))
        return max(m_tile, shfl_xor(FULL, m_tile, 2))

    @inline_device
    def exp_row(s, mr, m_sub, scale_log2):
        """p = 2^(s·c − m_sub) in place of row mr's scores (one FFMA and one ex2 each); this lane's sum of them."""
        half = mr & 1
        s0 = (mr >> 1) * S_TILES
        row_sum = ZERO
        for nt in range(S_TILES):
            for c in range(2):
                p = ex2(cuda.fma(s[s0 + nt, 2 * half + c], scale_log2, -m_sub))
                s[s0 + nt, 2 * half + c] = p
                row_sum += p
        return row_sum

    @inline_device
    def quad_row_sum(l_i, mr):
        """Row mr's l over the quad (each lane summed its own columns of the row)."""
        l_row = l_i[mr]
        l_row += shfl_xor(FULL, l_row, 1)
        return l_row + shfl_xor(FULL, l_row, 2)

    @inline_device
    def softmax_lazy(s, acc, m_i, l_i, scale_log2):
        """LAZY_RESCALE's online softmax of one tile (FA4's conditional rescaling): a row's M moves only
        when the tile's maximum exceeds it by more than RESCALE_LOG2 (base-2 units), so p = 2^(s·c − M)
        stays <= 2^RESCALE_LOG2 (exact in fp32, and in f16/bf16 P), and acc and l_i keep their scale.
        The result is the same softmax: O = acc / l and L = (M + log2 l)·ln 2 use one M throughout.
        Past the first tiles M rarely moves, so the per-tile rescale of acc (HEAD_DIM/4 FMUL per lane
        per m-tile, on the path into P·V's mma) is skipped by one branch per lane (its rows' M held)."""
        m_nw = cuda.local.array(ROWS_L, float32)
        rescale = False
        for mr in range(ROWS_L):
            m_c = tile_row_max(s, mr) * scale_log2
            # -inf + RESCALE_LOG2 is -inf: a row's first visible key always sets M.
            m_nw[mr] = m_c if m_c > m_i[mr] + RESCALE else m_i[mr]
            rescale |= m_nw[mr] != m_i[mr]
        if rescale:
            for mr in range(ROWS_L):
                half = mr & 1
                a0_ = (mr >> 1) * O_TILES
                # exactly 1 where M held; 0 where the row saw nothing before (acc, l_i are 0 there)
                alpha = ONE if m_nw[mr] == m_i[mr] else ex2(m_i[mr] - m_nw[mr])
                l_i[mr] *= alpha
                m_i[mr] = m_nw[mr]
                for dt in range(O_TILES):
                    acc[a0_ + dt, 2 * half] *= alpha
                    acc[a0_ + dt, 2 * half + 1] *= alpha
        for mr in range(ROWS_L):
            m_scaled = ZERO if m_i[mr] == NEG_INF else m_i[mr]  # nothing visible yet: ex2(-inf) = 0, not nan
            l_i[mr] += exp_row(s, mr, m_scaled, scale_log2)

    @inline_device
    def split_units(q, n_q, n_k, n_dp, n_sk):
        """SPLIT_TAIL: (sk, u_first, u_end), this block's units [u_first, u_end) of the 1-D grid over (Q tile,
        K/V tile) pairs, n_kv per Q tile in Q-tile order. Blocks below n_dp take one whole Q tile each; the
        n_sk blocks after them (sk = 0..n_sk-1) share the remaining units in near-equal ranges."""
        n_kv = (n_k + BLOCK_K - 1) // BLOCK_K
        blk = cuda.blockIdx.x
        sk = blk - n_dp
        if sk < 0:
            return sk, blk * n_kv, blk * n_kv + n_kv
        tail = (q.shape[0] * q.shape[1] * ((n_q + BLOCK_Q - 1) // BLOCK_Q) - n_dp) * n_kv
        return sk, n_dp * n_kv + (sk * tail) // n_sk, n_dp * n_kv + ((sk + 1) * tail) // n_sk

    @inline_device
    def forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, o_part, l_part, n_dp, n_sk, seg):
        # o_part, l_part, n_dp, n_sk, seg: SPLIT_TAIL's partial results, block split (split_tail_plan) and
        # segment of this block; the kernel without SPLIT_TAIL passes placeholders that are never read.
        # One dynamic allocation, Q | K | V tiles at word offsets SQ, SK, SV: 128-row tiles at
        # d = 128 need 64 KiB, over the 48 KiB static limit (offsets, not slices: a slice of a
        # dynamic array is clamped to its run-time length). ptxas: 64x64x128 174 -> 209
        # registers (unshipped), the shipped configs +0..4 (ptxas 13.0).
        smem = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)  # ldmatrix / cp.async: 16 B
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2  # fragment row (and row + 8)
        t = lane & 3  # fragment column pair
        if SPLIT_TAIL:  # segment seg of this block's units (split_units): Q tile `tile`, K/V tiles j_lo..j_hi-1
            if seg == 1:
                cuda.syncthreads()  # every warp is done with the first segment's shared memory
            n_kv = (n_k + BLOCK_K - 1) // BLOCK_K
            q_tiles_h = (n_q + BLOCK_Q - 1) // BLOCK_Q
            _, u_first, u_end = split_units(q, n_q, n_k, n_dp, n_sk)
            u = u_first if seg == 0 else (u_first // n_kv + 1) * n_kv
            tile = u // n_kv
            j_lo = u - tile * n_kv
            j_hi = min(n_kv, u_end - tile * n_kv)
            bh = tile // q_tiles_h
            q_tile = tile - bh * q_tiles_h
        # Heaviest causal tiles first: they start while the light ones fill the tail.
        elif GRID_BH_X:  # ... of all heads: B·H on x (dispatched fastest), Q tiles reversed on y
            q_tile = cuda.gridDim.y - 1 - cuda.blockIdx.y
            bh = cuda.blockIdx.x
        else:  # ... within each head
            q_tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
            bh = cuda.blockIdx.y
        n_heads = q.shape[1]
        b = bh // n_heads
        h = bh - b * n_heads
        h_kv = h // group
        q0 = q_tile * BLOCK_Q
        shift = n_k - n_q  # bottom-right causal alignment: query i sees key j iff j <= i + shift

        if SPLIT_TAIL:  # the loop below sees keys j_lo·BLOCK_K.. as keys 0..: its code and registers stay the plain kernel's
            n_k = n_k - j_lo * BLOCK_K
        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        if SPLIT_TAIL:
            n_tiles = j_hi - j_lo
        if CAUSAL:
            visible = min(q0 + BLOCK_Q, n_q) + shift  # keys the tile's last row can see
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_K - 1) // BLOCK_K)

        # Lane addresses for ldmatrix (matrix j = lane >> 3 of the x4 supplies rows lane & 7).
        mat = lane >> 3
        q_row = warp * ROWS_W + (lane & 15)  # A: quarters (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
        q_chunk = lane >> 4
        k_row = (mat >> 1) * 8 + (lane & 7)  # B of two n-tiles: (keys, d 0-7 | d 8-15) per tile
        k_chunk = mat & 1
        v_row = (mat & 1) * 8 + (lane & 7)  # B via .trans: (keys 0-7 | 8-15) per d-tile pair
        v_chunk = mat >> 1

        smem_b = ptx.shared_base(smem)
        # ldmatrix byte addresses, four per tile (lane_rows): every load below adds only constants to them
        # (as element offsets, ptxas rebuilt each of the 16 V addresses per tile: results/ncu-*-tenth*)
        q_at = cuda.local.array(4, uint32)
        k_at = cuda.local.array(4, uint32)
        v_at = cuda.local.array(4, uint32)
        lane_rows(q_at, smem_b + 2 * SQ, q_row, q_chunk)
        lane_rows(k_at, smem_b + 2 * SK, k_row, k_chunk)
        lane_rows(v_at, smem_b + 2 * SV, v_row, v_chunk)  # d-tile pair dp is "k-step" dp of lane_rows
        if FAST_LOADS:
            # k_next, v_next: this thread's source offset in the next K (V) tile to copy, stepped by a
            # constant per copied tile (no row × stride multiply in the loop)
            k_next, k_stride, col_bytes, kv_dst = copy_plan(k, b, h_kv, d)
            v_next, v_stride, _, _ = copy_plan(v, b, h_kv, d)
            k_step = BLOCK_K * k_stride
            v_step = BLOCK_K * v_stride
            if SPLIT_TAIL:
                k_next += j_lo * k_step
                v_next += j_lo * v_step

        # Prologue: Q, then K_0 (two groups); Q goes straight into A fragments, kept in registers.
        if FAST_LOADS:
            q_src, q_stride, _, q_dst = copy_plan(q, b, h, d)
            load_tile_fast(smem, SQ, q, q_src + q0 * q_stride, q_stride, col_bytes, q_dst, q0, n_q, Q_COPIES)
        else:
            load_tile(smem, SQ, q, b, h, q0, n_q, d, Q_COPIES)
        if EARLY_KV:  # one group Q + K_0 (+ V_0 for two stages); V_0 its own group
            if n_tiles > 0:
                k_next = copy_next(smem, SK, k, k_next, k_stride, k_step, col_bytes, kv_dst, 0, n_k)
                if TWO_STAGES:
                    v_next = copy_next(smem, SV, v, v_next, v_stride, v_step, col_bytes, kv_dst, 0, n_k)
            cp_commit()
            if PROLOGUE_V:
                if n_tiles > 0:
                    v_next = copy_next(smem, SV, v, v_next, v_stride, v_step, col_bytes, kv_dst, 0, n_k)
                cp_commit()
            if Q_IN_REGS:  # Q's fragments are loaded before the loop
                cp_wait(WAIT_Q)
                cuda.syncthreads()
        else:
            cp_commit()
            if n_tiles > 0:
                if FAST_LOADS:
                    k_next = copy_next(smem, SK, k, k_next, k_stride, k_step, col_bytes, kv_dst, 0, n_k)
                else:
                    load_tile(smem, SK, k, b, h_kv, 0, n_k, d, KV_COPIES)
            cp_commit()
            cp_wait(1)
            cuda.syncthreads()
        q_frag = cuda.local.array((Q_SLOTS, 4), uint32)
        if Q_IN_REGS:
            for mt in range(M_TILES):
                for kk in range(QK_STEPS):
                    a0, a1, a2, a3 = ldsm_at(smem, q_at[kk & 3] + (kk >> 2) * 128 + mt * (2 * MT_Q))
                    q_frag[mt * Q_FRAGS + kk, 0] = a0
                    q_frag[mt * Q_FRAGS + kk, 1] = a1
                    q_frag[mt * Q_FRAGS + kk, 2] = a2
                    q_frag[mt * Q_FRAGS + kk, 3] = a3

        # Fragments of m-tile mt: s[mt * S_TILES + nt], acc[mt * O_TILES + dt], rows 2 mt + {0, 1}.
        s = cuda.local.array((S_ALL, 4), float32)
        acc = cuda.local.array((O_ALL, 4), float32)
        m_i = cuda.local.array(ROWS_L, float32)  # rows g and g + 8 of each of this warp's m-tiles
        l_i = cuda.local.array(ROWS_L, float32)  # this lane's partial sums; the quad adds them at the end
        for dt in range(M_TILES * O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO
        for r in range(2 * M_TILES):
            m_i[r] = NEG_INF
            l_i[r] = ZERO

        # The tile loop counts in int32 (Numba's ints are 64-bit: a pair of instructions per add/compare).
        n_tiles = int32(n_tiles)
        last_tile = int32(n_tiles - 1)
        n_tiles_w = n_tiles  # tiles this warp computes (WARP_SKIP: those its rows see)
        if WARP_SKIP:
            seen_w = q0 + warp * ROWS_W + ROWS_W + shift  # keys the warp's last row sees
            n_tiles_w = int32(min(n_tiles, (max(seen_w, 0) + BLOCK_K - 1) // BLOCK_K))
        for j in range(n_tiles_w):
            k0 = int32(j * BLOCK_K)
            k1 = int32(k0 + BLOCK_K)  # the next tile's first key
            if TWO_STAGES:  # one barrier: K_j, V_j landed and every warp left tile j-1's buffers
                kv_buf = int32((j & 1) * KV_WORDS)  # word offset of this tile's (K, V) pair
                cp_wait(0)
                cuda.syncthreads()
                if j < last_tile:  # K_{j+1}, V_{j+1} into the other pair, a whole tile ahead
                    k_next = copy_next(smem, SK + (kv_buf ^ KV_WORDS), k, k_next, k_stride, k_step,
                                       col_bytes, kv_dst, k1, n_k)
                    v_next = copy_next(smem, SV + (kv_buf ^ KV_WORDS), v, v_next, v_stride, v_step,
                                       col_bytes, kv_dst, k1, n_k)
                cp_commit()
            elif PROLOGUE_V:  # tile 0: Q + K_0 landed (V_0 may be in flight); later tiles as TWO_SYNCS
                if j == 0:
                    cp_wait(1)
                else:
                    cp_wait(0)
                cuda.syncthreads()
                if j > 0:
                    v_next = copy_next(smem, SV, v, v_next, v_stride, v_step, col_bytes, kv_dst, k0, n_k)
                cp_commit()
            else:
                if TWO_SYNCS:  # FA2's order: one barrier says K_j landed and every warp left P·V_{j-1}
                    cp_wait(0)  # K_j (the only group in flight)
                    cuda.syncthreads()
                # V_j streams in while S = Q K_jᵀ and the softmax run.
                if FAST_LOADS:
                    v_next = copy_next(smem, SV, v, v_next, v_stride, v_step, col_bytes, kv_dst, k0, n_k)
                else:
                    load_tile(smem, SV, v, b, h_kv, k0, n_k, d, KV_COPIES)
                cp_commit()
            if not TWO_SYNCS:
                cp_wait(1)  # K_j has landed, V_j may still be in flight
                cuda.syncthreads()

            # S = Q K_jᵀ
            for nt in range(M_TILES * S_TILES):
                for r in range(4):
                    s[nt, r] = ZERO
            kv_bytes = 2 * kv_buf if TWO_STAGES else 0
            if UNROLL_QK:  # one call per k-step (NVVM inlines each; kk becomes a constant)
                qk_step(s, q_frag, smem, 0, q_at, k_at, kv_bytes)
                qk_step(s, q_frag, smem, 1, q_at, k_at, kv_bytes)
                qk_step(s, q_frag, smem, 2, q_at, k_at, kv_bytes)
                qk_step(s, q_frag, smem, 3, q_at, k_at, kv_bytes)
                if QK_STEPS > 4:
                    qk_step(s, q_frag, smem, 4, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 5, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 6, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 7, q_at, k_at, kv_bytes)
                if QK_STEPS > 8:
                    qk_step(s, q_frag, smem, 8, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 9, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 10, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 11, q_at, k_at, kv_bytes)
                if QK_STEPS > 12:
                    qk_step(s, q_frag, smem, 12, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 13, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 14, q_at, k_at, kv_bytes)
                    qk_step(s, q_frag, smem, 15, q_at, k_at, kv_bytes)
            else:
                for kk in range(QK_STEPS):
                    qk_step(s, q_frag, smem, kk, q_at, k_at, kv_bytes)

            # Mask only tiles that cross the end of the keys or the diagonal (raw scores).
            needs_mask = k1 > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k1 - 1 > q0 + warp * ROWS_W + shift)
            if needs_mask:
                for mt in range(M_TILES):
                    row_g = q0 + warp * ROWS_W + 16 * mt + g
                    for nt in range(S_TILES):
                        for r in range(4):
                            col = k0 + nt * 8 + 2 * t + (r & 1)
                            if col >= n_k or (CAUSAL and col > row_g + 8 * (r >> 1) + shift):
                                s[mt * S_TILES + nt, r] = NEG_INF

            # Online softmax on the fragments: row maxima over the quad, then p, alpha, l_i. m_i is
            # kept in raw score units; the scale is folded into the exponent, one FFMA per element.
            if LAZY_RESCALE:
                softmax_lazy(s, acc, m_i, l_i, scale_log2)
            else:
                for mr in range(2 * M_TILES):  # row g + 8 (mr % 2) of m-tile mr // 2
                    half = mr & 1
                    a0_ = (mr >> 1) * O_TILES
                    m_tile = tile_row_max(s, mr)
                    # m_i is kept scaled (M = m·scale·log2 e, rounded once): p = 2^(s·c − M) by one FFMA, and
                    # alpha = 2^(M_old − M_new) is then exactly the factor that moves the earlier p's to the new
                    # M (1 while the maximum holds). Unscaled m with alpha from m_old·c − m_new·c was contracted
                    # by NVVM to an FMA that left alpha = 1 ± 2^-23 on every tile: L drifted by 4e-5 at Nk 16384.
                    # A row with nothing visible yet keeps M = -inf; subtract 0 so ex2 gives 0, not nan.
                    m_new = max(m_i[mr], m_tile * scale_log2)
                    alpha = ZERO if m_new == NEG_INF else ex2(m_i[mr] - m_new)
                    m_scaled = ZERO if m_new == NEG_INF else m_new
                    l_i[mr] = alpha * l_i[mr] + exp_row(s, mr, m_scaled, scale_log2)
                    m_i[mr] = m_new
                    for dt in range(O_TILES):
                        acc[a0_ + dt, 2 * half] *= alpha
                        acc[a0_ + dt, 2 * half + 1] *= alpha

            if not TWO_STAGES:
                cp_wait(0)  # V_j
                cuda.syncthreads()  # ... for every warp; and every warp is done reading K_j
                if j < last_tile:  # K_{j+1} under P·V_j
                    if FAST_LOADS:
                        k_next = copy_next(smem, SK, k, k_next, k_stride, k_step, col_bytes, kv_dst, k1, n_k)
                    else:
                        load_tile(smem, SK, k, b, h_kv, k1, n_k, d, KV_COPIES)
                cp_commit()

            # O += P V_j: S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
            p_frag = cuda.local.array((M_TILES, 4), uint32)
            for kk in range(PV_STEPS):
                for mt in range(M_TILES):
                    st = mt * S_TILES + 2 * kk
                    p_frag[mt, 0] = pack(s[st, 0], s[st, 1])
                    p_frag[mt, 1] = pack(s[st, 2], s[st, 3])
                    p_frag[mt, 2] = pack(s[st + 1, 0], s[st + 1, 1])
                    p_frag[mt, 3] = pack(s[st + 1, 2], s[st + 1, 3])
                for dp in range(O_TILES // 2):
                    b0, b1, b2, b3 = ldsm_t_at(smem, v_at[dp & 3] + kv_bytes + (dp >> 2) * 128 + kk * (32 * HEAD_DIM))
                    for mt in range(M_TILES):  # one V fragment, M_TILES m-tiles
                        a0, a1, a2, a3 = p_frag[mt, 0], p_frag[mt, 1], p_frag[mt, 2], p_frag[mt, 3]
                        dt = mt * O_TILES + 2 * dp
                        acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3] = mma(
                            a0, a1, a2, a3, b0, b1, acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                        acc[dt + 1, 0], acc[dt + 1, 1], acc[dt + 1, 2], acc[dt + 1, 3] = mma(
                            a0, a1, a2, a3, b2, b3,
                            acc[dt + 1, 0], acc[dt + 1, 1], acc[dt + 1, 2], acc[dt + 1, 3])
            if not TWO_SYNCS:
                cuda.syncthreads()  # every warp is done reading V_j before V_{j+1} is copied over it

        if WARP_SKIP:  # the tiles this warp does not see: the same barriers and copies, no maths
            for j in range(n_tiles_w, n_tiles):
                k0 = int32(j * BLOCK_K)
                k1 = int32(k0 + BLOCK_K)
                if TWO_STAGES:
                    kv_buf = int32((j & 1) * KV_WORDS)
                    cp_wait(0)
                    cuda.syncthreads()
                    if j < last_tile:
                        k_next = copy_next(smem, SK + (kv_buf ^ KV_WORDS), k, k_next, k_stride, k_step,
                                           col_bytes, kv_dst, k1, n_k)
                        v_next = copy_next(smem, SV + (kv_buf ^ KV_WORDS), v, v_next, v_stride, v_step,
                                           col_bytes, kv_dst, k1, n_k)
                    cp_commit()
                else:
                    if PROLOGUE_V and j == 0:
                        cp_wait(1)
                    else:
                        cp_wait(0)
                    cuda.syncthreads()
                    if not PROLOGUE_V or j > 0:
                        v_next = copy_next(smem, SV, v, v_next, v_stride, v_step, col_bytes, kv_dst, k0, n_k)
                    cp_commit()
                    cp_wait(0)
                    cuda.syncthreads()
                    if j < last_tile:
                        k_next = copy_next(smem, SK, k, k_next, k_stride, k_step, col_bytes, kv_dst, k1, n_k)
                    cp_commit()

        cp_wait(0)  # nothing may be in flight when the block exits (n_tiles == 0 path included)
        if EPI_SYNC:
            if n_tiles == 0:  # (block-uniform)
                cuda.syncthreads()

        write_final = True
        if SPLIT_TAIL:
            # Blocks past n_dp write every part (a range that happens to be a whole tile merges as one part): O = acc / l and L
            # of the part, fp32, for merge_kernel; slot 2·sk + seg (recomputed here, not kept live in the loop).
            # (Folded into the epilogue loop below, ptxas spilled more in the split kernel: d64 28 -> 76 B.)
            if cuda.blockIdx.x >= n_dp:
                write_final = False
                for mr in range(2 * M_TILES):
                    half = mr & 1
                    a0_ = (mr >> 1) * O_TILES
                    l_row = quad_row_sum(l_i, mr)
                    prow = (2 * (cuda.blockIdx.x - n_dp) + seg) * BLOCK_Q + warp * ROWS_W + 8 * mr + g
                    inv_l = float32(1.0) / l_row if l_row > ZERO else ZERO
                    if t == 0:
                        l_part[prow] = (m_i[mr] + math.log2(l_row)) * float32(LN2) if l_row > ZERO else NEG_INF
                    for dt in range(O_TILES):
                        o_part[prow, dt * 8 + 2 * t] = acc[a0_ + dt, 2 * half] * inv_l
                        o_part[prow, dt * 8 + 2 * t + 1] = acc[a0_ + dt, 2 * half + 1] * inv_l
        if write_final:
            # Epilogue: the quad's partial row sums, O = acc / l_i, L = (m_i·scale_log2 + log2 l_i)·ln 2.
            for mr in range(2 * M_TILES):
                half = mr & 1
                a0_ = (mr >> 1) * O_TILES
                l_row = quad_row_sum(l_i, mr)
                row = q0 + warp * ROWS_W + 8 * mr + g
                inv_l = float32(1.0) / l_row if l_row > ZERO else ZERO  # a fully masked row: O = 0
                if SMEM_EPILOGUE:
                    if row < n_q and t == 0:
                        if l_row > ZERO:
                            lse[b, h, row] = (m_i[mr] + math.log2(l_row)) * float32(LN2)
                        else:
                            lse[b, h, row] = NEG_INF
                    if mr == 0:
                        syncwarp()  # every lane is past its last ldmatrix of these Q rows
                    row_t = warp * ROWS_W + 8 * mr + g  # the warp's own rows of the Q tile
                    for dt in range(O_TILES):  # conflict-free: chunk dt ^ g of row g, word t
                        bits = pack(acc[a0_ + dt, 2 * half] * inv_l, acc[a0_ + dt, 2 * half + 1] * inv_l)
                        st_shared_b32(smem, SQ + swizzle(row_t, dt) + 2 * t, bits)
                elif row < n_q:
                    if t == 0:
                        if l_row > ZERO:
                            lse[b, h, row] = (m_i[mr] + math.log2(l_row)) * float32(LN2)
                        else:
                            lse[b, h, row] = NEG_INF
                    for dt in range(O_TILES):
                        col = dt * 8 + 2 * t
                        bits = pack(acc[a0_ + dt, 2 * half] * inv_l, acc[a0_ + dt, 2 * half + 1] * inv_l)
                        if col < d:
                            out[b, h, row, col] = uint16(bits & 0xFFFF)
                        if col + 1 < d:
                            out[b, h, row, col + 1] = uint16(bits >> 16)
            if SMEM_EPILOGUE:  # the warp's O rows, 16 bytes per lane per store, a row's chunks on adjacent lanes
                syncwarp()
                o_base = b * (out.strides[0] // 2) + h * (out.strides[1] // 2)
                o_stride = out.strides[2] // 2
                for i in range(O_STORES):
                    c = lane + 32 * i
                    r = c // CHUNKS
                    chunk = c - r * CHUNKS
                    row_t = warp * ROWS_W + r
                    row = q0 + row_t
                    col = chunk * 8
                    if row < n_q and col < d:
                        src = SQ + swizzle(row_t, chunk)
                        if col + 8 <= d:
                            w0, w1, w2, w3 = ld_shared_v4(smem, src)
                            st_global_v4(out, o_base + row * o_stride + col, w0, w1, w2, w3)
                        else:  # d not a multiple of 8: the chunk's first d - col elements one by one
                            for e in range(8):
                                if col + e < d:
                                    out[b, h, row, col + e] = smem[src + e]


    def mma_forward(q, k, v, out, lse, n_q, n_k, d, group, scale_log2):
        forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, lse, lse, 0, 0, 0)

    def mma_forward_split_tail(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, o_part, l_part, n_dp, n_sk):
        # A block's range of units is no longer than a Q tile's (split_tail_plan makes sure): one segment,
        # or the end of one Q tile and the start of the next.
        _, u_first, u_end = split_units(q, n_q, n_k, n_dp, n_sk)
        n_kv = (n_k + BLOCK_K - 1) // BLOCK_K
        n_seg = 0 if u_end == u_first else (1 if (u_end - 1) // n_kv == u_first // n_kv else 2)
        # Two calls rather than a loop over segments (ptxas when timed, f6118ed: 0 B spilled at d = 64 against
        # 8-12 B for the loop; d = 128 304 B here, 236 B looped, 64 B without SPLIT_TAIL). The softmax helpers
        # shared since then moved these to 28 B (d = 64) and 268 B (d = 128); not re-timed.
        if n_seg > 0:
            forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, o_part, l_part, n_dp, n_sk, 0)
        if n_seg > 1:
            forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, o_part, l_part, n_dp, n_sk, 1)

    return mma_forward_split_tail if SPLIT_TAIL else mma_forward


@lru_cache(maxsize=None)
def make_forward_kernel(BLOCK_Q, BLOCK_K, HEAD_DIM, CAUSAL, DTYPE, Q_IN_REGS=None, FAST_LOADS=True, UNROLL_QK=True,
                        MAX_REGS=None, M_TILES=1, TWO_SYNCS=True, GRID_BH_X=False, SMEM_EPILOGUE=False,
                        PROLOGUE_V=False, KV_STAGES=1, WARP_SKIP=False, LAZY_RESCALE=False, SPLIT_TAIL=False,
                        PARTIAL_CHUNK=False):
    """The compiled kernel for one specialisation; cached so each compiles once.

    MAX_REGS caps registers per thread (ptxas -maxrregcount): e.g. 168 lets three 4-warp blocks
    share an SM (64K registers) where 174 allows two, at the price of a few spilled bytes."""
    bad = problems(BLOCK_Q, BLOCK_K, HEAD_DIM, DTYPE, M_TILES, KV_STAGES)
    if bad:
        raise ValueError(f"mma forward ({BLOCK_Q}, {BLOCK_K}, {HEAD_DIM}, {DTYPE}, M_TILES={M_TILES}) cannot be built: "
                         f"{'; '.join(bad)}")
    source = kernel_source(BLOCK_Q, BLOCK_K, HEAD_DIM, bool(CAUSAL), DTYPE, Q_IN_REGS, bool(FAST_LOADS), bool(UNROLL_QK),
                           M_TILES, bool(TWO_SYNCS), bool(GRID_BH_X), bool(SMEM_EPILOGUE), bool(PROLOGUE_V),
                           int(KV_STAGES), bool(WARP_SKIP), bool(LAZY_RESCALE), bool(SPLIT_TAIL), bool(PARTIAL_CHUNK))
    sig = kernel_signature(bool(SPLIT_TAIL))
    if MAX_REGS:
        return cuda.jit(sig, max_registers=int(MAX_REGS))(source)
    return cuda.jit(sig)(source)


# --- SPLIT_TAIL: the last wave of Q tiles spread over every block slot ------------------------------
# With equal Q tiles (non-causal) and S blocks resident at once (2 per SM here), T tiles run as
# ceil(T / S) waves and the last is T mod S tiles: the H200 benchmark's 2048 tiles on 264 slots leave
# 64 slots idle for the last eighth (2.5-2.9 % per tile, benchmarks/mma_ladder.md v8). SPLIT_TAIL runs
# the first T - T mod S tiles as before, one block each, and gives the rest to S more blocks as equal
# ranges of (Q tile, K/V tile) units, stream-K style; a range is no longer than a Q tile, so a block works
# on at most two tiles. Each writes O = acc / l and L of
# its part in fp32; merge_kernel combines a tile's parts (O = sum of exp(L_s - L) O_s, L = logsumexp L_s),
# the same merge as split-K decode's.
SPLIT_MIN_UNITS = 4  # K/V tiles per part at least (each part pays a Q load, a prologue and a partial write)
SPLIT_MAX_FILL = 0.9  # leave a last wave that is >= 90 % full alone (too little to win back)
MERGE_THREADS = 128
MERGE_MAX_PARTS = 256  # parts of one tile at most (split_tail_plan keeps ranges long enough)


def split_tail_plan(n_tiles, n_kv, slots):
    """(n_dp, n_sk): Q tiles run whole by one block each, and blocks sharing the remaining tiles'
    units (0 when the tail is not worth splitting: no tail, a nearly full last wave, short rows)."""
    if slots <= 0:
        return n_tiles, 0
    tail = n_tiles % slots if n_tiles >= slots else n_tiles
    if tail == 0 or tail > SPLIT_MAX_FILL * slots or n_kv < 2 * SPLIT_MIN_UNITS:
        return n_tiles, 0
    # ranges of >= SPLIT_MIN_UNITS units, and few enough parts per tile for the merge's shared memory
    min_units = max(SPLIT_MIN_UNITS, -(-n_kv // (MERGE_MAX_PARTS - 2)))
    n_sk = min(slots, tail * n_kv // min_units)
    if n_sk <= tail:  # a block would get a whole tile or more: nothing to gain (and > 2 segments)
        return n_tiles, 0
    return n_tiles - tail, n_sk  # n_sk > tail: every range is at most n_kv units, so it touches <= 2 Q tiles


@lru_cache(maxsize=None)
def make_merge_kernel(BLOCK_Q, BLOCK_K, DTYPE):
    """SPLIT_TAIL's merge: one block of MERGE_THREADS per shared tail tile. Its parts' slots are found once
    (by the arithmetic that split them, split_units) into shared memory; then each warp takes a row at a
    time: the lanes share out the parts' L (max and sum over the warp), write the weights exp(L_s − L) to
    shared memory, and sum weights x parts over the columns (lanes on adjacent columns: coalesced)."""
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    shfl_xor, syncwarp, FULL = ptx.shfl_xor_sync, ptx.syncwarp, ptx.FULL_MASK
    WARPS = MERGE_THREADS // 32
    MAX_P = MERGE_MAX_PARTS
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    def merge(out, lse, o_part, l_part, n_q, n_k, d, n_dp, n_sk):
        slots = cuda.shared.array(MAX_P, int32)
        weights = cuda.shared.array((WARPS, MAX_P), float32)
        n_parts = cuda.shared.array(1, int32)
        n_kv = (n_k + BLOCK_K - 1) // BLOCK_K
        q_tiles_h = (n_q + BLOCK_Q - 1) // BLOCK_Q
        tail = (out.shape[0] * out.shape[1] * q_tiles_h - n_dp) * n_kv
        t_first = cuda.blockIdx.x * n_kv  # this tile's units, counted from the first shared one
        t_end = t_first + n_kv
        if cuda.threadIdx.x == 0:
            c = (t_first * n_sk) // tail  # first block whose range reaches into the tile
            while c > 0 and (c * tail) // n_sk > t_first:
                c -= 1
            while ((c + 1) * tail) // n_sk <= t_first:
                c += 1
            n = 0
            while c < n_sk and (c * tail) // n_sk < t_end:  # a block's first part, or its second
                slots[n] = 2 * c if (c * tail) // n_sk >= t_first else 2 * c + 1
                n += 1
                c += 1
            n_parts[0] = n
        cuda.syncthreads()
        n = n_parts[0]
        tile = n_dp + cuda.blockIdx.x
        bh = tile // q_tiles_h
        b = bh // out.shape[1]
        h = bh - b * out.shape[1]
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        for r in range(warp, BLOCK_Q, WARPS):
            row = (tile - bh * q_tiles_h) * BLOCK_Q + r
            if row >= n_q:  # (warp-uniform)
                continue
            m = NEG_INF  # the parts' L, then exp(L_s - m), then the weights exp(L_s - L), in place
            for p in range(lane, n, 32):
                weights[warp, p] = l_part[slots[p] * BLOCK_Q + r]
                m = max(m, weights[warp, p])
            for x in (16, 8, 4, 2, 1):
                m = max(m, shfl_xor(FULL, m, x))
            total = ZERO
            for p in range(lane, n, 32):
                weights[warp, p] = math.exp(weights[warp, p] - m) if m > NEG_INF else ZERO
                total += weights[warp, p]
            for x in (16, 8, 4, 2, 1):
                total += shfl_xor(FULL, total, x)
            L = m + math.log(total) if total > ZERO else NEG_INF
            inv_total = float32(1.0) / total if total > ZERO else ZERO
            for p in range(lane, n, 32):
                weights[warp, p] *= inv_total
            syncwarp()
            for col in range(lane, d, 32):
                o = ZERO
                for p in range(n):
                    o += weights[warp, p] * o_part[slots[p] * BLOCK_Q + r, col]
                out[b, h, row, col] = uint16(pack(o, ZERO) & 0xFFFF)
            if lane == 0:
                lse[b, h, row] = L
            syncwarp()  # the weights are read before the next row's overwrite them

    io = types.Array(types.uint16, 4, "A")
    sig = types.void(io, types.Array(types.float32, 3, "A"), types.Array(types.float32, 2, "A"),
                     types.Array(types.float32, 1, "A"), int32, int32, int32, int32, int32)
    return cuda.jit(sig)(merge)


_SLOTS: dict = {}


def block_slots(kernel, threads, smem):
    """How many blocks of ``kernel`` the current device holds at once (occupancy x SMs); cached."""
    from ..launch import current_device_id, function, launcher_of

    cufunc = function(launcher_of(kernel), current_device_id(), smem)  # (sets the shared-memory opt-in)
    key = (kernel, cufunc.device.id, threads, smem)
    if key not in _SLOTS:
        from numba.cuda.cudadrv.devices import get_context

        per_sm = get_context().get_active_blocks_per_multiprocessor(cufunc, threads, smem)
        _SLOTS[key] = int(per_sm) * int(cufunc.device.MULTIPROCESSOR_COUNT)
    return _SLOTS[key]


def variant_kwargs(GRID_BH_X=False, SMEM_EPILOGUE=False, PROLOGUE_V=False, KV_STAGES=1, WARP_SKIP=False,
                   LAZY_RESCALE=False):
    """make_forward_kernel's keyword arguments for these variants: none when all are off and LAZY_RESCALE only
    when on, so a config without them keeps the cache key it had before they existed (launch() and the sweep
    scripts ask for the same key, so each kernel compiles once)."""
    if not (GRID_BH_X or SMEM_EPILOGUE or PROLOGUE_V or KV_STAGES != 1 or WARP_SKIP or LAZY_RESCALE):
        return {}
    extra = dict(GRID_BH_X=bool(GRID_BH_X), SMEM_EPILOGUE=bool(SMEM_EPILOGUE), PROLOGUE_V=bool(PROLOGUE_V),
                 KV_STAGES=int(KV_STAGES), WARP_SKIP=bool(WARP_SKIP))
    if LAZY_RESCALE:
        extra["LAZY_RESCALE"] = True
    return extra


VARIANT_NAMES = ("GRID_BH_X", "SMEM_EPILOGUE", "PROLOGUE_V", "KV_STAGES", "WARP_SKIP", "LAZY_RESCALE")


def config_variant_kwargs(cfg):
    """variant_kwargs of a config dict (configs.MMA_TABLE's, the sweep's): its other keys are ignored."""
    return variant_kwargs(**{n: cfg[n] for n in VARIANT_NAMES if n in cfg})


def _words(x):
    """The array as 16-bit words (bf16 already arrives as uint16; f16 is reinterpreted)."""
    return x if x.dtype == WORD else x.view(WORD)


def launch(q, k, v, out, lse, *, causal, softmax_scale, stream=0, BLOCK_Q=64, BLOCK_K=64, HEAD_DIM=None,
           Q_IN_REGS=None, FAST_LOADS=True, UNROLL_QK=True, MAX_REGS=None, M_TILES=1, TWO_SYNCS=True,
           GRID_BH_X=False, SMEM_EPILOGUE=False, PROLOGUE_V=False, KV_STAGES=1, WARP_SKIP=False,
           LAZY_RESCALE=False, SPLIT_TAIL=False, split_slots=None, alloc=None, layout_checked=False):
    """Run the tensor-core forward on device arrays; the caller has validated the problem.

    q, out: (B, H, Nq, d) float16 (or uint16 holding bf16 bits, which selects the bf16 kernel);
    k, v: (B, Hkv, Nk, d), same dtype, H % Hkv == 0 (kv head of h is h // (H // Hkv));
    lse: (B, H, Nq) float32, receives the natural-log logsumexp of the scaled scores (-inf for a
    row that sees no key, whose O is 0). softmax_scale > 0 multiplies q·kᵀ (computed by the caller
    from the original head dim; positive because row maxima are taken on the raw scores). d <= HEAD_DIM (default: 64 if d <= 64 else 128); the kernel zero-pads.
    Strides are arbitrary except: last dim unit stride, every other stride a multiple of 8
    elements and the base 16-byte aligned (cp.async copies 16 aligned bytes). BLOCK_Q, BLOCK_K,
    HEAD_DIM and Q_IN_REGS (None: the factory's default) pick the specialisation; FAST_LOADS and
    UNROLL_QK (default on) switch the v4 code paths (False: the older ones, kept for the sweep to
    compare); MAX_REGS (None: no cap) is ptxas's -maxrregcount; M_TILES (1 or 2) is the number of
    16-row m-tiles per warp (threads per block = 32 * BLOCK_Q / (16 * M_TILES)); TWO_SYNCS (default
    on): two barriers per K/V tile (False: the older three). GRID_BH_X, SMEM_EPILOGUE, PROLOGUE_V,
    KV_STAGES, WARP_SKIP, LAZY_RESCALE and SPLIT_TAIL are the variants of kernel_source (default off); SMEM_EPILOGUE
    quietly falls back to the fragment stores when out's rows are not 16-byte aligned. SPLIT_TAIL (non-causal;
    ignored causal) splits the last wave of Q tiles over all block slots (split_slots: how many blocks run
    at once; default: the device's occupancy for this kernel) and merges the parts with merge_kernel, in
    fp32 scratch from alloc(shape, "float32") -> device array (default: cuda.device_array). layout_checked=True skips the stride and
    alignment checks for a caller that has made them (numba_flash.forward: they are per-call host time).
    """
    B, H, n_q, d = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if HEAD_DIM is None:
        HEAD_DIM = 64 if d <= 64 else 128
    dtype = "bfloat16" if q.dtype == WORD else "float16"
    if not layout_checked:  # numba_flash.forward has checked strides and alignment already
        _check_layout(q, k, v, out, lse, d, HEAD_DIM)
    if B * H * n_q == 0:
        return
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    q_tiles = (n_q + BLOCK_Q - 1) // BLOCK_Q
    if GRID_BH_X and q_tiles > 65535 >= B * H:
        GRID_BH_X = False  # the y axis holds 65535 Q tiles; the (Q tiles, B·H) grid runs the same maths
    if (q_tiles if GRID_BH_X else B * H) > 65535:
        raise ValueError(f"{'Q tiles' if GRID_BH_X else 'B*H'} = {q_tiles if GRID_BH_X else B * H} exceeds the "
                         "grid's y limit of 65535")
    if SMEM_EPILOGUE and (address(out) % 16 or any(s % 16 for s in out.strides[:-1])):
        SMEM_EPILOGUE = False  # 16-byte stores need 16-byte aligned rows
    extra = variant_kwargs(GRID_BH_X, SMEM_EPILOGUE, PROLOGUE_V, KV_STAGES, WARP_SKIP, LAZY_RESCALE)
    if d % 8:  # a part-data chunk per row (kernel_source's PARTIAL_CHUNK); the key stays as it was otherwise
        extra["PARTIAL_CHUNK"] = True

    def build(**split):
        return make_forward_kernel(BLOCK_Q, BLOCK_K, HEAD_DIM, bool(causal), dtype, Q_IN_REGS, bool(FAST_LOADS),
                                   bool(UNROLL_QK), MAX_REGS, int(M_TILES), bool(TWO_SYNCS), **extra, **split)
    threads, smem = threads_per_block(BLOCK_Q, M_TILES), smem_bytes(BLOCK_Q, BLOCK_K, HEAD_DIM, KV_STAGES)
    if SPLIT_TAIL and not causal and n_k > 0:
        split = build(SPLIT_TAIL=True)
        n_kv = (n_k + BLOCK_K - 1) // BLOCK_K
        # the simulator has no occupancy to ask: it splits only when told how many slots to fill
        slots = split_slots or (0 if ptx.SIMULATOR else block_slots(split, threads, smem))
        n_dp, n_sk = split_tail_plan(B * H * q_tiles, n_kv, slots)
        if n_sk:
            if alloc is None:
                alloc = lambda shape, dt: cuda.device_array(shape, dt, stream=stream)  # noqa: E731
            o_part = alloc((2 * n_sk * BLOCK_Q, HEAD_DIM), "float32")
            l_part = alloc((2 * n_sk * BLOCK_Q,), "float32")
            scalars = (n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))
            launch_kernel(split, n_dp + n_sk, threads, stream, smem, _words(q), _words(k), _words(v), _words(out),
                          lse, *scalars, o_part, l_part, n_dp, n_sk)
            launch_kernel(make_merge_kernel(BLOCK_Q, BLOCK_K, dtype), B * H * q_tiles - n_dp, MERGE_THREADS, stream,
                          0, _words(out), lse, o_part, l_part, n_q, n_k, d, n_dp, n_sk)
            return
    grid = (B * H, q_tiles) if GRID_BH_X else (q_tiles, B * H)
    launch_kernel(build(), grid, threads, stream, smem,
                  _words(q), _words(k), _words(v), _words(out), lse, n_q, n_k, d, H // Hkv,
                  float32(softmax_scale * LOG2E))


def _check_layout(q, k, v, out, lse, d, HEAD_DIM):
    if d > HEAD_DIM:
        raise ValueError(f"head dim {d} > HEAD_DIM={HEAD_DIM}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"H={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    if len({x.dtype for x in (q, k, v, out)}) != 1 or q.dtype not in (F16, WORD):
        raise ValueError(f"q, k, v, out must share dtype float16 or uint16 (bf16 bits); got {[x.dtype for x in (q, k, v, out)]}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x.strides[-1] != 2:
            raise ValueError(f"{name}: last dim must have unit stride, strides are {x.strides}")
        if name != "out" and any(s % 16 for s in x.strides[:-1]):
            raise ValueError(f"{name}: strides {x.strides} (bytes) must be multiples of 16 for cp.async; pad the rows")
        if name != "out" and address(x) % 16:
            raise ValueError(f"{name}: data pointer is not 16-byte aligned")
    if lse.dtype != F32:
        raise ValueError(f"lse must be float32, got {lse.dtype}")
