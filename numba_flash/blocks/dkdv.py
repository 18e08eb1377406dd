"""The dK/dV skeleton every 16-bit dK/dV kernel assembles (mma.sync's in kernels/mma_dkdv.py, wgmma's in
kernels/wgmma_backward.py), and the two products of a tile over the head dim (mma_dkdv, mma_dq).

One block per (BLOCK_N keys, batch · kv head): K_j and V_j stay in shared memory, dK_j and dV_j accumulate
in registers while the block streams the Q / dO tiles (and their L2, D rows) of every query head of its
group through a double buffer, so the GQA sum needs no atomics. ``dkdv_common`` gives the shared-memory
plan, the copies (K and V; the streamed stage), the schedule of (query head, Q tile) steps (causal: from
the first Q tile that sees the block's keys) and the epilogue.
"""
from __future__ import annotations

from numba import cuda, float32, int32, uint16

from .. import ptx
from ..ptx import inline_device
from .copies import copy_threads, tile_copies


def stage_words(block_m: int, head_dim: int) -> int:
    """16-bit words of one dkdv stage [Q | dO | L2 | D], in whole rows of head_dim words: a stage
    offset then leaves the swizzle's chunk bits alone (the ldmatrix offsets XOR them in)."""
    return -(-(2 * block_m * head_dim + 4 * block_m) // head_dim) * head_dim



def pair_offset(HEAD_DIM):
    """at(off, j): the word offset of a lane's 16-column pair j (chunks 2j, 2j + 1) from its pair 0's offset
    ``off`` in a swizzled tile of HEAD_DIM-word rows (blocks.copies.tile_copies), off a whole-row offset plus
    the lane's chunk. The swizzle XORs a chunk's low 3 bits with row % 8, so pair j is pair j % 4 of 8-chunk
    group j // 4: off ^ (j % 4) << 4, plus j // 4 groups of 64 words. Where HEAD_DIM is a power of two the
    row bits lie above every pair's (16·(HEAD_DIM / 16 − 1) < HEAD_DIM) and one XOR does it; at d = 192
    (rows of 3 groups) the group must be added."""
    if HEAD_DIM & (HEAD_DIM - 1) == 0:
        @inline_device
        def at(off, j):
            return off ^ (j << 4)
    else:
        @inline_device
        def at(off, j):
            return (off ^ ((j & 3) << 4)) + ((j >> 2) << 6)
    return at


def two_products(HEAD_DIM, N_TILES, mma):
    """X = A1 B1ᵀ and Y = A2 B2ᵀ over the head dim (Sᵀ, dPᵀ in dkdv; S, dP in dq): A of 16 rows per
    warp, B of N_TILES n-tiles, all from swizzled tiles. The k-steps are written out one call each:
    NVVM leaves the loop rolled at d = 128 (half the mma in the PTX), as in the forward's Q·Kᵀ.
    a1, a2, b1: word offsets of whole rows (multiples of HEAD_DIM), b2 - b1 a constant: a lane's
    chunk 2 kk is then its chunk 0's offset XOR kk << 4 (the row's bits lie above the chunk's), one
    LOP3 per k-step and operand instead of the swizzle rebuilt and rescaled for every ldmatrix (at d = 192 an
    add too: pair_offset)."""
    ldsm = ptx.ldmatrix_x4
    D_STEPS = HEAD_DIM // 16
    at = pair_offset(HEAD_DIM)

    @inline_device
    def step(x, y, smem, kk, a1, a2, b1, b2, a_lane, b_lane):
        a_off = at(a_lane, kk)
        p0, p1, p2, p3 = ldsm(smem, a1 + a_off)
        r0, r1, r2, r3 = ldsm(smem, a2 + a_off)
        b_off = at(b1 + b_lane, kk)  # the stage offset inside: a register and immediates per k-step
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
        if D_STEPS > 8:
            step(x, y, smem, 8, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 9, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 10, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 11, a1, a2, b1, b2, a_lane, b_lane)
        if D_STEPS > 12:
            step(x, y, smem, 12, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 13, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 14, a1, a2, b1, b2, a_lane, b_lane)
            step(x, y, smem, 15, a1, a2, b1, b2, a_lane, b_lane)

    if D_STEPS not in (4, 8, 12, 16):
        raise ValueError(f"HEAD_DIM={HEAD_DIM}: the unrolled products take 64, 128, 192 or 256")
    return unrolled


def window_schedule(BLOCK_N, BLOCK_M):
    """schedule(k0, n_q, n_k, shift, group, left, right) of the window kind (blocks/mask.py): (first Q tile,
    Q tiles per query head, steps) for the key block k0 .. k0 + BLOCK_N - 1, from the first Q tile whose last
    row sees key k0 (row >= k0 - shift - right) to the last whose first row sees the block's last key
    (row <= key - shift + left); the Q tiles between are the only ones any row of which sees the block."""

    @inline_device
    def schedule(k0, n_q, n_k, shift, group, left, right):
        n_qt = (n_q + BLOCK_M - 1) // BLOCK_M
        qt0 = min(max(k0 - shift - right, 0) // BLOCK_M, n_qt)
        k_last = min(k0 + BLOCK_N, n_k) - 1
        qt_end = min((max(k_last - shift + left + 1, 0) + BLOCK_M - 1) // BLOCK_M, n_qt)
        per_head = max(qt_end - qt0, 0)
        return int32(qt0), int32(per_head), int32(group * per_head)

    return schedule


def dkdv_common(BLOCK_N, BLOCK_M, HEAD_DIM, CAUSAL, DTYPE, THREADS, OUT_TILES, PARTIAL_CHUNK, ATOMS=False):
    """What the dK/dV layouts share: the shared-memory plan, the copies (K and V, the streamed stage),
    the schedule of (query head, Q tile) steps and the epilogue. OUT_TILES: n-tiles of dK / dV per warp.
    PARTIAL_CHUNK: d % 8 != 0 (tile_copies' flag). ATOMS (the wgmma kernel): the 16-bit tiles in wgmma's
    column atoms (tile_copies' ATOM_ROWS) and every tile starting at a multiple of 1024 bytes.

    Word offsets: K and V once, then two stages of [Q | dO | L2 (fp32) | D (fp32)], then what the
    layout adds (EXTRA0 on)."""
    SK, SV = 0, BLOCK_N * HEAD_DIM
    STAGE0 = 2 * BLOCK_N * HEAD_DIM
    STAGE = -(-(2 * BLOCK_M * HEAD_DIM + 4 * BLOCK_M) // 512) * 512 if ATOMS else stage_words(BLOCK_M, HEAD_DIM)
    SQ, SDO, SL, SD = 0, BLOCK_M * HEAD_DIM, 2 * BLOCK_M * HEAD_DIM, 2 * BLOCK_M * HEAD_DIM + 2 * BLOCK_M
    EXTRA0 = STAGE0 + 2 * STAGE
    Q_COPIES = BLOCK_M * (HEAD_DIM // 8) // copy_threads(HEAD_DIM, THREADS)
    KV_COPIES = BLOCK_N * (HEAD_DIM // 8) // copy_threads(HEAD_DIM, THREADS)
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
    # of another module calls load_stage (tile_copies' thread_x, likewise)
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
    def prologue(smem, q, k, v, dout, l2, dd, b, h_kv, group, k0, qt0, steps, n_q, n_k, d, nq_pad, q_base=0,
                 k_base=0):
        """K_j, V_j and step 0's stage as one cp.async group; returns this thread's copy plan of the Q and dO
        tiles of query head h_kv·group (offsets, source bytes per copy, shared offset), kept for the loop's
        stages so a step only adds its head's and rows' offsets. q_base, k_base: the sequence's first query and
        key rows (varlen; 0 in a dense batch), folded into the plan's offsets."""
        k_off, k_rs, col_bytes, dst0 = copy_plan(k, b, h_kv, d)
        v_off, v_rs, _, _ = copy_plan(v, b, h_kv, d)
        k_off += k_base * k_rs
        v_off += k_base * v_rs
        load_tile_fast(smem, SK, k, k_off + k0 * k_rs, k_rs, col_bytes, dst0, k0, n_k, KV_COPIES)
        load_tile_fast(smem, SV, v, v_off + k0 * v_rs, v_rs, col_bytes, dst0, k0, n_k, KV_COPIES)
        q_off, q_rs, _, q_dst0 = copy_plan_q(q, b, h_kv * group, d)
        do_off, do_rs, _, _ = copy_plan_q(dout, b, h_kv * group, d)
        q_off += q_base * q_rs
        do_off += q_base * do_rs
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
        integer division: it was a ~40-instruction chain per step (ncu)."""
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
    def store_grads(dk, dv, acc_k, acc_v, b, h_kv, kw, g, t, col0, n_k, d, scale, k_base=0):
        """dV = Σ Pᵀ dO, dK = scale · Σ dSᵀ Q of rows kw + g (+ 8), columns col0.., rounded to 16 bits;
        keys past n_k and columns past d are not stored (rows from k_base on: varlen)."""
        for half in range(2):
            row = kw + g + 8 * half
            if row < n_k:
                for dt in range(OUT_TILES):
                    col = col0 + dt * 8 + 2 * t
                    bits_v = pack(acc_v[dt, 2 * half], acc_v[dt, 2 * half + 1])
                    bits_k = pack(acc_k[dt, 2 * half] * scale, acc_k[dt, 2 * half + 1] * scale)
                    if col < d:
                        dv[b, h_kv, k_base + row, col] = uint16(bits_v & 0xFFFF)
                        dk[b, h_kv, k_base + row, col] = uint16(bits_k & 0xFFFF)
                    if col + 1 < d:
                        dv[b, h_kv, k_base + row, col + 1] = uint16(bits_v >> 16)
                        dk[b, h_kv, k_base + row, col + 1] = uint16(bits_k >> 16)

    layout = (SK, SV, STAGE0, STAGE, SQ, SDO, SL, SD, EXTRA0)
    return layout, swizzle, prologue, schedule, step_tile, prefetch, swizzle_m, store_grads, dv_dk_step
