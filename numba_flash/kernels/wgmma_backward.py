"""The dK/dV/dQ kernel of the tensor-core backward on sm_90's warpgroup MMA (wgmma.mma_async).

The maths and the schedule are kernels/mma_dkdv.py's FA2 scheme with dQ formed in the dK/dV kernel
(``source`` with ATOMIC_DQ there; read its docstring first): one block per (128 keys, batch · kv head),
the Q / dO tiles of 64 query rows streamed through a double buffer, and per step

    Sᵀ  = K_j Q_iᵀ,  dPᵀ = V_j dO_iᵀ                       (64 keys x 64 queries per warpgroup)
    Pᵀ  = exp2(Sᵀ·scale·log2 e − L2),  dSᵀ = Pᵀ ∘ (dPᵀ − D)
    dV_j += Pᵀ dO_i,  dK_j += dSᵀ Q_i                       (64 keys x d per warpgroup, in registers)
    dQ_i += dS_i K_j                                        (64 queries x d/2 per warpgroup, added to
                                                              fp32 scratch: one plane, or the splits' planes)

What changes is who multiplies. mma.sync needs every fragment in registers, loaded by ldmatrix, and
profiles found those kernels waiting on ldmatrix → mma latency with 2 warps per scheduler.
wgmma reads its B operand (and A, where it is not in registers) straight from shared memory through a
descriptor and runs asynchronously: a warpgroup (4 warps) issues a whole 64 x N x 16 product at once and
overlaps the softmax of Sᵀ with the tensor cores' work on dPᵀ. The 8 warps are 2 warpgroups, warpgroup wg
owning keys 64 wg .. 64 wg + 63 (so warp w still owns keys 16 w .. 16 w + 15, and the accumulator layout
per warp is mma.sync's m16n8 C fragment: the softmax and the epilogue are mma_dkdv's, the skeleton is
blocks/dkdv.py's).

Operands (ptx/warpgroup.py has the layout rules):
    Sᵀ, dPᵀ: A = K, V rows (K-major), B = Q, dO rows (K-major): m64n64k16, HEAD_DIM / 16 k-steps
    dV, dK:  A = Pᵀ, dSᵀ from registers (the accumulators of n-tiles 2kk, 2kk+1 re-packed: k-step kk),
             B = dO, Q (MN-major): m64n{HEAD_DIM}k16, 4 k-steps
    dQ:      A = dS, the stored dSᵀ tile (MN-major), B = K (MN-major), columns HEAD_DIM/2 · wg ..:
             m64n{HEAD_DIM/2}k16, 8 k-steps
Every 16-bit tile is stored in wgmma's 128-byte-swizzled column atoms (``atom_offset``), at a multiple of
1024 bytes; cp.async fills them (blocks.copies.tile_copies with ATOM_ROWS), and after the writes land a
``fence.proxy.async`` makes them visible to wgmma's (async-proxy) reads before the barrier.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, uint16, uint32

from .. import ptx
from ..ptx import WGMMA_ALIGN, inline_device
from ..blocks.copies import atom_offset  # the tiles' layout (tile_copies' ATOM_ROWS fills them by it)
from ..blocks.dkdv import dkdv_common, window_schedule
from ..blocks.entry import dkdv_entry, dkdv_user_entry, kernel_signature, launch_dq_in_dkdv, varlen_key
from ..blocks.mods import (NO_MODS, Mods, alibi_bias, capped, dropout_first, head_slope, softcap_grad, user_aux_types,
                           user_score_grad)
from ..blocks.rng import fragment_dropout_t_bits, words_of
from ..blocks.mask import clamps_past_end, mask_kind, window_rules
from ..jit_cache import compile_kernel

BLOCK_N, BLOCK_M = 128, 64  # keys per block (2 warpgroups x 64), queries per streamed tile (wgmma's n)
THREADS = 256
HEAD_DIMS = (64, 128)


def threads() -> int:
    """Two warpgroups."""
    return THREADS


def smem_bytes(head_dim: int, defer_dq: bool = False) -> int:
    """K and V, two stages of [Q | dO | L2 | D] (each rounded up to 1024 B), the dSᵀ tile (two with defer_dq)."""
    stage = -(-(2 * BLOCK_M * head_dim + 4 * BLOCK_M) // 512) * 512
    return 2 * (2 * BLOCK_N * head_dim + 2 * stage + (2 if defer_dq else 1) * BLOCK_N * BLOCK_M)


def problems(head_dim: int, dtype: str) -> list[str]:
    """Why the wgmma dkdv cannot be built for this head dim / dtype (empty when it can)."""
    out = []
    if head_dim not in HEAD_DIMS:
        out.append(f"HEAD_DIM={head_dim}: the wgmma dkdv is built for {HEAD_DIMS}")
    if dtype not in ("float16", "bfloat16"):
        out.append(f"dtype={dtype!r}: float16 or bfloat16")
    return out


def source(HEAD_DIM, CAUSAL, DTYPE, PARTIAL_CHUNK=False, DQ_SPLITS=0, DEFER_DQ=False, MODS=NO_MODS, VARLEN=False):
    """The kernel (before cuda.jit) of blocks.entry.kernel_signature("dkdv", atomic_dq=True,
    dq_splits=bool(DQ_SPLITS)). DQ_SPLITS as mma_dkdv.source's: 0 one plane of adds (deterministic=False),
    1 the splits' adding launches, 2 the first launch's (stores).

    DEFER_DQ: step i's dQ product is left in flight through the next step's barrier and prefetch, and added
    before that step issues Sᵀ and dPᵀ (reading its accumulators inside their wgmma stage instead made ptxas
    serialize every wgmma); dSᵀ is double-buffered by step parity, since a warpgroup may still read step i's
    while the other writes step i + 1's.

    MODS (blocks/mods.py; the splits' adding build only, into zeroed planes): mma_dkdv.source's window
    schedule, per-score rules and softcap gradient; the cap's 1 − tanh² waits in registers of its own (sg)
    while dPᵀ is still in flight in dp. User mods (MODS.user, not varlen): the score mod and mask on every score in
    range (blocks.mods.user_score_grad), the score mod's derivative in sg (times the cap's); aux arrays last.
    Dropout (MODS.dropout, not varlen; blocks/rng.py): the step's keep mask as one register of bits
    (fragment_dropout_t_bits), drawn while dPᵀ is in flight; dSᵀ = Pᵀ ∘ (Z ∘ dPᵀ · 2^16 / keep16 − D), dV from
    Z ∘ Pᵀ and scaled at the end; its words last in aux."""
    bad = problems(HEAD_DIM, DTYPE)
    if bad:
        raise ValueError("; ".join(bad))
    Q_TILES = BLOCK_M // 8  # n-tiles of Sᵀ / dPᵀ (query columns) per warp
    M_STEPS = BLOCK_M // 16  # k-steps of dV and dK (over the queries)
    O_TILES = HEAD_DIM // 8  # n-tiles of dK / dV
    D_STEPS = HEAD_DIM // 16  # k-steps of Sᵀ and dPᵀ
    N_STEPS = BLOCK_N // 16  # k-steps of dQ (over the keys)
    DQ_N = HEAD_DIM // 2  # dQ columns per warpgroup
    DQ_TILES = DQ_N // 8
    WINDOW, SOFTCAP, ALIBI = bool(MODS.window), bool(MODS.softcap), bool(MODS.alibi)
    CAUSAL = bool(CAUSAL) and not WINDOW
    USER = MODS.user
    DROPOUT = bool(MODS.dropout)
    if MODS.aux and VARLEN:
        raise ValueError("wgmma_backward: user mods and dropout have no varlen build")
    keep_bits = fragment_dropout_t_bits(BLOCK_M // 8)
    dropout_words = words_of(dropout_first(MODS))
    user_score = user_score_grad(MODS) if USER else None
    SCORE_MODS = SOFTCAP or ALIBI or USER  # the score is modified before the exponent
    SG = SOFTCAP or USER  # dSᵀ takes a factor d score / d s (sg)
    schedule_window = window_schedule(BLOCK_N, BLOCK_M)
    _, window_edge, window_hidden = window_rules(16, BLOCK_M)  # a warp's 16 keys x the step's queries
    (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, SDS), _, prologue, schedule, step_tile, prefetch, _, store_grads, _ = \
        dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS, O_TILES, PARTIAL_CHUNK, ATOMS=True)
    mma_s = ptx.wgmma(BLOCK_M, DTYPE)
    mma_o = ptx.wgmma(HEAD_DIM, DTYPE, trans_b=True, a_regs=True)
    mma_q = ptx.wgmma(DQ_N, DTYPE, trans_a=True, trans_b=True)
    hold_s, hold_o, hold_q = ptx.wgmma_hold(BLOCK_M), ptx.wgmma_hold(HEAD_DIM), ptx.wgmma_hold(DQ_N)
    wait0, wait1 = ptx.wgmma_wait(0), ptx.wgmma_wait(1)
    DS_TILE = BLOCK_N * BLOCK_M  # words of one dSᵀ buffer
    fence, commit, fence_async = ptx.wgmma_fence, ptx.wgmma_commit, ptx.fence_proxy_async
    # descriptor bits: K-major operands ignore LBO; MN-major B steps LBO from one atom (64 columns) to the next
    K_MAJOR = ptx.wgmma_desc_bits(16)
    QO_MN = ptx.wgmma_desc_bits(BLOCK_M * 128)
    K_MN = ptx.wgmma_desc_bits(BLOCK_N * 128)
    # 16-byte units (a descriptor's address field) of the fixed offsets
    K16, V16 = 2 * SK >> 4, 2 * SV >> 4
    KV_ATOM16 = BLOCK_N * 128 >> 4  # one column atom of K / V
    QO_ATOM16 = BLOCK_M * 128 >> 4  # ... of Q / dO
    ROWS16_16 = 16 * 128 >> 4  # 16 rows of an atom (a k16 slice of an MN-major operand)
    # dQ's B columns DQ_N·wg ..: a whole atom further at d = 128, half an atom's row (64 B) at d = 64
    DQ_COL16 = KV_ATOM16 if DQ_N == 64 else DQ_N * 2 >> 4
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    st_b32 = ptx.st_shared_b32
    red_add2 = ptx.red_add_v2_f32
    st2 = ptx.st_global_v2_f32
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    CLAMP_P = clamps_past_end("window" if WINDOW else mask_kind(CAUSAL), True)  # this kernel always forms dQ
    SG_TILES = Q_TILES if SG else 1

    @inline_device
    def product_s(smem, acc, a16, b16):
        """acc = A Bᵀ over the head dim, both K-major (A: 64 rows of K or V at a16, B: the Q or dO tile at b16,
        16-byte units), as one commit group."""
        for kk in range(D_STEPS):
            a = K_MAJOR + a16 + (kk >> 2) * KV_ATOM16 + (kk & 3) * 2
            b = K_MAJOR + b16 + (kk >> 2) * QO_ATOM16 + (kk & 3) * 2
            mma_s(smem, acc, a, b, 1 if kk > 0 else 0)
        commit()

    @inline_device
    def products_s(smem, s, dp, kv16, st16):
        """Sᵀ into s, dPᵀ into dp (two commit groups: the softmax of s runs while dp is computed)."""
        fence()
        product_s(smem, s, kv16 + K16, st16 + (SQ >> 3))
        product_s(smem, dp, kv16 + V16, st16 + (SDO >> 3))

    @inline_device
    def dq_phase(smem, acc_q, base16, wg, ds16):
        """acc_q = dS_i K_j[:, DQ_N wg ..] from the stored dSᵀ (at ds16, 16-byte units); committed, not
        waited for."""
        fence()
        for kk in range(N_STEPS):
            a = QO_MN + base16 + ds16 + kk * ROWS16_16
            b = K_MN + base16 + K16 + wg * DQ_COL16 + kk * ROWS16_16
            mma_q(smem, acc_q, a, b, 1 if kk > 0 else 0)
        commit()

    @inline_device
    def add_dq(dq_acc, acc_q, row0, col0, t, first):
        for j in range(DQ_TILES):
            for half in range(2):  # scratch rows and columns are padded: no bounds checks
                off = row0 + 8 * half * HEAD_DIM + col0 + 8 * j + 2 * t
                if first:
                    st2(dq_acc, off, acc_q[j, 2 * half], acc_q[j, 2 * half + 1])
                else:
                    red_add2(dq_acc, off, acc_q[j, 2 * half], acc_q[j, 2 * half + 1])

    @inline_device
    def dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb, first,
                  left=0, right=0, cap_a=ZERO, cap_b=ZERO, slopes=None, inv_scale=ZERO, q_base=0, k_base=0, aux=()):
        smem = cuda.shared.array(0, uint16, alignment=WGMMA_ALIGN)
        smem_f = cuda.shared.array(0, float32, alignment=WGMMA_ALIGN)  # the same bytes, as fp32 (L2, D)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        wg = warp >> 2
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        bh = cuda.blockIdx.y
        n_kv_heads = k.shape[1]
        b = bh // n_kv_heads
        h_kv = bh - b * n_kv_heads
        k0 = kb * BLOCK_N
        kw = k0 + warp * 16  # this warp's first key
        shift = n_k - n_q
        nq_pad = l2.shape[1]
        dq_h0 = bh * group
        base16 = ptx.shared_base(smem) >> 4
        kv16 = base16 + wg * (64 * 128 >> 4)  # this warpgroup's 64 rows of K and V (K-major A)
        key_row = warp * 16 + g  # dSᵀ rows of this lane (+ 8)

        if WINDOW:
            qt0, per_head, steps = schedule_window(k0, n_q, n_k, shift, group, left, right)
        else:
            qt0, per_head, steps = schedule(k0, n_q, shift, group)
        plan = prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad, q_base,
                        k_base)

        acc_k = cuda.local.array((O_TILES, 4), float32)
        acc_v = cuda.local.array((O_TILES, 4), float32)
        s = cuda.local.array((Q_TILES, 4), float32)  # Sᵀ, then Pᵀ
        dp = cuda.local.array((Q_TILES, 4), float32)  # dPᵀ, then dSᵀ
        acc_q = cuda.local.array((DQ_TILES, 4), float32)
        sg = cuda.local.array((SG_TILES, 4), float32)  # d score / d s (1 − tanh², the user grad), for dSᵀ
        for dt in range(O_TILES):
            for r in range(4):
                acc_k[dt, r] = ZERO
                acc_v[dt, r] = ZERO

        row_prev = 0  # DEFER_DQ: the dQ rows of the product in flight
        for step in range(steps):
            cp_wait(0)  # this step's tiles (the only group in flight) ...
            fence_async()  # ... visible to wgmma's reads ...
            cuda.syncthreads()  # ... for every thread; and every warp has retired the previous step's dV, dK
            prefetch(smem, step, steps, qt0, per_head, q, dout, l2, dd, plan, b, h_kv, group, n_q, nq_pad)
            cp_commit()
            hh, i0 = step_tile(step, qt0, per_head, group)
            st = STAGE0 + (step & 1) * STAGE
            st16 = base16 + (st >> 3)
            sds = SDS + (step & 1) * DS_TILE if DEFER_DQ else SDS

            if DEFER_DQ and step > 0:  # the previous step's dQ, computed during the barrier and the prefetch
                wait0()
                hold_q(acc_q)
                add_dq(dq_acc, acc_q, row_prev, wg * DQ_N, t, first)
            products_s(smem, s, dp, kv16, st16)
            wait1()
            hold_s(s)

            # Pᵀ = exp2(Sᵀ·scale·log2 e − L2[query]) while the tensor cores finish dPᵀ
            needs_mask = CAUSAL and kw + 15 > i0 + shift
            if WINDOW:  # the warp's 16 keys against the step's BLOCK_M queries (the forward's edge test, transposed)
                needs_mask = window_edge(kw, kw + 16, i0, n_k, shift, left, right)
            slope = ZERO
            if ALIBI:  # of this step's query head
                slope = head_slope(slopes, b, h_kv * group + hh, inv_scale)
            l2_s = (st + SL) >> 1
            d_s = (st + SD) >> 1
            for nt in range(Q_TILES):
                for r in range(4):
                    col = nt * 8 + 2 * t + (r & 1)
                    if SCORE_MODS:
                        x = s[nt, r]
                        if SOFTCAP:
                            x = capped(x, cap_a, cap_b)
                            sg[nt, r] = softcap_grad(x, cap_b)
                        if ALIBI:
                            x -= alibi_bias(slope, i0 + col, kw + g + 8 * (r >> 1), shift)
                        if USER:
                            du = ONE
                            if i0 + col < n_q and kw + g + 8 * (r >> 1) < n_k:
                                x, du = user_score(x, i0 + col, kw + g + 8 * (r >> 1), b, h_kv * group + hh, scale,
                                                   inv_scale, aux)
                            if SOFTCAP:
                                sg[nt, r] *= du
                            else:
                                sg[nt, r] = du
                        x = x * scale_log2 - smem_f[l2_s + col]
                    else:
                        x = s[nt, r] * scale_log2 - smem_f[l2_s + col]
                    if CLAMP_P:  # keys past n_k: P stays <= 1 (blocks/mask.py)
                        x = min(x, ZERO)
                    if WINDOW:
                        if needs_mask and window_hidden(i0 + col, kw + g + 8 * (r >> 1), n_k, shift, left, right):
                            x = NEG_INF
                    elif needs_mask and kw + g + 8 * (r >> 1) > i0 + col + shift:
                        x = NEG_INF
                    s[nt, r] = ex2(x)
            z = uint32(0)
            keep_scale = ONE
            if DROPOUT:  # the step's keep mask (queries of head hh, this warp's keys), while dPᵀ is in flight
                seed_lo, seed_hi, rng_offset, keep16, keep_scale = dropout_words(aux)
                z = keep_bits(kw, i0, g, t, b * q.shape[1] + h_kv * group + hh, rng_offset, seed_lo, seed_hi, keep16)
            wait0()
            hold_s(dp)
            for nt in range(Q_TILES):
                for r in range(4):
                    col = nt * 8 + 2 * t + (r & 1)
                    dpv = dp[nt, r]
                    if DROPOUT:  # dSᵀ = Pᵀ ∘ (Z ∘ dPᵀ · scale − D); dV takes Z ∘ Pᵀ (its scale at the end)
                        kept_nr = (z >> uint32(4 * nt + r)) & uint32(1)
                        dpv = dpv * keep_scale if kept_nr else ZERO
                    if SG:
                        dp[nt, r] = s[nt, r] * (dpv - smem_f[d_s + col]) * sg[nt, r]
                    else:
                        dp[nt, r] = s[nt, r] * (dpv - smem_f[d_s + col])
                    if DROPOUT:
                        if not (z >> uint32(4 * nt + r)) & uint32(1):
                            s[nt, r] = ZERO

            # dV_w += Pᵀ dO_i, dK_w += dSᵀ Q_i (A from registers), and dSᵀ to shared memory for dQ. Every A
            # word is packed, and dSᵀ stored from the same words, before the fence: the PTX ISA leaves an A
            # register written after wgmma.fence, or read before the wait that retires its product, undefined.
            a_p = cuda.local.array((M_STEPS, 4), uint32)
            a_d = cuda.local.array((M_STEPS, 4), uint32)
            for kk in range(M_STEPS):
                nt = 2 * kk
                a_p[kk, 0] = pack(s[nt, 0], s[nt, 1])
                a_p[kk, 1] = pack(s[nt, 2], s[nt, 3])
                a_p[kk, 2] = pack(s[nt + 1, 0], s[nt + 1, 1])
                a_p[kk, 3] = pack(s[nt + 1, 2], s[nt + 1, 3])
                a_d[kk, 0] = pack(dp[nt, 0], dp[nt, 1])
                a_d[kk, 1] = pack(dp[nt, 2], dp[nt, 3])
                a_d[kk, 2] = pack(dp[nt + 1, 0], dp[nt + 1, 1])
                a_d[kk, 3] = pack(dp[nt + 1, 2], dp[nt + 1, 3])
                # dSᵀ rows key_row (+ 8), queries 16 kk + 2t (+ 8): the pairs of the A fragment
                st_b32(smem, sds + atom_offset(key_row, nt, BLOCK_N) + 2 * t, a_d[kk, 0])
                st_b32(smem, sds + atom_offset(key_row + 8, nt, BLOCK_N) + 2 * t, a_d[kk, 1])
                st_b32(smem, sds + atom_offset(key_row, nt + 1, BLOCK_N) + 2 * t, a_d[kk, 2])
                st_b32(smem, sds + atom_offset(key_row + 8, nt + 1, BLOCK_N) + 2 * t, a_d[kk, 3])
            fence()
            for kk in range(M_STEPS):
                mma_o(smem, acc_v, a_p[kk, 0], a_p[kk, 1], a_p[kk, 2], a_p[kk, 3],
                      QO_MN + st16 + (SDO >> 3) + kk * ROWS16_16, 1)
                mma_o(smem, acc_k, a_d[kk, 0], a_d[kk, 1], a_d[kk, 2], a_d[kk, 3],
                      QO_MN + st16 + (SQ >> 3) + kk * ROWS16_16, 1)
            commit()
            fence_async()  # the dSᵀ stores, for wgmma
            cuda.syncthreads()  # every warp's dSᵀ is in shared memory

            dq_phase(smem, acc_q, base16, wg, sds >> 3)
            row0 = ((dq_h0 + hh) * dq_acc.shape[1] + i0 + 16 * (warp & 3) + g) * HEAD_DIM
            if DEFER_DQ:
                wait1()  # this step's dV and dK: the stage may be refilled after the next barrier
                row_prev = row0
            else:
                wait0()  # dQ, dV and dK: the stage and dSᵀ may be overwritten after the next barrier
                hold_q(acc_q)
                add_dq(dq_acc, acc_q, row0, wg * DQ_N, t, first)

        if DEFER_DQ and steps > 0:  # the last step's dQ
            wait0()
            hold_q(acc_q)
            add_dq(dq_acc, acc_q, row_prev, wg * DQ_N, t, first)
        cp_wait(0)  # nothing may be in flight when the block exits (steps == 0 included)
        hold_o(acc_k)
        hold_o(acc_v)
        if DROPOUT:  # dV = (Z ∘ P)ᵀ dO · 2^16 / keep16
            keep_scale = dropout_words(aux)[4]
            for dt in range(O_TILES):
                for r in range(4):
                    acc_v[dt, r] *= keep_scale
        store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, 0, n_k, d, scale, k_base)

    if MODS.aux:
        return dkdv_user_entry(dkdv_body, globals(), "wgmma_dkdv_mods", True, DQ_SPLITS, len(user_aux_types(MODS)))
    # VARLEN: the packed-sequences form, key blocks past their sequence return
    return dkdv_entry(dkdv_body, globals(), "wgmma_dkdv", True, DQ_SPLITS, mods=MODS.any,
                      varlen_block_n=BLOCK_N if VARLEN else 0)


@lru_cache(maxsize=None)
def build(head_dim: int, causal: bool, dtype: str, partial_chunk: bool = False, dq_splits: int = 0,
          defer_dq: bool = False, mods: Mods = NO_MODS, varlen: bool = False):
    """The compiled wgmma dkdv of one specialisation (sm_90 only: wgmma is an sm_90a instruction)."""
    if dq_splits not in (0, 1, 2) or (dq_splits == 2 and (mods.any or varlen)):
        raise ValueError(f"dq_splits={dq_splits!r}: 0, 1 (adds) or 2 (the first launch: stores; not with mods or "
                         "varlen)")
    kernel = source(head_dim, bool(causal), dtype, bool(partial_chunk), int(dq_splits), bool(defer_dq), mods,
                    bool(varlen))
    key = ("wgmma_backward", head_dim, bool(causal), dtype, bool(partial_chunk), int(dq_splits), bool(defer_dq),
           mods) + varlen_key(varlen)
    return compile_kernel(key, kernel_signature("dkdv", True, bool(dq_splits), mods=mods.any, varlen=bool(varlen),
                                                aux=user_aux_types(mods)), kernel)


def launch(q, k, v, dout, l2, dd, dk, dv, dq_acc, scalars, *, head_dim, causal, dtype, stream=0,
           partial_chunk=False, dq_splits=None, defer_dq=False, mods=NO_MODS, varlen=None, aux=()):
    """The dK/dV kernel that also forms dQ over every key block (BLOCK_N keys): arguments as
    mma_dkdv.launch's with dq_acc; defer_dq: the DEFER_DQ build; mods: scalars end with the mods' launch
    arguments and the splits' planes are zeroed (every launch adds); varlen: as mma_dkdv.launch's; aux: the user
    mods' aux arrays (device views, the mask's first), last."""
    B, H = q.shape[0], q.shape[1]
    Hkv, n_k = k.shape[1], scalars[1]
    extra = {"mods": mods} if mods.any else {}  # passed only when on: the others' cache key
    if varlen is not None:
        extra["varlen"] = True
    launch_dq_in_dkdv(lambda splits: build(head_dim, bool(causal), dtype, bool(partial_chunk), splits, defer_dq,
                                           **extra),
                      B * Hkv, THREADS, smem_bytes(head_dim, defer_dq), stream, (q, k, v, dout, l2, dd, dk, dv, dq_acc),
                      scalars, (n_k + BLOCK_N - 1) // BLOCK_N, dq_splits, B * H, zeroed=mods.any or varlen is not None,
                      tail=(() if varlen is None else tuple(varlen[:2])) + tuple(aux))
