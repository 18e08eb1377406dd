"""Tensor-core FlashAttention-2 backward (fp16 / bf16 in, fp32 accumulation) on mma.sync m16n8k16.

Maths (reference/backward.py, section 3.6.7), with S = Q Kᵀ and P rebuilt from the forward's
saved logsumexp L, never stored as an N×N array:

    L2 = L·log2(e)                   base-2 logsumexp (+inf for a row that sees no key, so its
                                     P = exp2(… − inf) = 0, never exp(−inf + inf) = nan)
    P  = exp2(S·scale·log2(e) − L2)  the forward's probabilities, tile by tile
    D  = rowsum(dO ∘ O)              one fp32 number per query row
    dP = dO Vᵀ,   dS = P ∘ (dP − D)
    dV = Pᵀ dO,   dK = scale · dSᵀ Q,   dQ = scale · dS K

Three kernels on one stream (backward's dq-kernel scheme: no atomics anywhere, bitwise repeatable):

1. ``prep``: D and L2 per query row into fp32 scratch of shape (B·H, NQ_PAD), rows padded to a
   multiple of 128 with D = 0, L2 = +inf, so every query tile's L2 and D arrive by cp.async and a
   padded query row has P = 0 without a mask.
2. ``dkdv``: one block per (K/V tile of BLOCK_N keys, batch · kv head), warp w owning keys
   16w..16w+15 — the forward's structure with the roles of Q and K/V exchanged (the transposed
   orientation). K_j and V_j stay in shared memory; dK_j and dV_j accumulate in registers while
   the block streams the Q / dO tiles of every query head of its group (so the GQA sum needs no
   atomics):

       Sᵀ  (16 x BLOCK_M) = K_w · Q_iᵀ        A = K rows (ldmatrix), B = Q rows (ldmatrix)
       dPᵀ (16 x BLOCK_M) = V_w · dO_iᵀ       A = V rows, B = dO rows
       Pᵀ = exp2(Sᵀ·scale·log2 e − L2[col]),  dSᵀ = Pᵀ ∘ (dPᵀ − D[col])
       dV_w (16 x d) += Pᵀ · dO_i             A = Pᵀ re-packed in registers, B = dO by ldmatrix.trans
       dK_w (16 x d) += dSᵀ · Q_i             A = dSᵀ re-packed in registers, B = Q by ldmatrix.trans

   The Sᵀ accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk (as P in
   the forward's P·V), so no fragment passes through shared memory.
3. ``dq``: one block per (Q tile of BLOCK_M rows, batch · head), warp w owning rows 16w..16w+15 —
   the forward's loop with a second GEMM and no online softmax (L is known):

       S = Q_w K_jᵀ,  dP = dO_w V_jᵀ         A = Q / dO rows, B = K / V rows (ldmatrix)
       dS = exp2(S·scale·log2 e − L2[row]) ∘ (dP − D[row])
       dQ_w += dS · K_j                       A = dS re-packed, B = K by ldmatrix.trans

   This repeats the two products of ``dkdv`` (7 tile GEMMs instead of FA2's 5) in exchange for no
   atomic adds and a deterministic dQ.

FA2's schemes swap kernel 3 for a dQ phase in ``dkdv``: built with ATOMIC_DQ it also writes dSᵀ to
shared memory, computes dQ_i += dS K_j for 16 query rows per warp (dS by ldmatrix.trans of the stored
dSᵀ) and adds it to fp32 scratch with ``red.global.add``; a ``convert`` kernel then writes dq = scale ·
scratch. backward(deterministic=False): one launch, every block adding into one zeroed plane (the
order of the adds varies). The default at d128, FA2's deterministic splits (DQ_SPLITS builds): S
planes, ceil(key blocks / S) launches on the stream, block x of each owning plane x (the first launch
stores, the others add), and ``convert`` sums the planes in order: bitwise repeatable with 5 tile
products instead of 7 (``dq_splits`` picks S, backward.dq_scheme falls back to kernel 3 where the
splits would leave the GPU idle). The dQ phase runs after a second barrier, with every warp of the
block's only resident block in it at once: per product it is slower than kernel 3 (benchmarks/NOTES.md).

Shared memory: 16-bit tiles with rows of HEAD_DIM, 16-byte chunks XOR-swizzled by row % 8 (the
forward's layout: every ldmatrix phase hits 8 distinct bank groups). The streamed tiles (Q, dO,
L2, D in ``dkdv``; K, V in ``dq``) are double-buffered: at the top of step i one barrier says tile
i has landed and that every warp has left step i−1, whose buffer then receives tile i+1 by cp.async
while step i computes. Each thread's copy plan (source offset, byte count and swizzled destination
of its 16-byte chunks, mma_forward.tile_copies) is computed once before the loop; a tile whose rows
all exist then costs the step's row offset and a constant step per copy. Out-of-range rows and
head-dim columns (a sequence's last tile, a padded head dim) are zero-filled by cp.async's ignore-src
predicate, or by its src-size operand when d % 8 != 0 (PARTIAL_CHUNK: a chunk of data and zeros).

Causal (bottom-right, query i sees key j iff j <= i + Nk − Nq): ``dkdv`` starts at the first Q
tile that sees its keys, ``dq`` stops after the last K/V tile its rows see; only tiles that cross
the diagonal (or, in ``dq``, the end of the keys) pay for the mask.

On sm_90 the dkdv kernel that forms dQ is wgmma_backward's (the same steps on warpgroup MMA; config key
``dkdv_wgmma``, configs.MMA_BWD_WGMMA): ``launch`` runs it in place of ``dkdv_source``'s ATOMIC_DQ builds.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import address
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from . import wgmma_backward
from ..blocks.copies import tile_copies
from ..blocks.numerics import LOG2E
from ..blocks.rows import DELTA_LANES, DELTA_ROWS, row_dot_helper

DTYPES = ("float16", "bfloat16")
KERNELS = ("dkdv", "dq")
WORD = np.dtype(np.uint16)
PREP_ROWS, PREP_LANES = DELTA_ROWS, DELTA_LANES  # prep reuses the SIMT backward's row sums
ROW_PAD = 128  # scratch rows padded to this: every query tile (BLOCK_M <= 128) reads inside them


def padded_rows(n_q: int) -> int:
    """NQ_PAD: the scratch row length for n_q queries."""
    return -(-n_q // ROW_PAD) * ROW_PAD


# --------------------------------------------------------------------------------------------
# Shapes of a specialisation (data the launcher, the tests and explain share)
# --------------------------------------------------------------------------------------------
def threads_per_block(kernel: str, block_own: int, split_d: bool = False) -> int:
    """One warp per 16 rows of the block's own tile (keys in dkdv, queries in dq); two with split_d."""
    return 32 * (block_own // 16) * (2 if split_d else 1)


def stage_words(block_m: int, head_dim: int) -> int:
    """16-bit words of one dkdv stage [Q | dO | L2 | D], in whole rows of head_dim words: a stage
    offset then leaves the swizzle's chunk bits alone (the ldmatrix offsets XOR them in)."""
    return -(-(2 * block_m * head_dim + 4 * block_m) // head_dim) * head_dim


def smem_bytes(kernel: str, block_own: int, block_streamed: int, head_dim: int, atomic_dq: bool = False,
               split_d: bool = False, dq_deferred: bool = False, fa2: bool = False) -> int:
    """Own tiles once (K, V or Q, dO), streamed tiles twice (double buffer); dkdv adds L2 and D,
    with atomic_dq the 16-bit dSᵀ tile (two with dq_deferred), with split_d the 16-bit Pᵀ and dSᵀ tiles;
    fa2: the Pᵀ and dSᵀ tiles (its atomic dQ phase reads the latter)."""
    streamed = stage_words(block_streamed, head_dim) if kernel == "dkdv" else 2 * block_streamed * head_dim
    if fa2:
        ds = 2 * block_own * block_streamed
    else:
        ds = block_own * block_streamed * ((2 if dq_deferred else 1 if atomic_dq else 0) + (2 if split_d else 0))
    return 2 * (2 * block_own * head_dim + 2 * streamed + ds)


def problems(kernel: str, block_own: int, block_streamed: int, head_dim: int, dtype: str,
             split_d: bool = False, fa2: bool = False) -> list[str]:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    if kernel not in KERNELS:
        return [f"kernel={kernel!r} not in {KERNELS}"]
    if block_own % 16 or not 16 <= block_own <= 256:
        out.append(f"own tile of {block_own} rows: one warp per 16 rows, 1..16 warps")
    if kernel == "dq" and block_own > ROW_PAD:  # its rows' L2 and D are read from rows padded to ROW_PAD
        out.append(f"dq tile of {block_own} query rows > {ROW_PAD}, the scratch rows' padding")
    if block_streamed % 16 or not 16 <= block_streamed <= ROW_PAD:
        out.append(f"streamed tile of {block_streamed} rows: a multiple of 16 (the k of m16n8k16), <= {ROW_PAD}")
    if head_dim not in (64, 128):
        out.append(f"HEAD_DIM={head_dim}: 64 or 128 (the 8-chunk XOR swizzle, the unrolled k-steps)")
    if dtype not in DTYPES:
        out.append(f"dtype={dtype!r} not in {DTYPES}")
    threads = threads_per_block(kernel, block_own, split_d) if block_own % 16 == 0 and block_own >= 16 else 32
    for name, rows in (("own", block_own), ("streamed", block_streamed)):
        if (rows * head_dim // 8) % threads:
            out.append(f"{name} tile of {rows}x{head_dim} is not a whole number of 16-byte copies per thread")
    if kernel == "dkdv" and block_streamed // 2 > threads:
        out.append(f"{block_streamed} query rows of L2 and D need {block_streamed // 2} copying threads, have {threads}")
    nbytes = smem_bytes(kernel, block_own, block_streamed, head_dim, split_d=split_d, fa2=fa2)
    if nbytes > SMEM_PER_BLOCK_MAX:
        out.append(f"{nbytes} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


# --------------------------------------------------------------------------------------------
# Kernel sources
# --------------------------------------------------------------------------------------------
def prep_signature(dtype: str):
    """out, dout as float16 / uint16 (bf16 bits) / float32 (tf32_backward), lse, then the scratch rows."""
    io = types.Array({"float16": types.float16, "float32": types.float32}.get(dtype, types.uint16), 4, "A")
    rows = types.Array(types.float32, 2, "A")
    return types.void(io, io, types.Array(types.float32, 3, "A"), rows, rows, int32, int32)


def prep_source(dtype: str):
    """D = rowsum(dO ∘ O) and L2 = L·log2(e) (+inf where L = -inf) into padded (B·H, NQ_PAD) rows."""
    row_dot = row_dot_helper(dtype)  # the SIMT backward's D pass, row for row
    INF, NEG_INF = float32(math.inf), float32(-math.inf)

    def mma_backward_prep(out, dout, lse, l2, dd, n_q, d):
        partial = cuda.shared.array((PREP_ROWS, PREP_LANES), float32)
        b, h, row, total = row_dot(out, dout, partial, n_q, d)
        bh = cuda.blockIdx.y
        if cuda.threadIdx.x % PREP_LANES == 0:
            if row < n_q:
                x = lse[b, h, row]
                dd[bh, row] = total
                l2[bh, row] = INF if x == NEG_INF else x * float32(LOG2E)
            else:  # padding: P = exp2(… − inf) = 0, and dS = 0 · (dP − 0) stays finite
                dd[bh, row] = float32(0.0)
                l2[bh, row] = INF

    return mma_backward_prep


def kernel_signature(kernel: str, atomic_dq: bool = False, dq_splits: bool = False):
    """dkdv(q, k, v, do, l2, dd, dk, dv[, dq_acc], ...[, kb0, plane_rows]) / dq(q, k, v, do, l2, dd, dq, ...):
    16-bit words; dq_acc (planes·B·H, NQ_PAD, HEAD_DIM) fp32 when dkdv also adds up dQ (atomic_dq)."""
    io = types.Array(types.uint16, 4, "A")
    rows = types.Array(types.float32, 2, "A")
    grads = (io, io) if kernel == "dkdv" else (io,)
    if atomic_dq:
        grads += (types.Array(types.float32, 3, "A"),)
    tail = (int32, int32) if dq_splits else ()  # kb0, plane_rows (the deterministic splits' launches)
    return types.void(io, io, io, io, rows, rows, *grads, int32, int32, int32, int32, float32, float32, *tail)


def convert_signature(dtype: str):
    """dq_acc fp32 planes, dq as 16-bit words (or float32: tf32_backward's dQ-in-dkdv), then the scalars."""
    out = types.Array(types.float32 if dtype == "float32" else types.uint16, 4, "A")
    return types.void(types.Array(types.float32, 3, "A"), out, int32, int32, float32, int32, int32, int32, int32)


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


def convert_source(dtype: str, vec: bool = False):
    """dQ = scale · Σ_p dq_acc[plane p], planes summed in order 0, 1, ... (one plane unless the
    deterministic splits wrote several), rounded to 16 bits: the last step of the dQ-in-dkdv paths.
    A thread converts a pair of columns, or with ``vec`` 8 (two 16-byte loads per plane, one 16-byte
    store: d % 8 == 0, dq rows 16-byte aligned); the sums are the same either way. dtype "float32"
    (tf32_backward): dq stays fp32, two 16-byte stores per 8 columns."""
    F32 = dtype == "float32"
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    ld = ptx.ld_global_nc_v4
    st = ptx.st_global_v4
    VEC = bool(vec)
    from ..ptx import bits_from_f32, f32_from_bits

    def mma_backward_dq_convert(dq_acc, dq, n_q, d, scale, n_k, block_n, block_m, causal):
        bh = cuda.blockIdx.y
        n_heads = dq.shape[1]
        n_bh = dq.shape[0] * n_heads
        b = bh // n_heads
        h = bh - b * n_heads
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        per_row = d // 8 if VEC else (d + 1) // 2  # threads per row
        row = i // per_row
        col = (8 if VEC else 2) * (i - row * per_row)
        if row < n_q and VEC:
            plane = n_bh * dq_acc.shape[1] * dq_acc.shape[2]  # elements per plane
            src = (bh * dq_acc.shape[1] + row) * dq_acc.shape[2] + col
            acc = cuda.local.array(8, float32)
            for j in range(8):
                acc[j] = float32(0.0)
            for p in range(dq_acc.shape[0] // n_bh):  # planes 0, 1, ... in a fixed order
                if row >= plane_first_row(p, n_q, n_k, block_n, block_m, causal):
                    w = ld(dq_acc, src + p * plane)
                    u = ld(dq_acc, src + p * plane + 4)
                    for j in range(4):
                        acc[j] += f32_from_bits(w[j])
                        acc[4 + j] += f32_from_bits(u[j])
            if F32:
                dst = b * (dq.strides[0] // 4) + h * (dq.strides[1] // 4) + row * (dq.strides[2] // 4) + col
                st(dq, dst, bits_from_f32(acc[0] * scale), bits_from_f32(acc[1] * scale),
                   bits_from_f32(acc[2] * scale), bits_from_f32(acc[3] * scale))
                st(dq, dst + 4, bits_from_f32(acc[4] * scale), bits_from_f32(acc[5] * scale),
                   bits_from_f32(acc[6] * scale), bits_from_f32(acc[7] * scale))
            else:
                st(dq, b * (dq.strides[0] // 2) + h * (dq.strides[1] // 2) + row * (dq.strides[2] // 2) + col,
                   pack(acc[0] * scale, acc[1] * scale), pack(acc[2] * scale, acc[3] * scale),
                   pack(acc[4] * scale, acc[5] * scale), pack(acc[6] * scale, acc[7] * scale))
        elif row < n_q:
            x = float32(0.0)
            y = float32(0.0)
            for p in range(dq_acc.shape[0] // n_bh):  # planes 0, 1, ... in a fixed order
                if row >= plane_first_row(p, n_q, n_k, block_n, block_m, causal):
                    x += dq_acc[p * n_bh + bh, row, col]
                    y += dq_acc[p * n_bh + bh, row, col + 1]
            if F32:
                dq[b, h, row, col] = x * scale
                if col + 1 < d:
                    dq[b, h, row, col + 1] = y * scale
            else:
                bits = pack(x * scale, y * scale)
                dq[b, h, row, col] = uint16(bits & 0xFFFF)
                if col + 1 < d:
                    dq[b, h, row, col + 1] = uint16(bits >> 16)

    return mma_backward_dq_convert


# The vector forms of prep and convert (d % 8 == 0 and 16-byte aligned rows: every shipped layout): 16-byte
# loads and stores instead of one element per thread. The scalar forms (one element per load, 2-byte stores)
# took 162 and 148 us at fp16 B4 H16 N4096 d128 (profile-backward-autograd-2026-12-01-after.txt), 3-4 times
# what their bytes need.
VEC_THREADS = 256


def prep_vec_source(dtype: str, head_dim: int):
    """``prep`` reading 16-byte chunks: HEAD_DIM / PER lanes per row (PER = 8 16-bit or 4 fp32 elements a
    chunk), each one chunk of O and of dO (d % PER == 0, so a chunk is all data or past d and skipped), the
    row's sum by shuffles. VEC_THREADS / LANES rows per block."""
    F32 = dtype == "float32"
    PER = 4 if F32 else 8  # elements per 16-byte chunk ...
    ITEM = 4 if F32 else 2  # ... of this many bytes
    LANES = head_dim // PER
    ROWS = VEC_THREADS // LANES
    BF16 = dtype == "bfloat16"
    ld = ptx.ld_global_nc_v4
    shfl = ptx.shfl_xor_sync
    FULL = ptx.FULL_MASK
    INF, NEG_INF, ZERO = float32(math.inf), float32(-math.inf), float32(0.0)
    HI = uint32(0xFFFF0000)
    from ..ptx import f16x2_to_f32, f32_from_bits

    @inline_device
    def pair(word):
        if BF16:
            return f32_from_bits(word << 16), f32_from_bits(word & HI)
        return f16x2_to_f32(word)

    def mma_backward_prep(out, dout, lse, l2, dd, n_q, d):
        tid = cuda.threadIdx.x
        r = tid // LANES
        c = tid - r * LANES
        bh = cuda.blockIdx.y
        b = bh // out.shape[1]
        h = bh - b * out.shape[1]
        row = cuda.blockIdx.x * ROWS + r
        acc = ZERO
        if row < n_q and c * PER < d:
            o = ld(out, b * (out.strides[0] // ITEM) + h * (out.strides[1] // ITEM) + row * (out.strides[2] // ITEM)
                   + c * PER)
            g = ld(dout, b * (dout.strides[0] // ITEM) + h * (dout.strides[1] // ITEM)
                   + row * (dout.strides[2] // ITEM) + c * PER)
            for i in range(4):
                if F32:
                    acc = cuda.fma(f32_from_bits(o[i]), f32_from_bits(g[i]), acc)
                else:
                    o0, o1 = pair(o[i])
                    g0, g1 = pair(g[i])
                    acc = cuda.fma(o1, g1, cuda.fma(o0, g0, acc))
        m = 1
        while m < LANES:  # the row's lanes are neighbours in one warp
            acc += shfl(FULL, acc, m)
            m *= 2
        if c == 0:
            if row < n_q:
                x = lse[b, h, row]
                dd[bh, row] = acc
                l2[bh, row] = INF if x == NEG_INF else x * float32(LOG2E)
            else:  # padding: P = exp2(… − inf) = 0, and dS = 0 · (dP − 0) stays finite
                dd[bh, row] = ZERO
                l2[bh, row] = INF

    return mma_backward_prep, ROWS


def two_products(HEAD_DIM, N_TILES, mma):
    """X = A1 B1ᵀ and Y = A2 B2ᵀ over the head dim (Sᵀ, dPᵀ in dkdv; S, dP in dq): A of 16 rows per
    warp, B of N_TILES n-tiles, all from swizzled tiles. The k-steps are written out one call each:
    NVVM leaves the loop rolled at d = 128 (half the mma in the PTX), as in the forward's Q·Kᵀ.
    a1, a2, b1: word offsets of whole rows (multiples of HEAD_DIM), b2 - b1 a constant: a lane's
    chunk 2 kk is then its chunk 0's offset XOR kk << 4 (the row's bits lie above the chunk's), one
    LOP3 per k-step and operand instead of the swizzle rebuilt and rescaled for every ldmatrix."""
    ldsm = ptx.ldmatrix_x4
    D_STEPS = HEAD_DIM // 16

    @inline_device
    def step(x, y, smem, kk, a1, a2, b1, b2, a_lane, b_lane):
        a_off = a_lane ^ (kk << 4)
        p0, p1, p2, p3 = ldsm(smem, a1 + a_off)
        r0, r1, r2, r3 = ldsm(smem, a2 + a_off)
        b_off = (b1 + b_lane) ^ (kk << 4)  # the stage offset inside: a register and immediates per k-step
        for np2 in range(N_TILES // 2):
            nt = 2 * np2
            c0, c1, c2, c3 = ldsm(smem, b_off + np2 * 16 * HEAD_DIM)
            x[nt, 0], x[nt, 1], x[nt, 2], x[nt, 3] = mma(p0, p1, p2, p3, c0, c1, x[nt, 0], x[nt, 1], x[nt, 2], x[nt, 3])
            x[nt + 1, 0], x[nt + 1, 1], x[nt + 1, 2], x[nt + 1, 3] = mma(
                p0, p1, p2, p3, c2, c3, x[nt + 1, 0], x[nt + 1, 1], x[nt + 1, 2], x[nt + 1, 3])
            c0, c1, c2, c3 = ldsm(smem, b_off + (b2 - b1) + np2 * 16 * HEAD_DIM)
            y[nt, 0], y[nt, 1], y[nt, 2], y[nt, 3] = mma(r0, r1, r2, r3, c0, c1, y[nt, 0], y[nt, 1], y[nt, 2], y[nt, 3])
            y[nt + 1, 0], y[nt + 1, 1], y[nt + 1, 2], y[nt + 1, 3] = mma(
                r0, r1, r2, r3, c2, c3, y[nt + 1, 0], y[nt + 1, 1], y[nt + 1, 2], y[nt + 1, 3])

    @inline_device
    def unrolled(x, y, smem, a1, a2, b1, b2, a_row, a_x, b_row, b_x):
        for nt in range(N_TILES):
            for r in range(4):
                x[nt, r] = float32(0.0)
                y[nt, r] = float32(0.0)
        a_lane = a_row * HEAD_DIM + (a_x << 3)  # chunk 0 of the lane's row (2 kk: ^ (kk << 4))
        b_lane = b_row * HEAD_DIM + (b_x << 3)
        step(x, y, smem, 0, a1, a2, b1, b2, a_lane, b_lane)
        step(x, y, smem, 1, a1, a2, b1, b2, a_lane, b_lane)
        step(x, y, smem, 2, a1, a2, b1, b2, a_lane, b_lane)
        step(x, y, smem, 3, a1, a2, b1, b2, a_lane, b_lane)
        if D_STEPS > 4:
            step(x, y, smem, 4, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 5, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 6, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 7, a1, a2, b1, b2, a_lane, b_lane)

    if D_STEPS not in (4, 8):
        raise ValueError(f"HEAD_DIM={HEAD_DIM}: the unrolled products take 64 or 128")
    return unrolled


def _dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS, OUT_TILES, PARTIAL_CHUNK, ATOMS=False):
    """What the dK/dV layouts share: the shared-memory plan, the copies (K and V, the streamed stage),
    the schedule of (query head, Q tile) steps and the epilogue. OUT_TILES: n-tiles of dK / dV per warp.
    PARTIAL_CHUNK: d % 8 != 0 (tile_copies' flag). ATOMS (wgmma_backward): the 16-bit tiles in wgmma's
    column atoms (tile_copies' ATOM_ROWS) and every tile starting at a multiple of 1024 bytes.

    Word offsets: K and V once, then two stages of [Q | dO | L2 (fp32) | D (fp32)], then what the
    layout adds (EXTRA0 on)."""
    SK, SV = 0, BLOCK_N * HEAD_DIM
    STAGE0 = 2 * BLOCK_N * HEAD_DIM
    STAGE = -(-(2 * BLOCK_M * HEAD_DIM + 4 * BLOCK_M) // 512) * 512 if ATOMS else stage_words(BLOCK_M, HEAD_DIM)
    SQ, SDO, SL, SD = 0, BLOCK_M * HEAD_DIM, 2 * BLOCK_M * HEAD_DIM, 2 * BLOCK_M * HEAD_DIM + 2 * BLOCK_M
    EXTRA0 = STAGE0 + 2 * STAGE
    Q_COPIES = BLOCK_M * (HEAD_DIM // 8) // THREADS
    KV_COPIES = BLOCK_N * (HEAD_DIM // 8) // THREADS
    ROW_CHUNKS = BLOCK_M // 4  # 16-byte copies per row vector of L2 or D
    swizzle, _, copy_plan, load_tile_fast = tile_copies(HEAD_DIM, THREADS, PARTIAL_CHUNK, BLOCK_N if ATOMS else 0)
    # the streamed tiles' copies (another instance only for ATOMS: their atoms hold BLOCK_M rows)
    _, _, copy_plan_q, load_q_fast = tile_copies(HEAD_DIM, THREADS, PARTIAL_CHUNK, BLOCK_M) if ATOMS else \
        (swizzle, None, copy_plan, load_tile_fast)
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    ldsm_t = ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    cp_async = ptx.cp_async_16
    cp_commit = ptx.cp_async_commit
    CAUSAL = bool(CAUSAL)

    # cuda.jit, not inline_device: the simulator then runs it with this module's fake ``cuda`` when a kernel
    # of another module (wgmma_backward) calls load_stage (tile_copies' thread_x, likewise)
    @cuda.jit(device=True, inline=True)
    def thread_x():
        return cuda.threadIdx.x

    @inline_device
    def load_stage(smem, st, q, dout, l2, dd, plan, b, h0, hh, i0, n_q, nq_pad):
        """Q_i, dO_i rows i0.. of query head h0 + hh and their L2, D into the stage at word st (one
        cp.async group's worth), by this thread's plan for head h0 (the prologue's)."""
        q_off, do_off, col_bytes, dst0 = plan
        q_rs, do_rs = q.strides[2] // 2, dout.strides[2] // 2
        load_q_fast(smem, st + SQ, q, q_off + hh * (q.strides[1] // 2) + i0 * q_rs, q_rs, col_bytes, dst0, i0,
                    n_q, Q_COPIES)
        load_q_fast(smem, st + SDO, dout, do_off + hh * (dout.strides[1] // 2) + i0 * do_rs, do_rs, col_bytes,
                    dst0, i0, n_q, Q_COPIES)
        tid = thread_x()
        row = (b * q.shape[1] + h0 + hh) * nq_pad + i0  # scratch rows are padded: always inside
        if tid < ROW_CHUNKS:
            cp_async(smem, st + SL + 8 * tid, l2, row + 4 * tid)
        elif tid < 2 * ROW_CHUNKS:
            cp_async(smem, st + SD + 8 * (tid - ROW_CHUNKS), dd, row + 4 * (tid - ROW_CHUNKS))

    @inline_device
    def prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad):
        """K_j, V_j and step 0's stage as one cp.async group; returns this thread's copy plan of the Q and dO
        tiles of query head h_kv·group (offsets, source bytes per copy, shared offset), kept for the loop's
        stages so a step only adds its head's and rows' offsets."""
        k_off, k_rs, col_bytes, dst0 = copy_plan(k, b, h_kv, d)
        v_off, v_rs, _, _ = copy_plan(v, b, h_kv, d)
        load_tile_fast(smem, SK, k, k_off + k0 * k_rs, k_rs, col_bytes, dst0, k0, n_k, KV_COPIES)
        load_tile_fast(smem, SV, v, v_off + k0 * v_rs, v_rs, col_bytes, dst0, k0, n_k, KV_COPIES)
        q_off, _, _, q_dst0 = copy_plan_q(q, b, h_kv * group, d)
        do_off, _, _, _ = copy_plan_q(dout, b, h_kv * group, d)
        plan = (q_off, do_off, int32(col_bytes), q_dst0 if ATOMS else dst0)  # 0..16: one register, not a 64-bit pair
        if steps > 0:
            load_stage(smem, STAGE0, q, dout, l2, dd, plan, b, h_kv * group, int32(0), qt0 * BLOCK_M, n_q, nq_pad)
        cp_commit()
        return plan

    @inline_device
    def schedule(k0, n_q, shift, group):
        """(first Q tile, Q tiles per query head, steps): causal starts at the first Q tile that
        sees key k0 (query k0 - shift); steps run head-major over the group's query heads."""
        n_qt = (n_q + BLOCK_M - 1) // BLOCK_M
        qt0 = 0
        if CAUSAL:
            qt0 = min(max(k0 - shift, 0) // BLOCK_M, n_qt)
        per_head = n_qt - qt0
        return int32(qt0), int32(per_head), int32(group * per_head)  # 32-bit: the step loop's arithmetic

    @inline_device
    def step_tile(step, qt0, per_head, group):
        """(query head hh of the group, first query row i0) of step ``step``. Without GQA (group 1) no
        integer division: it was a ~40-instruction chain per step (ncu, tenth session)."""
        hh = int32(step // per_head) if group > 1 else int32(0)
        return hh, int32((qt0 + step - hh * per_head) * BLOCK_M)

    @inline_device
    def prefetch(smem, step, steps, qt0, per_head, q, dout, l2, dd, plan, b, h_kv, group, n_q, nq_pad):
        """Step step + 1's tiles into the buffer step - 1 used (after the barrier that freed it)."""
        nxt = int32(step + 1)
        if nxt < steps:
            hh, i0 = step_tile(nxt, qt0, per_head, group)
            load_stage(smem, STAGE0 + (nxt & 1) * STAGE, q, dout, l2, dd, plan, b, h_kv * group, hh, i0, n_q, nq_pad)

    @inline_device
    def dv_dk_step(smem, acc_v, acc_k, dt, t_off, p0, p1, p2, p3, d0, d1, d2, d3):
        """dV n-tiles dt, dt + 1 += Pᵀ dO and dK's += dSᵀ Q for one k-step: A = the packed Pᵀ (p) and
        dSᵀ (d) fragments, B = dO and Q by ldmatrix.trans at t_off in the stage."""
        b0, b1, b2, b3 = ldsm_t(smem, SDO + t_off)
        acc_v[dt, 0], acc_v[dt, 1], acc_v[dt, 2], acc_v[dt, 3] = mma(
            p0, p1, p2, p3, b0, b1, acc_v[dt, 0], acc_v[dt, 1], acc_v[dt, 2], acc_v[dt, 3])
        acc_v[dt + 1, 0], acc_v[dt + 1, 1], acc_v[dt + 1, 2], acc_v[dt + 1, 3] = mma(
            p0, p1, p2, p3, b2, b3, acc_v[dt + 1, 0], acc_v[dt + 1, 1], acc_v[dt + 1, 2], acc_v[dt + 1, 3])
        b0, b1, b2, b3 = ldsm_t(smem, SQ + t_off)
        acc_k[dt, 0], acc_k[dt, 1], acc_k[dt, 2], acc_k[dt, 3] = mma(
            d0, d1, d2, d3, b0, b1, acc_k[dt, 0], acc_k[dt, 1], acc_k[dt, 2], acc_k[dt, 3])
        acc_k[dt + 1, 0], acc_k[dt + 1, 1], acc_k[dt + 1, 2], acc_k[dt + 1, 3] = mma(
            d0, d1, d2, d3, b2, b3, acc_k[dt + 1, 0], acc_k[dt + 1, 1], acc_k[dt + 1, 2], acc_k[dt + 1, 3])

    @inline_device
    def swizzle_m(row, chunk):
        """Element offset in a BLOCK_N x 64 tile of queries (Pᵀ, dSᵀ: 8 chunks a row, XOR row % 8)."""
        return row * BLOCK_M + ((chunk ^ (row & 7)) << 3)

    @inline_device
    def store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, col0, n_k, d, scale):
        """dV = Σ Pᵀ dO, dK = scale · Σ dSᵀ Q of rows kw + g (+ 8), columns col0.., rounded to 16 bits;
        keys past n_k and columns past d are not stored."""
        for half in range(2):
            row = kw + g + 8 * half
            if row < n_k:
                for dt in range(OUT_TILES):
                    col = col0 + dt * 8 + 2 * t
                    bits_v = pack(acc_v[dt, 2 * half], acc_v[dt, 2 * half + 1])
                    bits_k = pack(acc_k[dt, 2 * half] * scale, acc_k[dt, 2 * half + 1] * scale)
                    if col < d:
                        dv[b, h_kv, row, col] = uint16(bits_v & 0xFFFF)
                        dk[b, h_kv, row, col] = uint16(bits_k & 0xFFFF)
                    if col + 1 < d:
                        dv[b, h_kv, row, col + 1] = uint16(bits_v >> 16)
                        dk[b, h_kv, row, col + 1] = uint16(bits_k >> 16)

    layout = (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, EXTRA0)
    return layout, swizzle, prologue, schedule, step_tile, prefetch, swizzle_m, store_grads, dv_dk_step


def dkdv_source(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, ATOMIC_DQ=False, VECTOR_RED=True, DQ_COLS=32,
                DQ_DEFERRED=False, RED_V4=False, PARTIAL_CHUNK=False, DQ_SPLITS=0):
    """The dK/dV kernel: BLOCK_N keys per block (one warp per 16), BLOCK_M-row Q/dO tiles streamed.
    PARTIAL_CHUNK (every kernel here; launch() sets it when d % 8 != 0): the copies' source bytes per
    16-byte chunk (mma_forward.kernel_source's flag of that name).

    ATOMIC_DQ (FA2's scheme, not bitwise repeatable): the block also computes its keys' share of
    dQ_i = dS_i K_j each step and adds it to fp32 dq_acc with atomic adds, so no dQ kernel has to
    recompute S and dP (5 tile GEMMs in all instead of 7). dSᵀ goes through shared memory (16-bit,
    swizzled) to change orientation: warp w then owns query rows 16(w mod 4).. of dQ_i (BLOCK_M = 64)
    and, with 8 warps (BLOCK_N = 128, FA2's d = 128 layout: half the atomics per product), half of
    its columns. The adds leave as red.global.add.v2.f32: a fragment's two adjacent columns at once
    (VECTOR_RED, sm_90+; below it two scalar red.global.add.f32).

    Candidate variants of the dQ phase (off by default; the sweep times them, ATOMIC_DQ only):
    DQ_COLS = 64: dQ columns per pass (32 accumulators per lane): one pass per warp at 128 keys, so
    the dS fragments are loaded once a step instead of twice. DQ_DEFERRED: dSᵀ double-buffered by
    step parity and step i's dQ computed after step i + 1's first barrier (the last one after the
    loop), so one barrier per step publishes both the streamed tiles and dSᵀ. RED_V4: lanes t, t ^ 1
    swap half a fragment (two shuffles) so each adds 4 adjacent columns of one row with one
    red.global.add.v4.f32: half the atomic instructions.

    DQ_SPLITS (with ATOMIC_DQ; backward(deterministic=True)'s splits, FA2's deterministic scheme): the kernel
    takes kb0 and plane_rows after scale and runs key block kb0 + blockIdx.x into plane blockIdx.x of dq_acc
    (rows blockIdx.x · plane_rows ..); launch() runs a launch per gridDim.x key blocks. 1: adds; 2: the first
    launch's build, which stores (so nobody zeroes the planes; as a runtime branch the choice cost 24
    instructions per step). Builds of their own so that deterministic=False's kernel stays as it was (its PTX
    is pinned in the tests)."""
    WARPS = BLOCK_N // 16
    THREADS = 32 * WARPS
    Q_TILES = BLOCK_M // 8  # n-tiles of Sᵀ / dPᵀ (query columns)
    M_STEPS = BLOCK_M // 16  # k-steps of dV and dK (over the queries)
    O_TILES = HEAD_DIM // 8  # n-tiles of dK / dV
    CAUSAL, ATOMIC_DQ = bool(CAUSAL), bool(ATOMIC_DQ)
    (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, SDS), swizzle, prologue, schedule, step_tile, prefetch, \
        swizzle_m, store_grads, dv_dk_step = _dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS, O_TILES,
                                                               PARTIAL_CHUNK)
    # ATOMIC_DQ: dSᵀ (BLOCK_N keys x BLOCK_M queries) at SDS
    if ATOMIC_DQ and not (BLOCK_M == 64 and BLOCK_N in (64, 128)):
        raise ValueError(f"ATOMIC_DQ needs 64-query tiles (8-chunk dSᵀ rows) and 64 or 128 keys (4 or 8 warps "
                         f"over dQ_i); got BLOCK_N={BLOCK_N}, BLOCK_M={BLOCK_M}")
    if DQ_COLS not in (32, 64) or ((DQ_COLS != 32 or DQ_DEFERRED or RED_V4) and not (ATOMIC_DQ and VECTOR_RED)):
        raise ValueError(f"DQ_COLS={DQ_COLS} (32 or 64), DQ_DEFERRED={DQ_DEFERRED}, RED_V4={RED_V4}: variants of "
                         f"the sm_90 atomic dQ (ATOMIC_DQ={ATOMIC_DQ}, VECTOR_RED={VECTOR_RED})")
    DS_TILE = BLOCK_N * BLOCK_M  # words of one dSᵀ buffer (two with DQ_DEFERRED)
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    unrolled = two_products(HEAD_DIM, Q_TILES, mma)
    # the dQ phase (built only with ATOMIC_DQ: its warp layout needs 4 or 8 warps)
    add_dq = atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, DTYPE, WARPS, SK, swizzle, swizzle_m, VECTOR_RED,
                             DQ_COLS, RED_V4) if ATOMIC_DQ else None
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    st_b32 = ptx.st_shared_b32
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    @inline_device
    def last_dq(smem, dq_acc, step, qt0, per_head, dq_h0, group, warp, lane, g, t, first):
        """DQ_DEFERRED: dQ of step - 1 from its dSᵀ buffer (parity step - 1)."""
        prev = step - 1
        hp, i0 = step_tile(prev, qt0, per_head, group)
        add_dq(smem, SDS + (prev & 1) * DS_TILE, dq_acc, dq_h0 + hp, i0, warp, lane, g, t, first)

    @inline_device
    def dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb, first):
        """Key block kb (BLOCK_N keys) of kv head blockIdx.y; dQ (ATOMIC_DQ) into dq_acc (the plane this
        block adds into: the splits pass a view from its first row), stored instead of added where first."""
        smem = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)
        smem_f = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)  # the same bytes, as fp32 (L2, D)
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
        nq_pad = l2.shape[1]
        dq_h0 = bh * group  # dq_acc row block of the group's first query head

        qt0, per_head, steps = schedule(k0, n_q, shift, group)

        # ldmatrix lane addresses (matrix lane >> 3 of the x4 takes its row from lanes 8j..8j+7).
        mat = lane >> 3
        a_row = warp * 16 + (lane & 15)  # A (K, V rows): quarters (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
        a_x = (lane >> 4) ^ (a_row & 7)
        b_row = (mat >> 1) * 8 + (lane & 7)  # B of two n-tiles (Q, dO rows): (rows, d 0-7 | 8-15)
        b_x = (mat & 1) ^ (b_row & 7)
        t_row = (mat & 1) * 8 + (lane & 7)  # B by .trans (dO, Q as k x n): (rows 0-7 | 8-15) per d pair
        t_lane = swizzle(t_row, mat >> 1)  # ... of d pair dp2, k-step kk: (t_lane ^ (dp2 << 4)) + kk·16 rows
        ds_lane = swizzle_m(warp * 16 + g, 0) + 2 * t  # dSᵀ pair (key 16w + g, queries 8 nt + 2t): ^ (nt << 3)

        plan = prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad)

        acc_k = cuda.local.array((O_TILES, 4), float32)
        acc_v = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((Q_TILES, 4), float32)  # Sᵀ, then Pᵀ
        dp = cuda.local.array((Q_TILES, 4), float32)  # dPᵀ, then dSᵀ
        for dt in range(O_TILES):
            for r in range(4):
                acc_k[dt, r] = ZERO
                acc_v[dt, r] = ZERO

        for step in range(steps):
            cp_wait(0)  # this step's tiles (the only group in flight) ...
            cuda.syncthreads()  # ... for every thread; and every warp has left the previous step
            prefetch(smem, step, steps, qt0, per_head, q, dout, l2, dd, plan, b, h_kv, group, n_q, nq_pad)
            cp_commit()
            hh, i0 = step_tile(step, qt0, per_head, group)
            st = STAGE0 + (step & 1) * STAGE
            if DQ_DEFERRED and step > 0:  # the barrier above published step - 1's dSᵀ
                last_dq(smem, dq_acc, step, qt0, per_head, dq_h0, group, warp, lane, g, t, first)

            # Sᵀ = K_w Q_iᵀ and dPᵀ = V_w dO_iᵀ
            unrolled(s, dp, smem, SK, SV, st + SQ, st + SDO, a_row, a_x, b_row, b_x)

            # Pᵀ = exp2(Sᵀ·scale·log2 e − L2[query]), dSᵀ = Pᵀ ∘ (dPᵀ − D[query]); padded queries
            # have L2 = +inf. Mask only where this warp's keys cross the tile's diagonal.
            needs_mask = CAUSAL and kw + 15 > i0 + shift
            l2_s = (st + SL) >> 1
            d_s = (st + SD) >> 1
            for nt in range(Q_TILES):
                for r in range(4):
                    col = nt * 8 + 2 * t + (r & 1)
                    x = s[nt, r] * scale_log2 - smem_f[l2_s + col]
                    if needs_mask and kw + g + 8 * (r >> 1) > i0 + col + shift:
                        x = NEG_INF
                    p = ex2(x)
                    s[nt, r] = p
                    dp[nt, r] = p * (dp[nt, r] - smem_f[d_s + col])

            sds = SDS + (step & 1) * DS_TILE if DQ_DEFERRED else SDS
            if ATOMIC_DQ:  # dSᵀ to shared memory as 16-bit pairs (row = key, 2 adjacent queries)
                for nt in range(Q_TILES):
                    for half in range(2):
                        st_b32(smem, sds + (ds_lane ^ (nt << 3)) + half * 8 * BLOCK_M,
                               pack(dp[nt, 2 * half], dp[nt, 2 * half + 1]))

            # dV_w += Pᵀ dO_i and dK_w += dSᵀ Q_i: accumulators of n-tiles 2kk, 2kk+1 = A of k-step kk.
            for kk in range(M_STEPS):
                nt = 2 * kk
                p0 = pack(s[nt, 0], s[nt, 1])
                p1 = pack(s[nt, 2], s[nt, 3])
                p2 = pack(s[nt + 1, 0], s[nt + 1, 1])
                p3 = pack(s[nt + 1, 2], s[nt + 1, 3])
                d0 = pack(dp[nt, 0], dp[nt, 1])
                d1 = pack(dp[nt, 2], dp[nt, 3])
                d2 = pack(dp[nt + 1, 0], dp[nt + 1, 1])
                d3 = pack(dp[nt + 1, 2], dp[nt + 1, 3])
                for dp2 in range(O_TILES // 2):
                    dt = 2 * dp2
                    t_off = ((st + t_lane) ^ (dp2 << 4)) + kk * 16 * HEAD_DIM
                    dv_dk_step(smem, acc_v, acc_k, dt, t_off, p0, p1, p2, p3, d0, d1, d2, d3)

            if ATOMIC_DQ and not DQ_DEFERRED:
                cuda.syncthreads()  # every warp's dSᵀ is in shared memory
                add_dq(smem, SDS, dq_acc, dq_h0 + hh, i0, warp, lane, g, t, first)

        if DQ_DEFERRED:  # the last step's dQ
            cuda.syncthreads()
            if steps > 0:
                last_dq(smem, dq_acc, steps, qt0, per_head, dq_h0, group, warp, lane, g, t, first)

        cp_wait(0)  # nothing may be in flight when the block exits (steps == 0 included)

        store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, 0, n_k, d, scale)

    FIRST_STORES = DQ_SPLITS == 2  # a compile-time constant: the other build's stores are pruned
    if ATOMIC_DQ and DQ_SPLITS:
        def mma_backward_dkdv(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb0,
                              plane_rows):
            # Key block kb0 + blockIdx.x, dQ into plane blockIdx.x (plane_rows = B·H rows of dq_acc each): a
            # launch's blocks own one plane each, and the launches of a backward follow each other on one
            # stream, so each dQ element of a plane gets its adds from one lane, launch after launch: the same
            # sums every run. The plane is a view (its own base address): as a row offset it cost 40 B of spills.
            dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc[cuda.blockIdx.x * plane_rows:], n_q, n_k, d, group,
                      scale_log2, scale, kb0 + cuda.blockIdx.x, FIRST_STORES)
    elif ATOMIC_DQ:  # every block adds into one plane: the order of the adds, hence the last bits, vary
        def mma_backward_dkdv(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale):
            dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x,
                      False)
    else:  # dq_acc is never touched: l2 stands in (the `if ATOMIC_DQ` branches are pruned at compile time)
        def mma_backward_dkdv(q, k, v, dout, l2, dd, dk, dv, n_q, n_k, d, group, scale_log2, scale):
            dkdv_body(q, k, v, dout, l2, dd, dk, dv, l2, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x,
                      False)

    return mma_backward_dkdv


def dkdv_split_source(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, PARTIAL_CHUNK=False):
    """dK/dV with FA2's warp layout (``split_d``): two warps per 16 keys, each owning half of the
    head dim of dK and dV (so half the accumulators: 64 fp32 per lane at d = 128 instead of 128)
    and half of the query columns of Sᵀ and dPᵀ. Pᵀ and dSᵀ meet in shared memory (16-bit,
    swizzled rows of BLOCK_M = 64 queries) and come back as A fragments by ldmatrix, one barrier
    later. Same maths, same outputs as ``dkdv_source`` up to summation order within a tile."""
    R_GROUPS = BLOCK_N // 16  # warps 2r, 2r + 1 own keys 16r..16r+15
    WARPS = 2 * R_GROUPS
    THREADS = 32 * WARPS
    Q_HALF = BLOCK_M // 2  # query columns of Sᵀ / dPᵀ per warp
    Q_TILES_W = Q_HALF // 8
    M_STEPS = BLOCK_M // 16  # k-steps of dV and dK (all queries)
    O_TILES_W = HEAD_DIM // 16  # n-tiles of this warp's half of dK / dV
    CAUSAL = bool(CAUSAL)
    if BLOCK_M != 64:
        raise ValueError(f"split_d dkdv needs 64-query tiles (8-chunk swizzled Pᵀ rows); got BLOCK_M={BLOCK_M}")
    (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, SP), swizzle, prologue, schedule, step_tile, prefetch, \
        swizzle_m, store_grads, dv_dk_step = _dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS, O_TILES_W,
                                                               PARTIAL_CHUNK)
    SDS = SP + BLOCK_N * BLOCK_M  # Pᵀ at SP, then dSᵀ: BLOCK_N keys x BLOCK_M queries each
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    unrolled = two_products(HEAD_DIM, Q_TILES_W, mma)
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    ldsm = ptx.ldmatrix_x4
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    def mma_backward_dkdv(q, k, v, dout, l2, dd, dk, dv, n_q, n_k, d, group, scale_log2, scale):
        smem = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)
        smem_f = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)  # the same bytes, as fp32 (L2, D)
        smem_w = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)  # ... and as 32-bit words (pairs)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        rg = warp >> 1  # key group: keys 16 rg..
        half_c = warp & 1  # query half of Sᵀ / dPᵀ, head-dim half of dK / dV
        bh = cuda.blockIdx.y
        n_kv_heads = k.shape[1]
        b = bh // n_kv_heads
        h_kv = bh - b * n_kv_heads
        k0 = cuda.blockIdx.x * BLOCK_N
        kw = k0 + rg * 16
        shift = n_k - n_q
        nq_pad = l2.shape[1]

        qt0, per_head, steps = schedule(k0, n_q, shift, group)

        mat = lane >> 3
        a_row = rg * 16 + (lane & 15)  # A rows: K, V (head dim) and Pᵀ, dSᵀ (queries)
        a_x = (lane >> 4) ^ (a_row & 7)
        b_row = (mat >> 1) * 8 + (lane & 7)
        b_x = (mat & 1) ^ (b_row & 7)
        t_row = (mat & 1) * 8 + (lane & 7)
        t_chunk = mat >> 1
        q_off = half_c * Q_HALF * HEAD_DIM  # this warp's query rows of the Q / dO tiles

        plan = prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad)

        acc_k = cuda.local.array((O_TILES_W, 4), float32)
        acc_v = cuda.local.array((O_TILES_W, 4), float32)
        s = cuda.local.array((Q_TILES_W, 4), float32)
        dp = cuda.local.array((Q_TILES_W, 4), float32)
        for dt in range(O_TILES_W):
            for r in range(4):
                acc_k[dt, r] = ZERO
                acc_v[dt, r] = ZERO

        for step in range(steps):
            cp_wait(0)
            cuda.syncthreads()  # tiles landed; every warp left the previous step (and its Pᵀ, dSᵀ)
            prefetch(smem, step, steps, qt0, per_head, q, dout, l2, dd, plan, b, h_kv, group, n_q, nq_pad)
            cp_commit()
            hh, i0 = step_tile(step, qt0, per_head, group)
            st = STAGE0 + (step & 1) * STAGE

            # Sᵀ and dPᵀ for keys 16 rg.. x this warp's half of the queries
            unrolled(s, dp, smem, SK, SV, st + SQ + q_off, st + SDO + q_off, a_row, a_x, b_row, b_x)

            needs_mask = CAUSAL and kw + 15 > i0 + shift
            l2_s = (st + SL) >> 1
            d_s = (st + SD) >> 1
            for nt in range(Q_TILES_W):
                for r in range(4):
                    col = half_c * Q_HALF + nt * 8 + 2 * t + (r & 1)
                    x = s[nt, r] * scale_log2 - smem_f[l2_s + col]
                    if needs_mask and kw + g + 8 * (r >> 1) > i0 + col + shift:
                        x = NEG_INF
                    p = ex2(x)
                    s[nt, r] = p
                    dp[nt, r] = p * (dp[nt, r] - smem_f[d_s + col])
            for nt in range(Q_TILES_W):  # Pᵀ and dSᵀ to shared memory as 16-bit pairs
                for half in range(2):
                    off = swizzle_m(rg * 16 + g + 8 * half, half_c * Q_TILES_W + nt) + 2 * t
                    smem_w[(SP + off) >> 1] = pack(s[nt, 2 * half], s[nt, 2 * half + 1])
                    smem_w[(SDS + off) >> 1] = pack(dp[nt, 2 * half], dp[nt, 2 * half + 1])
            cuda.syncthreads()  # both query halves of every key group are in shared memory

            # dV[16 rg.., d half] += Pᵀ dO and dK[...] += dSᵀ Q over all BLOCK_M queries.
            for kk in range(M_STEPS):
                a_off = swizzle_m(a_row, 2 * kk + (lane >> 4))
                p0, p1, p2, p3 = ldsm(smem, SP + a_off)
                d0, d1, d2, d3 = ldsm(smem, SDS + a_off)
                for dp2 in range(O_TILES_W // 2):
                    dt = 2 * dp2
                    t_off = st + swizzle(kk * 16 + t_row, half_c * O_TILES_W + dp2 * 2 + t_chunk)
                    dv_dk_step(smem, acc_v, acc_k, dt, t_off, p0, p1, p2, p3, d0, d1, d2, d3)

        cp_wait(0)
        store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, half_c * (HEAD_DIM // 2), n_k, d, scale)

    return mma_backward_dkdv


def two_products_m(HEAD_DIM, M_TILES, N_TILES, mma):
    """two_products for warps of M_TILES m-tiles (16·M_TILES rows of A): every B fragment feeds
    M_TILES mma, so the B tiles (shared by every warp) are read 1/M_TILES as often per product.
    X and Y are (M_TILES, N_TILES, 4) accumulators; A rows of m-tile mt start at a_row + 16 mt."""
    ldsm = ptx.ldmatrix_x4
    D_STEPS = HEAD_DIM // 16

    @inline_device
    def step(x, y, fa, fb, smem, kk, a1, a2, b1, b2, a_row, a_x, b_row, b_x):
        a_off = a_row * HEAD_DIM + (((2 * kk) ^ a_x) << 3)  # row + 16 mt keeps row % 8: the same swizzle
        for mt in range(M_TILES):
            fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3] = ldsm(smem, a1 + a_off + mt * 16 * HEAD_DIM)
            fb[mt, 0], fb[mt, 1], fb[mt, 2], fb[mt, 3] = ldsm(smem, a2 + a_off + mt * 16 * HEAD_DIM)
        b_off = b_row * HEAD_DIM + (((2 * kk) ^ b_x) << 3)
        for np2 in range(N_TILES // 2):
            nt = 2 * np2
            c0, c1, c2, c3 = ldsm(smem, b1 + b_off + np2 * 16 * HEAD_DIM)
            for mt in range(M_TILES):
                x[mt, nt, 0], x[mt, nt, 1], x[mt, nt, 2], x[mt, nt, 3] = mma(
                    fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], c0, c1,
                    x[mt, nt, 0], x[mt, nt, 1], x[mt, nt, 2], x[mt, nt, 3])
                x[mt, nt + 1, 0], x[mt, nt + 1, 1], x[mt, nt + 1, 2], x[mt, nt + 1, 3] = mma(
                    fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], c2, c3,
                    x[mt, nt + 1, 0], x[mt, nt + 1, 1], x[mt, nt + 1, 2], x[mt, nt + 1, 3])
            c0, c1, c2, c3 = ldsm(smem, b2 + b_off + np2 * 16 * HEAD_DIM)
            for mt in range(M_TILES):
                y[mt, nt, 0], y[mt, nt, 1], y[mt, nt, 2], y[mt, nt, 3] = mma(
                    fb[mt, 0], fb[mt, 1], fb[mt, 2], fb[mt, 3], c0, c1,
                    y[mt, nt, 0], y[mt, nt, 1], y[mt, nt, 2], y[mt, nt, 3])
                y[mt, nt + 1, 0], y[mt, nt + 1, 1], y[mt, nt + 1, 2], y[mt, nt + 1, 3] = mma(
                    fb[mt, 0], fb[mt, 1], fb[mt, 2], fb[mt, 3], c2, c3,
                    y[mt, nt + 1, 0], y[mt, nt + 1, 1], y[mt, nt + 1, 2], y[mt, nt + 1, 3])

    @inline_device
    def unrolled(x, y, smem, a1, a2, b1, b2, a_row, a_x, b_row, b_x):
        fa = cuda.local.array((M_TILES, 4), uint32)
        fb = cuda.local.array((M_TILES, 4), uint32)
        for mt in range(M_TILES):
            for nt in range(N_TILES):
                for r in range(4):
                    x[mt, nt, r] = float32(0.0)
                    y[mt, nt, r] = float32(0.0)
        step(x, y, fa, fb, smem, 0, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
        step(x, y, fa, fb, smem, 1, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
        step(x, y, fa, fb, smem, 2, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
        step(x, y, fa, fb, smem, 3, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
        if D_STEPS > 4:
            step(x, y, fa, fb, smem, 4, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
            step(x, y, fa, fb, smem, 5, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
            step(x, y, fa, fb, smem, 6, a1, a2, b1, b2, a_row, a_x, b_row, b_x)
            step(x, y, fa, fb, smem, 7, a1, a2, b1, b2, a_row, a_x, b_row, b_x)

    if D_STEPS not in (4, 8):
        raise ValueError(f"HEAD_DIM={HEAD_DIM}: the unrolled products take 64 or 128")
    return unrolled


def atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, DTYPE, WARPS, SK, swizzle, swizzle_m, VECTOR_RED=True, DQ_COLS=32,
                    RED_V4=False):
    """The atomic dQ phase of a dK/dV kernel (dkdv_source with ATOMIC_DQ, dkdv_fa2_source): from the
    dSᵀ tile in shared memory, dQ_i[16 rw.., cw..] += dS_i K_j, added to fp32 scratch with atomics.
    Warps 4 down dQ_i's 64 rows (rw = w mod 4) x WARPS / 4 across its columns (cw), DQ_COLS columns
    per pass (DQ_COLS / 2 accumulators per lane), each pass added atomically; RED_V4 (dkdv_source's
    variant): lane pairs swap half a fragment so each add covers 4 columns."""
    DQ_TILES = DQ_COLS // 8
    ROW_GROUPS = BLOCK_M // 16  # warps down dQ_i's rows ...
    COL_GROUPS = max(WARPS // ROW_GROUPS, 1)  # ... and across its columns
    WARP_COLS = HEAD_DIM // COL_GROUPS
    if WARPS % ROW_GROUPS or WARP_COLS % DQ_COLS:
        raise ValueError(f"{WARPS} warps over {ROW_GROUPS} row groups of dQ_i ({WARP_COLS} columns a warp): "
                         f"the warps must fill whole row groups, DQ_COLS={DQ_COLS} columns a pass "
                         f"(BLOCK_N={BLOCK_N}, HEAD_DIM={HEAD_DIM})")
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    ldsm_t = ptx.ldmatrix_x4_trans
    red_add2 = ptx.red_add_v2_f32
    red_add = ptx.red_add_f32
    red_add4 = ptx.red_add_v4_f32
    st2 = ptx.st_global_v2_f32
    st1 = ptx.st_global_f32
    shfl = ptx.shfl_xor_sync
    FULL = ptx.FULL_MASK
    ZERO = float32(0.0)

    @inline_device
    def red_pairs(dq_acc, acc_q, row0, pc, t):
        """RED_V4: even t keeps row g and takes its partner's row-g pair, odd t keeps row g + 8 and
        takes its partner's: each lane then holds 4 adjacent columns (16-byte aligned) of one row."""
        odd = (t & 1) == 1
        for nt in range(DQ_TILES):
            lo0, lo1, hi0, hi1 = acc_q[nt, 0], acc_q[nt, 1], acc_q[nt, 2], acc_q[nt, 3]
            x = shfl(FULL, lo0 if odd else hi0, 1)  # even sends row g + 8, odd row g
            y = shfl(FULL, lo1 if odd else hi1, 1)
            off = row0 + pc * DQ_COLS + nt * 8 + 2 * t + (8 * HEAD_DIM - 2 if odd else 0)
            red_add4(dq_acc, off, x if odd else lo0, y if odd else lo1, hi0 if odd else x, hi1 if odd else y)

    PASSES = WARP_COLS // DQ_COLS

    @inline_device
    def dq_pass(smem, ds_lane, dq_acc, acc_q, row0, pc, t_row, t_chunk, t, first):
        """One DQ_COLS-column chunk pc of this warp's dQ_i rows: acc_q = dS_i K_j[:, chunk], then the adds
        (stores where ``first``: the deterministic splits' first launch, into planes nobody zeroed)."""
        for nt in range(DQ_TILES):
            for r in range(4):
                acc_q[nt, r] = ZERO
        k_lane = SK + swizzle(t_row, pc * DQ_TILES + t_chunk)  # d pair dp2, k-step kk: ^ (dp2 << 4), + kk·16 rows
        for kk in range(BLOCK_N // 16):
            a0, a1, a2, a3 = ldsm_t(smem, ds_lane + kk * 16 * BLOCK_M)
            for dp2 in range(DQ_COLS // 16):
                nt = 2 * dp2
                b0, b1, b2, b3 = ldsm_t(smem, (k_lane ^ (dp2 << 4)) + kk * 16 * HEAD_DIM)
                acc_q[nt, 0], acc_q[nt, 1], acc_q[nt, 2], acc_q[nt, 3] = mma(
                    a0, a1, a2, a3, b0, b1, acc_q[nt, 0], acc_q[nt, 1], acc_q[nt, 2], acc_q[nt, 3])
                acc_q[nt + 1, 0], acc_q[nt + 1, 1], acc_q[nt + 1, 2], acc_q[nt + 1, 3] = mma(
                    a0, a1, a2, a3, b2, b3, acc_q[nt + 1, 0], acc_q[nt + 1, 1], acc_q[nt + 1, 2], acc_q[nt + 1, 3])
        if RED_V4:
            red_pairs(dq_acc, acc_q, row0, pc, t)
        else:
            for nt in range(DQ_TILES):
                col = pc * DQ_COLS + nt * 8 + 2 * t
                for half in range(2):  # scratch rows and columns are padded: no bounds checks
                    off = row0 + 8 * half * HEAD_DIM + col
                    if first and VECTOR_RED:
                        st2(dq_acc, off, acc_q[nt, 2 * half], acc_q[nt, 2 * half + 1])
                    elif first:
                        st1(dq_acc, off, acc_q[nt, 2 * half])
                        st1(dq_acc, off + 1, acc_q[nt, 2 * half + 1])
                    elif VECTOR_RED:
                        red_add2(dq_acc, off, acc_q[nt, 2 * half], acc_q[nt, 2 * half + 1])
                    else:
                        red_add(dq_acc, off, acc_q[nt, 2 * half])
                        red_add(dq_acc, off + 1, acc_q[nt, 2 * half + 1])

    @inline_device
    def add_dq(smem, sds, dq_acc, bh, i0, warp, lane, g, t, first=False):
        """dQ_i[16 rw.., cw..] += dS_i K_j for this warp's 16 query rows (rw = w mod ROW_GROUPS) and
        WARP_COLS columns (cw), DQ_COLS per pass: A = dS by ldmatrix.trans of the stored dSᵀ, B = K by
        ldmatrix.trans, then atomic adds. The passes go in pairs, written out with an accumulator array
        each (the shipped tiles have one pair, or one pass): as a rolled loop (NVVM kept it rolled) the
        second pass's first ldmatrix reused registers that the first pass's red instructions were still
        reading (long-scoreboard stalls in ncu). Four passes (a sweep tile) loop over two pairs."""
        rw = warp % ROW_GROUPS
        cw = warp // ROW_GROUPS
        mat = lane >> 3
        a_key = (mat >> 1) * 8 + (lane & 7)  # A (queries x keys) from dSᵀ rows (keys): transposed quarters
        ds_lane = sds + swizzle_m(a_key, 2 * rw + (mat & 1))  # ... of k-step kk: + kk·16 rows
        t_row = (mat & 1) * 8 + (lane & 7)
        t_chunk = mat >> 1
        row0 = (bh * dq_acc.shape[1] + i0 + rw * 16 + g) * HEAD_DIM  # flat offset of row g (contiguous)
        acc_a = cuda.local.array((DQ_TILES, 4), float32)
        acc_b = cuda.local.array((DQ_TILES, 4), float32)
        for wc in range(0, PASSES, 2):  # one trip for the shipped tiles (2 passes, or 1)
            pc = cw * PASSES + wc  # this pass's DQ_COLS-column chunk of dQ_i
            dq_pass(smem, ds_lane, dq_acc, acc_a, row0, pc, t_row, t_chunk, t, first)
            if PASSES > 1:
                dq_pass(smem, ds_lane, dq_acc, acc_b, row0, pc + 1, t_row, t_chunk, t, first)

    return add_dq


def dkdv_fa2_source(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, ATOMIC_DQ=False, VECTOR_RED=True, PARTIAL_CHUNK=False):
    """dK/dV with FA2's d = 128 warp tiles (``fa2``): warps in pairs over 32 keys (two m-tiles), each
    computing Sᵀ and dPᵀ for its 32 keys x half of the 64 queries (32 x 32 tiles: every K, V, Q, dO
    fragment loaded feeds 2 mma, where the shipped layout's 16 x 64 tiles feed 1 with A), then
    dV, dK for its 32 keys x half of the head dim from Pᵀ and dSᵀ in shared memory (each dO and Q
    fragment feeds both m-tiles). BLOCK_N = 128: 8 warps, FA2's 2 x 4 / 4 x 2 layouts; per warp and
    step at d = 128 112 ldmatrix per 256 mma (the shipped dkdv: 144). Accumulators per lane as the
    shipped kernel's (dK + dV: 128 fp32 at d = 128). ATOMIC_DQ: dQ_i += dS K_j from the same dSᵀ
    tile (atomic_dq_phase), no extra barrier: the next step's writes of Pᵀ / dSᵀ follow its first
    barrier. Same maths and outputs as ``dkdv_source`` up to summation order within a tile."""
    KT = 2  # m-tiles (16 keys each) per warp
    R_GROUPS = BLOCK_N // (16 * KT)  # warps 2r, 2r + 1 own keys 32r..32r+31
    WARPS = 2 * R_GROUPS
    THREADS = 32 * WARPS
    Q_HALF = BLOCK_M // 2  # query columns of Sᵀ / dPᵀ per warp
    Q_TILES_W = Q_HALF // 8
    M_STEPS = BLOCK_M // 16  # k-steps of dV and dK (all queries)
    O_TILES_W = HEAD_DIM // 16  # n-tiles of this warp's half of dK / dV
    CAUSAL, ATOMIC_DQ = bool(CAUSAL), bool(ATOMIC_DQ)
    if BLOCK_M != 64 or BLOCK_N not in (64, 128):
        raise ValueError(f"fa2 dkdv needs 64-query tiles (8-chunk swizzled Pᵀ rows) and 64 or 128 keys (whole "
                         f"warp pairs; 4 or 8 warps over dQ_i's 4 row groups); got BLOCK_N={BLOCK_N}, BLOCK_M={BLOCK_M}")
    (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, SP), swizzle, prologue, schedule, step_tile, prefetch, \
        swizzle_m, _store_grads, _dv_dk_step = _dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS,
                                                           O_TILES_W, PARTIAL_CHUNK)
    SDS = SP + BLOCK_N * BLOCK_M  # Pᵀ at SP, then dSᵀ: BLOCK_N keys x BLOCK_M queries each
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    unrolled = two_products_m(HEAD_DIM, KT, Q_TILES_W, mma)
    add_dq = atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, DTYPE, WARPS, SK, swizzle, swizzle_m,
                             VECTOR_RED) if ATOMIC_DQ else None
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    ldsm = ptx.ldmatrix_x4
    ldsm_t = ptx.ldmatrix_x4_trans
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    @inline_device
    def dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale):
        smem = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)
        smem_f = cuda.shared.array(0, float32, alignment=SMEM_ALIGN)  # the same bytes, as fp32 (L2, D)
        smem_w = cuda.shared.array(0, uint32, alignment=SMEM_ALIGN)  # ... and as 32-bit words (pairs)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        rg = warp >> 1  # key group: keys 32 rg..
        half_c = warp & 1  # query half of Sᵀ / dPᵀ, head-dim half of dK / dV
        bh = cuda.blockIdx.y
        n_kv_heads = k.shape[1]
        b = bh // n_kv_heads
        h_kv = bh - b * n_kv_heads
        k0 = cuda.blockIdx.x * BLOCK_N
        kw = k0 + rg * 16 * KT  # this warp pair's first key
        shift = n_k - n_q
        nq_pad = l2.shape[1]

        qt0, per_head, steps = schedule(k0, n_q, shift, group)

        mat = lane >> 3
        a_row = rg * 16 * KT + (lane & 15)  # A rows of m-tile 0: K, V (head dim) and Pᵀ, dSᵀ (queries)
        a_x = (lane >> 4) ^ (a_row & 7)
        b_row = (mat >> 1) * 8 + (lane & 7)
        b_x = (mat & 1) ^ (b_row & 7)
        t_row = (mat & 1) * 8 + (lane & 7)
        t_chunk = mat >> 1
        q_off = half_c * Q_HALF * HEAD_DIM  # this warp's query rows of the Q / dO tiles

        plan = prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad)

        acc_k = cuda.local.array((KT, O_TILES_W, 4), float32)
        acc_v = cuda.local.array((KT, O_TILES_W, 4), float32)
        s = cuda.local.array((KT, Q_TILES_W, 4), float32)  # Sᵀ, then Pᵀ
        dp = cuda.local.array((KT, Q_TILES_W, 4), float32)  # dPᵀ, then dSᵀ
        pa = cuda.local.array((KT, 4), uint32)  # Pᵀ fragments of one k-step, per m-tile
        da = cuda.local.array((KT, 4), uint32)  # dSᵀ's
        for mt in range(KT):
            for dt in range(O_TILES_W):
                for r in range(4):
                    acc_k[mt, dt, r] = ZERO
                    acc_v[mt, dt, r] = ZERO

        for step in range(steps):
            cp_wait(0)
            cuda.syncthreads()  # tiles landed; every warp left the previous step (its Pᵀ, dSᵀ, dQ phase)
            prefetch(smem, step, steps, qt0, per_head, q, dout, l2, dd, plan, b, h_kv, group, n_q, nq_pad)
            cp_commit()
            hh, i0 = step_tile(step, qt0, per_head, group)
            st = STAGE0 + (step & 1) * STAGE

            # Sᵀ and dPᵀ for keys 32 rg.. x this warp's half of the queries
            unrolled(s, dp, smem, SK, SV, st + SQ + q_off, st + SDO + q_off, a_row, a_x, b_row, b_x)

            needs_mask = CAUSAL and kw + 16 * KT - 1 > i0 + shift
            l2_s = (st + SL) >> 1
            d_s = (st + SD) >> 1
            for mt in range(KT):
                for nt in range(Q_TILES_W):
                    for r in range(4):
                        col = half_c * Q_HALF + nt * 8 + 2 * t + (r & 1)
                        x = s[mt, nt, r] * scale_log2 - smem_f[l2_s + col]
                        if needs_mask and kw + mt * 16 + g + 8 * (r >> 1) > i0 + col + shift:
                            x = NEG_INF
                        p = ex2(x)
                        s[mt, nt, r] = p
                        dp[mt, nt, r] = p * (dp[mt, nt, r] - smem_f[d_s + col])
            for mt in range(KT):  # Pᵀ and dSᵀ to shared memory as 16-bit pairs
                for nt in range(Q_TILES_W):
                    for half in range(2):
                        off = swizzle_m(rg * 16 * KT + mt * 16 + g + 8 * half, half_c * Q_TILES_W + nt) + 2 * t
                        smem_w[(SP + off) >> 1] = pack(s[mt, nt, 2 * half], s[mt, nt, 2 * half + 1])
                        smem_w[(SDS + off) >> 1] = pack(dp[mt, nt, 2 * half], dp[mt, nt, 2 * half + 1])
            cuda.syncthreads()  # both query halves of every key group are in shared memory

            # dV[32 rg.., d half] += Pᵀ dO and dK[...] += dSᵀ Q over all BLOCK_M queries.
            for kk in range(M_STEPS):
                for mt in range(KT):
                    a_off = swizzle_m(a_row + 16 * mt, 2 * kk + (lane >> 4))
                    pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3] = ldsm(smem, SP + a_off)
                    da[mt, 0], da[mt, 1], da[mt, 2], da[mt, 3] = ldsm(smem, SDS + a_off)
                for dp2 in range(O_TILES_W // 2):
                    dt = 2 * dp2
                    t_off = st + swizzle(kk * 16 + t_row, half_c * O_TILES_W + dp2 * 2 + t_chunk)
                    b0, b1, b2, b3 = ldsm_t(smem, SDO + t_off)
                    for mt in range(KT):
                        acc_v[mt, dt, 0], acc_v[mt, dt, 1], acc_v[mt, dt, 2], acc_v[mt, dt, 3] = mma(
                            pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b0, b1,
                            acc_v[mt, dt, 0], acc_v[mt, dt, 1], acc_v[mt, dt, 2], acc_v[mt, dt, 3])
                        acc_v[mt, dt + 1, 0], acc_v[mt, dt + 1, 1], acc_v[mt, dt + 1, 2], acc_v[mt, dt + 1, 3] = mma(
                            pa[mt, 0], pa[mt, 1], pa[mt, 2], pa[mt, 3], b2, b3,
                            acc_v[mt, dt + 1, 0], acc_v[mt, dt + 1, 1], acc_v[mt, dt + 1, 2], acc_v[mt, dt + 1, 3])
                    b0, b1, b2, b3 = ldsm_t(smem, SQ + t_off)
                    for mt in range(KT):
                        acc_k[mt, dt, 0], acc_k[mt, dt, 1], acc_k[mt, dt, 2], acc_k[mt, dt, 3] = mma(
                            da[mt, 0], da[mt, 1], da[mt, 2], da[mt, 3], b0, b1,
                            acc_k[mt, dt, 0], acc_k[mt, dt, 1], acc_k[mt, dt, 2], acc_k[mt, dt, 3])
                        acc_k[mt, dt + 1, 0], acc_k[mt, dt + 1, 1], acc_k[mt, dt + 1, 2], acc_k[mt, dt + 1, 3] = mma(
                            da[mt, 0], da[mt, 1], da[mt, 2], da[mt, 3], b2, b3,
                            acc_k[mt, dt + 1, 0], acc_k[mt, dt + 1, 1], acc_k[mt, dt + 1, 2], acc_k[mt, dt + 1, 3])

            if ATOMIC_DQ:  # dSᵀ is complete since the barrier above
                add_dq(smem, SDS, dq_acc, bh * group + hh, i0, warp, lane, g, t)

        cp_wait(0)  # nothing may be in flight when the block exits (steps == 0 included)

        col0 = half_c * (HEAD_DIM // 2)
        for mt in range(KT):
            for half in range(2):
                row = kw + mt * 16 + g + 8 * half
                if row < n_k:
                    for dt in range(O_TILES_W):
                        col = col0 + dt * 8 + 2 * t
                        bits_v = pack(acc_v[mt, dt, 2 * half], acc_v[mt, dt, 2 * half + 1])
                        bits_k = pack(acc_k[mt, dt, 2 * half] * scale, acc_k[mt, dt, 2 * half + 1] * scale)
                        if col < d:
                            dv[b, h_kv, row, col] = uint16(bits_v & 0xFFFF)
                            dk[b, h_kv, row, col] = uint16(bits_k & 0xFFFF)
                        if col + 1 < d:
                            dv[b, h_kv, row, col + 1] = uint16(bits_v >> 16)
                            dk[b, h_kv, row, col + 1] = uint16(bits_k >> 16)

    if ATOMIC_DQ:
        def mma_backward_dkdv(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale):
            dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale)
    else:  # dq_acc is never touched: l2 stands in
        def mma_backward_dkdv(q, k, v, dout, l2, dd, dk, dv, n_q, n_k, d, group, scale_log2, scale):
            dkdv_body(q, k, v, dout, l2, dd, dk, dv, l2, n_q, n_k, d, group, scale_log2, scale)

    return mma_backward_dkdv


def dq_source(BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DTYPE, PARTIAL_CHUNK=False):
    """The dQ kernel: BLOCK_M queries per block (one warp per 16), BLOCK_N-row K/V tiles streamed."""
    WARPS = BLOCK_M // 16
    THREADS = 32 * WARPS
    CHUNKS = HEAD_DIM // 8
    Q_COPIES = BLOCK_M * CHUNKS // THREADS
    KV_COPIES = BLOCK_N * CHUNKS // THREADS
    K_TILES = BLOCK_N // 8  # n-tiles of S / dP (key columns)
    N_STEPS = BLOCK_N // 16  # k-steps of dQ (over the keys)
    O_TILES = HEAD_DIM // 8  # n-tiles of dQ
    SQ, SDO = 0, BLOCK_M * HEAD_DIM  # word offsets: Q and dO once, then two stages of [K | V]
    STAGE0 = 2 * BLOCK_M * HEAD_DIM
    STAGE = 2 * BLOCK_N * HEAD_DIM
    SK, SV = 0, BLOCK_N * HEAD_DIM
    CAUSAL = bool(CAUSAL)
    swizzle, _, copy_plan, load_tile_fast = tile_copies(HEAD_DIM, THREADS, PARTIAL_CHUNK)
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    unrolled = two_products(HEAD_DIM, K_TILES, mma)
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    ldsm_t = ptx.ldmatrix_x4_trans
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    def mma_backward_dq(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale):
        smem = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        # Heaviest causal tiles first: they start while the light ones fill the tail.
        q0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BLOCK_M
        bh = cuda.blockIdx.y
        n_heads = q.shape[1]
        b = bh // n_heads
        h = bh - b * n_heads
        h_kv = h // group
        qw = q0 + warp * 16  # this warp's first query row
        shift = n_k - n_q

        n_tiles = (n_k + BLOCK_N - 1) // BLOCK_N
        if CAUSAL:
            visible = min(q0 + BLOCK_M, n_q) + shift  # keys the tile's last row can see
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_N - 1) // BLOCK_N)

        mat = lane >> 3
        a_row = warp * 16 + (lane & 15)  # A (Q, dO rows)
        a_x = (lane >> 4) ^ (a_row & 7)
        b_row = (mat >> 1) * 8 + (lane & 7)  # B of two n-tiles (K, V rows)
        b_x = (mat & 1) ^ (b_row & 7)
        t_row = (mat & 1) * 8 + (lane & 7)  # B by .trans (K as k x n)
        t_lane = swizzle(t_row, mat >> 1)  # ... of d pair dp2, k-step kk: (t_lane ^ (dp2 << 4)) + kk·16 rows

        # This thread's copy plans (offsets, source bytes per copy, shared offset); K's and V's offsets
        # step by a tile per K/V tile.
        q_off, q_rs, col_bytes, dst0 = copy_plan(q, b, h, d)
        do_off, do_rs, _, _ = copy_plan(dout, b, h, d)
        k_next, k_rs, _, _ = copy_plan(k, b, h_kv, d)
        v_next, v_rs, _, _ = copy_plan(v, b, h_kv, d)
        load_tile_fast(smem, SQ, q, q_off + q0 * q_rs, q_rs, col_bytes, dst0, q0, n_q, Q_COPIES)
        load_tile_fast(smem, SDO, dout, do_off + q0 * do_rs, do_rs, col_bytes, dst0, q0, n_q, Q_COPIES)
        if n_tiles > 0:
            load_tile_fast(smem, STAGE0 + SK, k, k_next, k_rs, col_bytes, dst0, int32(0), n_k, KV_COPIES)
            load_tile_fast(smem, STAGE0 + SV, v, v_next, v_rs, col_bytes, dst0, int32(0), n_k, KV_COPIES)
        cp_commit()

        # L2 and D of this lane's rows g and g + 8 (padded scratch: always inside).
        l2_r = cuda.local.array(2, float32)
        d_r = cuda.local.array(2, float32)
        for half in range(2):
            l2_r[half] = l2[bh, qw + g + 8 * half]
            d_r[half] = dd[bh, qw + g + 8 * half]

        acc = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((K_TILES, 4), float32)  # S, then P
        dp = cuda.local.array((K_TILES, 4), float32)  # dP, then dS
        for dt in range(O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO

        for j in range(int32(n_tiles)):  # 32-bit: the loop's arithmetic
            k0 = j * BLOCK_N
            cp_wait(0)  # K_j, V_j (the only group in flight) ...
            cuda.syncthreads()  # ... for every thread; and every warp has left tile j - 1
            if j + 1 < n_tiles:  # K_{j+1}, V_{j+1} into the buffer tile j - 1 used
                nxt = STAGE0 + ((j + 1) & 1) * STAGE
                k_next += BLOCK_N * k_rs
                v_next += BLOCK_N * v_rs
                load_tile_fast(smem, nxt + SK, k, k_next, k_rs, col_bytes, dst0, k0 + BLOCK_N, n_k, KV_COPIES)
                load_tile_fast(smem, nxt + SV, v, v_next, v_rs, col_bytes, dst0, k0 + BLOCK_N, n_k, KV_COPIES)
            cp_commit()
            st = STAGE0 + (j & 1) * STAGE

            # S = Q_w K_jᵀ and dP = dO_w V_jᵀ
            unrolled(s, dp, smem, SQ, SDO, st + SK, st + SV, a_row, a_x, b_row, b_x)

            # dS = exp2(S·scale·log2 e − L2[row]) ∘ (dP − D[row]); mask keys past n_k and the diagonal.
            needs_mask = k0 + BLOCK_N > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_N - 1 > qw + shift)
            for nt in range(K_TILES):
                for r in range(4):
                    half = r >> 1
                    x = s[nt, r] * scale_log2 - l2_r[half]
                    if needs_mask:
                        col = k0 + nt * 8 + 2 * t + (r & 1)
                        if col >= n_k or (CAUSAL and col > qw + g + 8 * half + shift):
                            x = NEG_INF
                    dp[nt, r] = ex2(x) * (dp[nt, r] - d_r[half])

            # dQ_w += dS K_j: dS accumulators of n-tiles 2kk, 2kk+1 = A of k-step kk; K by .trans.
            for kk in range(N_STEPS):
                nt = 2 * kk
                a0 = pack(dp[nt, 0], dp[nt, 1])
                a1 = pack(dp[nt, 2], dp[nt, 3])
                a2 = pack(dp[nt + 1, 0], dp[nt + 1, 1])
                a3 = pack(dp[nt + 1, 2], dp[nt + 1, 3])
                for dp2 in range(O_TILES // 2):
                    dt = 2 * dp2
                    b0, b1, b2, b3 = ldsm_t(smem, ((st + SK + t_lane) ^ (dp2 << 4)) + kk * 16 * HEAD_DIM)
                    acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3] = mma(
                        a0, a1, a2, a3, b0, b1, acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                    acc[dt + 1, 0], acc[dt + 1, 1], acc[dt + 1, 2], acc[dt + 1, 3] = mma(
                        a0, a1, a2, a3, b2, b3, acc[dt + 1, 0], acc[dt + 1, 1], acc[dt + 1, 2], acc[dt + 1, 3])

        cp_wait(0)  # nothing may be in flight when the block exits (n_tiles == 0 included)

        for half in range(2):
            row = qw + g + 8 * half
            if row < n_q:
                for dt in range(O_TILES):
                    col = dt * 8 + 2 * t
                    bits = pack(acc[dt, 2 * half] * scale, acc[dt, 2 * half + 1] * scale)
                    if col < d:
                        dq[b, h, row, col] = uint16(bits & 0xFFFF)
                    if col + 1 < d:
                        dq[b, h, row, col + 1] = uint16(bits >> 16)

    return mma_backward_dq


ATOMIC_VARIANTS = {"dq_cols": 32, "dq_deferred": False, "red_v4": False}  # dkdv_source's dQ-phase flags, off


def kernel_source(kernel, block_own, block_streamed, head_dim, causal, dtype, atomic_dq=False, split_d=False,
                  vector_red=True, fa2=False, partial_chunk=False, dq_splits=0, **variants):
    """The Python kernel of one specialisation (before cuda.jit; the compile tests use it). variants:
    the atomic dQ phase's candidates, ATOMIC_VARIANTS' keys (dkdv_source's DQ_COLS, DQ_DEFERRED, RED_V4).
    partial_chunk: the sources' PARTIAL_CHUNK (d % 8 != 0)."""
    unknown = set(variants) - set(ATOMIC_VARIANTS)
    if unknown:
        raise ValueError(f"unknown atomic dQ variants {sorted(unknown)}; known {sorted(ATOMIC_VARIANTS)}")
    if kernel == "dkdv" and fa2:
        if variants:
            raise ValueError(f"the fa2 dkdv has no atomic dQ variants (got {sorted(variants)})")
        return dkdv_fa2_source(block_own, block_streamed, head_dim, causal, dtype, atomic_dq, vector_red, partial_chunk)
    if kernel == "dkdv" and split_d:
        return dkdv_split_source(block_own, block_streamed, head_dim, causal, dtype, partial_chunk)
    if kernel == "dkdv":
        v = dict(ATOMIC_VARIANTS, **variants)
        return dkdv_source(block_own, block_streamed, head_dim, causal, dtype, atomic_dq, vector_red,
                           int(v["dq_cols"]), bool(v["dq_deferred"]), bool(v["red_v4"]), partial_chunk, int(dq_splits))
    return dq_source(block_own, block_streamed, head_dim, causal, dtype, partial_chunk)


# --------------------------------------------------------------------------------------------
# Kernel factories
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def make_prep_kernel(dtype: str):
    """The scalar prep (float32 too: tf32_backward's)."""
    if dtype not in (*DTYPES, "float32"):
        raise ValueError(f"dtype {dtype!r} not in {DTYPES + ('float32',)}")
    return cuda.jit(prep_signature(dtype))(prep_source(dtype))


@lru_cache(maxsize=None)
def make_convert_kernel(dtype: str, vec: bool = False):
    """The convert kernel (float32 too: tf32_backward's dq stays fp32)."""
    if dtype not in (*DTYPES, "float32"):
        raise ValueError(f"dtype {dtype!r} not in {DTYPES + ('float32',)}")
    return cuda.jit(convert_signature(dtype))(convert_source(dtype, vec))


@lru_cache(maxsize=None)
def make_prep_vec_kernel(dtype: str, head_dim: int):
    """(kernel, rows per block) of the vector prep (float32 too: tf32_backward's)."""
    if dtype not in (*DTYPES, "float32") or head_dim not in ((32, 64, 128) if dtype == "float32" else (64, 128)):
        raise ValueError(f"vector prep: dtype {dtype!r} not in {DTYPES + ('float32',)} or head dim {head_dim} not "
                         "64 / 128 (32 too for float32)")
    source, rows = prep_vec_source(dtype, head_dim)
    return cuda.jit(prep_signature(dtype))(source), rows


def rows16(x) -> bool:
    """Unit-stride rows, other strides multiples of 16 B, 16-byte aligned data: 16-byte vector access."""
    return x.strides[-1] == x.dtype.itemsize and all(st % 16 == 0 for st in x.strides[:-1]) and address(x) % 16 == 0


@lru_cache(maxsize=None)
def make_kernel(kernel: str, block_own: int, block_streamed: int, head_dim: int, causal: bool, dtype: str,
                max_registers: int | None = None, atomic_dq: bool = False, split_d: bool = False,
                vector_red: bool = True, fa2: bool = False, partial_chunk: bool = False, dq_splits: int = 0,
                **variants):
    """The compiled ``dkdv`` or ``dq`` kernel of one specialisation; cached so each compiles once.
    atomic_dq (dkdv only): the kernel also adds dQ into fp32 scratch with atomics (FA2's scheme),
    as red.global.add.v2.f32 (vector_red, sm_90+) or scalar adds.
    split_d (dkdv only): two warps per 16 keys (``dkdv_split_source``).
    fa2 (dkdv only): FA2's d = 128 warp tiles, two warps per 32 keys (``dkdv_fa2_source``), with or
    without atomic dQ.
    partial_chunk: d % 8 != 0 (launch passes it only then, so the other kernels keep their cache key).
    dq_splits (atomic dkdv only): the deterministic splits' builds, 1 (adds) or 2 (the first launch: stores);
    dkdv_source's DQ_SPLITS, passed only when on.
    variants (atomic dkdv only): candidate dQ phases, ATOMIC_VARIANTS' keys; not shipped."""
    bad = problems(kernel, block_own, block_streamed, head_dim, dtype, split_d, fa2)
    if atomic_dq and not (kernel == "dkdv" and block_own in (64, 128) and block_streamed == 64):
        bad.append(f"atomic dQ is built into the dkdv kernel with 64 or 128 keys and 64-query tiles only, not "
                   f"{kernel} {block_own}x{block_streamed}")
    if split_d and (kernel != "dkdv" or block_streamed != 64 or atomic_dq):
        bad.append(f"split_d is a dkdv layout for 64-query tiles without atomic dQ, not {kernel} "
                   f"{block_own}x{block_streamed} atomic_dq={atomic_dq}")
    if fa2 and (kernel != "dkdv" or block_streamed != 64 or block_own not in (64, 128) or split_d):
        bad.append(f"fa2 is a dkdv layout for 64-query tiles and 64 or 128 keys (whole warp pairs, 4 or 8 "
                   f"warps over dQ_i), not {kernel} {block_own}x{block_streamed} split_d={split_d}")
    if dq_splits not in (0, 1, 2) or (dq_splits and (not atomic_dq or fa2 or variants.get("red_v4"))):
        bad.append(f"dq_splits={dq_splits!r}: 0, or 1 / 2 for builds of the atomic dkdv kernel (atomic_dq=True, "
                   "not fa2, not red_v4: its paired adds have no store form for the first launch)")
    if bad:
        raise ValueError(f"mma backward {kernel} ({block_own}, {block_streamed}, {head_dim}, {dtype}) cannot be "
                         f"built: {'; '.join(bad)}")
    source = kernel_source(kernel, block_own, block_streamed, head_dim, bool(causal), dtype, bool(atomic_dq),
                           bool(split_d), bool(vector_red), bool(fa2), bool(partial_chunk), int(dq_splits), **variants)
    cap = {"max_registers": int(max_registers)} if max_registers else {}
    return cuda.jit(kernel_signature(kernel, bool(atomic_dq), bool(dq_splits)), **cap)(source)


# --------------------------------------------------------------------------------------------
# Deterministic splits of the dQ-in-dkdv kernel
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# Launcher (the dQ-in-dkdv helpers serve tf32_backward.launch too)
# --------------------------------------------------------------------------------------------
def check_dq_acc(dq_acc, dq_splits, n_bh, nq_pad, head_dim, n_kb):
    """ValueError unless dq_acc is the C-contiguous fp32 scratch of (dq_splits or 1) planes of n_bh heads,
    nq_pad rows and head_dim columns, and 1 <= dq_splits <= n_kb key blocks (or None)."""
    planes = dq_splits or 1
    if (tuple(dq_acc.shape) != (planes * n_bh, nq_pad, head_dim)
            or tuple(dq_acc.strides) != (nq_pad * head_dim * 4, head_dim * 4, 4)):
        raise ValueError(f"dq_acc has shape {tuple(dq_acc.shape)}, strides {tuple(dq_acc.strides)}; dq_splits="
                         f"{dq_splits} needs a C-contiguous fp32 array of shape ({planes * n_bh}, {nq_pad}, "
                         f"{head_dim}) (planes of B·H = {n_bh} heads, padded rows, HEAD_DIM)")
    if dq_splits is not None and not 1 <= dq_splits <= n_kb:
        raise ValueError(f"dq_splits={dq_splits}: 1 <= dq_splits <= {n_kb} key blocks")


def launch_dq_in_dkdv(build, grid_y, threads, smem, stream, args, scalars, n_kb, dq_splits, plane_rows):
    """The launches of a dkdv kernel that also forms dQ; build(splits) -> its kernel (0: the atomic grid's
    build; 1 / 2: the deterministic splits' adding / storing builds). dq_splits None: one launch of every key
    block, all adding into one plane. Else a launch per dq_splits key blocks, block x of each into plane x:
    stream order orders the adds; the first launch stores, since nobody zeroed the planes."""
    if dq_splits is None:
        launch_kernel(build(0), (n_kb, grid_y), threads, stream, smem, *args, *scalars)
        return
    for kb0 in range(0, n_kb, dq_splits):
        launch_kernel(build(2 if kb0 == 0 else 1), (min(dq_splits, n_kb - kb0), grid_y), threads, stream, smem,
                      *args, *scalars, kb0, plane_rows)


def launch_prep(dtype, head_dim, vec, out, dout, lse, l2, dd, n_q, d, n_bh, stream):
    """D and L2 into the scratch rows l2, dd: by 16-byte loads where vec (d a multiple of a chunk's elements,
    out and dout rows 16-byte aligned), else one element per load."""
    if vec:
        kernel, rows = make_prep_vec_kernel(dtype, head_dim)
        launch_kernel(kernel, (l2.shape[1] // rows, n_bh), VEC_THREADS, stream, 0, out, dout, lse, l2, dd, n_q, d)
    else:
        launch_kernel(make_prep_kernel(dtype), (l2.shape[1] // PREP_ROWS, n_bh), PREP_ROWS * PREP_LANES, stream, 0,
                      out, dout, lse, l2, dd, n_q, d)


def launch_convert(dtype, vec, dq_acc, dq, n_q, d, softmax_scale, n_k, bn, bm, causal, n_bh, stream):
    """dq = scale · the planes of dq_acc summed in order (convert_source; vec: 8 columns a thread)."""
    threads = 256
    per_row = d // 8 if vec else (d + 1) // 2  # threads per row: 8 columns, or a pair, each
    launch_kernel(make_convert_kernel(dtype, **({"vec": True} if vec else {})),
                  ((n_q * per_row + threads - 1) // threads, n_bh), threads, stream, 0,
                  dq_acc, dq, n_q, d, float32(softmax_scale), n_k, bn, bm, int(bool(causal)))


def _words(x):
    """The array as 16-bit words (bf16 already arrives as uint16; f16 is reinterpreted)."""
    return x if x.dtype == WORD else x.view(WORD)


def launch(q, k, v, out, dout, lse, l2, dd, dq, dk, dv, *, causal, softmax_scale, dtype, d, config,
           stream=0, kernels=("prep", "dkdv", "dq"), dq_acc=None, dq_splits=None):
    """Run prep, dkdv and dq on device arrays; the caller has validated the problem and the layout.

    q, out, dout, dq: (B, H, Nq, d); k, v, dk, dv: (B, Hkv, Nk, d), all 16-bit (float16, or uint16
    holding bf16 bits); q, k, v, dout with unit last stride, other strides multiples of 16 B and
    16-byte aligned data (cp.async); lse: (B, H, Nq) fp32; l2, dd: fp32 scratch of shape
    (B·H, padded_rows(Nq)), C-contiguous. ``config``: {"dkdv": (BLOCK_N, BLOCK_M), "dq": (BLOCK_M,
    BLOCK_N), "head_dim": HEAD_DIM[, "dkdv_split_d": bool][, "dkdv_fa2": bool][, "dkdv_atomic": (BLOCK_N,
    BLOCK_M)][, "dkdv_atomic_variants": {name: value}]}, as configs.MMA_BWD_TABLE holds them (dkdv_split_d:
    the two-warps-per-16-keys dkdv layout, ignored with dq_acc; dkdv_fa2: FA2's two warps per 32
    keys, for the dkdv tile and, with dq_acc, the atomic one; dkdv_atomic: the dkdv tile used
    with dq_acc, default the "dkdv" one; dkdv_atomic_variants: sweep candidates of its dQ phase,
    ATOMIC_VARIANTS' keys, none shipped). Nq, Nk > 0. ``kernels``
    picks which of the three run (the sweep times them one by one; dkdv and dq read prep's scratch).
    dq_acc: None (deterministic: the dq kernel), or zeroed C-contiguous fp32 scratch of shape
    (B·H, padded_rows(Nq), HEAD_DIM): dkdv then adds dQ into it atomically (not bitwise repeatable)
    and a last kernel writes dq = scale · dq_acc; the dq kernel does not run.
    dq_splits: None (with dq_acc: one dkdv block per key block, all adding into one plane), or the
    deterministic splits S (``dq_splits``' choice): dq_acc then has S planes, shape (S·B·H, NQ_PAD,
    HEAD_DIM); dkdv runs as ceil(n_kb / S) launches of S key blocks per kv head, block x of every launch
    adding into plane x, and the last kernel sums the planes in order: bitwise repeatable (FA2's
    deterministic scheme, its key-block loop on the host).
    """
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    head_dim = config["head_dim"]
    partial = {"partial_chunk": True} if d % 8 else {}  # a part-data chunk per row (the sources' PARTIAL_CHUNK)
    scalars = (n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E), float32(softmax_scale))
    atomic = dq_acc is not None
    vec = d % 8 == 0 and all(rows16(_words(x)) for x in (out, dout, dq))  # 16-byte prep and convert
    if "prep" in kernels:
        launch_prep(dtype, head_dim, vec, out, dout, lse, l2, dd, n_q, d, B * H, stream)
    words = tuple(_words(x) for x in (q, k, v, dout))
    bn, bm = config.get("dkdv_atomic", config["dkdv"]) if atomic else config["dkdv"]
    split = bool(config.get("dkdv_split_d", False)) and not atomic
    fa2 = bool(config.get("dkdv_fa2", False))
    n_kb = (n_k + bn - 1) // bn
    if atomic:
        check_dq_acc(dq_acc, dq_splits, B * H, l2.shape[1], head_dim, n_kb)
    if dq_splits is not None and (not atomic or fa2):
        raise ValueError(f"dq_splits={dq_splits}: needs dq_acc and the dkdv_source layout (not dkdv_fa2)")
    wgmma = atomic and bool(config.get("dkdv_wgmma", False))
    if wgmma and not ptx.current_wgmma():
        cc = "".join(map(str, ptx.compute_capability()))
        raise ValueError(f"dkdv_wgmma: wgmma needs an sm_90 GPU, this one is sm_{cc} (backward.mma_config adds the "
                         "key only there)")
    if "dkdv" in kernels and wgmma:  # the sm_90 warpgroup-MMA build of the dQ-in-dkdv kernel (wgmma_backward)
        if (bn, bm) != (wgmma_backward.BLOCK_N, wgmma_backward.BLOCK_M) or fa2:
            raise ValueError(f"dkdv_wgmma: the wgmma dkdv takes ({wgmma_backward.BLOCK_N}, "
                             f"{wgmma_backward.BLOCK_M}) tiles (dkdv_atomic), got ({bn}, {bm}) fa2={fa2}")
        args = (*words, l2, dd, _words(dk), _words(dv), dq_acc)
        defer = ("atomic" if dq_splits is None else "splits") in config.get("dkdv_wgmma_defer_dq", ())
        launch_dq_in_dkdv(lambda splits: wgmma_backward.make_kernel(head_dim, bool(causal), dtype, bool(partial),
                                                                    splits, defer),
                          B * Hkv, wgmma_backward.THREADS, wgmma_backward.smem_bytes(head_dim, defer), stream, args,
                          scalars, n_kb, dq_splits, B * H)
    elif "dkdv" in kernels:
        # the vector adds exist from sm_90 on; passed only when off, so the default keeps its cache key
        scalar_red = {"vector_red": False} if atomic and not ptx.current_sm90() else {}
        variants = dict(config.get("dkdv_atomic_variants", {})) if atomic else {}
        layout = {"fa2": True} if fa2 else {}  # passed only when on, as above
        build = dict(atomic_dq=atomic, split_d=split, **scalar_red, **layout, **partial, **variants)
        threads = threads_per_block("dkdv", bn, split)
        smem = smem_bytes("dkdv", bn, bm, head_dim, atomic, split, bool(variants.get("dq_deferred")), fa2)
        args = (*words, l2, dd, _words(dk), _words(dv))
        if atomic:
            launch_dq_in_dkdv(lambda splits: make_kernel("dkdv", bn, bm, head_dim, bool(causal), dtype, **build,
                                                         **({"dq_splits": splits} if splits else {})),
                              B * Hkv, threads, smem, stream, (*args, dq_acc), scalars, n_kb, dq_splits, B * H)
        else:
            launch_kernel(make_kernel("dkdv", bn, bm, head_dim, bool(causal), dtype, **build), (n_kb, B * Hkv),
                          threads, stream, smem, *args, *scalars)
    if atomic:
        if "dq" in kernels:
            launch_convert(dtype, vec, dq_acc, _words(dq), n_q, d, softmax_scale, n_k, bn, bm, causal, B * H, stream)
        return
    bm, bn = config["dq"]
    if "dq" in kernels:
        launch_kernel(make_kernel("dq", bm, bn, head_dim, bool(causal), dtype, **partial),
                      ((n_q + bm - 1) // bm, B * H),
                      threads_per_block("dq", bm), stream, smem_bytes("dq", bm, bn, head_dim),
                      *words, l2, dd, _words(dq), *scalars)
