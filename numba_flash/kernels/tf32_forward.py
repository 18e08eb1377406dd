"""fp32 FlashAttention-2 forward on tensor cores: mma.sync m16n8k8 tf32, split 3xTF32 for fp32 accuracy.

Maths: the online softmax of section 3.6.4 (eager, blocks/softmax.py's maths: m_i in base-2 units of the
scaled scores, softmax_scale·log2(e) folded into one FFMA + ex2 per element, L = (m_i + log2 l_i)·ln 2).
What differs is how the two products are formed from fp32 operands.

A tensor core multiplies tf32 values (fp32 with a 10-bit mantissa). Split every operand as
x = hi + lo with hi = tf32(x) and lo = tf32(x - hi) (x - hi is exact in fp32; tf32(): round to nearest,
ties to even by cvt.rn on sm_90, one instruction, away from zero by cvt.rna before it, four); then

    x·y = hi_x·hi_y + hi_x·lo_y + lo_x·hi_y + lo_x·lo_y,

and the last term is below fp32's rounding of the product (|lo| <= 2^-11 |x|), so three tf32
products (small terms first, into one fp32 accumulator) give fp32-level accuracy: "3xTF32", what
CUTLASS calls OpMultiplyAddFastF32 and what PyTorch's memory-efficient SDPA runs for fp32 on sm_80+.
PASSES = 1 keeps only hi·hi (plain TF32, ~1e-3 relative error: PyTorch's allow_tf32).

Work split (FA2): WARPS = BLOCK_Q / 16 warps, warp w owns query rows 16w..16w+15. Per K/V tile:

    S (16 x BLOCK_K)  = Q_w · K_jᵀ     HEAD_DIM/8 k-steps x BLOCK_K/8 n-tiles of m16n8k8
    O (16 x HEAD_DIM) += P · V_j      BLOCK_K/8 k-steps x HEAD_DIM/8 n-tiles

Fragments (numba_flash.ptx, g = lane >> 2, t = lane % 4). A k-step's 8 summation indices may be
taken in any order as long as A's columns and B's rows agree, which removes all shuffles:

* S = Q·Kᵀ sums over d. k-steps come in pairs covering 16 columns of d; lane (g, t) owns columns
  16c + 4t .. 16c + 4t + 3 of its rows g and g + 8 (one 16-byte shared load per row): the pair's
  first step takes columns +0 (as its column t) and +1 (as t + 4), the second +2 and +3. K's rows
  are read the same way, so Q's column t and K's row t are always the same d.
* O += P·V sums over keys. The S accumulators hold S[g, 8n + 2t], S[g, 8n + 2t + 1] (and row
  g + 8): taken as P's columns t and t + 4 of k-step n, they are already the A fragment; V's B
  fragment is then V[8n + 2t, col] and V[8n + 2t + 1, col]: two 4-byte shared loads.

Shared memory (fp32 words): Q and K rows padded to QK_STRIDE (== 16 mod 32 words: a quarter-warp's
16-byte loads of rows g, g + 1 cover all 32 banks), V rows to V_STRIDE (== 4 mod 16: the 4-byte
loads of keys 2t at column g hit 32 different banks). Tiles arrive by cp.async, 16 bytes per copy
(rows past the sequence and columns past d zero-filled); V_j streams in during S = Q·K_jᵀ and the
softmax, K_{j+1} during P·V_j (two barriers per tile).

Causal masking aligns to the bottom right (query i sees key j iff j <= i + Nk - Nq); tiles wholly
above the diagonal are never loaded; a row that sees no key gets O = 0 and L = -inf.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import address
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from ..tiles import Tile
from ..blocks.numerics import LOG2E
from ..blocks.softmax import fragment_softmax, row_lse
from ..blocks.tf32 import SPLIT_ROUNDS, head_dim_for, products, split_round_for_device  # noqa: F401 (re-exported)
from ..ptx import ld_shared_f32x4, st_shared_f32x4
from ..jit_cache import compile_kernel

F32 = np.dtype(np.float32)
PASSES = (1, 3)  # tf32 products per fp32 product: 1 (plain TF32) or 3 (3xTF32, fp32 accuracy)
FLAGS = ("presplit", "grid_bh_x")


def kernel_signature():
    """q, k, v, out float32 (any strides, unit last dim), lse float32, n_q, n_k, d, group, scale_log2."""
    io = types.Array(types.float32, 4, "A")
    lse = types.Array(types.float32, 3, "A")
    return types.void(io, io, io, io, lse, int32, int32, int32, int32, float32)


def strides(HEAD_DIM):
    """(QK_STRIDE, V_STRIDE): padded row lengths in words (module docstring: bank conflicts)."""
    qk = HEAD_DIM + (16 if HEAD_DIM % 32 == 0 else 0)
    return qk, HEAD_DIM + 4


def smem_bytes(tile: Tile, passes: int = 3) -> int:
    """Q, K, V tiles (and presplit's K lo, V lo), fp32 words of padded rows."""
    qk, v = strides(tile.head_dim)
    kv = 2 if presplit(tile, passes) else 1
    return 4 * ((tile.block_q + kv * tile.block_k) * qk + kv * tile.block_k * v)


def threads(tile: Tile) -> int:
    """One warp per 16 query rows."""
    return 32 * (tile.block_q // 16)


def presplit(tile: Tile, passes: int) -> bool:
    """presplit acts only with a lo part to split (3 passes)."""
    return tile.has("presplit") and passes == 3


def problems(tile: Tile, passes: int = 3) -> list:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    BLOCK_Q, BLOCK_K, HEAD_DIM = tile.block_q, tile.block_k, tile.head_dim
    if BLOCK_Q % 16 or not 16 <= BLOCK_Q <= 256:
        out.append(f"block_q={BLOCK_Q}: one warp per 16 query rows, 1..16 warps")
    elif tile.warps not in (0, BLOCK_Q // 16):
        out.append(f"{tile.warps} warps: one per 16 of {BLOCK_Q} rows")
    if BLOCK_K not in (8, 16, 24, 32, 64, 96, 128):
        out.append(f"block_k={BLOCK_K}: 8, 16, 24, 32, 64, 96 or 128 (k-steps of P·V are unrolled in 1, 2, 3, 4 or "
                   "groups of 4)")
    if HEAD_DIM not in (16, 32, 64, 96, 128):
        out.append(f"head_dim={HEAD_DIM}: 16, 32, 64, 96 or 128 (pairs of k-steps; n-tiles of O unrolled in 2, 4 or "
                   "groups of 4)")
    if passes not in PASSES:
        out.append(f"passes={passes}: 1 (TF32) or 3 (3xTF32)")
    if tile.stages != 1:
        out.append(f"stages={tile.stages}: one K and one V buffer")
    unknown = sorted(tile.flags - set(FLAGS))
    if unknown:
        out.append(f"flags {unknown}: not among {FLAGS}")
    if not out:
        n_threads, chunks = threads(tile), HEAD_DIM // 4
        if n_threads % chunks or (BLOCK_Q * chunks) % n_threads or (BLOCK_K * chunks) % n_threads:
            out.append(f"tiles of {BLOCK_Q}/{BLOCK_K} rows x {HEAD_DIM} are not whole 16-byte copies per thread "
                       f"({n_threads} threads)")
        if smem_bytes(tile, passes) > SMEM_PER_BLOCK_MAX:
            out.append(f"{smem_bytes(tile, passes)} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def kernel_source(tile: Tile, causal: bool, passes: int = 3, split_round: str = "rn"):
    """The Python kernel for one specialisation (before cuda.jit; compile tests use it).

    The tensor core adds the products of an mma into its fp32 accumulator with truncation, so a long chain
    of mma on one accumulator drifts (H200, fp32 d128: max |O - fp64| 6.3e-6 at N4096 with one chain per
    row, against 3.9e-7 to 4.9e-7 for the SIMT kernel). So each n-tile of P·V_j goes into fresh registers
    and is added to acc by a rounded FFMA that also applies alpha (acc = alpha·acc + P·V_j): chains of
    BLOCK_K/8 k-steps, not Nk/8 (5.0e-7 at N4096); likewise each pair of k-steps of S = Q·Kᵀ (6 mma) starts
    from zero and is added to S by an FADD.

    presplit (speed): each thread splits the K and V chunks it copied into hi (in place) and lo (a second
    buffer) once per tile, between the cp.async wait and the barrier that already follows it, so the warps
    read hi and lo instead of each re-splitting the whole tile (4x less cvt work at 4 warps), for twice the
    K/V shared memory. grid_bh_x: the grid is (B·H, Q tiles), Q tiles reversed on y, so every head's
    heaviest causal tile is dispatched before any lighter one (mma_forward's flag of that name).

    passes: 3 (3xTF32) or 1 (TF32); split_round: how operands are split (SPLIT_ROUNDS; "rn" needs sm_90,
    launch picks by device)."""
    BLOCK_Q, BLOCK_K, HEAD_DIM = tile.block_q, tile.block_k, tile.head_dim
    CAUSAL = bool(causal)
    PRESPLIT, GRID_BH_X = presplit(tile, passes), tile.has("grid_bh_x")
    WARPS = BLOCK_Q // 16
    THREADS = 32 * WARPS
    CHUNKS = HEAD_DIM // 4  # 16-byte copies per row
    ROW_STEP = THREADS // CHUNKS  # rows between one thread's successive copies of a tile
    Q_COPIES, KV_COPIES = BLOCK_Q // ROW_STEP, BLOCK_K // ROW_STEP
    QK_PAIRS = HEAD_DIM // 16  # pairs of k-steps of S = Q Kᵀ
    S_TILES = BLOCK_K // 8  # n-tiles of S = k-steps of P V
    O_TILES = HEAD_DIM // 8  # n-tiles of O
    QK_STRIDE, V_STRIDE = strides(HEAD_DIM)
    # Word offsets of the tiles: Q | K | V (| K lo | V lo with presplit)
    SQ, SK, SV = 0, BLOCK_Q * QK_STRIDE, (BLOCK_Q + BLOCK_K) * QK_STRIDE
    SKL = SV + BLOCK_K * V_STRIDE
    SVL = SKL + BLOCK_K * QK_STRIDE
    cp_async, cp_commit, cp_wait = ptx.cp_async_16_zfill, ptx.cp_async_commit, ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    split, mma3 = products(passes, split_round)
    _, _, quad_row_sum, _ = fragment_softmax(S_TILES, O_TILES)
    ex2 = ptx.ex2_approx
    shfl_xor = ptx.shfl_xor_sync
    FULL = ptx.FULL_MASK

    @inline_device
    def split_chunks(smem, tile0, lo0, STRIDE, dst0):
        """presplit: this thread's copied chunks of a tile -> hi in place, lo at the same offset of lo0."""
        for i in range(KV_COPIES):
            off = dst0 + i * (ROW_STEP * STRIDE)
            x0, x1, x2, x3 = ld_shared_f32x4(smem, tile0 + off)
            h0, l0 = split(x0)
            h1, l1 = split(x1)
            h2, l2 = split(x2)
            h3, l3 = split(x3)
            st_shared_f32x4(smem, tile0 + off, h0, h1, h2, h3)
            st_shared_f32x4(smem, lo0 + off, l0, l1, l2, l3)

    @inline_device
    def copy_plan(src, b, h, d, STRIDE):
        """This thread's part of every tile of src[b, h]: (flat element offset of its first copy in
        row 0, row stride, source bytes per copy, shared offset of copy 0 within a tile)."""
        tid = cuda.threadIdx.x
        r0 = tid // CHUNKS
        col = (tid - r0 * CHUNKS) * 4
        col_bytes = min(max(d - col, 0), 4) * 4
        src_col = col if col_bytes > 0 else 0
        row_stride = src.strides[2] // 4
        base = b * (src.strides[0] // 4) + h * (src.strides[1] // 4) + r0 * row_stride + src_col
        return base, row_stride, col_bytes, r0 * STRIDE + col

    @inline_device
    def load_tile(smem, tile0, STRIDE, src, base, row_stride, col_bytes, dst0, row0, n_rows, COPIES):
        """cp.async rows row0.. of src into the tile at word tile0 (zero fill past n_rows and d)."""
        r0 = cuda.threadIdx.x // CHUNKS
        if row0 + COPIES * ROW_STEP <= n_rows:  # the whole tile is inside: no row checks
            for i in range(COPIES):
                cp_async(smem, tile0 + dst0 + i * (ROW_STEP * STRIDE), src,
                         base + (row0 + i * ROW_STEP) * row_stride, col_bytes)
        else:
            for i in range(COPIES):
                row = row0 + r0 + i * ROW_STEP
                nbytes = col_bytes if row < n_rows else 0
                # A zero-byte copy still names an address: the last row, inside the array.
                src_off = base + (min(row, n_rows - 1) - r0) * row_stride
                cp_async(smem, tile0 + dst0 + i * (ROW_STEP * STRIDE), src, src_off, nbytes)

    @inline_device
    def k_split(smem, off):
        """K_j at word off (4 consecutive d of one key) as hi and lo parts."""
        z0, z1, z2, z3 = ld_shared_f32x4(smem, off)
        if PRESPLIT:
            w0, w1, w2, w3 = ld_shared_f32x4(smem, off - SK + SKL)
            return z0, z1, z2, z3, w0, w1, w2, w3
        zh0, zl0 = split(z0)
        zh1, zl1 = split(z1)
        zh2, zl2 = split(z2)
        zh3, zl3 = split(z3)
        return zh0, zh1, zh2, zh3, zl0, zl1, zl2, zl3

    @inline_device
    def v_split(smem, off):
        """V_j's word off as (hi, lo)."""
        if PRESPLIT:
            return smem[off], smem[off - SV + SVL]
        return split(smem[off])

    @inline_device
    def qk_pair(s, nt, smem, k_off, xh0, xh1, xh2, xh3, xl0, xl1, xl2, xl3, yh0, yh1, yh2, yh3,
                yl0, yl1, yl2, yl3):
        """Two k-steps of S[n-tile nt] += Q_w K_jᵀ over the 16 columns of d this pair covers: lane
        (g, t) brings columns 4t..4t+3 of Q rows g, g+8 (x, y) and of K row g of the n-tile."""
        zh0, zh1, zh2, zh3, zl0, zl1, zl2, zl3 = k_split(smem, k_off)
        c = cuda.local.array((1, 4), float32)
        # a0..a3 = A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4]; b0, b1 = B[t, g], B[t+4, g]
        for r in range(4):  # a chain of 6 mma from zero, then one rounded add
            c[0, r] = ZERO
        mma3(c, 0, xh0, yh0, xh1, yh1, xl0, yl0, xl1, yl1, zh0, zh1, zl0, zl1)
        mma3(c, 0, xh2, yh2, xh3, yh3, xl2, yl2, xl3, yl3, zh2, zh3, zl2, zl3)
        for r in range(4):
            s[nt, r] += c[0, r]

    @inline_device
    def pv_col(acc, ph, pl, smem, dt, v_lane, alpha):
        """n-tile dt of O, acc[dt] = alpha·acc[dt] + P·V_j[:, 8dt:8dt+8], P·V_j in fresh registers."""
        c = cuda.local.array((1, 4), float32)
        for r in range(4):
            c[0, r] = ZERO
        for n in range(S_TILES):
            v_row = v_lane + n * 8 * V_STRIDE + dt * 8
            vh0, vl0 = v_split(smem, v_row)  # V[8n + 2t, 8dt + g]
            vh1, vl1 = v_split(smem, v_row + V_STRIDE)  # V[8n + 2t + 1, 8dt + g]
            mma3(c, 0, ph[n, 0], ph[n, 2], ph[n, 1], ph[n, 3], pl[n, 0], pl[n, 2], pl[n, 1], pl[n, 3],
                 vh0, vh1, vl0, vl1)
        acc[dt, 0] = cuda.fma(acc[dt, 0], alpha[0], c[0, 0])
        acc[dt, 1] = cuda.fma(acc[dt, 1], alpha[0], c[0, 1])
        acc[dt, 2] = cuda.fma(acc[dt, 2], alpha[1], c[0, 2])
        acc[dt, 3] = cuda.fma(acc[dt, 3], alpha[1], c[0, 3])

    def tf32_forward(q, k, v, out, lse, n_q, n_k, d, group, scale_log2):
        smem = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)  # Q | K | V, cp.async targets
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        if GRID_BH_X:  # heaviest causal tiles of all heads first
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
        shift = n_k - n_q  # query i sees key j iff j <= i + shift

        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        if CAUSAL:
            visible = min(q0 + BLOCK_Q, n_q) + shift
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_K - 1) // BLOCK_K)

        q_src, q_stride, col_bytes, qk_dst = copy_plan(q, b, h, d, QK_STRIDE)
        k_src, k_stride, _, _ = copy_plan(k, b, h_kv, d, QK_STRIDE)
        v_src, v_stride, _, v_dst = copy_plan(v, b, h_kv, d, V_STRIDE)
        # Prologue: Q and K_0 as one group (the first tile's barrier waits for both).
        load_tile(smem, SQ, QK_STRIDE, q, q_src, q_stride, col_bytes, qk_dst, q0, n_q, Q_COPIES)
        if n_tiles > 0:
            load_tile(smem, SK, QK_STRIDE, k, k_src, k_stride, col_bytes, qk_dst, 0, n_k, KV_COPIES)
        cp_commit()

        # Lane offsets: Q rows g, g + 8 of the warp and K rows g of each n-tile, at columns 4t (+16c);
        # V rows 2t, 2t + 1 (+8n) at column g (+8dt).
        q_lane = SQ + (warp * 16 + g) * QK_STRIDE + 4 * t
        k_lane = SK + g * QK_STRIDE + 4 * t
        v_lane = SV + 2 * t * V_STRIDE + g

        s = cuda.local.array((S_TILES, 4), float32)
        acc = cuda.local.array((O_TILES, 4), float32)
        alpha_r = cuda.local.array(2, float32)  # this tile's rescale of rows g, g + 8, applied with P·V_j
        ph = cuda.local.array((S_TILES, 4), float32)  # P = ph + pl, split once
        pl = cuda.local.array((S_TILES, 4), float32)
        m_i = cuda.local.array(2, float32)  # rows g and g + 8
        l_i = cuda.local.array(2, float32)  # this lane's partial sums; the quad adds them at the end
        for dt in range(O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO

        for j in range(n_tiles):
            k0 = j * BLOCK_K
            cp_wait(0)  # K_j (and Q at j = 0)
            if PRESPLIT:  # every warp left S_{j-1}, which read K lo (the barrier before P·V_{j-1})
                split_chunks(smem, SK, SKL, QK_STRIDE, qk_dst)
            cuda.syncthreads()  # ... for every warp, and every warp has left P·V_{j-1}
            load_tile(smem, SV, V_STRIDE, v, v_src, v_stride, col_bytes, v_dst, k0, n_k, KV_COPIES)
            cp_commit()

            # S = Q K_jᵀ, two k-steps per 16-byte load of each operand row.
            for nt in range(S_TILES):
                for r in range(4):
                    s[nt, r] = ZERO
            for c in range(QK_PAIRS):
                x0, x1, x2, x3 = ld_shared_f32x4(smem, q_lane + 16 * c)  # row g
                y0, y1, y2, y3 = ld_shared_f32x4(smem, q_lane + 8 * QK_STRIDE + 16 * c)  # row g + 8
                xh0, xl0 = split(x0)
                xh1, xl1 = split(x1)
                xh2, xl2 = split(x2)
                xh3, xl3 = split(x3)
                yh0, yl0 = split(y0)
                yh1, yl1 = split(y1)
                yh2, yl2 = split(y2)
                yh3, yl3 = split(y3)
                for nt in range(S_TILES):
                    qk_pair(s, nt, smem, k_lane + nt * 8 * QK_STRIDE + 16 * c, xh0, xh1, xh2, xh3, xl0, xl1, xl2, xl3,
                            yh0, yh1, yh2, yh3, yl0, yl1, yl2, yl3)

            # Mask only tiles that cross the end of the keys or the diagonal (raw scores).
            needs_mask = k0 + BLOCK_K > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_K - 1 > q0 + warp * 16 + shift)
            if needs_mask:
                row_g = q0 + warp * 16 + g
                for nt in range(S_TILES):
                    for r in range(4):
                        col = k0 + nt * 8 + 2 * t + (r & 1)
                        if col >= n_k or (CAUSAL and col > row_g + 8 * (r >> 1) + shift):
                            s[nt, r] = NEG_INF

            # Online softmax on the fragments (quad-wide row maxima), p in place of s.
            for half in range(2):
                m_tile = NEG_INF
                for nt in range(S_TILES):
                    m_tile = max(m_tile, max(s[nt, 2 * half], s[nt, 2 * half + 1]))
                m_tile = max(m_tile, shfl_xor(FULL, m_tile, 1))
                m_tile = max(m_tile, shfl_xor(FULL, m_tile, 2))
                # m_i is kept scaled (M = m·scale·log2 e, rounded once): p = 2^(s·c − M) by one FFMA, and
                # alpha = 2^(M_old − M_new) is then exactly the factor that moves the earlier p's to the new
                # M (1 while the maximum holds). Unscaled m with alpha from m_old·c − m_new·c was contracted
                # by NVVM to an FMA that left alpha = 1 ± 2^-23 on every tile: L drifted by 4e-5 at Nk 16384.
                # A row with nothing visible yet keeps M = -inf; subtract 0 so ex2 gives 0, not nan.
                m_new = max(m_i[half], m_tile * scale_log2)
                alpha = ZERO if m_new == NEG_INF else ex2(m_i[half] - m_new)
                m_scaled = ZERO if m_new == NEG_INF else m_new
                row_sum = ZERO
                for nt in range(S_TILES):
                    for e in range(2):
                        p = ex2(cuda.fma(s[nt, 2 * half + e], scale_log2, -m_scaled))
                        s[nt, 2 * half + e] = p
                        row_sum += p
                l_i[half] = alpha * l_i[half] + row_sum
                m_i[half] = m_new
                alpha_r[half] = alpha  # applied with P·V_j below

            cp_wait(0)  # V_j
            if PRESPLIT:  # every warp left P·V_{j-1}, which read V lo (the barrier at the top of this tile)
                split_chunks(smem, SV, SVL, V_STRIDE, v_dst)
            cuda.syncthreads()  # ... for every warp; and every warp is done reading K_j
            if j + 1 < n_tiles:  # K_{j+1} under P·V_j
                load_tile(smem, SK, QK_STRIDE, k, k_src, k_stride, col_bytes, qk_dst, k0 + BLOCK_K, n_k, KV_COPIES)
            cp_commit()

            # acc = alpha·acc + P·V_j, one call per n-tile of O (constant indices: registers)
            for n in range(S_TILES):
                for r in range(4):
                    ph[n, r], pl[n, r] = split(s[n, r])
            pv_col(acc, ph, pl, smem, 0, v_lane, alpha_r)
            pv_col(acc, ph, pl, smem, 1, v_lane, alpha_r)
            if O_TILES > 2:
                pv_col(acc, ph, pl, smem, 2, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 3, v_lane, alpha_r)
            if O_TILES > 4:
                pv_col(acc, ph, pl, smem, 4, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 5, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 6, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 7, v_lane, alpha_r)
            if O_TILES > 8:
                pv_col(acc, ph, pl, smem, 8, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 9, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 10, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 11, v_lane, alpha_r)
            if O_TILES > 12:
                pv_col(acc, ph, pl, smem, 12, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 13, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 14, v_lane, alpha_r)
                pv_col(acc, ph, pl, smem, 15, v_lane, alpha_r)

        cp_wait(0)  # nothing may be in flight when the block exits (n_tiles == 0 included)

        # Epilogue: the quad's partial sums, O = acc / l_i, L = (m_i·scale_log2 + log2 l_i)·ln 2.
        for half in range(2):
            l_row = quad_row_sum(l_i, half)
            row = q0 + warp * 16 + 8 * half + g
            inv_l = float32(1.0) / l_row if l_row != ZERO else ZERO  # a fully masked row: O = 0
            if row < n_q:
                if t == 0:
                    if l_row != ZERO:
                        lse[b, h, row] = row_lse(m_i[half], l_row)
                    else:
                        lse[b, h, row] = NEG_INF
                for dt in range(O_TILES):
                    col = dt * 8 + 2 * t
                    if col < d:
                        out[b, h, row, col] = acc[dt, 2 * half] * inv_l
                    if col + 1 < d:
                        out[b, h, row, col + 1] = acc[dt, 2 * half + 1] * inv_l

    return tf32_forward


@lru_cache(maxsize=None)
def build(tile: Tile, causal: bool, passes: int = 3, split_round: str = "rn"):
    """The compiled kernel for one specialisation; cached so each compiles once."""
    bad = problems(tile, passes)
    if bad:
        raise ValueError(f"tf32 forward ({tile}, passes={passes}) cannot be built: {'; '.join(bad)}")
    return compile_kernel(("tf32_forward", tile, bool(causal), int(passes), split_round), kernel_signature(),
                          kernel_source(tile, bool(causal), int(passes), split_round))


def launch(q, k, v, out, lse, tile: Tile, *, causal, softmax_scale, passes=3, stream=0, split_round=None,
           layout_checked=False):
    """Run the tf32 tensor-core forward on float32 device arrays; the caller has validated the problem.

    q, out (B, H, Nq, d); k, v (B, Hkv, Nk, d), H % Hkv == 0; lse (B, H, Nq) float32 receives the
    natural-log logsumexp of the scaled scores (-inf for a row that sees no key). tile: the specialisation
    (configs.TF32_TABLE's); d <= tile.head_dim, the kernel zero-pads. Strides: unit last dim, every other
    stride of q, k, v a multiple of 4 elements and 16-byte aligned bases (cp.async). passes 3 (3xTF32,
    default) or 1 (TF32); split_round: one of SPLIT_ROUNDS (default: split_round_for_device).
    Shapes of k vs v and of out / lse are the caller's to match (numba_flash.forward validates them)."""
    B, H, n_q, d = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if not layout_checked:
        _check_layout(q, k, v, out, lse, d, tile.head_dim)
    if B * H * n_q == 0:
        return
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    q_tiles = (n_q + tile.block_q - 1) // tile.block_q
    grid_bh_x = tile.has("grid_bh_x")
    if grid_bh_x and q_tiles > 65535 >= B * H:  # the y axis holds 65535 Q tiles; the other grid runs the same maths
        grid_bh_x = False
        tile = tile.with_(flags=tile.flags - {"grid_bh_x"})
    if (q_tiles if grid_bh_x else B * H) > 65535:
        raise ValueError(f"{'Q tiles' if grid_bh_x else 'B*H'} = {q_tiles if grid_bh_x else B * H} exceeds the "
                         "grid's y limit of 65535")
    if tile.has("presplit") and passes != 3:
        tile = tile.with_(flags=tile.flags - {"presplit"})  # one pass has no lo to split: one build for both keys
    kernel = build(tile, bool(causal), int(passes), split_round_for_device(split_round))
    grid = (B * H, q_tiles) if grid_bh_x else (q_tiles, B * H)
    launch_kernel(kernel, grid, threads(tile), stream, smem_bytes(tile, passes),
                  q, k, v, out, lse, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))


def _check_layout(q, k, v, out, lse, d, HEAD_DIM):
    if d > HEAD_DIM:
        raise ValueError(f"head dim {d} > HEAD_DIM={HEAD_DIM}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"H={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if x.dtype != F32:
            raise ValueError(f"{name} must be float32, got {x.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x.strides[-1] != 4:
            raise ValueError(f"{name}: last dim must have unit stride, strides are {x.strides}")
        if name != "out" and (any(s % 16 for s in x.strides[:-1]) or address(x) % 16):
            raise ValueError(f"{name}: strides {x.strides} (bytes) and the data pointer must be multiples of 16 "
                             "for cp.async")
