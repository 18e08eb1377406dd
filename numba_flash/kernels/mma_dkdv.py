"""The dK/dV kernel of the tensor-core backward on mma.sync m16n8k16 (fp16 / bf16 in, fp32 accumulation),
with or without FA2's dQ phase. Maths (reference/backward.py, section 3.6.7), with S = Q Kᵀ and P rebuilt
from the forward's saved logsumexp as L2 = L·log2(e) (kernels/bwd_prep.py):

    P  = exp2(S·scale·log2(e) − L2),  D = rowsum(dO ∘ O)
    dP = dO Vᵀ,   dS = P ∘ (dP − D)
    dV = Pᵀ dO,   dK = scale · dSᵀ Q,   dQ = scale · dS K

One block per (K/V tile of BLOCK_N keys, batch · kv head), warp w owning keys 16w..16w+15: the forward's
structure with the roles of Q and K/V exchanged (the transposed orientation; blocks/dkdv.py has the
skeleton). K_j and V_j stay in shared memory; dK_j and dV_j accumulate in registers while the block streams
the Q / dO tiles of every query head of its group (so the GQA sum needs no atomics):

    Sᵀ  (16 x BLOCK_M) = K_w · Q_iᵀ        A = K rows (ldmatrix), B = Q rows (ldmatrix)
    dPᵀ (16 x BLOCK_M) = V_w · dO_iᵀ       A = V rows, B = dO rows
    Pᵀ = exp2(Sᵀ·scale·log2 e − L2[col]),  dSᵀ = Pᵀ ∘ (dPᵀ − D[col])
    dV_w (16 x d) += Pᵀ · dO_i             A = Pᵀ re-packed in registers, B = dO by ldmatrix.trans
    dK_w (16 x d) += dSᵀ · Q_i             A = dSᵀ re-packed in registers, B = Q by ldmatrix.trans

The Sᵀ accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk (as P in the forward's
P·V), so no fragment passes through shared memory.

Built with ATOMIC_DQ (FA2's schemes) it also writes dSᵀ to shared memory, computes dQ_i += dS K_j for 16
query rows per warp (dS by ldmatrix.trans of the stored dSᵀ) and adds it to fp32 scratch with
``red.global.add``; kernels/bwd_prep.py's convert then writes dq = scale · scratch. deterministic=False: one
launch, every block adding into one zeroed plane (the order of the adds varies). The deterministic splits
(DQ_SPLITS builds, blocks/schedule.py): S planes, ceil(key blocks / S) launches on the stream, block x of
each owning plane x (the first launch stores, the others add), and convert sums the planes in order:
bitwise repeatable with 5 tile products instead of the dq kernel's 7. The dQ phase runs after a second
barrier, with every warp of the block's only resident block in it at once: per product it is slower than
the dq kernel (benchmarks/DESIGN.md).

Shared memory: 16-bit tiles with rows of HEAD_DIM, 16-byte chunks XOR-swizzled by row % 8 (the forward's
layout: every ldmatrix phase hits 8 distinct bank groups). The streamed tiles (Q, dO, L2, D) are
double-buffered: at the top of step i one barrier says tile i has landed and that every warp has left step
i−1, whose buffer then receives tile i+1 by cp.async while step i computes. Each thread's copy plan (source
offset, byte count and swizzled destination of its 16-byte chunks, blocks.copies.tile_copies) is computed
once before the loop. Out-of-range rows and head-dim columns are zero-filled by cp.async's ignore-src
predicate, or by its src-size operand when d % 8 != 0 (PARTIAL_CHUNK: a chunk of data and zeros).

Causal (bottom-right, query i sees key j iff j <= i + Nk − Nq): a block starts at the first Q tile that sees
its keys; only tiles that cross the diagonal pay for the mask.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from ..blocks.copies import copy_threads
from ..blocks.dkdv import dkdv_common, pair_offset, stage_words, two_products, window_schedule
from ..blocks.entry import dkdv_entry, dkdv_user_entry, kernel_signature, launch_dq_in_dkdv, varlen_key
from ..blocks.mask import clamps_past_end, mask_kind, window_rules
from ..blocks.mods import (NO_MODS, Mods, alibi_bias, capped, dropout_first, head_slope, softcap_grad, user_aux_types,
                           user_score_grad)
from ..blocks.rng import fragment_dropout_t, words_of
from ..blocks.schedule import ROW_PAD
from ..jit_cache import compile_kernel

DTYPES = ("float16", "bfloat16")
DQ_COLS = 32  # columns of dQ_i a warp forms per pass of the dQ phase (16 accumulators per lane)


def col_split(head_dim: int) -> int:
    """Warps per 16 keys: 1 up to d = 128; 2 above (the split layout), whose dK, dV of 16 keys x d (d fp32 per
    lane) would not fit a warp's 255 registers beside Sᵀ and dPᵀ. Each warp of a pair then forms Sᵀ, dPᵀ for half
    the step's queries and dK, dV for half the columns, Pᵀ and dSᵀ passing through shared memory (FA2's d = 256
    layout: 64 keys, 8 warps, 128 accumulators a lane)."""
    return 1 if head_dim <= 128 else 2


def threads(block_n: int, head_dim: int = 128) -> int:
    """One warp per 16 keys (two above d = 128: col_split)."""
    return 32 * (block_n // 16) * col_split(head_dim)


def smem_bytes(block_n: int, block_m: int, head_dim: int, atomic_dq: bool = False) -> int:
    """K and V once, two stages of [Q | dO | L2 | D] (double buffer); with atomic_dq or the split layout the
    16-bit dSᵀ tile, with the split layout Pᵀ too."""
    split = col_split(head_dim) > 1
    tiles = 2 if split else (1 if atomic_dq else 0)
    return 2 * (2 * block_n * head_dim + 2 * stage_words(block_m, head_dim) + tiles * block_n * block_m)


def problems(block_n: int, block_m: int, head_dim: int, dtype: str) -> list[str]:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    if block_n % 16 or not 16 <= block_n <= 256:
        out.append(f"own tile of {block_n} rows: one warp per 16 rows, 1..16 warps")
    if block_m % 16 or not 16 <= block_m <= ROW_PAD:
        out.append(f"streamed tile of {block_m} rows: a multiple of 16 (the k of m16n8k16), <= {ROW_PAD}")
    if head_dim not in (64, 128, 192, 256):
        out.append(f"HEAD_DIM={head_dim}: 64, 128, 192 or 256 (the unrolled k-steps)")
    if col_split(head_dim) > 1 and block_m != 64:
        out.append(f"streamed tile of {block_m} rows at HEAD_DIM={head_dim}: the split layout's Pᵀ and dSᵀ tiles "
                   "take 64 queries (8-chunk swizzled rows)")
    if dtype not in DTYPES:
        out.append(f"dtype={dtype!r} not in {DTYPES}")
    n_threads = threads(block_n, head_dim) if block_n % 16 == 0 and block_n >= 16 else 32
    copying = copy_threads(head_dim, n_threads) if head_dim % 8 == 0 else n_threads
    for name, rows in (("own", block_n), ("streamed", block_m)):
        if not copying or (rows * head_dim // 8) % copying:
            out.append(f"{name} tile of {rows}x{head_dim} is not a whole number of 16-byte copies per thread")
    if block_m // 2 > n_threads:
        out.append(f"{block_m} query rows of L2 and D need {block_m // 2} copying threads, have {n_threads}")
    nbytes = smem_bytes(block_n, block_m, head_dim)
    if nbytes > SMEM_PER_BLOCK_MAX:
        out.append(f"{nbytes} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def source(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, ATOMIC_DQ=False, VECTOR_RED=True, PARTIAL_CHUNK=False,
           DQ_SPLITS=0, MODS=NO_MODS, VARLEN=False):
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

    DQ_SPLITS (with ATOMIC_DQ; backward(deterministic=True)'s splits, FA2's deterministic scheme): the kernel
    takes kb0 and plane_rows after scale and runs key block kb0 + blockIdx.x into plane blockIdx.x of dq_acc
    (rows blockIdx.x · plane_rows ..); launch() runs a launch per gridDim.x key blocks. 1: adds; 2: the first
    launch's build, which stores (blocks.entry.dkdv_entry). Builds of their own so that deterministic=False's
    kernel stays as it was (its PTX is pinned in the tests).

    MODS (blocks/mods.py; the splits' adding build only): a window (the Q tiles between the first and the last that see the block,
    blocks.dkdv.window_schedule; keys past n_k masked, so no clamp), and softcap / ALiBi on each recomputed
    score, the cap's 1 − tanh² on dS. User mods (MODS.user, not varlen): the score mod and mask on every score in
    range (blocks.mods.user_score_grad), the score mod's derivative on dS; their aux arrays come last. Dropout
    (MODS.dropout, not varlen; blocks/rng.py): the keep mask Z of the step's scores (fragment_dropout_t), dV from
    Z ∘ Pᵀ and scaled by 2^16 / keep16 at the end, dSᵀ = Pᵀ ∘ (Z ∘ dPᵀ · 2^16 / keep16 − D); its words last in aux.

    VARLEN: the packed-sequences entry (blocks.entry.varlen_entry): key blocks past their sequence return.

    Above d = 128 the split layout (col_split): warps kg and BLOCK_N / 16 + kg share keys 16 kg ..; the
    first forms Sᵀ, dPᵀ for queries 0 .. BLOCK_M / 2 − 1 of the step and dK, dV for columns 0 .. d / 2 − 1, the
    second the other halves; Pᵀ and dSᵀ go to shared memory between (one more barrier a step) and come back
    as the A fragments of dV, dK by ldmatrix."""
    KEY_WARPS = BLOCK_N // 16
    SPLIT = col_split(HEAD_DIM)
    SPLIT_LAYOUT = SPLIT > 1
    WARPS = KEY_WARPS * SPLIT
    THREADS = 32 * WARPS
    QW = BLOCK_M // SPLIT  # queries of a warp's Sᵀ / dPᵀ
    Q_TILES = QW // 8  # n-tiles of Sᵀ / dPᵀ (query columns)
    M_STEPS = BLOCK_M // 16  # k-steps of dV and dK (over the queries)
    O_TILES = HEAD_DIM // SPLIT // 8  # n-tiles of dK / dV
    PAIRS = O_TILES // 2
    REG_STEPS = 0 if SPLIT_LAYOUT else M_STEPS  # k-steps of dV, dK with A re-packed from the registers
    WINDOW, SOFTCAP, ALIBI = bool(MODS.window), bool(MODS.softcap), bool(MODS.alibi)
    CAUSAL, ATOMIC_DQ = bool(CAUSAL) and not WINDOW, bool(ATOMIC_DQ)
    USER = MODS.user
    DROPOUT = bool(MODS.dropout)
    if MODS.aux and VARLEN:
        raise ValueError("mma_dkdv: user mods and dropout have no varlen build")
    keep_t = fragment_dropout_t(Q_TILES)
    dropout_words = words_of(dropout_first(MODS))
    user_score = user_score_grad(MODS) if USER else None
    (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, SDS), swizzle, prologue, schedule, step_tile, prefetch, \
        swizzle_m, store_grads, dv_dk_step = dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS, O_TILES,
                                                              PARTIAL_CHUNK)
    # ATOMIC_DQ or SPLIT_LAYOUT: dSᵀ (BLOCK_N keys x BLOCK_M queries) at SDS; SPLIT_LAYOUT: Pᵀ at SP
    SP = SDS + BLOCK_N * BLOCK_M
    STORE_DS = ATOMIC_DQ and not SPLIT_LAYOUT  # dSᵀ stored from the registers of the one-warp layout
    if ATOMIC_DQ and not (BLOCK_M == 64 and WARPS in (4, 8)):
        raise ValueError(f"ATOMIC_DQ needs 64-query tiles (8-chunk dSᵀ rows) and 4 or 8 warps over dQ_i; got "
                         f"BLOCK_N={BLOCK_N}, BLOCK_M={BLOCK_M}, {WARPS} warps")
    if SPLIT_LAYOUT and BLOCK_M != 64:
        raise ValueError(f"the split layout (HEAD_DIM={HEAD_DIM}) takes 64-query tiles (8-chunk Pᵀ, dSᵀ rows); "
                         f"got BLOCK_M={BLOCK_M}")
    at = pair_offset(HEAD_DIM)
    ldsm = ptx.ldmatrix_x4
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    unrolled = two_products(HEAD_DIM, Q_TILES, mma)
    # the dQ phase (built only with ATOMIC_DQ: its warp layout needs 4 or 8 warps)
    add_dq = atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, DTYPE, WARPS, SK, swizzle, swizzle_m,
                             VECTOR_RED) if ATOMIC_DQ else None
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    st_b32 = ptx.st_shared_b32
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    CLAMP_P = clamps_past_end("window" if WINDOW else mask_kind(CAUSAL), ATOMIC_DQ)
    schedule_window = window_schedule(BLOCK_N, BLOCK_M)
    _, window_edge, window_hidden = window_rules(16, BLOCK_M)  # a warp's 16 keys x the step's queries

    @inline_device
    def dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb, first,
                  left=0, right=0, cap_a=ZERO, cap_b=ZERO, slopes=None, inv_scale=ZERO, q_base=0, k_base=0, aux=()):
        """Key block kb (BLOCK_N keys) of kv head blockIdx.y; dQ (ATOMIC_DQ) into dq_acc (the plane this
        block adds into: the splits pass a view from its first row), stored instead of added where first.
        left .. inv_scale: the mods' launch arguments (MODS builds only); aux: the user mods' arrays."""
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
        if SPLIT_LAYOUT:
            cg = warp // KEY_WARPS  # its half of the step's queries (Sᵀ, dPᵀ) and of the columns (dK, dV)
            kw = k0 + (warp - cg * KEY_WARPS) * 16
        shift = n_k - n_q  # query i sees key j iff j <= i + shift
        nq_pad = l2.shape[1]
        dq_h0 = bh * group  # dq_acc row block of the group's first query head

        if WINDOW:
            qt0, per_head, steps = schedule_window(k0, n_q, n_k, shift, group, left, right)
        else:
            qt0, per_head, steps = schedule(k0, n_q, shift, group)

        # ldmatrix lane addresses (matrix lane >> 3 of the x4 takes its row from lanes 8j..8j+7).
        mat = lane >> 3
        a_row = warp * 16 + (lane & 15)  # A (K, V rows): quarters (rows 0-7 | 8-15) x (cols 0-7 | 8-15)
        if SPLIT_LAYOUT:
            a_row = kw - k0 + (lane & 15)
        a_x = (lane >> 4) ^ (a_row & 7)
        b_row = (mat >> 1) * 8 + (lane & 7)  # B of two n-tiles (Q, dO rows): (rows, d 0-7 | 8-15)
        b_x = (mat & 1) ^ (b_row & 7)
        t_row = (mat & 1) * 8 + (lane & 7)  # B by .trans (dO, Q as k x n): (rows 0-7 | 8-15) per d pair
        t_lane = swizzle(t_row, mat >> 1)  # ... of d pair dp2, k-step kk: (t_lane ^ (dp2 << 4)) + kk·16 rows
        ds_lane = swizzle_m(warp * 16 + g, 0) + 2 * t  # dSᵀ pair (key 16w + g, queries 8 nt + 2t): ^ (nt << 3)
        if SPLIT_LAYOUT:  # (key kw + g; n-tiles from the warp's half of the queries); A of dV, dK: ^ (kk << 4)
            ds_lane = swizzle_m(kw - k0 + g, 0) + 2 * t
            pa_lane = swizzle_m(a_row, lane >> 4)

        plan = prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad, q_base,
                        k_base)

        acc_k = cuda.local.array((O_TILES, 4), float32)
        acc_v = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((Q_TILES, 4), float32)  # Sᵀ, then Pᵀ
        dp = cuda.local.array((Q_TILES, 4), float32)  # dPᵀ, then dSᵀ
        z = cuda.local.array((Q_TILES, 4), float32)  # dropout's keep mask of the step's scores
        seed_lo, seed_hi, rng_offset, keep16, keep_scale = uint32(0), uint32(0), uint32(0), uint32(0), ONE
        if DROPOUT:
            seed_lo, seed_hi, rng_offset, keep16, keep_scale = dropout_words(aux)
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

            # Sᵀ = K_w Q_iᵀ and dPᵀ = V_w dO_iᵀ
            if SPLIT_LAYOUT:  # of the warp's half of the queries
                unrolled(s, dp, smem, SK, SV, st + SQ + cg * (QW * HEAD_DIM), st + SDO + cg * (QW * HEAD_DIM), a_row,
                         a_x, b_row, b_x)
            else:
                unrolled(s, dp, smem, SK, SV, st + SQ, st + SDO, a_row, a_x, b_row, b_x)

            # Pᵀ = exp2(Sᵀ·scale·log2 e − L2[query]), dSᵀ = Pᵀ ∘ (dPᵀ − D[query]); padded queries
            # have L2 = +inf. Mask only where this warp's keys cross the tile's diagonal.
            needs_mask = CAUSAL and kw + 15 > i0 + shift
            if WINDOW:  # the warp's 16 keys against the step's BLOCK_M queries (the forward's edge test, transposed)
                needs_mask = window_edge(kw, kw + 16, i0, n_k, shift, left, right)
            slope = ZERO
            if ALIBI:  # of this step's query head
                slope = head_slope(slopes, b, h_kv * group + hh, inv_scale)
            l2_s = (st + SL) >> 1
            d_s = (st + SD) >> 1
            if DROPOUT:  # the draws of (query head hh's queries, this warp's keys): the forward's
                i0_w = i0
                if SPLIT_LAYOUT:
                    i0_w += cg * QW
                keep_t(z, kw, i0_w, g, t, b * q.shape[1] + h_kv * group + hh, rng_offset, seed_lo, seed_hi, keep16)
            for nt in range(Q_TILES):
                for r in range(4):
                    col = nt * 8 + 2 * t + (r & 1)
                    if SPLIT_LAYOUT:
                        col += cg * QW
                    x = s[nt, r]
                    if SOFTCAP:
                        x = capped(x, cap_a, cap_b)
                        s[nt, r] = x  # the capped score: its 1 − tanh² below
                    if ALIBI:
                        x -= alibi_bias(slope, i0 + col, kw + g + 8 * (r >> 1), shift)
                    du = ONE  # d(user score mod)/d score
                    if USER:
                        if i0 + col < n_q and kw + g + 8 * (r >> 1) < n_k:
                            x, du = user_score(x, i0 + col, kw + g + 8 * (r >> 1), b, h_kv * group + hh, scale,
                                               inv_scale, aux)
                    x = x * scale_log2 - smem_f[l2_s + col]
                    if CLAMP_P:  # keys past n_k: P stays <= 1 (blocks/mask.py)
                        x = min(x, ZERO)
                    if WINDOW:
                        if needs_mask and window_hidden(i0 + col, kw + g + 8 * (r >> 1), n_k, shift, left, right):
                            x = NEG_INF
                    elif needs_mask and kw + g + 8 * (r >> 1) > i0 + col + shift:
                        x = NEG_INF
                    p = ex2(x)
                    if DROPOUT:  # dSᵀ = Pᵀ ∘ (Z ∘ dPᵀ · scale − D); dV takes Z ∘ Pᵀ (its scale at the end)
                        ds = p * (dp[nt, r] * z[nt, r] * keep_scale - smem_f[d_s + col])
                        p *= z[nt, r]
                    else:
                        ds = p * (dp[nt, r] - smem_f[d_s + col])
                    if SOFTCAP:
                        ds *= softcap_grad(s[nt, r], cap_b)
                    if USER:
                        ds *= du
                    s[nt, r] = p
                    dp[nt, r] = ds

            if STORE_DS:  # dSᵀ to shared memory as 16-bit pairs (row = key, 2 adjacent queries)
                for nt in range(Q_TILES):
                    for half in range(2):
                        st_b32(smem, SDS + (ds_lane ^ (nt << 3)) + half * 8 * BLOCK_M,
                               pack(dp[nt, 2 * half], dp[nt, 2 * half + 1]))

            if SPLIT_LAYOUT:  # Pᵀ and dSᵀ through shared memory: each warp of a pair needs the other's queries
                for nt in range(Q_TILES):
                    x_nt = ds_lane ^ ((cg * Q_TILES + nt) << 3)
                    for half in range(2):
                        st_b32(smem, SP + x_nt + half * 8 * BLOCK_M, pack(s[nt, 2 * half], s[nt, 2 * half + 1]))
                        st_b32(smem, SDS + x_nt + half * 8 * BLOCK_M, pack(dp[nt, 2 * half], dp[nt, 2 * half + 1]))
                cuda.syncthreads()  # both halves of every warp pair's Pᵀ, dSᵀ are in shared memory
                # dV_w += Pᵀ dO_i and dK_w += dSᵀ Q_i over the warp's d / 2 columns: A by ldmatrix
                for kk in range(M_STEPS):
                    p0, p1, p2, p3 = ldsm(smem, SP + (pa_lane ^ (kk << 4)))
                    d0, d1, d2, d3 = ldsm(smem, SDS + (pa_lane ^ (kk << 4)))
                    for dp2 in range(PAIRS):
                        t_off = at(st + t_lane, cg * PAIRS + dp2) + kk * 16 * HEAD_DIM
                        dv_dk_step(smem, acc_v, acc_k, 2 * dp2, t_off, p0, p1, p2, p3, d0, d1, d2, d3)

            # dV_w += Pᵀ dO_i and dK_w += dSᵀ Q_i: accumulators of n-tiles 2kk, 2kk+1 = A of k-step kk.
            for kk in range(REG_STEPS):
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

            if STORE_DS:
                cuda.syncthreads()  # every warp's dSᵀ is in shared memory
            if ATOMIC_DQ:  # (the split layout's barrier above covers its dSᵀ)
                add_dq(smem, SDS, dq_acc, dq_h0 + hh, i0, warp, lane, g, t, first)

        cp_wait(0)  # nothing may be in flight when the block exits (steps == 0 included)
        if DROPOUT:  # dV = (Z ∘ P)ᵀ dO · 2^16 / keep16
            for dt in range(O_TILES):
                for r in range(4):
                    acc_v[dt, r] *= keep_scale

        if SPLIT_LAYOUT:
            store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, cg * (HEAD_DIM // SPLIT), n_k, d, scale, k_base)
        else:
            store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, 0, n_k, d, scale, k_base)

    if MODS.aux:
        return dkdv_user_entry(dkdv_body, globals(), "mma_dkdv_mods", ATOMIC_DQ, DQ_SPLITS, len(user_aux_types(MODS)))
    # VARLEN: the packed-sequences form, key blocks past their sequence return
    return dkdv_entry(dkdv_body, globals(), "mma_dkdv", ATOMIC_DQ, DQ_SPLITS, mods=MODS.any,
                      varlen_block_n=BLOCK_N if VARLEN else 0)

