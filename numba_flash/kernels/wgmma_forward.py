"""Tensor-core forward on sm_90's warpgroup MMA (wgmma.mma_async), fp16 / bf16 in, fp32 accumulation.

The maths is kernels/mma_forward.py's (read its docstring first): the online softmax of blocks/softmax.py with
lazy rescaling, M in base-2 units of the scaled scores, per K/V tile j

    S (64 x BLOCK_K)   = Q_wg (64 x HEAD_DIM) · K_jᵀ       wgmma m64n{BLOCK_K}k16, A and B from shared memory
    O (64 x HEAD_DIM) += P (64 x BLOCK_K) · V_j             wgmma m64n{HEAD_DIM}k16, A (P) from registers

per warpgroup wg (4 warps, 128 threads), which owns query rows 64·wg .. 64·wg + 63 of the block's BLOCK_Q. What
changes against mma.sync is who multiplies: a warpgroup issues a whole 64 x N x 16 product at once, its B (and
Q) read by the tensor cores straight from shared memory through descriptors, with no ldmatrix and no fragment
registers for the operands. The accumulators are laid out per warp as mma.sync's m16n8 C fragments (ptx/
warpgroup.py), so warp w of the block holds rows 16·w + g (+ 8) exactly as an mma.sync warp of one m-tile does,
and the softmax, the masks and the mods are the fragment blocks mma_forward uses (blocks/softmax.py, mask.py,
mods.py); P is re-packed from the S accumulators of n-tiles 2kk, 2kk + 1 into the A fragment of k-step kk.

Shared memory holds the Q tile and two (K, V) tile pairs in wgmma's 128-byte-swizzled column atoms
(blocks.copies.atom_offset: 64 columns an atom, every tile at a multiple of 1024 bytes), filled by cp.async
(blocks.copies.tile_copies with ATOM_ROWS); after the copies land, ``fence.proxy.async`` makes them visible to
wgmma's (async-proxy) reads, then one barrier. K_{j+1}, V_{j+1} are issued into the other pair right after it,
a whole tile ahead, as in mma_forward.

What this kernel does not do yet (FA3's further steps, hopper/): TMA loads by a producer warp with mbarriers,
ping-pong scheduling of the warpgroups and the softmax of tile j under the Q·Kᵀ of tile j + 1; here the two
warpgroups overlap each other only as the warp schedulers interleave them.

Flags (``tile.flags``): grid_bh_x as mma_forward's (the heaviest causal Q tiles of every head first).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..jit_cache import compile_kernel
from ..launch import unused_slopes
from ..launch import launch as launch_kernel
from ..ptx import WGMMA_ALIGN, inline_device
from ..tiles import Tile
from ..blocks.copies import check_layout, copy_threads, tile_copies
from ..blocks.entry import forward_entry, forward_grid, forward_signature, varlen_key
from ..blocks.mask import fragment_mask, fragment_window, mask_kind, window_rules
from ..blocks.mods import NO_MODS, Mods, fragment_mods, fragment_user_mods, head_slope, launch_args, user_aux_types
from ..blocks.numerics import LOG2E
from ..blocks.softmax import fragment_softmax, row_lse
from ..blocks.sparsity import entry, is_full, list_length, lists_of, tile_of

DTYPES = ("float16", "bfloat16")
FLAGS = ("wgmma", "grid_bh_x")  # wgmma: names this family in the shared configs (it changes nothing here)
STAGES = 2
HEAD_DIMS = (64, 128, 192, 256)
WORD = np.dtype(np.uint16)  # bf16 arrays travel as uint16 bit patterns (which select the bf16 build)


def kernel_signature(mods: Mods = NO_MODS, varlen: bool = False):
    """blocks.entry.forward_signature: q, k, v, out as 16-bit words, lse float32; with mods the window, softcap and
    ALiBi arguments; varlen cu_seqlens_q, cu_seqlens_k last."""
    return forward_signature(mods.any, varlen, user_aux_types(mods))


def threads(tile: Tile) -> int:
    return 32 * tile.warps


def smem_bytes(tile: Tile) -> int:
    """The Q tile and two (K, V) pairs, 16-bit words (each a whole number of 1024-byte atoms' rows)."""
    return 2 * tile.head_dim * (tile.block_q + 2 * STAGES * tile.block_k)


def problems(tile: Tile, dtype: str) -> list:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    bq, bk, hd = tile.block_q, tile.block_k, tile.head_dim
    if tile.warps not in (4, 8) or bq != 16 * tile.warps:
        out.append(f"{tile.warps} warps for {bq} rows: one or two warpgroups of 64 rows (block_q = 16 x warps)")
    if bk % 16 or not 16 <= bk <= 256:
        out.append(f"block_k={bk}: a multiple of 16 (P·V's k) up to 256 (wgmma's n)")
    if hd not in HEAD_DIMS:
        out.append(f"head_dim={hd}: one of {HEAD_DIMS} (whole 64-column atoms; wgmma's n <= 256)")
    if dtype not in DTYPES:
        out.append(f"dtype={dtype!r} not in {DTYPES}")
    if tile.stages != STAGES:
        out.append(f"stages={tile.stages}: K/V are double-buffered ({STAGES})")
    unknown = sorted(tile.flags - set(FLAGS))
    if unknown:
        out.append(f"flags {unknown}: not among {FLAGS}")
    copying = copy_threads(hd, threads(tile)) if hd in HEAD_DIMS and tile.warps else 0
    for name, rows in (("Q", bq), ("K/V", bk)):
        if not copying or (rows * hd // 8) % copying:
            out.append(f"{name} tile of {rows}x{hd} is not a whole number of 16-byte copies per copying thread")
    if smem_bytes(tile) > SMEM_PER_BLOCK_MAX:
        out.append(f"{smem_bytes(tile)} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def kernel_source(tile: Tile, causal: bool, dtype: str, partial_chunk: bool = False, mods: Mods = NO_MODS,
                  varlen: bool = False):
    """The Python kernel for one specialisation (before cuda.jit); arguments as mma_forward.kernel_source's."""
    BLOCK_Q, BLOCK_K, HEAD_DIM, WARPS = tile.block_q, tile.block_k, tile.head_dim, tile.warps
    WINDOW, SOFTCAP, ALIBI = bool(mods.window), bool(mods.softcap), bool(mods.alibi)
    SCORE_MODS = SOFTCAP or ALIBI
    USER = mods.user  # user mask / score mods (blocks/mods.py): every tile calls them
    CAUSAL = bool(causal) and not WINDOW
    BLOCK_SPARSE = bool(mods.block_sparse)  # the BlockMask's key-tile lists (mma_forward.kernel_source's)
    RANGE_CAUSAL, RANGE_WINDOW = CAUSAL and not BLOCK_SPARSE, WINDOW and not BLOCK_SPARSE
    lists = lists_of(len(user_aux_types(mods)) - 2)  # (counts, entries) from aux (block_sparse)
    GRID_BH_X = tile.has("grid_bh_x")
    THREADS = 32 * WARPS
    CHUNKS = HEAD_DIM // 8
    Q_COPIES = BLOCK_Q * CHUNKS // copy_threads(HEAD_DIM, THREADS)
    KV_COPIES = BLOCK_K * CHUNKS // copy_threads(HEAD_DIM, THREADS)
    QK_STEPS = HEAD_DIM // 16  # k-steps of S = Q Kᵀ
    S_TILES = BLOCK_K // 8  # n-tiles of S per warp
    PV_STEPS = BLOCK_K // 16  # k-steps of O += P V
    O_TILES = HEAD_DIM // 8  # n-tiles of O per warp
    SQ, SK = 0, BLOCK_Q * HEAD_DIM  # word offsets: Q | K0 | V0 | K1 | V1
    SV = SK + BLOCK_K * HEAD_DIM
    KV_WORDS = 2 * BLOCK_K * HEAD_DIM  # from one (K, V) pair to the other
    mma_s = ptx.wgmma(BLOCK_K, dtype)
    mma_o = ptx.wgmma(HEAD_DIM, dtype, trans_b=True, a_regs=True)
    hold_s, hold_o = ptx.wgmma_hold(BLOCK_K), ptx.wgmma_hold(HEAD_DIM)
    wait0 = ptx.wgmma_wait(0)
    fence, commit, fence_async = ptx.wgmma_fence, ptx.wgmma_commit, ptx.fence_proxy_async
    K_MAJOR = ptx.wgmma_desc_bits(16)  # Q, K: the reduction (head dim) along the rows; LBO unused
    V_MN = ptx.wgmma_desc_bits(BLOCK_K * 128)  # V: the reduction (keys) down the rows; LBO = one atom
    Q_ATOM16 = BLOCK_Q * 128 >> 4  # 16-byte units: one column atom of Q, of K / V, 16 rows of an atom
    KV_ATOM16 = BLOCK_K * 128 >> 4
    ROWS16_16 = 16 * 128 >> 4
    WG_ROWS16 = 64 * 128 >> 4  # a warpgroup's 64 rows of a Q atom
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    cp_commit, cp_wait = ptx.cp_async_commit, ptx.cp_async_wait
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    _, _, q_plan, load_q = tile_copies(HEAD_DIM, THREADS, bool(partial_chunk), BLOCK_Q)
    _, _, kv_plan, load_kv = tile_copies(HEAD_DIM, THREADS, bool(partial_chunk), BLOCK_K)
    mask_tile = fragment_mask(mask_kind(CAUSAL), BLOCK_K, 1)
    window_range, window_edge, _ = window_rules(BLOCK_K, 16)
    window_tile = fragment_window(BLOCK_K, 1)
    mod_tile = fragment_mods(mods, BLOCK_K, 1)
    user_tile = fragment_user_mods(mods, BLOCK_K, 1)
    _, _, quad_row_sum, softmax_step = fragment_softmax(S_TILES, O_TILES, 1)

    @inline_device
    def product_s(smem, s, q16, k16):
        """s = Q_wg K_jᵀ (both K-major: rows of the head dim), one commit group, waited for."""
        fence()
        for kk in range(QK_STEPS):
            a = K_MAJOR + q16 + (kk >> 2) * Q_ATOM16 + (kk & 3) * 2
            b = K_MAJOR + k16 + (kk >> 2) * KV_ATOM16 + (kk & 3) * 2
            mma_s(smem, s, a, b, 1 if kk > 0 else 0)
        commit()
        wait0()
        hold_s(s)

    @inline_device
    def product_o(smem, acc, s, v16):
        """acc += P V_j: P re-packed from s (k-step kk from n-tiles 2kk, 2kk + 1), every A word before the fence
        (an A register written after wgmma.fence is undefined); waited for."""
        a_p = cuda.local.array((PV_STEPS, 4), uint32)
        for kk in range(PV_STEPS):
            nt = 2 * kk
            a_p[kk, 0] = pack(s[nt, 0], s[nt, 1])
            a_p[kk, 1] = pack(s[nt, 2], s[nt, 3])
            a_p[kk, 2] = pack(s[nt + 1, 0], s[nt + 1, 1])
            a_p[kk, 3] = pack(s[nt + 1, 2], s[nt + 1, 3])
        fence()
        for kk in range(PV_STEPS):
            mma_o(smem, acc, a_p[kk, 0], a_p[kk, 1], a_p[kk, 2], a_p[kk, 3], V_MN + v16 + kk * ROWS16_16, 1)
        commit()
        wait0()
        hold_o(acc)

    @inline_device
    def forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, alibi, inv_scale,
                     q_base=0, k_base=0, aux=()):
        smem = cuda.shared.array(0, uint16, alignment=WGMMA_ALIGN)  # atoms: 1024-byte aligned
        tid = cuda.threadIdx.x
        warp = tid >> 5
        wg = warp >> 2
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        if GRID_BH_X:
            q_tile = cuda.gridDim.y - 1 - cuda.blockIdx.y
            bh = cuda.blockIdx.x
        else:
            q_tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
            bh = cuda.blockIdx.y
        n_heads = q.shape[1]
        b = bh // n_heads
        h = bh - b * n_heads
        h_kv = h // group
        q0 = q_tile * BLOCK_Q
        row_w = q0 + 16 * warp  # this warp's first query row
        shift = n_k - n_q
        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        if RANGE_CAUSAL:
            visible = min(q0 + BLOCK_Q, n_q) + shift
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_K - 1) // BLOCK_K)
        j_first = 0
        if BLOCK_SPARSE:  # n_tiles counts list entries, not key tiles
            kv_counts, kv_entries = lists(aux)
            n_tiles = list_length(kv_counts, b, h, q_tile)
        if RANGE_WINDOW:
            j_first, n_tiles = window_range(q0, min(q0 + BLOCK_Q, n_q), n_k, shift, left, right)
        slope = ZERO
        if ALIBI:
            slope = head_slope(alibi, b, h, inv_scale)
        scale = ZERO
        if USER:  # a score mod sees the scaled logit scale·s
            scale = float32(1.0) / inv_scale

        base16 = int64(ptx.shared_base(smem) >> 4)  # descriptors are 64-bit (the simulator's arithmetic too)
        q16 = base16 + (2 * SQ >> 4) + wg * WG_ROWS16
        k_next, k_stride, col_bytes, kv_dst = kv_plan(k, b, h_kv, d)
        v_next, v_stride, _, _ = kv_plan(v, b, h_kv, d)
        k_next += (k_base + j_first * BLOCK_K) * k_stride
        v_next += (k_base + j_first * BLOCK_K) * v_stride
        k_step = BLOCK_K * k_stride
        v_step = BLOCK_K * v_stride
        j_load = j_first  # the first key tile
        if BLOCK_SPARSE:  # tile j's offset is k_tiles + j·k_step: the listed tiles are not consecutive
            k_tiles, v_tiles = k_next, v_next
            if n_tiles > 0:
                j_load = tile_of(entry(kv_entries, b, h, q_tile, 0))
                k_next = k_tiles + j_load * k_step
                v_next = v_tiles + j_load * v_step

        q_src, q_stride, _, q_dst = q_plan(q, b, h, d)
        load_q(smem, SQ, q, q_src + (q_base + q0) * q_stride, q_stride, col_bytes, q_dst, q0, n_q, Q_COPIES)
        if n_tiles > j_first:
            load_kv(smem, SK, k, k_next, k_stride, col_bytes, kv_dst, j_load * BLOCK_K, n_k, KV_COPIES)
            load_kv(smem, SV, v, v_next, v_stride, col_bytes, kv_dst, j_load * BLOCK_K, n_k, KV_COPIES)
            k_next += k_step
            v_next += v_step
        cp_commit()

        s = cuda.local.array((S_TILES, 4), float32)
        acc = cuda.local.array((O_TILES, 4), float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        for dt in range(O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO

        n_tiles = int32(n_tiles)
        last_tile = int32(n_tiles - 1)
        for it in range(int32(j_first), n_tiles):
            j = it  # the key tile (block_sparse: list entry it's)
            full = False
            if BLOCK_SPARSE:
                e = entry(kv_entries, b, h, q_tile, it)
                j = tile_of(e)
                full = is_full(e)
            k0 = int32(j * BLOCK_K)
            k1 = int32(k0 + BLOCK_K)
            kv_buf = int32(((it - j_first) & 1) * KV_WORDS)
            cp_wait(0)  # K_j, V_j (and Q) landed ...
            fence_async()  # ... visible to wgmma's reads ...
            cuda.syncthreads()  # ... for every thread; every warpgroup has retired tile j - 1's products
            if it < last_tile:
                k_load = k1
                if BLOCK_SPARSE:  # the next listed tile
                    j_next = tile_of(entry(kv_entries, b, h, q_tile, it + 1))
                    k_load = int32(j_next * BLOCK_K)
                    k_next = k_tiles + j_next * k_step
                    v_next = v_tiles + j_next * v_step
                load_kv(smem, SK + (kv_buf ^ KV_WORDS), k, k_next, k_stride, col_bytes, kv_dst, k_load, n_k, KV_COPIES)
                load_kv(smem, SV + (kv_buf ^ KV_WORDS), v, v_next, v_stride, col_bytes, kv_dst, k_load, n_k, KV_COPIES)
                k_next += k_step
                v_next += v_step
            cp_commit()

            product_s(smem, s, q16, base16 + ((SK + kv_buf) >> 3))
            if SCORE_MODS:
                mod_tile(s, k0, row_w, shift, g, t, cap_a, cap_b, slope)
            if USER:  # the user's score mod and mask: every tile (then the built-in mask below)
                if BLOCK_SPARSE:  # a FULL tile: no mask_mod call
                    user_tile(s, k0, row_w, n_q, n_k, b, h, scale, inv_scale, g, t, aux, not full)
                else:
                    user_tile(s, k0, row_w, n_q, n_k, b, h, scale, inv_scale, g, t, aux)
            if WINDOW:
                if window_edge(k0, k1, row_w, n_k, shift, left, right):
                    window_tile(s, k0, row_w, n_k, shift, left, right, g, t)
            else:
                needs_mask = k1 > n_k
                if CAUSAL:
                    needs_mask = needs_mask or (k1 - 1 > row_w + shift)
                if needs_mask:
                    mask_tile(s, k0, row_w, n_k, shift, g, t)
            m_nw = cuda.local.array(2, float32)
            softmax_step(s, acc, m_i, l_i, m_nw, scale_log2)
            product_o(smem, acc, s, base16 + ((SV + kv_buf) >> 3))

        cp_wait(0)  # nothing in flight at exit
        for mr in range(2):
            l_row = quad_row_sum(l_i, mr)
            row = row_w + 8 * mr + g
            inv_l = float32(1.0) / l_row if l_row != ZERO else ZERO
            if row < n_q:
                if t == 0:
                    lse[b, h, q_base + row] = row_lse(m_i[mr], l_row) if l_row != ZERO else NEG_INF
                for dt in range(O_TILES):
                    col = dt * 8 + 2 * t
                    bits = pack(acc[dt, 2 * mr] * inv_l, acc[dt, 2 * mr + 1] * inv_l)
                    if col < d:
                        out[b, h, q_base + row, col] = uint16(bits & 0xFFFF)
                    if col + 1 < d:
                        out[b, h, q_base + row, col + 1] = uint16(bits >> 16)

    return forward_entry(forward_body, globals(), "wgmma_forward", mods.any, varlen=varlen, block_q=BLOCK_Q,
                         grid_bh_x=GRID_BH_X, user_aux=len(user_aux_types(mods)) if USER else -1)


@lru_cache(maxsize=None)
def build(tile: Tile, causal: bool, dtype: str, partial_chunk: bool = False, mods: Mods = NO_MODS,
          varlen: bool = False):
    """The compiled kernel for one specialisation (sm_90 only: wgmma is an sm_90a instruction)."""
    bad = problems(tile, dtype)
    if mods.dropout:  # the mma.sync forward has it (api dispatch sends dropout there)
        bad.append("dropout is not built into the wgmma forward (the mma.sync forward has it)")
    if bad:
        raise ValueError(f"wgmma forward ({tile}, {dtype}) cannot be built: {'; '.join(bad)}")
    key = ("wgmma_forward", tile, bool(causal), dtype, bool(partial_chunk), mods) + varlen_key(varlen)
    return compile_kernel(key, kernel_signature(mods, varlen),
                          kernel_source(tile, bool(causal), dtype, bool(partial_chunk), mods, varlen))


def launch(q, k, v, out, lse, tile: Tile, *, causal, softmax_scale, stream=0, layout_checked=False, mods=NO_MODS,
           window=(0, 0), softcap=0.0, alibi=None, varlen=None, aux=()):
    """Run the wgmma forward on device arrays; arguments as mma_forward.launch's (the layout its cp.async copies
    need, checked unless layout_checked). O is stored from the fragments (no shared-memory epilogue)."""
    B, H, n_q, d = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if varlen is not None:
        n_q, n_k = int(varlen[2]), int(varlen[3])
    if not layout_checked:
        check_layout(q, k, v, out, lse, d, tile.head_dim)
    if B * H * n_q == 0:
        return
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    words = [x if x.dtype == WORD else x.view(WORD) for x in (q, k, v, out)]
    dtype = "bfloat16" if q.dtype == WORD else "float16"
    grid, tile = forward_grid(tile, B * H, (n_q + tile.block_q - 1) // tile.block_q)
    args = (*words, lse, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))
    if mods.any:
        args += launch_args(window, softcap, softmax_scale, alibi, unused_slopes(lse)) + tuple(aux)
    extra = {}
    if varlen is not None:
        args += (varlen[0], varlen[1])
        extra["varlen"] = True
    launch_kernel(build(tile, bool(causal), dtype, d % 8 != 0, mods, **extra), grid, threads(tile), stream,
                  smem_bytes(tile), *args)
