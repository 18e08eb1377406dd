"""fp32 FlashAttention-2 backward on tensor cores: mma.sync m16n8k8 tf32, split 3xTF32 (auto for fp32).

Maths: kernels/mma_dkdv.py's (reference/backward.py, section 3.6.7), with P rebuilt from the saved L:

    L2 = L·log2(e)   (+inf for a row that sees no key: its P = exp2(… − inf) = 0)
    P  = exp2(S·scale·log2(e) − L2),   D = rowsum(dO ∘ O)
    dP = dO Vᵀ,   dS = P ∘ (dP − D),   dV = Pᵀ dO,   dK = scale·dSᵀ Q,   dQ = scale·dS K

Every product is formed as in tf32_forward: each fp32 operand split x = hi + lo (tf32 parts), three
tf32 products lo·hi + hi·lo + hi·hi per fp32 product, small terms first. Kernels on one stream, in
the 16-bit backward's schemes (numba_flash/backward_plan.py runs them): prep, dkdv and the separate dq
kernel below (7 tile products, no atomics), or prep and dkdv built with ATOMIC_DQ (dkdv_source,
atomic_dq_phase: the dkdv kernel also forms dQ_i += dS_i K_j, 5 tile products, into fp32 planes: one with
atomic adds for deterministic=False, or the deterministic splits) and convert (dq = scale · the planes
summed in order):

1. prep: D and L2 into fp32 scratch (B·H, NQ_PAD) (kernels/bwd_prep.py on fp32, by 16-byte loads where the rows allow).
2. dkdv: one block per (BLOCK_N keys, batch · kv head), warp w owning keys 16w..16w+15; the block
   streams (query head of the group, Q tile) steps, so the GQA sum needs no atomics:

       Sᵀ  = K_w · Q_iᵀ      pattern 1 (A = K rows, B = Q rows, both over d)
       dPᵀ = V_w · dO_iᵀ     pattern 1
       Pᵀ  = exp2(Sᵀ·c − L2[query]),  dSᵀ = Pᵀ ∘ (dPᵀ − D[query])
       dV_w += Pᵀ · dO_i     pattern 2 (A = the Pᵀ accumulators, B = dO rows 2t, 2t+1 at column g)
       dK_w += dSᵀ · Q_i     pattern 2

3. dq: one block per (BLOCK_M queries, batch · head), warp w owning queries 16w..16w+15:

       S = Q_w · K_jᵀ,  dP = dO_w · V_jᵀ     pattern 1 both
       dS = exp2(S·c − L2[row]) ∘ (dP − D[row])
       dQ_w += dS · K_j                       pattern 2 (K rows 2t, 2t+1 at column g)

Fragment patterns (tf32_forward's docstring): pattern 1 reads A and B rows over the summed dim with
one 16-byte shared load per row feeding two k-steps; pattern 2 takes an accumulator's columns 2t,
2t+1 as k-indices t, t+4, so the B operand is read at rows 8n+2t, 8n+2t+1. Accumulation truncates
on the tensor core, so each pair of k-steps of a pattern-1 product and each n-tile of a pattern-2
product per streamed tile starts from zero and is added to its fp32 total by a rounded FADD.

Shared memory (fp32 words): tiles read only by pattern 1 have rows padded to S1 (== 16 mod 32:
conflict-free 16-byte loads). No row padding serves both patterns (pattern 1 wants rows == 16 mod
32, pattern 2 rows == 4 mod 16): tiles read both ways (Q, dO in dkdv; K in dq) use S2 = HEAD_DIM + 8,
two-way conflicts in each pattern instead of four-way in one (ncu on an H200: 43 % of the d = 128
dkdv's shared wavefronts and 32 % of dq's are bank conflicts). Unpadded rows with 16-byte chunks
XOR-swizzled were conflict-free in both patterns but slower (the XOR offsets cost registers; the
verdict is in benchmarks/DESIGN.md's variants that did not ship).
Tiles arrive by cp.async with zero fill past the sequence and d; the streamed ones (Q, dO, L2, D
in dkdv; K, V in dq) are double-buffered: at the top of step i one barrier says tile i has landed
and every warp has left step i − 1, whose buffer then receives tile i + 1 while step i computes.

Causal masking aligns to the bottom right (query i sees key j iff j <= i + Nk − Nq): dkdv starts at
the first Q tile that sees its keys, dq stops after the last K/V tile its rows see; a fully masked
row has L2 = +inf (P = 0) and gets dq = 0.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, types

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from ..ptx import bits_from_f32
from ..ptx import ld_shared_f32x4 as ld4  # 16-byte shared load
from ..blocks.entry import dkdv_entry, kernel_signature as _signature, launch_dq_in_dkdv
from ..blocks.mask import clamps_past_end, mask_kind
from ..blocks.schedule import ROW_PAD
from ..blocks.tf32 import SPLIT_ROUNDS, products
from ..jit_cache import compile_kernel

KERNELS = ("dkdv", "dq")


# --------------------------------------------------------------------------------------------
# Shapes of a specialisation
# --------------------------------------------------------------------------------------------
def strides(HEAD_DIM):
    """(S1, S2): row lengths in words of tiles read by pattern 1 only, and by both patterns (padded by 8)."""
    return HEAD_DIM + (16 if HEAD_DIM % 32 == 0 else 0), HEAD_DIM + 8


def threads(block_own):
    """One warp per 16 rows of the block's own tile (keys in dkdv, queries in dq)."""
    return 32 * (block_own // 16)


def stage_words(kernel, block_streamed, HEAD_DIM):
    """One buffer of the streamed tiles: dkdv Q, dO (S2) | L2, D; dq K (S2) | V (S1)."""
    s1, s2 = strides(HEAD_DIM)
    if kernel == "dkdv":
        return 2 * block_streamed * s2 + 2 * block_streamed
    return block_streamed * (s1 + s2)


def ds_in_stage(block_n, HEAD_DIM):
    """Whether the atomic dQ phase's dS (hi and lo, BLOCK_M x BLOCK_N words each) goes over the step's Q and
    dO buffers (rows of S2 >= BLOCK_N words: no extra shared memory, one more barrier) or a region of its own."""
    return block_n <= strides(HEAD_DIM)[1]


def smem_bytes(kernel, block_own, block_streamed, HEAD_DIM, atomic_dq=False):
    """The own tiles once (dkdv: K, V; dq: Q, dO; rows of S1), the streamed ones twice (double buffer);
    with atomic_dq (dkdv), dS's own region where it does not fit the stage (ds_in_stage)."""
    ds = 2 * block_streamed * block_own if atomic_dq and not ds_in_stage(block_own, HEAD_DIM) else 0
    return 4 * (2 * block_own * strides(HEAD_DIM)[0] + 2 * stage_words(kernel, block_streamed, HEAD_DIM)
                + ds)


def problems(kernel, block_own, block_streamed, HEAD_DIM):
    """Why a specialisation cannot be built (empty when it can)."""
    if kernel not in KERNELS:
        return [f"kernel={kernel!r} not in {KERNELS}"]
    out = []
    if block_own % 16 or not 16 <= block_own <= 128:
        out.append(f"own tile of {block_own} rows: one warp per 16 rows, 1..8 warps")
    if block_streamed not in (8, 16, 32, 64):
        out.append(f"streamed tile of {block_streamed} rows: 8, 16, 32 or 64 (n-tiles of 8, divides {ROW_PAD})")
    elif kernel == "dkdv" and block_streamed // 2 > threads(block_own or 16):
        out.append(f"{block_streamed} queries' L2 and D need {block_streamed // 2} copying threads")
    if kernel == "dq" and ROW_PAD % max(block_own, 1):
        out.append(f"dq tile of {block_own} rows does not divide the scratch padding {ROW_PAD}")
    if HEAD_DIM not in (32, 64, 128):
        out.append(f"HEAD_DIM={HEAD_DIM}: 32, 64 or 128")
    if not out and smem_bytes(kernel, block_own, block_streamed, HEAD_DIM) > SMEM_PER_BLOCK_MAX:
        out.append(f"{smem_bytes(kernel, block_own, block_streamed, HEAD_DIM)} B of shared memory > "
                   f"{SMEM_PER_BLOCK_MAX}")
    return out


# --------------------------------------------------------------------------------------------
# Kernel sources
# --------------------------------------------------------------------------------------------
def kernel_signature(kernel, atomic_dq=False, dq_splits=False):
    """blocks.entry.kernel_signature on fp32 arrays."""
    return _signature(kernel, atomic_dq, dq_splits, types.float32)


def _helpers(THREADS, HEAD_DIM, SPLIT_ROUND):
    """Device functions both kernels share: tile copies, the split, 3xTF32 mma, the two patterns.
    SPLIT_ROUND: blocks.tf32.SPLIT_ROUNDS."""
    S2 = strides(HEAD_DIM)[1]
    CHUNKS = HEAD_DIM // 4  # 16-byte copies per row
    PAIRS = HEAD_DIM // 16  # pairs of k-steps over d (pattern 1)
    O_TILES = HEAD_DIM // 8  # n-tiles over d (pattern 2)
    cp_async = ptx.cp_async_16_zfill
    ZERO = float32(0.0)

    split, mma3 = products(3, SPLIT_ROUND)

    @inline_device
    def load_tile(smem, tile0, STRIDE, src, b, h, row0, n_rows, d, ROWS):
        """cp.async rows row0.. of src[b, h] into the tile at word tile0 (zero fill past n_rows and d)."""
        rs = src.strides[2] // 4
        base = b * (src.strides[0] // 4) + h * (src.strides[1] // 4)
        for i in range((ROWS * CHUNKS + THREADS - 1) // THREADS):
            idx = cuda.threadIdx.x + i * THREADS
            if idx < ROWS * CHUNKS:
                r = idx // CHUNKS
                chunk = idx - r * CHUNKS
                col = chunk * 4
                row = row0 + r
                nbytes = min(max(d - col, 0), 4) * 4 if row < n_rows else 0
                # a zero-byte copy still names an address inside the array: row 0 of the tile's rows, column 0
                src_off = base + (row * rs + col if nbytes > 0 else min(row0, n_rows - 1) * rs)
                cp_async(smem, tile0 + r * STRIDE + (chunk << 2), src, src_off, nbytes)

    @inline_device
    def pattern1(out, smem, a_lane, A_STRIDE, b_lane, B_STRIDE, N_TILES):
        """out[nt] = A_w · Bᵀ for n-tiles nt < N_TILES over all of d: lane (g, t) brings columns
        16c + 4t .. +3 of A rows g, g + 8 (a_lane) and of B row 8nt + g (b_lane: the row's column 4t);
        each pair of k-steps starts from zero and is added by an FADD. b_lane + 16c: an immediate on one
        register."""
        c = cuda.local.array((1, 4), float32)
        for nt in range(N_TILES):
            for r in range(4):
                out[nt, r] = ZERO
        for cc in range(PAIRS):
            x0, x1, x2, x3 = ld4(smem, a_lane + 16 * cc)  # row g
            y0, y1, y2, y3 = ld4(smem, a_lane + 8 * A_STRIDE + 16 * cc)  # row g + 8
            xh0, xl0 = split(x0)
            xh1, xl1 = split(x1)
            xh2, xl2 = split(x2)
            xh3, xl3 = split(x3)
            yh0, yl0 = split(y0)
            yh1, yl1 = split(y1)
            yh2, yl2 = split(y2)
            yh3, yl3 = split(y3)
            for nt in range(N_TILES):
                z0, z1, z2, z3 = ld4(smem, b_lane + nt * 8 * B_STRIDE + 16 * cc)
                zh0, zl0 = split(z0)
                zh1, zl1 = split(z1)
                zh2, zl2 = split(z2)
                zh3, zl3 = split(z3)
                for r in range(4):
                    c[0, r] = ZERO
                # a0..a3 = A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4]; b0, b1 = B[t, g], B[t+4, g]
                mma3(c, 0, xh0, yh0, xh1, yh1, xl0, yl0, xl1, yl1, zh0, zh1, zl0, zl1)
                mma3(c, 0, xh2, yh2, xh3, yh3, xl2, yl2, xl3, yl3, zh2, zh3, zl2, zl3)
                for r in range(4):
                    out[nt, r] += c[0, r]

    @inline_device
    def pattern2_tile(acc, ah, al, smem, b_lane, dt, K_STEPS):
        """acc[dt] += A · B[:, 8dt:8dt+8] in fresh registers, A = the accumulators ah + al (columns
        8n + 2t, 8n + 2t + 1 as k-indices t, t + 4 of k-step n), B rows 8n + 2t (+1) at column 8dt + g:
        b_lane = row 2t's start + g."""
        c = cuda.local.array((1, 4), float32)
        for r in range(4):
            c[0, r] = ZERO
        for n in range(K_STEPS):
            off = b_lane + n * 8 * S2 + dt * 8  # 8dt + g of both rows: immediates on one register
            bh0, bl0 = split(smem[off])
            bh1, bl1 = split(smem[off + S2])
            mma3(c, 0, ah[n, 0], ah[n, 2], ah[n, 1], ah[n, 3], al[n, 0], al[n, 2], al[n, 1], al[n, 3],
                 bh0, bh1, bl0, bl1)
        for r in range(4):
            acc[dt, r] += c[0, r]

    @inline_device
    def pattern2(acc, ah, al, smem, b_lane, K_STEPS):
        """Every n-tile of acc (16 x HEAD_DIM) += A · B, one call per n-tile (constant indices: registers)."""
        pattern2_tile(acc, ah, al, smem, b_lane, 0, K_STEPS)
        pattern2_tile(acc, ah, al, smem, b_lane, 1, K_STEPS)
        pattern2_tile(acc, ah, al, smem, b_lane, 2, K_STEPS)
        pattern2_tile(acc, ah, al, smem, b_lane, 3, K_STEPS)
        if O_TILES > 4:
            pattern2_tile(acc, ah, al, smem, b_lane, 4, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 5, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 6, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 7, K_STEPS)
        if O_TILES > 8:
            pattern2_tile(acc, ah, al, smem, b_lane, 8, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 9, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 10, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 11, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 12, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 13, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 14, K_STEPS)
            pattern2_tile(acc, ah, al, smem, b_lane, 15, K_STEPS)

    @inline_device
    def split_all(x, lo, N):
        """x[n] -> hi in place, lo[n] (pattern 2's A operand, split once per tile)."""
        for n in range(N):
            for r in range(4):
                x[n, r], lo[n, r] = split(x[n, r])

    @inline_device
    def store_rows(dst, acc, b, h, row0, g, t, n_rows, d, scale):
        """dst[b, h, rows row0 + g (+8), d columns] = scale · acc (rows past n_rows, columns past d skipped)."""
        for half in range(2):
            row = row0 + g + 8 * half
            if row < n_rows:
                for dt in range(O_TILES):
                    col = dt * 8 + 2 * t
                    if col < d:
                        dst[b, h, row, col] = acc[dt, 2 * half] * scale
                    if col + 1 < d:
                        dst[b, h, row, col + 1] = acc[dt, 2 * half + 1] * scale

    return load_tile, pattern1, pattern2, split_all, store_rows



def dq_warps(block_n, block_m, head_dim):
    """(query groups, column slices, n-tiles a warp) of the atomic dQ phase: warp w computes dQ_i's 16 rows
    16 (w mod QG).. and HEAD_DIM / SLICES columns (w div QG)·COLS.., COLS / 8 n-tiles."""
    warps = block_n // 16
    qg = block_m // 16
    slices = max(warps // max(qg, 1), 1)
    return qg, slices, head_dim // (8 * slices)


def atomic_problems(block_n, block_m, head_dim):
    """Why the dkdv kernel of these tiles cannot also form dQ (empty when it can)."""
    qg, slices, dq_tiles = dq_warps(block_n, block_m, head_dim)
    if block_m % 16 or qg < 1:  # add_dq reads whole 16-row fragments of dS
        return [f"{block_m}-query steps: the dQ phase needs whole groups of 16 queries"]
    out = []
    if (block_n // 16) % qg or dq_tiles < 1 or dq_tiles * 8 * slices != head_dim:
        out.append(f"{block_n // 16} warps do not tile dQ_i ({block_m} rows = {qg} groups of 16, {head_dim} "
                   f"columns in whole n-tiles)")
    if smem_bytes("dkdv", block_n, block_m, head_dim, atomic_dq=True) > SMEM_PER_BLOCK_MAX:
        out.append(f"{smem_bytes('dkdv', block_n, block_m, head_dim, atomic_dq=True)} B of shared memory with dS's "
                   f"region > {SMEM_PER_BLOCK_MAX}")
    return out


def atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, SK, S1, VECTOR_RED=True, SPLIT_ROUND="rn"):
    """The atomic dQ phase of the dK/dV kernel (dkdv_source with ATOMIC_DQ; mma_dkdv's FA2 scheme in
    3xTF32): dQ_i += dS_i K_j over the block's BLOCK_N keys, added to fp32 scratch.

    (store_ds, add_dq). store_ds: each warp writes its dSᵀ (hi and lo parts, split once for dK) to shared
    memory in the consumer's fragment order: per (16-query group qg, k-step ks of 8 keys) 32 lanes x 4
    words, lane L's a0..a3 (dS[g][t], dS[g+8][t], dS[g][t+4], dS[g+8][t+4]) at slot L ^ ((L >> 1) & 4),
    so add_dq reads a fragment with one 16-byte load (the XOR halves the stores' bank conflicts: 2-way).
    add_dq: warp w owns query group w mod QG and COLS = HEAD_DIM / SLICES columns. Its n-tile nt's
    n-index j is column col0 + DQ_TILES·j + nt, so lane g reads B = K[key][col0 + DQ_TILES·g ..] for every
    n-tile with one 16-byte load, and its accumulators cover 2·DQ_TILES adjacent columns of rows g, g + 8:
    red.global.add.v4.f32 (sm_90; VECTOR_RED) or scalar adds, st.global where ``first`` (the deterministic
    splits' first launch). Each pair of k-steps starts from zero and is added by an FADD (the tensor core
    truncates its accumulation, tf32_forward)."""
    QG, SLICES, DQ_TILES = dq_warps(BLOCK_N, BLOCK_M, HEAD_DIM)
    bad = atomic_problems(BLOCK_N, BLOCK_M, HEAD_DIM)
    if bad:
        raise ValueError("; ".join(bad))
    KS = BLOCK_N // 8  # k-steps over the block's keys
    COLS = DQ_TILES * 8
    M_TILES = BLOCK_M // 8
    VEC_B = DQ_TILES % 4 == 0  # B by 16-byte loads (else one word per n-tile)
    WIDE = 2 * DQ_TILES  # adjacent columns a lane holds per row
    split, mma3 = products(3, SPLIT_ROUND)
    red1, red4, st4 = ptx.red_add_f32, ptx.red_add_v4_f32, ptx.st_global_v4
    red2, st2 = ptx.red_add_v2_f32, ptx.st_global_v2_f32
    bits = bits_from_f32
    ZERO = float32(0.0)

    @inline_device
    def store_ds(smem, s_hi, s_lo, dp, lo, warp, g, t):
        """dSᵀ of this warp (keys 16w + g (+8), queries 8nt + 2t (+1): dp hi, lo lo) in fragment order."""
        for nt in range(M_TILES):
            for r in range(4):
                lane_c = 4 * (2 * t + (r & 1)) + (g & 3)  # the consumer lane of query 8nt+2t+(r&1), key g
                slot = lane_c ^ ((lane_c >> 1) & 4)
                word = (((nt >> 1) * KS + 2 * warp + (r >> 1)) * 32 + slot) * 4 + (nt & 1) + 2 * (g >> 2)
                smem[s_hi + word] = dp[nt, r]
                smem[s_lo + word] = lo[nt, r]

    @inline_device
    def add_dq(smem, s_hi, s_lo, dq_acc, row0, warp, lane, g, t, first):
        """dQ_i[rows 16qg + g (+8), COLS columns] += dS_i K_j; row0: flat offset of dQ_i's row 0 in dq_acc."""
        qg = warp % QG
        col0 = (warp // QG) * COLS
        a_off = qg * KS * 128 + 4 * (lane ^ ((lane >> 1) & 4))
        b_lane = SK + t * S1 + col0 + DQ_TILES * g
        acc = cuda.local.array((DQ_TILES, 4), float32)
        c = cuda.local.array((DQ_TILES, 4), float32)
        z = cuda.local.array((2, DQ_TILES), float32)
        for nt in range(DQ_TILES):
            for r in range(4):
                acc[nt, r] = ZERO
        for kp in range(KS // 2):  # pairs of k-steps: 16 keys
            for nt in range(DQ_TILES):
                for r in range(4):
                    c[nt, r] = ZERO
            for half in range(2):
                ks = 2 * kp + half
                a0, a1, a2, a3 = ld4(smem, s_hi + a_off + ks * 128)
                l0, l1, l2, l3 = ld4(smem, s_lo + a_off + ks * 128)
                for kr in range(2):  # keys 8ks + t and 8ks + t + 4
                    row = b_lane + (8 * ks + 4 * kr) * S1
                    if VEC_B:
                        for q4 in range(DQ_TILES // 4):
                            z[kr, 4 * q4], z[kr, 4 * q4 + 1], z[kr, 4 * q4 + 2], z[kr, 4 * q4 + 3] = ld4(
                                smem, row + 4 * q4)
                    else:
                        for nt in range(DQ_TILES):
                            z[kr, nt] = smem[row + nt]
                for nt in range(DQ_TILES):
                    bh0, bl0 = split(z[0, nt])
                    bh1, bl1 = split(z[1, nt])
                    mma3(c, nt, a0, a1, a2, a3, l0, l1, l2, l3, bh0, bh1, bl0, bl1)
            for nt in range(DQ_TILES):
                for r in range(4):
                    acc[nt, r] += c[nt, r]
        # lane (g, t) holds columns col0 + 2t·DQ_TILES + e of rows g, g + 8, e = j·DQ_TILES + nt: acc[nt, 2·half + j]
        for half in range(2):
            off = row0 + (16 * qg + g + 8 * half) * HEAD_DIM + col0 + 2 * t * DQ_TILES  # padded: no bounds checks
            for e4 in range(0, WIDE, 4 if WIDE >= 4 else 2):
                if WIDE >= 4:
                    x0 = acc[e4 % DQ_TILES, 2 * half + e4 // DQ_TILES]
                    x1 = acc[(e4 + 1) % DQ_TILES, 2 * half + (e4 + 1) // DQ_TILES]
                    x2 = acc[(e4 + 2) % DQ_TILES, 2 * half + (e4 + 2) // DQ_TILES]
                    x3 = acc[(e4 + 3) % DQ_TILES, 2 * half + (e4 + 3) // DQ_TILES]
                    if first:
                        st4(dq_acc, off + e4, bits(x0), bits(x1), bits(x2), bits(x3))
                    elif VECTOR_RED:
                        red4(dq_acc, off + e4, x0, x1, x2, x3)
                    else:
                        red1(dq_acc, off + e4, x0)
                        red1(dq_acc, off + e4 + 1, x1)
                        red1(dq_acc, off + e4 + 2, x2)
                        red1(dq_acc, off + e4 + 3, x3)
                else:  # one n-tile: columns 2t, 2t + 1
                    x0 = acc[0, 2 * half]
                    x1 = acc[0, 2 * half + 1]
                    if first:
                        st2(dq_acc, off, x0, x1)
                    elif VECTOR_RED:
                        red2(dq_acc, off, x0, x1)
                    else:
                        red1(dq_acc, off, x0)
                        red1(dq_acc, off + 1, x1)

    return store_ds, add_dq


def dkdv_source(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, ATOMIC_DQ=False, DQ_SPLITS=0, VECTOR_RED=True, SPLIT_ROUND="rn"):
    """The dK/dV kernel: BLOCK_N keys per block (one warp per 16), BLOCK_M-query tiles streamed.

    ATOMIC_DQ: the kernel also forms dQ (FA2's scheme, mma_dkdv's dQ-in-dkdv): after dV and dK, dSᵀ into
    shared memory (atomic_dq_phase), a barrier, then dQ_i += dS_i K_j added to fp32 scratch dq_acc. dS goes
    over this step's dO (hi parts) and Q (lo) buffers where it fits (ds_in_stage: d128, no room for more),
    after a barrier that says every warp has read them; else into a region of its own after the stages
    (the barrier at the top of the next step keeps it until every warp has read it). Without DQ_SPLITS
    every block adds into one zeroed plane, atomics in any order (deterministic=False). DQ_SPLITS:
    the deterministic splits (blocks.entry.dkdv_entry): 1 = block x adds into plane x (a view of dq_acc from row
    x·plane_rows), key block kb0 + x; 2 = the same, storing (the first launch, into planes nobody zeroed)."""
    FIRST_STORES = DQ_SPLITS == 2  # a compile-time constant: the other builds' stores are pruned
    THREADS = threads(BLOCK_N)
    O_TILES = HEAD_DIM // 8
    M_TILES = BLOCK_M // 8  # n-tiles of Sᵀ / dPᵀ = k-steps of dV, dK
    S1, S2 = strides(HEAD_DIM)
    SK, SV = 0, BLOCK_N * S1
    STAGE0, STAGE = 2 * BLOCK_N * S1, stage_words("dkdv", BLOCK_M, HEAD_DIM)  # two buffers of:
    SQ = STAGE0
    SDO = SQ + BLOCK_M * S2
    SL = SDO + BLOCK_M * S2  # L2 of the tile's queries, then D
    SD = SL + BLOCK_M
    CAUSAL = bool(CAUSAL)
    ROW_CHUNKS = BLOCK_M // 4  # 16-byte copies of a tile's L2 (or D)
    load_tile, pattern1, pattern2, split_all, store_rows = _helpers(THREADS, HEAD_DIM, SPLIT_ROUND)
    if ATOMIC_DQ:
        store_ds, add_dq = atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, SK, S1, VECTOR_RED, SPLIT_ROUND)
    DS_IN_STAGE = ds_in_stage(BLOCK_N, HEAD_DIM)
    SDS = STAGE0 + 2 * STAGE  # dS's own region (hi, then lo) where it does not fit the stage
    ex2 = ptx.ex2_approx
    cp_async, cp_commit, cp_wait = ptx.cp_async_16_zfill, ptx.cp_async_commit, ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    CLAMP_P = clamps_past_end(mask_kind(CAUSAL), ATOMIC_DQ)

    @inline_device
    def load_stage(smem, step, q, dout, l2, dd, b, h_kv, group, n_kv_heads, qt0, per_head, n_q, d):
        """Step step's Q_i, dO_i, L2 and D into buffer step & 1 by cp.async (one group with whatever
        else is in flight); steps run head-major over the group's query heads."""
        hh = step // per_head
        i0 = (qt0 + step - hh * per_head) * BLOCK_M
        h = h_kv * group + hh
        st = (step & 1) * STAGE
        load_tile(smem, SQ + st, S2, q, b, h, i0, n_q, d, BLOCK_M)
        load_tile(smem, SDO + st, S2, dout, b, h, i0, n_q, d, BLOCK_M)
        tid = cuda.threadIdx.x
        row = (b * (group * n_kv_heads) + h) * (l2.strides[0] // 4) + i0  # padded: i0 + BLOCK_M <= NQ_PAD
        if tid < ROW_CHUNKS:
            cp_async(smem, SL + st + 4 * tid, l2, row + 4 * tid, 16)
        elif tid < 2 * ROW_CHUNKS:
            cp_async(smem, SD + st + 4 * (tid - ROW_CHUNKS), dd, row + 4 * (tid - ROW_CHUNKS), 16)

    @inline_device
    def dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb):
        """The kernel for key block kb; dq_acc: the plane dQ goes to (ATOMIC_DQ; else unused)."""
        smem = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        bh = cuda.blockIdx.y
        n_kv_heads = k.shape[1]
        b = bh // n_kv_heads
        h_kv = bh - b * n_kv_heads
        k0 = kb * BLOCK_N
        kw = k0 + warp * 16  # this warp's first key
        shift = n_k - n_q  # query i sees key j iff j <= i + shift

        # (query head, Q tile) steps, head-major; causal starts at the first tile that sees key k0
        n_qt = (n_q + BLOCK_M - 1) // BLOCK_M
        qt0 = min(max(k0 - shift, 0) // BLOCK_M, n_qt) if CAUSAL else 0
        per_head = n_qt - qt0
        steps = group * per_head

        load_tile(smem, SK, S1, k, b, h_kv, k0, n_k, d, BLOCK_N)
        load_tile(smem, SV, S1, v, b, h_kv, k0, n_k, d, BLOCK_N)
        if steps > 0:
            load_stage(smem, 0, q, dout, l2, dd, b, h_kv, group, n_kv_heads, qt0, per_head, n_q, d)
        cp_commit()

        # Lane offsets: K, V rows g (+8) of the warp and Q, dO rows g of each n-tile at columns 4t
        # (pattern 1); Q, dO rows 2t (+1) at column g (pattern 2).
        k_lane = SK + (warp * 16 + g) * S1 + 4 * t
        v_lane = SV + (warp * 16 + g) * S1 + 4 * t
        q_lane = SQ + g * S2 + 4 * t
        do_lane = SDO + g * S2 + 4 * t
        q_t = SQ + 2 * t * S2 + g
        do_t = SDO + 2 * t * S2 + g

        acc_k = cuda.local.array((O_TILES, 4), float32)
        acc_v = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((M_TILES, 4), float32)  # Sᵀ, then Pᵀ (hi)
        dp = cuda.local.array((M_TILES, 4), float32)  # dPᵀ, then dSᵀ (hi)
        lo = cuda.local.array((M_TILES, 4), float32)  # Pᵀ's, then dSᵀ's lo parts
        for dt in range(O_TILES):
            for r in range(4):
                acc_k[dt, r] = ZERO
                acc_v[dt, r] = ZERO

        for step in range(steps):
            hh = step // per_head
            i0 = (qt0 + step - hh * per_head) * BLOCK_M
            cp_wait(0)  # this step's tiles (the only group in flight; K, V too at step 0) ...
            cuda.syncthreads()  # ... for every thread; and every warp has left step - 1, whose buffer ...
            if step + 1 < steps:  # ... now receives step + 1's tiles while this step computes
                load_stage(smem, step + 1, q, dout, l2, dd, b, h_kv, group, n_kv_heads, qt0, per_head, n_q, d)
            cp_commit()
            st = (step & 1) * STAGE

            pattern1(s, smem, k_lane, S1, q_lane + st, S2, M_TILES)  # Sᵀ = K_w Q_iᵀ
            pattern1(dp, smem, v_lane, S1, do_lane + st, S2, M_TILES)  # dPᵀ = V_w dO_iᵀ

            # Pᵀ = exp2(Sᵀ·c − L2[query]), dSᵀ = Pᵀ ∘ (dPᵀ − D[query]); padded queries have L2 = +inf.
            needs_mask = CAUSAL and kw + 15 > i0 + shift
            for nt in range(M_TILES):
                for r in range(4):
                    col = nt * 8 + 2 * t + (r & 1)
                    x = s[nt, r] * scale_log2 - smem[SL + st + col]
                    if CLAMP_P:  # keys past n_k: P stays <= 1 (blocks/mask.py)
                        x = min(x, ZERO)
                    if needs_mask and kw + g + 8 * (r >> 1) > i0 + col + shift:
                        x = NEG_INF
                    p = ex2(x)
                    s[nt, r] = p
                    dp[nt, r] = p * (dp[nt, r] - smem[SD + st + col])

            split_all(s, lo, M_TILES)
            pattern2(acc_v, s, lo, smem, do_t + st, M_TILES)  # dV_w += Pᵀ dO_i
            split_all(dp, lo, M_TILES)
            pattern2(acc_k, dp, lo, smem, q_t + st, M_TILES)  # dK_w += dSᵀ Q_i
            if ATOMIC_DQ:
                if DS_IN_STAGE:
                    s_hi, s_lo = SDO + st, SQ + st
                    cuda.syncthreads()  # every warp has read this step's Q and dO: dS goes over them
                else:
                    s_hi, s_lo = SDS, SDS + BLOCK_M * BLOCK_N
                store_ds(smem, s_hi, s_lo, dp, lo, warp, g, t)
                cuda.syncthreads()
                row0 = ((b * (group * n_kv_heads) + h_kv * group + hh) * dq_acc.shape[1] + i0) * HEAD_DIM
                add_dq(smem, s_hi, s_lo, dq_acc, row0, warp, lane, g, t, FIRST_STORES)

        cp_wait(0)  # nothing may be in flight when the block exits (steps == 0 included)
        store_rows(dv, acc_v, b, h_kv, kw, g, t, n_k, d, float32(1.0))
        store_rows(dk, acc_k, b, h_kv, kw, g, t, n_k, d, scale)

    return dkdv_entry(dkdv_body, globals(), "tf32_dkdv", ATOMIC_DQ, DQ_SPLITS, first=False, stand_in="dk")


def dq_source(BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, SPLIT_ROUND="rn"):
    """The dQ kernel: BLOCK_M queries per block (one warp per 16), BLOCK_N-key K/V tiles streamed."""
    THREADS = threads(BLOCK_M)
    O_TILES = HEAD_DIM // 8
    N_TILES = BLOCK_N // 8  # n-tiles of S / dP = k-steps of dQ
    S1, S2 = strides(HEAD_DIM)
    SQ, SDO = 0, BLOCK_M * S1
    STAGE = stage_words("dq", BLOCK_N, HEAD_DIM)  # two buffers of K_j | V_j
    SK = 2 * BLOCK_M * S1
    SV = SK + BLOCK_N * S2
    CAUSAL = bool(CAUSAL)
    load_tile, pattern1, pattern2, split_all, store_rows = _helpers(THREADS, HEAD_DIM, SPLIT_ROUND)
    ex2 = ptx.ex2_approx
    cp_commit, cp_wait = ptx.cp_async_commit, ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    def tf32_dq(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale):
        smem = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        q0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BLOCK_M  # heaviest causal tiles first
        bh = cuda.blockIdx.y
        n_heads = q.shape[1]
        b = bh // n_heads
        h = bh - b * n_heads
        h_kv = h // group
        qw = q0 + warp * 16  # this warp's first query
        shift = n_k - n_q

        n_tiles = (n_k + BLOCK_N - 1) // BLOCK_N
        if CAUSAL:
            visible = min(q0 + BLOCK_M, n_q) + shift  # keys the tile's last row can see
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_N - 1) // BLOCK_N)

        load_tile(smem, SQ, S1, q, b, h, q0, n_q, d, BLOCK_M)
        load_tile(smem, SDO, S1, dout, b, h, q0, n_q, d, BLOCK_M)
        if n_tiles > 0:
            load_tile(smem, SK, S2, k, b, h_kv, 0, n_k, d, BLOCK_N)
            load_tile(smem, SV, S1, v, b, h_kv, 0, n_k, d, BLOCK_N)
        cp_commit()

        # L2 and D of rows g, g + 8 (padded scratch: always inside)
        l2_r = cuda.local.array(2, float32)
        d_r = cuda.local.array(2, float32)
        for half in range(2):
            l2_r[half] = l2[bh, qw + g + 8 * half]
            d_r[half] = dd[bh, qw + g + 8 * half]

        q_lane = SQ + (warp * 16 + g) * S1 + 4 * t
        do_lane = SDO + (warp * 16 + g) * S1 + 4 * t
        k_lane = SK + g * S2 + 4 * t
        v_lane = SV + g * S1 + 4 * t
        k_t = SK + 2 * t * S2 + g

        acc = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((N_TILES, 4), float32)  # S
        dp = cuda.local.array((N_TILES, 4), float32)  # dP, then dS (hi)
        lo = cuda.local.array((N_TILES, 4), float32)  # dS's lo parts
        for dt in range(O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO

        for j in range(n_tiles):
            k0 = j * BLOCK_N
            cp_wait(0)  # K_j, V_j (the only group in flight; Q, dO too at j = 0) ...
            cuda.syncthreads()  # ... for every thread; and every warp has left tile j - 1, whose buffer ...
            if j + 1 < n_tiles:  # ... now receives tile j + 1 while this one computes
                nxt = ((j + 1) & 1) * STAGE
                load_tile(smem, SK + nxt, S2, k, b, h_kv, k0 + BLOCK_N, n_k, d, BLOCK_N)
                load_tile(smem, SV + nxt, S1, v, b, h_kv, k0 + BLOCK_N, n_k, d, BLOCK_N)
            cp_commit()
            st = (j & 1) * STAGE

            pattern1(s, smem, q_lane, S1, k_lane + st, S2, N_TILES)  # S = Q_w K_jᵀ
            pattern1(dp, smem, do_lane, S1, v_lane + st, S1, N_TILES)  # dP = dO_w V_jᵀ

            # dS = exp2(S·c − L2[row]) ∘ (dP − D[row]); mask keys past n_k and past the diagonal.
            needs_mask = k0 + BLOCK_N > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_N - 1 > qw + shift)
            for nt in range(N_TILES):
                for r in range(4):
                    half = r >> 1
                    x = s[nt, r] * scale_log2 - l2_r[half]
                    if needs_mask:
                        col = k0 + nt * 8 + 2 * t + (r & 1)
                        if col >= n_k or (CAUSAL and col > qw + g + 8 * half + shift):
                            x = NEG_INF
                    dp[nt, r] = ex2(x) * (dp[nt, r] - d_r[half])

            split_all(dp, lo, N_TILES)
            pattern2(acc, dp, lo, smem, k_t + st, N_TILES)  # dQ_w += dS K_j

        cp_wait(0)  # nothing may be in flight when the block exits (n_tiles == 0 included)
        store_rows(dq, acc, b, h, qw, g, t, n_q, d, scale)

    return tf32_dq


def source(kernel, block_own, block_streamed, HEAD_DIM, causal, atomic_dq=False, dq_splits=0, vector_red=True,
           split_round="rn"):
    """The Python kernel of one specialisation (before cuda.jit; the compile test uses it); atomic_dq,
    dq_splits, vector_red: dkdv_source's ATOMIC_DQ, DQ_SPLITS, VECTOR_RED; split_round: how operands are
    split (blocks.tf32.SPLIT_ROUNDS; "rn" needs sm_90)."""
    if kernel == "dkdv":
        return dkdv_source(block_own, block_streamed, HEAD_DIM, causal, atomic_dq, dq_splits, vector_red, split_round)
    return dq_source(block_own, block_streamed, HEAD_DIM, causal, split_round)


# --------------------------------------------------------------------------------------------
# Kernel factories
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def build(kernel, block_own, block_streamed, HEAD_DIM, causal, max_registers=None, atomic_dq=False, dq_splits=0,
          vector_red=True, split_round="rn"):
    """The compiled dkdv or dq kernel of one specialisation; cached so each compiles once.
    atomic_dq (dkdv only): the kernel also adds dQ into fp32 scratch (red.global.add.v4.f32 with
    vector_red, sm_90+, else scalar adds); dq_splits: 1 / 2, the deterministic splits' builds (adds /
    the first launch's stores), passed only when on (dkdv_source's DQ_SPLITS); split_round: source's,
    passed only when not "rn" (launch: "rna" below sm_90)."""
    bad = problems(kernel, block_own, block_streamed, HEAD_DIM)
    if atomic_dq and kernel != "dkdv":
        bad.append(f"atomic dQ is built into the dkdv kernel only, not {kernel}")
    elif atomic_dq and not bad:
        bad += atomic_problems(block_own, block_streamed, HEAD_DIM)
    if dq_splits not in (0, 1, 2) or (dq_splits and not atomic_dq):
        bad.append(f"dq_splits={dq_splits!r}: 0, or 1 / 2 for builds of the atomic dkdv kernel (atomic_dq=True)")
    if split_round not in SPLIT_ROUNDS:
        bad.append(f"split_round={split_round!r}: one of {SPLIT_ROUNDS}")
    if bad:
        raise ValueError(f"tf32 backward {kernel} ({block_own}, {block_streamed}, {HEAD_DIM}) cannot be built: "
                         f"{'; '.join(bad)}")
    cap = {"max_registers": int(max_registers)} if max_registers else {}
    fn = source(kernel, block_own, block_streamed, HEAD_DIM, bool(causal), bool(atomic_dq), int(dq_splits),
                bool(vector_red), split_round)
    key = ("tf32_backward", kernel, block_own, block_streamed, HEAD_DIM, bool(causal), bool(atomic_dq),
           int(dq_splits), bool(vector_red), split_round)
    return compile_kernel(key, kernel_signature(kernel, bool(atomic_dq), bool(dq_splits)), fn, **cap)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def launch(kernel, args, scalars, *, tile, head_dim, causal, stream=0, split_round="rn", dq_acc=None,
           dq_splits=None):
    """One kernel over its grid: args = (q, k, v, dout, l2, dd, dk, dv) for dkdv or (..., dd, dq) for dq, fp32
    arrays (l2, dd: prep's scratch rows), scalars (n_q, n_k, d, group, scale·log2 e, scale). dkdv with dq_acc:
    the build that also forms dQ, one zeroed plane with atomic adds (dq_splits None) or dq_splits planes
    (blocks.entry.launch_dq_in_dkdv)."""
    q, k = args[0], args[1]
    B, H, n_q = q.shape[0], q.shape[1], q.shape[2]
    Hkv, n_k = k.shape[1], k.shape[2]
    rnd = {} if split_round == "rn" else {"split_round": split_round}  # passed only when not the default (cache key)
    if kernel == "dkdv" and dq_acc is not None:
        bn, bm = tile
        red = {} if ptx.current_sm90() else {"vector_red": False}  # passed only when off (cache key)
        launch_dq_in_dkdv(
            lambda splits: build("dkdv", bn, bm, head_dim, bool(causal), atomic_dq=True, **red, **rnd,
                                 **({"dq_splits": splits} if splits else {})),
            B * Hkv, threads(bn), smem_bytes("dkdv", bn, bm, head_dim, atomic_dq=True), stream, (*args, dq_acc),
            scalars, (n_k + bn - 1) // bn, dq_splits, B * H)
    elif kernel == "dkdv":
        bn, bm = tile
        launch_kernel(build("dkdv", bn, bm, head_dim, bool(causal), **rnd), ((n_k + bn - 1) // bn, B * Hkv),
                      threads(bn), stream, smem_bytes("dkdv", bn, bm, head_dim), *args, *scalars)
    else:
        bm, bn = tile
        launch_kernel(build("dq", bm, bn, head_dim, bool(causal), **rnd), ((n_q + bm - 1) // bm, B * H),
                      threads(bm), stream, smem_bytes("dq", bm, bn, head_dim), *args, *scalars)
