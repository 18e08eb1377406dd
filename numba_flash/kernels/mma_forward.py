"""Tensor-core FlashAttention-2 forward (fp16 / bf16 in, fp32 accumulation) on mma.sync m16n8k16.

Maths: the online softmax of section 3.6.4 (blocks/softmax.py, lazy rescaling), per query row, for each K/V
tile j with scores s = q·kᵀ: M = max of the scaled scores, p = 2^(s·c − M), l_i += rowsum(p), acc += p·V_j,
then O = acc / l_i and L = (M + log2 l_i)·ln 2. M is kept in base-2 units of the scaled scores
(c = softmax_scale·log2(e)) while S stays raw, so each p is one FFMA and one ``ex2.approx`` (valid for
softmax_scale > 0).

Work split (FA2): one thread block of ``tile.warps`` warps per (Q tile, batch·head); warp w owns query rows
ROWS_W·w .. ROWS_W·w + ROWS_W − 1 of the tile (ROWS_W = 16·M_TILES, M_TILES 16-row m-tiles per warp), so each
row's softmax lives inside one warp and the only cross-thread reductions are over the 4 lanes of a quad
(shuffles). Per K/V tile and m-tile, each warp runs

    S (16 x BLOCK_K)  = Q_w (16 x HEAD_DIM) · K_jᵀ          HEAD_DIM/16 x BLOCK_K/8 mma
    O (16 x HEAD_DIM) += P (16 x BLOCK_K) · V_j             BLOCK_K/16 x HEAD_DIM/8 mma

with the m16n8k16 fragment layouts of numba_flash.ptx (g = lane >> 2, t = lane % 4); every K and V fragment
loaded by ldmatrix feeds the warp's M_TILES m-tiles:

* Q_w comes from shared memory by ldmatrix as A fragments ``q_frag[kk]``: at d <= 64 once, kept in
  registers; at d = 128 re-read per k-step of every tile (saves the 32 registers that made it spill).
* K_j rows are the B operand of S as stored (k-major per key): plain ldmatrix.
* S accumulators ``s[nt]`` hold S[g, 8nt+2t+{0,1}] and S[g+8, 8nt+2t+{0,1}]. Exactly these are
  the A operand of P·V for the k-step kk when taken from the n-tiles 2kk and 2kk+1, so P is only
  re-packed to f16x2/bf16x2 in registers, never written to shared memory.
* V_j is stored key-major, so its B fragments come from ldmatrix.trans.
* acc[dt] holds O[g, 8dt+2t+{0,1}], O[g+8, ...]: the same layout, so alpha scales registers 0,1
  by row g's factor and 2,3 by row g+8's.

Shared memory holds the Q tile and two (K, V) tile pairs as 16-bit words, rows of HEAD_DIM, with the
16-byte chunks of row r XOR-swizzled by r % 8: the 8 row addresses of each ldmatrix phase then fall in 8
different bank groups (no padding). Each lane keeps four byte addresses per tile (lane_rows) and every
ldmatrix adds a constant to one of them, which ptxas folds into the instruction. Tiles arrive by cp.async
(blocks/copies.py: 16 bytes per copy, a thread's offsets computed once; rows past the sequence and columns
past d are zero-filled by the ignore-src operand, or by src-size when d % 8 != 0). Pipeline: K and V are
double-buffered (Q | K0 | V0 | K1 | V1); at the top of tile j one barrier (K_j and V_j landed, every warp
left tile j-1) and K_{j+1}, V_{j+1} are issued into the other pair, a whole tile ahead.

Masking (blocks/mask.py): causal aligns to the bottom right (query i sees key j iff j <= i + Nk - Nq).
Tiles wholly above the diagonal are never loaded; only tiles that cross it or the end of the keys pay for
the mask. A row that sees no key gets O = 0 and L = -inf.

Flags a shipped tile sets (``tile.flags``):
grid_bh_x      the grid is (B·H, Q tiles) instead of (Q tiles, B·H), Q tiles reversed on y, so the heaviest
               causal tile of *every* head is dispatched before any lighter one; launch builds the grid.
smem_epilogue  O is normalised, packed and written by 32-bit shared stores into the warp's own rows of the
               Q tile (only that warp ever reads them), then copied out as 16-byte rows (ld.shared.v4 +
               st.global.v4, a row's chunks on consecutive lanes); launch drops it when out's rows are not
               16-byte aligned.
warp_skip      (causal) a warp computes only the tiles its own rows see; past them it only
               takes part in the barriers and copies (exact: there p would be 0 and alpha 1).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..launch import address, unused_slopes
from ..launch import launch as launch_kernel
from ..ptx import SMEM_ALIGN, inline_device
from ..tiles import Tile
from ..blocks.entry import forward_entry, forward_grid, forward_signature, varlen_key
from ..blocks.copies import check_layout, copy_threads, tile_copies
from ..blocks.mask import fragment_mask, fragment_window, mask_kind, window_rules
from ..blocks.mods import (NO_MODS, Mods, dropout_first, fragment_mods, fragment_user_mods, head_slope, launch_args,
                           list_first, user_aux_types)
from ..blocks.rng import fragment_dropout, words_of
from ..blocks.numerics import LOG2E
from ..blocks.softmax import fragment_softmax, row_lse
from ..blocks.sparsity import entry, is_full, list_length, lists_of, tile_of
from ..jit_cache import compile_kernel

DTYPES = ("float16", "bfloat16")  # bf16 arrays travel as uint16 bit patterns; f16 as float16
FLAGS = ("grid_bh_x", "smem_epilogue", "warp_skip")
STAGES = 2  # (K, V) buffers: every shipped tile double-buffers
WORD = np.dtype(np.uint16)  # bf16 arrays travel as uint16 bit patterns (which select the bf16 build)


def kernel_signature(mods: Mods = NO_MODS, varlen: bool = False):
    """blocks.entry.forward_signature: q, k, v, out as 16-bit words, lse float32; with mods the window, softcap and
    ALiBi arguments; varlen cu_seqlens_q, cu_seqlens_k last."""
    return forward_signature(mods.any, varlen, user_aux_types(mods))


def smem_bytes(tile: Tile) -> int:
    """The Q tile plus two (K, V) tile pairs, 16-bit words."""
    return 2 * tile.head_dim * (tile.block_q + 2 * tile.block_k * STAGES)


def threads(tile: Tile) -> int:
    return 32 * tile.warps


def m_tiles(tile: Tile) -> int:
    """16-row m-tiles per warp."""
    return tile.block_q // (16 * tile.warps) if tile.warps else 0


def problems(tile: Tile, dtype: str) -> list:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    bq, bk, hd, mt = tile.block_q, tile.block_k, tile.head_dim, m_tiles(tile)
    if not tile.warps or bq % (16 * tile.warps) or mt not in (1, 2) or tile.warps > 16:
        out.append(f"{tile.warps} warps for {bq} rows: 1 or 2 m-tiles of 16 rows per warp, 1..16 warps")
    if bk % 16 or bk < 16:
        out.append(f"block_k={bk}: a multiple of 16 (the k of m16n8k16 for P·V)")
    if hd % 64 or hd <= 0:
        out.append(f"head_dim={hd}: a multiple of 64 (the 8-chunk XOR swizzle)")
    if dtype not in DTYPES:
        out.append(f"dtype={dtype!r} not in {DTYPES}")
    if tile.stages != STAGES:
        out.append(f"stages={tile.stages}: K/V are double-buffered ({STAGES})")
    unknown = sorted(tile.flags - set(FLAGS))
    if unknown:
        out.append(f"flags {unknown}: not among {FLAGS}")
    copying = copy_threads(hd, threads(tile)) if hd % 64 == 0 and tile.warps else 0
    for name, rows in (("Q", bq), ("K/V", bk)):
        if not copying or (rows * hd // 8) % copying:
            out.append(f"{name} tile of {rows}x{hd} is not a whole number of 16-byte copies per copying thread")
    if smem_bytes(tile) > SMEM_PER_BLOCK_MAX:
        out.append(f"{smem_bytes(tile)} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def kernel_source(tile: Tile, causal: bool, dtype: str, partial_chunk: bool = False, mods: Mods = NO_MODS,
                  varlen: bool = False):
    """The Python kernel for one specialisation (before cuda.jit; compile tests use it).

    varlen: the packed-sequences entry (blocks.entry.varlen_entry): Q tiles past their sequence return at once.

    mods (blocks/mods.py): a window replaces the causal mask (causal=True with a window is its right = 0);
    softcap and ALiBi modify each score before the mask.

    partial_chunk (launch sets it when d % 8 != 0): copies name their source bytes (cp.async's src-size),
    so the 16-byte chunk holding column d - 1 is part data, part zeros; otherwise every chunk is all data
    or all zeros, and the copies use the ignore-src form, which ptxas issues without address arithmetic."""
    BLOCK_Q, BLOCK_K, HEAD_DIM, M_TILES = tile.block_q, tile.block_k, tile.head_dim, m_tiles(tile)
    WINDOW, SOFTCAP, ALIBI = bool(mods.window), bool(mods.softcap), bool(mods.alibi)
    SCORE_MODS = SOFTCAP or ALIBI
    USER = mods.user  # user mask / score mods (blocks/mods.py): every tile calls them
    CAUSAL = bool(causal) and not WINDOW
    # block_sparse (blocks/sparsity.py): the key tiles come from the BlockMask's lists, already intersected with
    # causal / window on the host, so the kernel computes no tile range of its own
    BLOCK_SPARSE = bool(mods.block_sparse)
    RANGE_CAUSAL, RANGE_WINDOW = CAUSAL and not BLOCK_SPARSE, WINDOW and not BLOCK_SPARSE
    lists = lists_of(list_first(mods))  # (counts, entries) from aux (block_sparse)
    DROPOUT = bool(mods.dropout)  # P's dropped entries zeroed before P·V (blocks/rng.py), O scaled at the end
    dropout_words = words_of(dropout_first(mods))
    GRID_BH_X, SMEM_EPILOGUE = tile.has("grid_bh_x"), tile.has("smem_epilogue")
    WARP_SKIP = tile.has("warp_skip") and CAUSAL
    Q_IN_REGS = HEAD_DIM <= 64  # d = 128 keeps Q in shared memory: its 32 registers would spill
    ROWS_W = 16 * M_TILES  # query rows per warp
    WARPS = BLOCK_Q // ROWS_W
    THREADS = 32 * WARPS
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks per row
    Q_COPIES = BLOCK_Q * CHUNKS // copy_threads(HEAD_DIM, THREADS)  # cp.async per copying thread per tile
    KV_COPIES = BLOCK_K * CHUNKS // copy_threads(HEAD_DIM, THREADS)
    QK_STEPS = HEAD_DIM // 16  # k-steps of S = Q Kᵀ
    S_TILES = BLOCK_K // 8  # n-tiles of S
    PV_STEPS = BLOCK_K // 16  # k-steps of O += P V
    O_TILES = HEAD_DIM // 8  # n-tiles of O
    Q_FRAGS = QK_STEPS if Q_IN_REGS else 1  # per m-tile
    MT_Q = 16 * HEAD_DIM  # shared offset between a warp's m-tiles of Q (16 rows: same row % 8)
    Q_SLOTS, S_ALL, O_ALL, ROWS_L = M_TILES * Q_FRAGS, M_TILES * S_TILES, M_TILES * O_TILES, 2 * M_TILES
    SQ, SK, SV = 0, BLOCK_Q * HEAD_DIM, (BLOCK_Q + BLOCK_K) * HEAD_DIM  # word offsets of the tiles in smem
    KV_WORDS = 2 * BLOCK_K * HEAD_DIM  # offset of the second (K, V) pair
    # O goes into Q's rows, which other threads' cp.async filled; without a prologue barrier only the
    # loop's barriers prove those copies landed, so a block with no K/V tile needs one of its own.
    EPI_SYNC = bool(SMEM_EPILOGUE and not Q_IN_REGS)
    O_STORES = ROWS_W * CHUNKS // 32  # smem_epilogue: 16-byte stores per lane (a warp's rows)
    mma = ptx.mma_m16n8k16_f16 if dtype == "float16" else ptx.mma_m16n8k16_bf16
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    cp_commit = ptx.cp_async_commit
    cp_wait = ptx.cp_async_wait
    st_shared_b32, ld_shared_v4, st_global_v4, syncwarp = ptx.st_shared_b32, ptx.ld_shared_v4, ptx.st_global_v4, ptx.syncwarp
    ldsm_t_at = ptx.ldmatrix_x4_trans_at
    ldsm_at = ptx.ldmatrix_x4_at
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    swizzle, _, copy_plan, load_tile_fast = tile_copies(HEAD_DIM, THREADS, bool(partial_chunk))
    mask_tile = fragment_mask(mask_kind(CAUSAL), BLOCK_K, M_TILES)
    window_range, window_edge, _ = window_rules(BLOCK_K, ROWS_W)
    window_tile = fragment_window(BLOCK_K, M_TILES)
    mod_tile = fragment_mods(mods, BLOCK_K, M_TILES)
    user_tile = fragment_user_mods(mods, BLOCK_K, M_TILES)
    drop_tile = fragment_dropout(S_TILES, M_TILES)
    _, _, quad_row_sum, softmax_step = fragment_softmax(S_TILES, O_TILES, M_TILES)

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
        """K or V rows row0.. into the tile at word tile0 (load_tile_fast); returns the offset
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
    def forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, alibi, inv_scale,
                     q_base=0, k_base=0, aux=()):
        # q_base, k_base: the first query and key row of the block's sequence (varlen; 0 in a dense batch)
        # One dynamic allocation, Q | K0 | V0 | K1 | V1 at word offsets (offsets, not slices: a slice of a
        # dynamic array is clamped to its run-time length); 128-row tiles at d = 128 need 64 KiB, over the
        # 48 KiB static limit.
        smem = cuda.shared.array(0, uint16, alignment=SMEM_ALIGN)  # ldmatrix / cp.async: 16 B
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2  # fragment row (and row + 8)
        t = lane & 3  # fragment column pair
        # Heaviest causal tiles first: they start while the light ones fill the tail.
        if GRID_BH_X:  # ... of all heads: B·H on x (dispatched fastest), Q tiles reversed on y
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
        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        if RANGE_CAUSAL:
            visible = min(q0 + BLOCK_Q, n_q) + shift  # keys the tile's last row can see
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_K - 1) // BLOCK_K)
        j_first = 0  # the window: tiles left of every row's window are never loaded
        if BLOCK_SPARSE:  # n_tiles counts list entries, not key tiles
            kv_counts, kv_entries = lists(aux)
            n_tiles = list_length(kv_counts, b, h, q_tile)
        if RANGE_WINDOW:
            j_first, n_tiles = window_range(q0, min(q0 + BLOCK_Q, n_q), n_k, shift, left, right)
        slope = ZERO
        if ALIBI:  # (Ba, H): Ba = 1 broadcasts over the batch
            slope = head_slope(alibi, b, h, inv_scale)
        scale = ZERO
        if USER:  # a score mod sees the scaled logit scale·s
            scale = float32(1.0) / inv_scale
        seed_lo, seed_hi, rng_offset, keep16, keep_scale = uint32(0), uint32(0), uint32(0), uint32(0), float32(1.0)
        if DROPOUT:
            seed_lo, seed_hi, rng_offset, keep16, keep_scale = dropout_words(aux)

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
        # (as element offsets, ptxas rebuilt each of the 16 V addresses per tile)
        q_at = cuda.local.array(4, uint32)
        k_at = cuda.local.array(4, uint32)
        v_at = cuda.local.array(4, uint32)
        lane_rows(q_at, smem_b + 2 * SQ, q_row, q_chunk)
        lane_rows(k_at, smem_b + 2 * SK, k_row, k_chunk)
        lane_rows(v_at, smem_b + 2 * SV, v_row, v_chunk)  # d-tile pair dp is "k-step" dp of lane_rows
        # k_next, v_next: this thread's source offset in the next K (V) tile to copy, stepped by a
        # constant per copied tile (no row × stride multiply in the loop)
        k_next, k_stride, col_bytes, kv_dst = copy_plan(k, b, h_kv, d)
        v_next, v_stride, _, _ = copy_plan(v, b, h_kv, d)
        k_next += k_base * k_stride
        v_next += k_base * v_stride
        k_step = BLOCK_K * k_stride
        v_step = BLOCK_K * v_stride
        if RANGE_WINDOW:
            k_next += j_first * k_step
            v_next += j_first * v_step
        j_load = j_first  # the first key tile
        if BLOCK_SPARSE:  # tile j's offset is k_tiles + j·k_step: the listed tiles are not consecutive
            k_tiles, v_tiles = k_next, v_next
            if n_tiles > 0:
                j_load = tile_of(entry(kv_entries, b, h, q_tile, 0))
                k_next = k_tiles + j_load * k_step
                v_next = v_tiles + j_load * v_step

        # Prologue: Q, K_0 and V_0 as one group.
        q_src, q_stride, _, q_dst = copy_plan(q, b, h, d)
        load_tile_fast(smem, SQ, q, q_src + (q_base + q0) * q_stride, q_stride, col_bytes, q_dst, q0, n_q, Q_COPIES)
        if n_tiles > j_first:
            k_next = copy_next(smem, SK, k, k_next, k_stride, k_step, col_bytes, kv_dst, j_load * BLOCK_K, n_k)
            v_next = copy_next(smem, SV, v, v_next, v_stride, v_step, col_bytes, kv_dst, j_load * BLOCK_K, n_k)
        cp_commit()
        if Q_IN_REGS:  # Q's fragments are loaded before the loop
            cp_wait(0)
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
        n_tiles_w = n_tiles  # tiles this warp computes (warp_skip: those its rows see)
        if WARP_SKIP:
            seen_w = q0 + warp * ROWS_W + ROWS_W + shift  # keys the warp's last row sees
            if BLOCK_SPARSE:  # compared with key tiles, not list entries
                n_tiles_w = int32((max(seen_w, 0) + BLOCK_K - 1) // BLOCK_K)
            else:
                n_tiles_w = int32(min(n_tiles, (max(seen_w, 0) + BLOCK_K - 1) // BLOCK_K))
        for it in range(int32(j_first), n_tiles):
            j = it  # the key tile (block_sparse: list entry it's)
            full = False
            if BLOCK_SPARSE:
                e = entry(kv_entries, b, h, q_tile, it)
                j = tile_of(e)
                full = is_full(e)
            k0 = int32(j * BLOCK_K)
            k1 = int32(k0 + BLOCK_K)  # the next tile's first key
            # one barrier: K_j, V_j landed and every warp left tile j-1's buffers
            kv_buf = int32(((it - j_first) & 1) * KV_WORDS)  # word offset of this tile's (K, V) pair
            cp_wait(0)
            cuda.syncthreads()
            if it < last_tile:  # K_{j+1}, V_{j+1} into the other pair, a whole tile ahead
                k_load = k1
                if BLOCK_SPARSE:  # the next listed tile
                    j_next = tile_of(entry(kv_entries, b, h, q_tile, it + 1))
                    k_load = int32(j_next * BLOCK_K)
                    k_next = k_tiles + j_next * k_step
                    v_next = v_tiles + j_next * v_step
                k_next = copy_next(smem, SK + (kv_buf ^ KV_WORDS), k, k_next, k_stride, k_step,
                                   col_bytes, kv_dst, k_load, n_k)
                v_next = copy_next(smem, SV + (kv_buf ^ KV_WORDS), v, v_next, v_stride, v_step,
                                   col_bytes, kv_dst, k_load, n_k)
            cp_commit()

            # warp_skip: a warp past its rows' tiles skips the maths (exact: p = 0, alpha = 1) but keeps the
            # loop, so every warp reaches the one bar.sync above from the same instruction (warp-uniform)
            if not WARP_SKIP or j < n_tiles_w:
                # S = Q K_jᵀ, one call per k-step (NVVM inlines each; kk becomes a constant: a rolled loop left
                # every ldmatrix address 64-bit arithmetic on a counter, and no load of step kk+1 under step kk's mma)
                for nt in range(M_TILES * S_TILES):
                    for r in range(4):
                        s[nt, r] = ZERO
                kv_bytes = 2 * kv_buf
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

                if SCORE_MODS:  # softcap, ALiBi: every score, before the mask
                    mod_tile(s, k0, q0 + warp * ROWS_W, shift, g, t, cap_a, cap_b, slope)
                if USER:  # the user's score mod and mask: every tile (then the built-in mask below)
                    if BLOCK_SPARSE:  # a FULL tile: no mask_mod call
                        user_tile(s, k0, q0 + warp * ROWS_W, n_q, n_k, b, h, scale, inv_scale, g, t, aux, not full)
                    else:
                        user_tile(s, k0, q0 + warp * ROWS_W, n_q, n_k, b, h, scale, inv_scale, g, t, aux)
                # Mask only tiles that cross the end of the keys, the diagonal or the window's edges (raw scores).
                if WINDOW:
                    if window_edge(k0, k1, q0 + warp * ROWS_W, n_k, shift, left, right):
                        window_tile(s, k0, q0 + warp * ROWS_W, n_k, shift, left, right, g, t)
                else:
                    needs_mask = k1 > n_k
                    if CAUSAL:
                        needs_mask = needs_mask or (k1 - 1 > q0 + warp * ROWS_W + shift)
                    if needs_mask:
                        mask_tile(s, k0, q0 + warp * ROWS_W, n_k, shift, g, t)

                # Online softmax on the fragments, M moved only past M + RESCALE_LOG2 (blocks/softmax.py).
                m_nw = cuda.local.array(ROWS_L, float32)
                softmax_step(s, acc, m_i, l_i, m_nw, scale_log2)
                if DROPOUT:  # after l_i summed the undropped P: L is the softmax's, O = dropped P·V / l_i
                    drop_tile(s, k0, q0 + warp * ROWS_W, g, t, bh, rng_offset, seed_lo, seed_hi, keep16)

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
                        b0, b1, b2, b3 = ldsm_t_at(smem, v_at[dp & 3] + kv_bytes + (dp >> 2) * 128
                                                   + kk * (32 * HEAD_DIM))
                        for mt in range(M_TILES):  # one V fragment, M_TILES m-tiles
                            a0, a1, a2, a3 = p_frag[mt, 0], p_frag[mt, 1], p_frag[mt, 2], p_frag[mt, 3]
                            dt = mt * O_TILES + 2 * dp
                            acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3] = mma(
                                a0, a1, a2, a3, b0, b1, acc[dt, 0], acc[dt, 1], acc[dt, 2], acc[dt, 3])
                            acc[dt + 1, 0], acc[dt + 1, 1], acc[dt + 1, 2], acc[dt + 1, 3] = mma(
                                a0, a1, a2, a3, b2, b3,
                                acc[dt + 1, 0], acc[dt + 1, 1], acc[dt + 1, 2], acc[dt + 1, 3])

        cp_wait(0)  # nothing may be in flight when the block exits (n_tiles == 0 path included)
        if EPI_SYNC:
            if n_tiles == j_first:  # (block-uniform)
                cuda.syncthreads()

        # Epilogue: the quad's partial row sums, O = acc / l_i, L = (m_i·scale_log2 + log2 l_i)·ln 2.
        for mr in range(2 * M_TILES):
            half = mr & 1
            a0_ = (mr >> 1) * O_TILES
            l_row = quad_row_sum(l_i, mr)
            row = q0 + warp * ROWS_W + 8 * mr + g
            inv_l = float32(1.0) / l_row if l_row != ZERO else ZERO  # a fully masked row: O = 0
            if DROPOUT:
                inv_l *= keep_scale
            if SMEM_EPILOGUE:
                if row < n_q and t == 0:
                    if l_row != ZERO:
                        lse[b, h, q_base + row] = row_lse(m_i[mr], l_row)
                    else:
                        lse[b, h, q_base + row] = NEG_INF
                if mr == 0:
                    syncwarp()  # every lane is past its last ldmatrix of these Q rows
                row_t = warp * ROWS_W + 8 * mr + g  # the warp's own rows of the Q tile
                for dt in range(O_TILES):  # conflict-free: chunk dt ^ g of row g, word t
                    bits = pack(acc[a0_ + dt, 2 * half] * inv_l, acc[a0_ + dt, 2 * half + 1] * inv_l)
                    st_shared_b32(smem, SQ + swizzle(row_t, dt) + 2 * t, bits)
            elif row < n_q:
                if t == 0:
                    if l_row != ZERO:
                        lse[b, h, q_base + row] = row_lse(m_i[mr], l_row)
                    else:
                        lse[b, h, q_base + row] = NEG_INF
                for dt in range(O_TILES):
                    col = dt * 8 + 2 * t
                    bits = pack(acc[a0_ + dt, 2 * half] * inv_l, acc[a0_ + dt, 2 * half + 1] * inv_l)
                    if col < d:
                        out[b, h, q_base + row, col] = uint16(bits & 0xFFFF)
                    if col + 1 < d:
                        out[b, h, q_base + row, col + 1] = uint16(bits >> 16)
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
                        st_global_v4(out, o_base + (q_base + row) * o_stride + col, w0, w1, w2, w3)
                    else:  # d not a multiple of 8: the chunk's first d - col elements one by one
                        for e in range(8):
                            if col + e < d:
                                out[b, h, q_base + row, col + e] = smem[src + e]

    return forward_entry(forward_body, globals(), "mma_forward", mods.any, varlen=varlen, block_q=BLOCK_Q,
                         grid_bh_x=GRID_BH_X, user_aux=len(user_aux_types(mods)) if mods.aux else -1)


@lru_cache(maxsize=None)
def build(tile: Tile, causal: bool, dtype: str, partial_chunk: bool = False, mods: Mods = NO_MODS,
          varlen: bool = False):
    """The compiled kernel for one specialisation; cached so each compiles once."""
    bad = problems(tile, dtype)
    if bad:
        raise ValueError(f"mma forward ({tile}, {dtype}) cannot be built: {'; '.join(bad)}")
    key = ("mma_forward", tile, bool(causal), dtype, bool(partial_chunk), mods) + varlen_key(varlen)
    return compile_kernel(key, kernel_signature(mods, varlen),
                          kernel_source(tile, bool(causal), dtype, bool(partial_chunk), mods, varlen))


def _words(x):
    """The array as 16-bit words (bf16 already arrives as uint16; f16 is reinterpreted)."""
    return x if x.dtype == WORD else x.view(WORD)


def launch(q, k, v, out, lse, tile: Tile, *, causal, softmax_scale, stream=0, layout_checked=False, mods=NO_MODS,
           window=(0, 0), softcap=0.0, alibi=None, varlen=None, aux=(), dropout=()):
    """Run the tensor-core forward on device arrays; the caller has validated the problem.

    q, out: (B, H, Nq, d) float16 (or uint16 holding bf16 bits, which selects the bf16 kernel);
    k, v: (B, Hkv, Nk, d), same dtype, H % Hkv == 0 (kv head of h is h // (H // Hkv));
    lse: (B, H, Nq) float32, receives the natural-log logsumexp of the scaled scores (-inf for a
    row that sees no key, whose O is 0). softmax_scale > 0 multiplies q·kᵀ (computed by the caller
    from the original head dim; positive because row maxima are taken on the raw scores). tile: the
    specialisation (configs.MMA_TABLE's); d <= tile.head_dim, the kernel zero-pads. Strides are arbitrary
    except: last dim unit stride, every other stride a multiple of 8 elements and the base 16-byte aligned
    (cp.async copies 16 aligned bytes). smem_epilogue quietly falls back to the fragment stores when out's
    rows are not 16-byte aligned. layout_checked=True skips the stride and alignment checks for a caller
    that has made them (numba_flash.forward: they are per-call host time).
    mods (blocks/mods.py) with their values: window (left, right) as blocks/mask.window_bounds gives them,
    softcap > 0, alibi a float32 (Ba, H) device array of slopes (Ba = 1 or B).
    varlen: None, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed sequences: q, k, v,
    out, lse are then views of the packed arrays with a batch stride of 0 (B = the number of sequences,
    Nq / Nk = the packed totals), and the grid covers max_seqlen_q rows of every sequence.
    dropout: with mods.dropout, (seed_lo, seed_hi, offset, keep16) (blocks/rng.py), after aux.
    """
    B, H, n_q, d = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if varlen is not None:
        n_q, n_k = int(varlen[2]), int(varlen[3])
    dtype = "bfloat16" if q.dtype == WORD else "float16"
    if not layout_checked:  # numba_flash.forward has checked strides and alignment already
        check_layout(q, k, v, out, lse, d, tile.head_dim)
    if B * H * n_q == 0:
        return
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    grid, tile = forward_grid(tile, B * H, (n_q + tile.block_q - 1) // tile.block_q)
    if tile.has("smem_epilogue") and (address(out) % 16 or any(s % 16 for s in out.strides[:-1])):
        tile = tile.with_(flags=tile.flags - {"smem_epilogue"})  # 16-byte stores need 16-byte aligned rows
    args = (_words(q), _words(k), _words(v), _words(out), lse, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))
    if mods.any:
        args += launch_args(window, softcap, softmax_scale, alibi, unused_slopes(lse)) + tuple(aux) + tuple(dropout)
    extra = {}
    if varlen is not None:
        args += (varlen[0], varlen[1])
        extra["varlen"] = True  # passed only when on: the dense builds keep their cache key
    launch_kernel(build(tile, bool(causal), dtype, d % 8 != 0, mods, **extra), grid, threads(tile), stream,
                  smem_bytes(tile), *args)
