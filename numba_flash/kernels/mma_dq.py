"""The dQ kernel of the tensor-core backward on mma.sync m16n8k16 (fp16 / bf16 in, fp32 accumulation): the
deterministic scheme without scratch, where the dK/dV kernel does not form dQ (kernels/mma_dkdv.py).

One block per (Q tile of BLOCK_M rows, batch · head), warp w owning rows 16w..16w+15: the forward's loop with
a second GEMM and no online softmax (L is known, L2 = L·log2 e from kernels/bwd_prep.py):

    S = Q_w K_jᵀ,  dP = dO_w V_jᵀ         A = Q / dO rows, B = K / V rows (ldmatrix)
    dS = exp2(S·scale·log2 e − L2[row]) ∘ (dP − D[row])
    dQ_w += dS · K_j                       A = dS re-packed, B = K by ldmatrix.trans

This repeats the two products of the dK/dV kernel (7 tile GEMMs instead of FA2's 5) in exchange for no
atomic adds and a bitwise repeatable dQ. K and V are streamed through a double buffer in the swizzled layout
of blocks/copies.py; causal (bottom-right) stops after the last K/V tile the block's rows see, and only
tiles that cross the diagonal or the end of the keys pay for the mask.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from ..blocks.copies import copy_threads, tile_copies
from ..blocks.dkdv import pair_offset, two_products
from ..blocks.entry import kernel_signature, user_entry, varlen_entry, varlen_key, varlen_rules, with_row_bases
from ..blocks.mask import window_rules
from ..blocks.mods import (NO_MODS, Mods, alibi_bias, capped, dropout_first, head_slope, softcap_grad, user_aux_types,
                           user_score_grad)
from ..blocks.rng import fragment_keep, words_of
from ..blocks.schedule import ROW_PAD
from ..jit_cache import compile_kernel

DTYPES = ("float16", "bfloat16")


def threads(block_m: int) -> int:
    """One warp per 16 query rows."""
    return 32 * (block_m // 16)


def smem_bytes(block_m: int, block_n: int, head_dim: int) -> int:
    """Q and dO once, two stages of [K | V] (double buffer)."""
    return 2 * (2 * block_m * head_dim + 2 * 2 * block_n * head_dim)


def problems(block_m: int, block_n: int, head_dim: int, dtype: str) -> list[str]:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    if block_m % 16 or not 16 <= block_m <= 256:
        out.append(f"own tile of {block_m} rows: one warp per 16 rows, 1..16 warps")
    if block_m > ROW_PAD:  # its rows' L2 and D are read from rows padded to ROW_PAD
        out.append(f"dq tile of {block_m} query rows > {ROW_PAD}, the scratch rows' padding")
    if block_n % 16 or not 16 <= block_n <= ROW_PAD:
        out.append(f"streamed tile of {block_n} rows: a multiple of 16 (the k of m16n8k16), <= {ROW_PAD}")
    if head_dim not in (64, 128, 192, 256):
        out.append(f"HEAD_DIM={head_dim}: 64, 128, 192 or 256 (the unrolled k-steps)")
    if dtype not in DTYPES:
        out.append(f"dtype={dtype!r} not in {DTYPES}")
    n_threads = threads(block_m) if block_m % 16 == 0 and block_m >= 16 else 32
    copying = copy_threads(head_dim, n_threads) if head_dim % 8 == 0 else n_threads
    for name, rows in (("own", block_m), ("streamed", block_n)):
        if not copying or (rows * head_dim // 8) % copying:
            out.append(f"{name} tile of {rows}x{head_dim} is not a whole number of 16-byte copies per thread")
    nbytes = smem_bytes(block_m, block_n, head_dim)
    if nbytes > SMEM_PER_BLOCK_MAX:
        out.append(f"{nbytes} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def source(BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DTYPE, PARTIAL_CHUNK=False, MODS=NO_MODS, VARLEN=False):
    """The dQ kernel: BLOCK_M queries per block (one warp per 16), BLOCK_N-row K/V tiles streamed. MODS
    (blocks/mods.py): the window's tile range and edges (the forward's window_rules), softcap and ALiBi on each
    recomputed score and the cap's 1 − tanh² on dS; the kernel then takes the mods' launch arguments last. User
    mods (MODS.user): the score mod and mask on every score in range (blocks.mods.user_score_grad) and the score
    mod's derivative on dS; their aux arrays follow the mods' launch arguments (no varlen build). Dropout
    (MODS.dropout, blocks/rng.py): dS = P ∘ (Z ∘ dP · 2^16 / keep16 − D) with the forward's keep mask Z
    (fragment_keep); its words last in aux (no varlen build).
    VARLEN: the packed-sequences entry (blocks.entry.varlen_entry): Q tiles past their sequence return."""

    WARPS = BLOCK_M // 16
    THREADS = 32 * WARPS
    CHUNKS = HEAD_DIM // 8
    Q_COPIES = BLOCK_M * CHUNKS // copy_threads(HEAD_DIM, THREADS)
    KV_COPIES = BLOCK_N * CHUNKS // copy_threads(HEAD_DIM, THREADS)
    K_TILES = BLOCK_N // 8  # n-tiles of S / dP (key columns)
    N_STEPS = BLOCK_N // 16  # k-steps of dQ (over the keys)
    O_TILES = HEAD_DIM // 8  # n-tiles of dQ
    SQ, SDO = 0, BLOCK_M * HEAD_DIM  # word offsets: Q and dO once, then two stages of [K | V]
    STAGE0 = 2 * BLOCK_M * HEAD_DIM
    STAGE = 2 * BLOCK_N * HEAD_DIM
    SK, SV = 0, BLOCK_N * HEAD_DIM
    WINDOW, SOFTCAP, ALIBI = bool(MODS.window), bool(MODS.softcap), bool(MODS.alibi)
    CAUSAL = bool(CAUSAL) and not WINDOW
    USER = MODS.user
    DROPOUT = bool(MODS.dropout)
    if MODS.aux and VARLEN:
        raise ValueError("mma_dq: user mods and dropout have no varlen build")
    keep_tile = fragment_keep(K_TILES, 1)
    dropout_words = words_of(dropout_first(MODS))
    user_score = user_score_grad(MODS) if USER else None
    window_range, window_edge, window_hidden = window_rules(BLOCK_N, 16)
    swizzle, _, copy_plan, load_tile_fast = tile_copies(HEAD_DIM, THREADS, PARTIAL_CHUNK)
    mma = ptx.mma_m16n8k16_f16 if DTYPE == "float16" else ptx.mma_m16n8k16_bf16
    unrolled = two_products(HEAD_DIM, K_TILES, mma)
    at = pair_offset(HEAD_DIM)
    pack = ptx.pack_f16x2 if DTYPE == "float16" else ptx.pack_bf16x2
    ex2 = ptx.ex2_approx
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    ldsm_t = ptx.ldmatrix_x4_trans
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)

    @inline_device
    def dq_body(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale, left, right, cap_a, cap_b, slopes,
                inv_scale, q_base=0, k_base=0, aux=()):
        # q_base, k_base: the first query and key row of the block's sequence (varlen; 0 in a dense batch)
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
        j_first = 0
        if WINDOW:
            j_first, n_tiles = window_range(q0, min(q0 + BLOCK_M, n_q), n_k, shift, left, right)
        slope = ZERO
        if ALIBI:
            slope = head_slope(slopes, b, h, inv_scale)

        mat = lane >> 3
        a_row = warp * 16 + (lane & 15)  # A (Q, dO rows)
        a_x = (lane >> 4) ^ (a_row & 7)
        b_row = (mat >> 1) * 8 + (lane & 7)  # B of two n-tiles (K, V rows)
        b_x = (mat & 1) ^ (b_row & 7)
        t_row = (mat & 1) * 8 + (lane & 7)  # B by .trans (K as k x n)
        t_lane = swizzle(t_row, mat >> 1)  # ... of d pair dp2, k-step kk: at(t_lane, dp2) + kk·16 rows

        # This thread's copy plans (offsets, source bytes per copy, shared offset); K's and V's offsets
        # step by a tile per K/V tile.
        q_off, q_rs, col_bytes, dst0 = copy_plan(q, b, h, d)
        do_off, do_rs, _, _ = copy_plan(dout, b, h, d)
        k_next, k_rs, _, _ = copy_plan(k, b, h_kv, d)
        v_next, v_rs, _, _ = copy_plan(v, b, h_kv, d)
        q_off += q_base * q_rs
        do_off += q_base * do_rs
        k_next += k_base * k_rs
        v_next += k_base * v_rs
        if WINDOW:
            k_next += j_first * BLOCK_N * k_rs
            v_next += j_first * BLOCK_N * v_rs
        load_tile_fast(smem, SQ, q, q_off + q0 * q_rs, q_rs, col_bytes, dst0, q0, n_q, Q_COPIES)
        load_tile_fast(smem, SDO, dout, do_off + q0 * do_rs, do_rs, col_bytes, dst0, q0, n_q, Q_COPIES)
        if n_tiles > j_first:
            load_tile_fast(smem, STAGE0 + SK, k, k_next, k_rs, col_bytes, dst0, int32(j_first * BLOCK_N), n_k,
                           KV_COPIES)
            load_tile_fast(smem, STAGE0 + SV, v, v_next, v_rs, col_bytes, dst0, int32(j_first * BLOCK_N), n_k,
                           KV_COPIES)
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
        z = cuda.local.array((K_TILES, 4), float32)  # dropout's keep mask of the tile's scores
        seed_lo, seed_hi, rng_offset, keep16, keep_scale = uint32(0), uint32(0), uint32(0), uint32(0), ONE
        if DROPOUT:
            seed_lo, seed_hi, rng_offset, keep16, keep_scale = dropout_words(aux)
        for dt in range(O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO

        for j in range(int32(j_first), int32(n_tiles)):  # 32-bit: the loop's arithmetic
            k0 = j * BLOCK_N
            cp_wait(0)  # K_j, V_j (the only group in flight) ...
            cuda.syncthreads()  # ... for every thread; and every warp has left tile j - 1
            if j + 1 < n_tiles:  # K_{j+1}, V_{j+1} into the buffer tile j - 1 used
                nxt = STAGE0 + ((j - j_first + 1) & 1) * STAGE
                k_next += BLOCK_N * k_rs
                v_next += BLOCK_N * v_rs
                load_tile_fast(smem, nxt + SK, k, k_next, k_rs, col_bytes, dst0, k0 + BLOCK_N, n_k, KV_COPIES)
                load_tile_fast(smem, nxt + SV, v, v_next, v_rs, col_bytes, dst0, k0 + BLOCK_N, n_k, KV_COPIES)
            cp_commit()
            st = STAGE0 + ((j - j_first) & 1) * STAGE

            # S = Q_w K_jᵀ and dP = dO_w V_jᵀ
            unrolled(s, dp, smem, SQ, SDO, st + SK, st + SV, a_row, a_x, b_row, b_x)

            # dS = exp2(S·scale·log2 e − L2[row]) ∘ (dP − D[row]); mask keys past n_k and the diagonal.
            needs_mask = k0 + BLOCK_N > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_N - 1 > qw + shift)
            if WINDOW:
                needs_mask = window_edge(k0, k0 + BLOCK_N, qw, n_k, shift, left, right)
            if DROPOUT:
                keep_tile(z, k0, qw, g, t, bh, rng_offset, seed_lo, seed_hi, keep16)
            for nt in range(K_TILES):
                for r in range(4):
                    half = r >> 1
                    x = s[nt, r]
                    if SOFTCAP:
                        x = capped(x, cap_a, cap_b)
                        s[nt, r] = x  # the capped score: its 1 − tanh² below
                    if ALIBI:
                        x -= alibi_bias(slope, qw + g + 8 * half, k0 + nt * 8 + 2 * t + (r & 1), shift)
                    du = ONE  # d(user score mod)/d score
                    if USER:
                        row = qw + g + 8 * half
                        col = k0 + nt * 8 + 2 * t + (r & 1)
                        if row < n_q and col < n_k:
                            x, du = user_score(x, row, col, b, h, scale, inv_scale, aux)
                    x = x * scale_log2 - l2_r[half]
                    if needs_mask:
                        col = k0 + nt * 8 + 2 * t + (r & 1)
                        if WINDOW:
                            if window_hidden(qw + g + 8 * half, col, n_k, shift, left, right):
                                x = NEG_INF
                        elif col >= n_k or (CAUSAL and col > qw + g + 8 * half + shift):
                            x = NEG_INF
                    if DROPOUT:
                        ds = ex2(x) * (dp[nt, r] * z[nt, r] * keep_scale - d_r[half])
                    else:
                        ds = ex2(x) * (dp[nt, r] - d_r[half])
                    if SOFTCAP:
                        ds *= softcap_grad(s[nt, r], cap_b)
                    if USER:
                        ds *= du
                    dp[nt, r] = ds

            # dQ_w += dS K_j: dS accumulators of n-tiles 2kk, 2kk+1 = A of k-step kk; K by .trans.
            for kk in range(N_STEPS):
                nt = 2 * kk
                a0 = pack(dp[nt, 0], dp[nt, 1])
                a1 = pack(dp[nt, 2], dp[nt, 3])
                a2 = pack(dp[nt + 1, 0], dp[nt + 1, 1])
                a3 = pack(dp[nt + 1, 2], dp[nt + 1, 3])
                for dp2 in range(O_TILES // 2):
                    dt = 2 * dp2
                    b0, b1, b2, b3 = ldsm_t(smem, at(st + SK + t_lane, dp2) + kk * 16 * HEAD_DIM)
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
                        dq[b, h, q_base + row, col] = uint16(bits & 0xFFFF)
                    if col + 1 < d:
                        dq[b, h, q_base + row, col + 1] = uint16(bits >> 16)

    body = with_row_bases(dq_body, globals()) if VARLEN else dq_body
    if MODS.aux:
        mods = "left, right, cap_a, cap_b, slopes, inv_scale"
        params = f"q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale, {mods}"
        return user_entry(body, globals(), "mma_dq_mods", params, params + ", 0, 0", len(user_aux_types(MODS)))
    if MODS.any:
        def mma_dq_mods(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale, left, right, cap_a, cap_b,
                        slopes, inv_scale):
            body(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale, left, right, cap_a, cap_b,
                 slopes, inv_scale)

        kernel = mma_dq_mods
    else:
        def mma_dq(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale):
            body(q, k, v, dout, l2, dd, dq, n_q, n_k, d, group, scale_log2, scale, 0, 0, ZERO, ZERO, l2, ZERO)

        kernel = mma_dq
    if VARLEN:  # Q tiles past their sequence return
        return varlen_entry(kernel, globals(), *varlen_rules("q_tiles", BLOCK_M))
    return kernel


@lru_cache(maxsize=None)
def build(block_m: int, block_n: int, head_dim: int, causal: bool, dtype: str, max_registers: int | None = None,
          partial_chunk: bool = False, mods: Mods = NO_MODS, varlen: bool = False):
    """The compiled kernel of one specialisation; cached so each compiles once. partial_chunk: d % 8 != 0."""
    bad = problems(block_m, block_n, head_dim, dtype)
    if bad:
        raise ValueError(f"mma backward dq ({block_m}, {block_n}, {head_dim}, {dtype}) cannot be built: "
                         f"{'; '.join(bad)}")
    kernel = source(block_m, block_n, head_dim, bool(causal), dtype, bool(partial_chunk), mods, bool(varlen))
    cap = {"max_registers": int(max_registers)} if max_registers else {}
    key = ("mma_dq", block_m, block_n, head_dim, bool(causal), dtype, bool(partial_chunk), mods) + varlen_key(varlen)
    return compile_kernel(key, kernel_signature("dq", mods=mods.any, varlen=bool(varlen), aux=user_aux_types(mods)),
                          kernel, **cap)


def launch(q, k, v, dout, l2, dd, dq, scalars, *, tile, head_dim, causal, dtype, stream=0, partial_chunk=False,
           mods=NO_MODS, varlen=None, aux=()):
    """The dQ kernel over every query tile: q, k, v, dout, dq as 16-bit words, l2 and dd prep's scratch rows,
    scalars (n_q, n_k, d, group, scale·log2 e, scale); varlen: as mma_dkdv.launch's; aux: the user mods' aux
    arrays (device views, the mask's first)."""
    bm, bn = tile
    B, H, n_q = q.shape[0], q.shape[1], scalars[0]
    partial = {"partial_chunk": True} if partial_chunk else {}  # passed only when on: the others' cache key
    if mods.any:
        partial["mods"] = mods
    tail = ()
    if varlen is not None:
        partial["varlen"] = True
        tail = tuple(varlen[:2])
    tail += tuple(aux)
    launch_kernel(build(bm, bn, head_dim, bool(causal), dtype, **partial), ((n_q + bm - 1) // bm, B * H),
                  threads(bm), stream, smem_bytes(bm, bn, head_dim), q, k, v, dout, l2, dd, dq, *scalars, *tail)