def atomic_dq_phase(BLOCK_N, BLOCK_M, HEAD_DIM, DTYPE, WARPS, SK, swizzle, swizzle_m, VECTOR_RED=True):
    """The atomic dQ phase of the dK/dV kernel (source with ATOMIC_DQ): from the dSᵀ tile in shared
    memory, dQ_i[16 rw.., cw..] += dS_i K_j, added to fp32 scratch with atomics. Warps 4 down dQ_i's 64
    rows (rw = w mod 4) x WARPS / 4 across its columns (cw), DQ_COLS columns per pass (DQ_COLS / 2
    accumulators per lane), each pass added atomically."""
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
    st2 = ptx.st_global_v2_f32
    st1 = ptx.st_global_f32
    ZERO = float32(0.0)

    PASSES = WARP_COLS // DQ_COLS
    PAIRED = PASSES > 1 and PASSES % 2 == 0  # every trip's second pass runs
    ODD_PAIRED = PASSES > 1 and PASSES % 2 == 1  # the last trip's does not

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
        reading (long-scoreboard stalls in ncu)."""
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
            if PAIRED:
                dq_pass(smem, ds_lane, dq_acc, acc_b, row0, pc + 1, t_row, t_chunk, t, first)
            if ODD_PAIRED:  # (d = 192 in the split layout: 3 passes a warp)
                if wc + 1 < PASSES:
                    dq_pass(smem, ds_lane, dq_acc, acc_b, row0, pc + 1, t_row, t_chunk, t, first)

    return add_dq

@lru_cache(maxsize=None)
def build(block_n: int, block_m: int, head_dim: int, causal: bool, dtype: str, max_registers: int | None = None,
          atomic_dq: bool = False, vector_red: bool = True, partial_chunk: bool = False, dq_splits: int = 0,
          mods: Mods = NO_MODS, varlen: bool = False):
    """The compiled kernel of one specialisation; cached so each compiles once. atomic_dq: the kernel also
    adds dQ into fp32 scratch (FA2's scheme), as red.global.add.v2.f32 (vector_red, sm_90+) or scalar adds.
    partial_chunk: d % 8 != 0. dq_splits (atomic only): the deterministic splits' builds, 1 (adds) or 2 (the
    first launch: stores)."""
    bad = problems(block_n, block_m, head_dim, dtype)
    if atomic_dq and not (threads(block_n, head_dim) in (128, 256) and block_m == 64):
        bad.append(f"atomic dQ is built into the dkdv kernel with 4 or 8 warps (64 or 128 keys, 32 or 64 above "
                   f"d = 128) and 64-query tiles only, not dkdv {block_n}x{block_m}")
    if dq_splits not in (0, 1, 2) or (dq_splits and not atomic_dq):
        bad.append(f"dq_splits={dq_splits!r}: 0, or 1 / 2 for builds of the atomic dkdv kernel (atomic_dq=True)")
    if dq_splits == 2 and (mods.any or varlen):
        bad.append(f"{'varlen' if varlen else f'mods {mods}'}: the splits add into zeroed planes (no storing build, "
                   f"dq_splits={dq_splits})")
    if bad:
        raise ValueError(f"mma backward dkdv ({block_n}, {block_m}, {head_dim}, {dtype}) cannot be built: "
                         f"{'; '.join(bad)}")
    kernel = source(block_n, block_m, head_dim, bool(causal), dtype, bool(atomic_dq), bool(vector_red),
                    bool(partial_chunk), int(dq_splits), mods, bool(varlen))
    cap = {"max_registers": int(max_registers)} if max_registers else {}
    key = ("mma_dkdv", block_n, block_m, head_dim, bool(causal), dtype, bool(atomic_dq), bool(vector_red),
           bool(partial_chunk), int(dq_splits), mods) + varlen_key(varlen)
    return compile_kernel(key, kernel_signature("dkdv", bool(atomic_dq), bool(dq_splits), mods=mods.any,
                                                varlen=bool(varlen), aux=user_aux_types(mods)), kernel, **cap)


def launch(q, k, v, dout, l2, dd, dk, dv, scalars, *, tile, head_dim, causal, dtype, stream=0,
           partial_chunk=False, dq_acc=None, dq_splits=None, mods=NO_MODS, varlen=None, aux=()):
    """The dK/dV kernel over every key block: q, k, v, dout, dk, dv as 16-bit words, l2 and dd prep's
    scratch rows, scalars (n_q, n_k, d, group, scale·log2 e, scale[, the mods' launch arguments]). dq_acc: the
    kernel also forms dQ into it, one zeroed plane with atomic adds (dq_splits None) or dq_splits planes
    (blocks.entry.launch_dq_in_dkdv). varlen: (cu_seqlens_q, cu_seqlens_k) of packed arrays viewed as batches
    (arrays.packed_as_batch); scalars then hold the longest sequences' lengths, and the splits' planes are
    zeroed (every launch adds). aux: the user mods' aux arrays (device views, the mask's first), last."""
    bn, bm = tile
    B, H = q.shape[0], q.shape[1]
    Hkv, n_k = k.shape[1], scalars[1]
    n_kb = (n_k + bn - 1) // bn
    partial = {"partial_chunk": True} if partial_chunk else {}  # passed only when on: the others' cache key
    if mods.any:
        partial["mods"] = mods
    tail = ()
    if varlen is not None:
        partial["varlen"] = True
        tail = tuple(varlen[:2])
    tail += tuple(aux)
    args = (q, k, v, dout, l2, dd, dk, dv)
    if dq_acc is None:
        launch_kernel(build(bn, bm, head_dim, bool(causal), dtype, **partial), (n_kb, B * Hkv), threads(bn, head_dim),
                      stream,
                      smem_bytes(bn, bm, head_dim), *args, *scalars, *tail)
        return
    # the vector adds exist from sm_90 on; passed only when off, so the default keeps its cache key
    red = {} if ptx.current_sm90() else {"vector_red": False}
    launch_dq_in_dkdv(lambda splits: build(bn, bm, head_dim, bool(causal), dtype, atomic_dq=True, **red, **partial,
                                           **({"dq_splits": splits} if splits else {})),
                      B * Hkv, threads(bn, head_dim), smem_bytes(bn, bm, head_dim, True), stream, (*args, dq_acc), scalars,
                      n_kb, dq_splits, B * H, zeroed=mods.any or varlen is not None, tail=tail)
