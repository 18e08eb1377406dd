"""Warp-specialised forward on sm_90: TMA loads by a producer warp into an mbarrier ring, wgmma products by
consumer warpgroups (FA3's structure, hopper/ of flash-attention). fp16 / bf16 in, fp32 accumulation.

The maths and the fragments are wgmma_forward's (read its docstring first): per K/V tile j, per consumer
warpgroup of 64 query rows,

    S (64 x BLOCK_K)   = Q_wg · K_jᵀ      wgmma m64n{BLOCK_K}k16, Q and K from shared memory
    O (64 x HEAD_DIM) += P · V_j          wgmma m64n{HEAD_DIM}k16, P from registers

with the online softmax of blocks/softmax.py and the masks of blocks/mask.py on the accumulator fragments.

What changes is who loads. The block is warpgroup 0, the producer, and CONSUMERS warpgroups of 64 rows
(block_q = 64 · CONSUMERS, warps = 4 · (CONSUMERS + 1)). One thread of the producer issues every copy, by TMA
(ptx/tma.py: cp.async.bulk.tensor, one box per 64-column atom, landing in the 128-byte swizzle wgmma reads;
blocks/tensor_maps.py encodes the maps): Q once, then K_j and V_j into slot j % STAGES of a ring. Each slot has
four mbarriers: K full and V full (the copies' bytes complete them: expect_tx by the producer), K empty and V
empty (one arrival per consumer warp once its product reading that tile retired). The producer waits for a
tile's "empty" before it refills it, the consumers wait for "K full" before Q·Kᵀ and for "V full" before P·V, so
the loads run STAGES - 1 tiles ahead with no block-wide barrier after the set-up. Rows past n_q and keys past n_k arrive as
zeros (the map's bounds), the masks hide those keys.

Flags (``tile.flags``):
    grid_bh_x    as mma_forward's (the heaviest causal Q tiles of every head first)
    setmaxnreg   the producer warpgroup gives registers back (setmaxnreg.dec to PRODUCER_REGS) and the
                 consumers take them (setmaxnreg.inc to CONSUMER_REGS); the build's cap is the block's share
    pingpong     the consumers issue their products in turn (named barriers 1 and 2: Q·Kᵀ, and with overlap
                 P·V of the tile before): one warpgroup's softmax then runs while the other's products occupy
                 the tensor cores (FA3's warp scheduler barriers)
    overlap      FA3's intra-warpgroup pipelining: Q·K_jᵀ is issued with P_{j-1}·V_{j-1} behind it, tile j's mask
                 and softmax run while that product is in flight, and O's rescale waits for it to retire
                 (blocks.softmax.fragment_softmax_deferred); with two consumers it needs setmaxnreg
    persistent   one block per SM (the grid: min(work items, n_sm)) walks work items w = blockIdx.x, + gridDim.x,
                 .. in grid_bh_x's order (the heaviest causal Q tiles of every head first); the ring's steps count
                 on across items, so the producer loads the next item's first K/V tiles while the consumers
                 finish the last one, and its Q once they release the Q tile (a "Q empty" mbarrier, after O's
                 store has read it)
    tma_store    O leaves through shared memory (each warpgroup's rows of the Q tile, after its last Q·Kᵀ) by
                 a TMA store; without it every lane stores its fragments directly
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, int64, types, uint16, uint32

from .. import ptx
from ..configs import SMEM_PER_BLOCK_MAX
from ..jit_cache import compile_kernel
from ..launch import DeviceView, unused_slopes
from ..launch import launch as launch_kernel
from ..ptx import WGMMA_ALIGN, inline_device, tma
from ..ptx.warpgroup import wgmma_hold_a
from ..tiles import Tile
from ..blocks.copies import atom_offset
from ..blocks.entry import MOD_ARGS, VARLEN_ARGS, forward_grid, maps_entry, varlen_key
from ..blocks.mask import fragment_mask, fragment_window, mask_kind, window_rules
from ..blocks.mods import NO_MODS, Mods, fragment_mods, fragment_user_mods, head_slope, launch_args, user_aux_types
from ..blocks.numerics import LOG2E
from ..blocks.softmax import fragment_softmax, fragment_softmax_deferred, row_lse
from ..blocks.sparsity import entry, is_full, list_length, lists_of, tile_of
from ..blocks.tensor_maps import device_maps, maps_view

DTYPES = ("float16", "bfloat16")
FLAGS = ("grid_bh_x", "setmaxnreg", "pingpong", "tma_store", "overlap", "persistent", "ws")  # "ws": the family's mark (dispatch)
STAGES = (2, 3, 4)
HEAD_DIMS = (64, 128, 192, 256)
WORD = np.dtype(np.uint16)  # bf16 arrays travel as uint16 bit patterns (which select the bf16 build)
PRODUCER_REGS, CONSUMER_REGS = 24, 240  # setmaxnreg: 24 + 2 x 240 <= 512 a thread of each warpgroup's lanes
REGS_PER_SM = 65536
BAR_BYTES = 8
MAPS = ("q", "k", "v", "o")  # map i at byte i * TMAP_BYTES of the kernel's maps array


def kernel_signature(mods: Mods = NO_MODS, varlen: bool = False):
    """(maps, out, lse, n_heads, n_q, n_k, d, group, scale_log2): the tensor maps (uint8, MAPS order), O as
    16-bit words, L float32; with mods blocks.entry.MOD_ARGS, then the user mods' aux arrays and a BlockMask's
    lists (blocks.mods.user_aux_types); varlen: cu_seqlens_q and cu_seqlens_k last (blocks.entry.VARLEN_ARGS)."""
    tail = (MOD_ARGS + user_aux_types(mods)) if mods.any else ()
    tail += VARLEN_ARGS if varlen else ()
    return types.void(types.Array(types.uint8, 1, "A"), types.Array(types.uint16, 4, "A"),
                      types.Array(types.float32, 3, "A"), int32, int32, int32, int32, int32, float32, *tail)


def consumers(tile: Tile) -> int:
    return tile.warps // 4 - 1


def threads(tile: Tile) -> int:
    return 32 * tile.warps


def max_registers(tile: Tile) -> int:
    """The build's register cap: the block's share of the register file (whole multiples of 8), at most 255."""
    return min(255, REGS_PER_SM // threads(tile) // 8 * 8)


def smem_bytes(tile: Tile) -> int:
    """The Q tile, STAGES (K, V) slots (16-bit words, 1024-byte multiples), then the mbarriers (Q full; K full,
    V full, K empty, V empty of each slot; Q empty)."""
    words = tile.head_dim * (tile.block_q + 2 * tile.stages * tile.block_k)
    return 2 * words + BAR_BYTES * (2 + 4 * tile.stages)


def problems(tile: Tile, dtype: str, varlen: bool = False) -> list:
    """Why a specialisation cannot be built (empty when it can)."""
    out = []
    bq, bk, hd = tile.block_q, tile.block_k, tile.head_dim
    if tile.warps not in (8, 12) or bq != 64 * consumers(tile):
        out.append(f"{tile.warps} warps for {bq} rows: a producer warpgroup and one or two consumer warpgroups of "
                   "64 rows (warps 8 or 12, block_q = 64 x consumers)")
    if bk % 16 or not 16 <= bk <= 256:
        out.append(f"block_k={bk}: a multiple of 16 (P·V's k) up to 256 (wgmma's n, a TMA box's rows)")
    if hd not in HEAD_DIMS:
        out.append(f"head_dim={hd}: one of {HEAD_DIMS} (whole 64-column atoms; wgmma's n <= 256)")
    if dtype not in DTYPES:
        out.append(f"dtype={dtype!r} not in {DTYPES}")
    if tile.stages not in STAGES:
        out.append(f"stages={tile.stages}: the ring has {STAGES} slots")
    unknown = sorted(tile.flags - set(FLAGS))
    if unknown:
        out.append(f"flags {unknown}: not among {FLAGS}")
    if tile.has("persistent") and tile.has("grid_bh_x"):
        out.append("persistent with grid_bh_x: a persistent grid walks its own heaviest-first order")
    if varlen and tile.has("persistent"):
        out.append("persistent with varlen: a persistent grid walks the work items of one dense batch")
    if varlen and tile.has("tma_store"):
        out.append("tma_store with varlen: a Q tile's box runs past its sequence into the next one's rows (the "
                   "fragment stores stop at the sequence's end; launch drops the flag)")
    if tile.has("setmaxnreg") and tile.warps != 12:
        out.append("setmaxnreg: built for two consumer warpgroups (warps=12)")
    if tile.has("pingpong") and tile.warps != 12:
        out.append("pingpong: needs two consumer warpgroups (warps=12)")
    if tile.has("overlap") and tile.warps == 12 and not tile.has("setmaxnreg"):
        out.append(f"overlap with two consumer warpgroups needs setmaxnreg (S, P and O at {max_registers(tile)} "
                   "registers a thread spill)")
    if hd >= 192 and tile.warps == 12 and not tile.has("setmaxnreg"):
        out.append(f"head_dim={hd} with two consumer warpgroups needs setmaxnreg (at {max_registers(tile)} registers a "
                   "thread the O accumulators spill)")
    if smem_bytes(tile) > SMEM_PER_BLOCK_MAX:
        out.append(f"{smem_bytes(tile)} B of shared memory > {SMEM_PER_BLOCK_MAX}")
    return out


def kernel_source(tile: Tile, causal: bool, dtype: str, mods: Mods = NO_MODS, varlen: bool = False):
    """The Python kernel for one specialisation (before cuda.jit). mods: a window, softcap, ALiBi, user mask /
    score mods, or a BlockMask's key-tile lists (blocks/mods.py, blocks/sparsity.py) on the S fragments, as
    wgmma_forward applies them; the producer and the consumers walk the same key tiles (the window's range, or
    the lists) so the ring stays in step.

    varlen: packed sequences (blocks.entry.maps_entry's varlen form). The maps are over the packed arrays as one
    batch, so a block loads its sequence's rows at q_base + row and keys at k_base + key (batch coordinate 0);
    the boxes of a sequence's last Q and K/V tiles run on into the next sequence's rows (past the pack: zeros).
    Those keys are masked like keys past n_k (their scores become -inf whatever K held), those rows are never
    stored, and each consumer warpgroup zeroes the V rows past n_k of the tile that crosses it (the walk's last)
    before its P·V (``clear_past_keys``): P = 0 times a NaN or inf of the next sequence would be NaN, and no other
    sequence may reach this one's O."""
    BLOCK_Q, BLOCK_K, HEAD_DIM, STAGES_ = tile.block_q, tile.block_k, tile.head_dim, tile.stages
    WINDOW, SOFTCAP, ALIBI = bool(mods.window), bool(mods.softcap), bool(mods.alibi)
    SCORE_MODS = SOFTCAP or ALIBI
    USER = mods.user
    CAUSAL = bool(causal) and not WINDOW
    BLOCK_SPARSE = bool(mods.block_sparse)
    RANGE_CAUSAL, RANGE_WINDOW = CAUSAL and not BLOCK_SPARSE, WINDOW and not BLOCK_SPARSE
    lists = lists_of(len(user_aux_types(mods)) - 2)  # (counts, entries) from aux (block_sparse)
    GRID_BH_X = tile.has("grid_bh_x")
    SETMAXNREG, PINGPONG, TMA_STORE = tile.has("setmaxnreg"), tile.has("pingpong"), tile.has("tma_store")
    OVERLAP = tile.has("overlap")
    PERSISTENT = tile.has("persistent")
    VARLEN = bool(varlen)
    CONSUMERS = consumers(tile)
    CONSUMER_WARPS = 4 * CONSUMERS
    ATOMS = HEAD_DIM // 64  # 64-column atoms of a row: one TMA box each
    S_TILES = BLOCK_K // 8  # n-tiles of S per warp
    PV_STEPS = BLOCK_K // 16  # k-steps of O += P V
    QK_STEPS = HEAD_DIM // 16  # k-steps of S = Q Kᵀ
    O_TILES = HEAD_DIM // 8  # n-tiles of O per warp
    KV_WORDS = BLOCK_K * HEAD_DIM  # one K or V slot
    SQ, SK = 0, BLOCK_Q * HEAD_DIM  # word offsets: Q | K slots | V slots | barriers
    SV = SK + STAGES_ * KV_WORDS
    BAR = SV + STAGES_ * KV_WORDS  # mbarriers, 4 words each: Q full, K full[s], V full[s], K empty[s], V empty[s]
    Q_FULL = BAR
    K_FULL, V_FULL = BAR + 4, BAR + 4 * (1 + STAGES_)
    K_EMPTY, V_EMPTY = BAR + 4 * (1 + 2 * STAGES_), BAR + 4 * (1 + 3 * STAGES_)
    Q_EMPTY = BAR + 4 * (1 + 4 * STAGES_)  # persistent: the consumers are done with the Q tile (O's store too)
    Q_BYTES = 2 * BLOCK_Q * HEAD_DIM
    KV_BYTES = 2 * KV_WORDS
    Q_ATOM, KV_ATOM = BLOCK_Q * 64, BLOCK_K * 64  # words of one column atom
    TMAP = tma.TMAP_BYTES
    MAP_Q, MAP_K, MAP_V, MAP_O = 0, TMAP, 2 * TMAP, 3 * TMAP
    load = tma.tma_load(4)
    store = tma.tma_store(4)
    bulk_commit, bulk_wait = tma.bulk_commit, tma.bulk_wait_read(0)
    arrive = tma.mbarrier_arrive
    try_wait = ptx.mbarrier_try_wait_parity
    expect_tx = ptx.mbarrier_arrive_expect_tx
    mma_s = ptx.wgmma(BLOCK_K, dtype)
    mma_o = ptx.wgmma(HEAD_DIM, dtype, trans_b=True, a_regs=True)
    hold_s, hold_o = ptx.wgmma_hold(BLOCK_K), ptx.wgmma_hold(HEAD_DIM)
    hold_a = wgmma_hold_a(4 * PV_STEPS)
    wait0, wait1 = ptx.wgmma_wait(0), ptx.wgmma_wait(1)
    fence, commit, fence_async = ptx.wgmma_fence, ptx.wgmma_commit, ptx.fence_proxy_async
    K_MAJOR = ptx.wgmma_desc_bits(16)  # Q, K: the reduction (head dim) along the rows; LBO unused
    V_MN = ptx.wgmma_desc_bits(BLOCK_K * 128)  # V: the reduction (keys) down the rows; LBO = one atom
    Q_ATOM16 = BLOCK_Q * 128 >> 4  # 16-byte units: one column atom of Q, of K / V, 16 rows of an atom
    KV_ATOM16 = BLOCK_K * 128 >> 4
    ROWS16_16 = 16 * 128 >> 4
    WG_ROWS16 = 64 * 128 >> 4  # a warpgroup's 64 rows of a Q atom
    regs_down, regs_up = tma.setmaxnreg(PRODUCER_REGS, False), tma.setmaxnreg(CONSUMER_REGS, True)
    # barrier 1 + c: consumer c's turn to issue Q·Kᵀ (c's 128 threads wait, the other's 128 arrive)
    turn_sync0, turn_sync1 = tma.named_barrier_sync(1, 256), tma.named_barrier_sync(2, 256)
    turn_arrive0, turn_arrive1 = tma.named_barrier_arrive(1, 256), tma.named_barrier_arrive(2, 256)
    # barrier 3 + c: consumer c's O tile is in shared memory
    o_ready0, o_ready1 = tma.named_barrier_sync(3, 128), tma.named_barrier_sync(4, 128)
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    mask_tile = fragment_mask(mask_kind(CAUSAL), BLOCK_K, 1)
    window_range, window_edge, _ = window_rules(BLOCK_K, 16)
    window_tile = fragment_window(BLOCK_K, 1)
    mod_tile = fragment_mods(mods, BLOCK_K, 1)
    user_tile = fragment_user_mods(mods, BLOCK_K, 1)
    _, _, quad_row_sum, softmax_step = fragment_softmax(S_TILES, O_TILES, 1)
    deferred_step, deferred_rescale = fragment_softmax_deferred(S_TILES, O_TILES, 1)

    @inline_device
    def wait_phase(smem, bar, parity):
        while try_wait(smem, bar, parity) == 0:
            pass

    @inline_device
    def kv_walk(b, h, q0, q_tile, n_q, n_k, shift, left, right, aux):
        """(j_first, n_iter): the first key tile and how many tiles the block walks (the producer's loads and
        each consumer's products, in the same order)."""
        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        j_first = 0
        if RANGE_CAUSAL:
            visible = min(q0 + BLOCK_Q, n_q) + shift
            n_tiles = min(n_tiles, (max(visible, 0) + BLOCK_K - 1) // BLOCK_K)
        if BLOCK_SPARSE:  # list entries, not key tiles
            kv_counts, _ = lists(aux)
            n_tiles = list_length(kv_counts, b, h, q_tile)
        if RANGE_WINDOW:
            j_first, n_tiles = window_range(q0, min(q0 + BLOCK_Q, n_q), n_k, shift, left, right)
        return int32(j_first), int32(max(n_tiles - j_first, 0))

    @inline_device
    def key_tile(r, j_first, b, h, q_tile, aux):
        """(key tile, FULL) of the block's r-th step: j_first + r, or the r-th listed tile of a BlockMask."""
        if BLOCK_SPARSE:
            _, kv_entries = lists(aux)
            e = entry(kv_entries, b, h, q_tile, r)
            return tile_of(e), is_full(e)
        return int32(j_first + r), False

    @inline_device
    def scores(s, j, full, row_w, n_q, n_k, shift, b, h, g, t, left, right, cap_a, cap_b, slope, scale, inv_scale,
               aux):
        """Tile j's mods and masks on S (wgmma_forward's order): softcap / ALiBi, the user's score mod and mask,
        then the window, or causal and the sequence end, where the tile crosses them."""
        k0 = int32(j * BLOCK_K)
        k1 = int32(k0 + BLOCK_K)
        if SCORE_MODS:
            mod_tile(s, k0, row_w, shift, g, t, cap_a, cap_b, slope)
        if USER:
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

    @inline_device
    def product_s(smem, s, q16, k16):
        """s = Q_wg K_jᵀ (both K-major: rows of the head dim), one commit group, not waited for."""
        fence()
        for kk in range(QK_STEPS):
            a = K_MAJOR + q16 + (kk >> 2) * Q_ATOM16 + (kk & 3) * 2
            b = K_MAJOR + k16 + (kk >> 2) * KV_ATOM16 + (kk & 3) * 2
            mma_s(smem, s, a, b, 1 if kk > 0 else 0)
        commit()

    @inline_device
    def pack_p(a_p, s):
        """P (in s) as the A fragments of P·V's k-steps: k-step kk from n-tiles 2kk, 2kk + 1."""
        for kk in range(PV_STEPS):
            nt = 2 * kk
            a_p[kk, 0] = pack(s[nt, 0], s[nt, 1])
            a_p[kk, 1] = pack(s[nt, 2], s[nt, 3])
            a_p[kk, 2] = pack(s[nt + 1, 0], s[nt + 1, 1])
            a_p[kk, 3] = pack(s[nt + 1, 2], s[nt + 1, 3])
        hold_a(a_p)

    @inline_device
    def issue_o(smem, acc, a_p, v16):
        """acc += P V from the packed a_p, one commit group, not waited for (a_p and acc are the product's until
        it retires)."""
        fence()
        for kk in range(PV_STEPS):
            mma_o(smem, acc, a_p[kk, 0], a_p[kk, 1], a_p[kk, 2], a_p[kk, 3], V_MN + v16 + kk * ROWS16_16, 1)
        commit()

    @inline_device
    def product_o(smem, acc, s, v16):
        """acc += P V_j: P re-packed from s, every A word before the fence; waited for."""
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
    def overlap_step(smem, s, acc, a_p, m_i, l_i, alpha, R, j, full, FIRST, c, q16, base16, row_w, n_q, n_k, shift,
                     b, h, g, t, lane, scale_log2, left, right, cap_a, cap_b, slope, scale, inv_scale, aux):
        """Ring step R (key tile j) of the overlap schedule: issue S_j and (unless FIRST, a work item's first step)
        the previous step's P·V, then tile j's mods, masks and softmax under the product, O's deferred rescale, and
        P_j packed for the next."""
        slot = R % STAGES_
        prev = (R - 1) % STAGES_
        wait_phase(smem, K_FULL + 4 * slot, (R // STAGES_) & 1)
        if PINGPONG:
            if c == 0:
                turn_sync0()
            else:
                turn_sync1()
        product_s(smem, s, q16, base16 + ((SK + slot * KV_WORDS) >> 3))
        if not FIRST:
            wait_phase(smem, V_FULL + 4 * prev, ((R - 1) // STAGES_) & 1)
            issue_o(smem, acc, a_p, base16 + ((SV + prev * KV_WORDS) >> 3))
        if PINGPONG:
            if c == 0:
                turn_arrive1()
            else:
                turn_arrive0()
        if FIRST:
            wait0()
        else:
            wait1()
        hold_s(s)
        if lane == 0:  # this warp's Q·K_jᵀ retired: one of CONSUMER_WARPS arrivals
            arrive(smem, K_EMPTY + 4 * slot)
        scores(s, j, full, row_w, n_q, n_k, shift, b, h, g, t, left, right, cap_a, cap_b, slope, scale, inv_scale,
               aux)
        moved = deferred_step(s, m_i, l_i, alpha, scale_log2)
        if not FIRST:
            wait0()
            hold_o(acc)
            if lane == 0:
                arrive(smem, V_EMPTY + 4 * prev)
        if moved:
            deferred_rescale(acc, alpha)
        hold_o(acc)  # the rescaled accumulators defined here, above the next products' fence
        pack_p(a_p, s)

    @inline_device
    def clear_past_keys(smem, slot, j, n_k, c, warp_c, lane):
        """varlen: the V rows past n_k of tile j in slot (the next sequence's keys) set to zero by this consumer
        warpgroup before its P·V reads them (the whole 128-byte rows of every atom: the swizzle only permutes
        chunks within a row); the other warpgroup writes the same zeros. Generic-proxy stores, then
        fence.proxy.async and the warpgroup's named barrier, so its wgmma (the async proxy) sees them."""
        valid = n_k - j * BLOCK_K
        if valid < BLOCK_K:  # uniform over the warpgroup: every thread takes the barrier
            first = max(valid, 0)
            per_row = ATOMS * 32  # 32-bit words of a row over the atoms
            base = SV + slot * KV_WORDS
            for i in range(32 * (warp_c & 3) + lane, (BLOCK_K - first) * per_row, 128):
                r = first + i // per_row
                rest = i - (r - first) * per_row
                a = rest // 32
                ptx.st_shared_b32(smem, base + a * KV_ATOM + r * 64 + 2 * (rest - 32 * a), uint32(0))
            fence_async()
            if c == 0:
                o_ready0()
            else:
                o_ready1()

    @inline_device
    def load_kv(smem, maps, R, j, h_kv, b, k_base):
        """Ring step R (over the block's whole walk): K_j and V_j into slot R % STAGES, each once its previous
        tile (step R - STAGES) is released; keys from row k_base on (varlen: the sequence's first key)."""
        slot = R % STAGES_
        row = j * BLOCK_K + k_base
        if VARLEN:
            b = 0  # the maps' one batch: the whole pack
        if R >= STAGES_:  # the consumers released this slot's previous K
            wait_phase(smem, K_EMPTY + 4 * slot, (R // STAGES_ - 1) & 1)
        expect_tx(smem, K_FULL + 4 * slot, KV_BYTES)
        for a in range(ATOMS):
            load(smem, SK + slot * KV_WORDS + a * KV_ATOM, maps, MAP_K, smem, K_FULL + 4 * slot, a * 64, row,
                 h_kv, b)
        if R >= STAGES_:  # ... and its previous V
            wait_phase(smem, V_EMPTY + 4 * slot, (R // STAGES_ - 1) & 1)
        expect_tx(smem, V_FULL + 4 * slot, KV_BYTES)
        for a in range(ATOMS):
            load(smem, SV + slot * KV_WORDS + a * KV_ATOM, maps, MAP_V, smem, V_FULL + 4 * slot, a * 64, row,
                 h_kv, b)

    @inline_device
    def work(w, n_bh, q_tiles):
        """(q_tile, bh) of the block's work item w: persistent, item w of the heaviest-first order (the last query
        tiles of every head first); else the block's own tile, from the grid."""
        if PERSISTENT:
            qi = w // n_bh
            return q_tiles - 1 - qi, w - qi * n_bh
        if GRID_BH_X:
            return cuda.gridDim.y - 1 - cuda.blockIdx.y, cuda.blockIdx.x
        return cuda.gridDim.x - 1 - cuda.blockIdx.x, cuda.blockIdx.y

    @inline_device
    def produce_item(smem, maps, w, R0, i, n_heads, n_q, n_k, group, left, right, aux, n_bh, q_tiles, q_base, k_base):
        """Work item w (the block's i-th, its ring steps from R0): Q, then K_j and V_j of each step; persistent and
        not the first item: its first STAGES steps before its Q, which waits for the consumers to release the Q tile
        (O's store reads it). Returns the item's step count."""
        q_tile, bh = work(w, n_bh, q_tiles)
        b = bh // n_heads
        h = bh - b * n_heads
        h_kv = h // group
        q0 = q_tile * BLOCK_Q
        j_first, n_iter = kv_walk(b, h, q0, q_tile, n_q, n_k, n_k - n_q, left, right, aux)
        pre = int32(0)
        if PERSISTENT and i > 0:
            pre = min(n_iter, int32(STAGES_))
            for r in range(pre):
                j, _ = key_tile(r, j_first, b, h, q_tile, aux)
                load_kv(smem, maps, R0 + r, j, h_kv, b, k_base)
            wait_phase(smem, Q_EMPTY, (i - 1) & 1)
        expect_tx(smem, Q_FULL, Q_BYTES)
        for a in range(ATOMS):
            load(smem, SQ + a * Q_ATOM, maps, MAP_Q, smem, Q_FULL, a * 64, q_base + q0, h, 0 if VARLEN else b)
        for r in range(pre, n_iter):
            j, _ = key_tile(r, j_first, b, h, q_tile, aux)
            load_kv(smem, maps, R0 + r, j, h_kv, b, k_base)
        return n_iter

    @inline_device
    def producer(smem, maps, n_heads, n_q, n_k, group, left, right, aux, n_bh, q_tiles, q_base, k_base):
        """One thread of warpgroup 0 loads every work item's tiles into the ring, a slot refilled once released."""
        if SETMAXNREG:
            regs_down()
        if cuda.threadIdx.x == 0:
            tma.prefetch_tensormap(maps, MAP_K)
            tma.prefetch_tensormap(maps, MAP_V)
            if PERSISTENT:
                R0 = int32(0)  # ring steps of the items before
                i = int32(0)
                for w in range(cuda.blockIdx.x, n_bh * q_tiles, cuda.gridDim.x):
                    R0 += produce_item(smem, maps, w, R0, i, n_heads, n_q, n_k, group, left, right, aux, n_bh,
                                       q_tiles, q_base, k_base)
                    i += 1
            else:
                produce_item(smem, maps, 0, 0, 0, n_heads, n_q, n_k, group, left, right, aux, n_bh, q_tiles, q_base,
                             k_base)

    @inline_device
    def consume_item(smem, maps, out, lse, w, R0, i, c, warp_c, lane, g, t, base16, q16, s, acc, m_i, l_i, n_heads,
                     n_q, n_k, d, scale_log2, left, right, cap_a, cap_b, alibi, inv_scale, scale, aux, n_bh, q_tiles,
                     q_base):
        """Work item w (the block's i-th, its ring steps from R0) for warpgroup c: query rows q0 + 64c .., the
        products, the softmax and O's store; persistent: then it releases the Q tile. Returns the step count."""
        shift = n_k - n_q
        q_tile, bh = work(w, n_bh, q_tiles)
        b = bh // n_heads
        h = bh - b * n_heads
        q0 = q_tile * BLOCK_Q
        row_w = q0 + 16 * warp_c  # this warp's first query row
        j_first, n_iter = kv_walk(b, h, q0, q_tile, n_q, n_k, shift, left, right, aux)
        slope = ZERO
        if ALIBI:
            slope = head_slope(alibi, b, h, inv_scale)
        for dt in range(O_TILES):
            for r in range(4):
                acc[dt, r] = ZERO
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO

        wait_phase(smem, Q_FULL, i & 1)
        if OVERLAP:
            # S_j is issued with the previous step's P·V behind it; S_j retires first (groups retire in order),
            # so tile j's mask and softmax run under that product, and O's rescale waits for it. The first step
            # is peeled (FIRST a constant): no branch around a product in flight, whose joins would define its
            # registers
            alpha = cuda.local.array(2, float32)
            a_p = cuda.local.array((PV_STEPS, 4), uint32)
            if n_iter > 0:
                j, full = key_tile(0, j_first, b, h, q_tile, aux)
                overlap_step(smem, s, acc, a_p, m_i, l_i, alpha, R0, j, full, True, c, q16, base16, row_w, n_q,
                             n_k, shift, b, h, g, t, lane, scale_log2, left, right, cap_a, cap_b, slope, scale,
                             inv_scale, aux)
            for r in range(1, n_iter):
                j, full = key_tile(r, j_first, b, h, q_tile, aux)
                overlap_step(smem, s, acc, a_p, m_i, l_i, alpha, R0 + r, j, full, False, c, q16, base16, row_w,
                             n_q, n_k, shift, b, h, g, t, lane, scale_log2, left, right, cap_a, cap_b, slope,
                             scale, inv_scale, aux)
            if n_iter > 0:
                last = R0 + n_iter - 1
                wait_phase(smem, V_FULL + 4 * (last % STAGES_), (last // STAGES_) & 1)
                if VARLEN:  # the walk's last tile is the only one that can cross n_k
                    j_last, _ = key_tile(n_iter - 1, j_first, b, h, q_tile, aux)
                    clear_past_keys(smem, last % STAGES_, j_last, n_k, c, warp_c, lane)
                issue_o(smem, acc, a_p, base16 + ((SV + (last % STAGES_) * KV_WORDS) >> 3))
                wait0()
                hold_o(acc)
                if lane == 0:
                    arrive(smem, V_EMPTY + 4 * (last % STAGES_))
        else:
            for r in range(n_iter):
                j, full = key_tile(r, j_first, b, h, q_tile, aux)
                slot = (R0 + r) % STAGES_
                parity = ((R0 + r) // STAGES_) & 1
                wait_phase(smem, K_FULL + 4 * slot, parity)
                if PINGPONG:
                    if c == 0:
                        turn_sync0()
                    else:
                        turn_sync1()
                product_s(smem, s, q16, base16 + ((SK + slot * KV_WORDS) >> 3))
                if PINGPONG:
                    if c == 0:
                        turn_arrive1()
                    else:
                        turn_arrive0()
                wait0()
                hold_s(s)
                if lane == 0:  # this warp's Q·K_jᵀ retired: one of CONSUMER_WARPS arrivals
                    arrive(smem, K_EMPTY + 4 * slot)
                scores(s, j, full, row_w, n_q, n_k, shift, b, h, g, t, left, right, cap_a, cap_b, slope, scale,
                       inv_scale, aux)
                m_nw = cuda.local.array(2, float32)
                softmax_step(s, acc, m_i, l_i, m_nw, scale_log2)
                wait_phase(smem, V_FULL + 4 * slot, parity)
                if VARLEN:
                    clear_past_keys(smem, slot, j, n_k, c, warp_c, lane)
                product_o(smem, acc, s, base16 + ((SV + slot * KV_WORDS) >> 3))
                if lane == 0:
                    arrive(smem, V_EMPTY + 4 * slot)

        for mr in range(2):
            l_row = quad_row_sum(l_i, mr)
            row = row_w + 8 * mr + g
            inv_l = float32(1.0) / l_row if l_row != ZERO else ZERO
            if row < n_q and t == 0:
                lse[b, h, q_base + row] = row_lse(m_i[mr], l_row) if l_row != ZERO else NEG_INF
            if TMA_STORE:  # into this warpgroup's rows of the Q tile (its last Q·Kᵀ has retired)
                r_wg = 16 * (warp_c & 3) + 8 * mr + g
                for dt in range(O_TILES):
                    bits = pack(acc[dt, 2 * mr] * inv_l, acc[dt, 2 * mr + 1] * inv_l)
                    word = SQ + c * 64 * 64 + atom_offset(r_wg, dt, BLOCK_Q) + 2 * t
                    ptx.st_shared_b32(smem, word, bits)
            else:
                if row < n_q:
                    for dt in range(O_TILES):
                        col = dt * 8 + 2 * t
                        bits = pack(acc[dt, 2 * mr] * inv_l, acc[dt, 2 * mr + 1] * inv_l)
                        if col < d:
                            out[b, h, q_base + row, col] = uint16(bits & 0xFFFF)
                        if col + 1 < d:
                            out[b, h, q_base + row, col + 1] = uint16(bits >> 16)
        if TMA_STORE:
            fence_async()  # the st.shared above, visible to the TMA engine's reads
            if c == 0:
                o_ready0()
            else:
                o_ready1()
            if warp_c & 3 == 0 and lane == 0:
                for a in range(ATOMS):
                    store(maps, MAP_O, smem, SQ + a * Q_ATOM + c * 64 * 64, a * 64, q0 + 64 * c, h, b)
                bulk_commit()
                bulk_wait()  # the store has read the Q tile's rows
                if PERSISTENT:
                    arrive(smem, Q_EMPTY)
        elif PERSISTENT and lane == 0:  # this warp's products that read Q have retired
            arrive(smem, Q_EMPTY)
        return n_iter

    @inline_device
    def consumer(smem, maps, out, lse, n_heads, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, alibi,
                 inv_scale, aux, n_bh, q_tiles, q_base):
        """Warpgroup c = wg - 1: its rows of every work item."""
        if SETMAXNREG:
            regs_up()
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        c = (warp >> 2) - 1
        warp_c = warp - 4
        g = lane >> 2
        t = lane & 3
        base16 = int64(ptx.shared_base(smem) >> 4)  # descriptors are 64-bit (the simulator's arithmetic too)
        q16 = base16 + (2 * SQ >> 4) + c * WG_ROWS16
        scale = ZERO
        if USER:  # a score mod sees the scaled logit scale·s
            scale = float32(1.0) / inv_scale
        s = cuda.local.array((S_TILES, 4), float32)
        acc = cuda.local.array((O_TILES, 4), float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        if PINGPONG and c == 0:  # consumer 0 goes first: its own arrival opens its first turn
            turn_arrive0()

        if PERSISTENT:
            R0 = int32(0)  # ring steps of the items before (the producer's count)
            i = int32(0)
            for w in range(cuda.blockIdx.x, n_bh * q_tiles, cuda.gridDim.x):
                R0 += consume_item(smem, maps, out, lse, w, R0, i, c, warp_c, lane, g, t, base16, q16, s, acc, m_i,
                                   l_i, n_heads, n_q, n_k, d, scale_log2, left, right, cap_a, cap_b, alibi,
                                   inv_scale, scale, aux, n_bh, q_tiles, q_base)
                i += 1
        else:
            consume_item(smem, maps, out, lse, 0, 0, 0, c, warp_c, lane, g, t, base16, q16, s, acc, m_i, l_i,
                         n_heads, n_q, n_k, d, scale_log2, left, right, cap_a, cap_b, alibi, inv_scale, scale, aux,
                         n_bh, q_tiles, q_base)

    @inline_device
    def ws_body(maps, out, lse, n_heads, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, alibi,
                inv_scale, aux=(), q_base=0, k_base=0):
        smem = cuda.shared.array(0, uint16, alignment=WGMMA_ALIGN)  # atoms: 1024-byte aligned
        n_bh, q_tiles = 0, 0  # persistent: the work items are (q tile, b·h) pairs
        if PERSISTENT:
            n_bh = out.shape[0] * n_heads
            q_tiles = (n_q + BLOCK_Q - 1) // BLOCK_Q

        if cuda.threadIdx.x == 0:
            ptx.mbarrier_init(smem, Q_FULL, 1)
            if PERSISTENT:
                ptx.mbarrier_init(smem, Q_EMPTY, CONSUMERS if TMA_STORE else CONSUMER_WARPS)
            for st in range(STAGES_):
                ptx.mbarrier_init(smem, K_FULL + 4 * st, 1)
                ptx.mbarrier_init(smem, V_FULL + 4 * st, 1)
                ptx.mbarrier_init(smem, K_EMPTY + 4 * st, CONSUMER_WARPS)
                ptx.mbarrier_init(smem, V_EMPTY + 4 * st, CONSUMER_WARPS)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()

        if cuda.threadIdx.x < 128:  # warpgroup 0, the producer
            producer(smem, maps, n_heads, n_q, n_k, group, left, right, aux, n_bh, q_tiles, q_base, k_base)
        else:
            consumer(smem, maps, out, lse, n_heads, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, alibi,
                     inv_scale, aux, n_bh, q_tiles, q_base)

    return maps_entry(ws_body, globals(), "wgmma_ws_forward", mods.any,
                      user_aux=len(user_aux_types(mods)) if USER else -1, varlen=VARLEN, block_q=BLOCK_Q,
                      grid_bh_x=GRID_BH_X)


@lru_cache(maxsize=None)
def build(tile: Tile, causal: bool, dtype: str, mods: Mods = NO_MODS, varlen: bool = False):
    """The compiled kernel for one specialisation (sm_90 only: TMA, wgmma and setmaxnreg are sm_90(a))."""
    bad = problems(tile, dtype, varlen)
    if mods.user and varlen:
        bad.append("user mods have no varlen build")
    if mods.dropout:  # benchmarks/DESIGN.md: built and measured, slower than the mma.sync forward's dropout
        bad.append("dropout is not built into the warp-specialised forward (the mma.sync forward has it)")
    if bad:
        raise ValueError(f"wgmma_ws forward ({tile}, {dtype}{', varlen' if varlen else ''}) cannot be built: "
                         f"{'; '.join(bad)}")
    key = ("wgmma_ws_forward", tile, bool(causal), dtype, mods) + varlen_key(varlen)
    options = {} if ptx.SIMULATOR else {"max_registers": max_registers(tile)}
    return compile_kernel(key, kernel_signature(mods, varlen), kernel_source(tile, bool(causal), dtype, mods, varlen),
                          **options)


def one_batch(x):
    """A varlen (B, H, total, d) view with batch stride 0 as its first batch, (1, H, total, d): the whole pack, which
    the tensor maps cover once."""
    if isinstance(x, DeviceView):
        return DeviceView(x.ptr, (1,) + tuple(x.shape[1:]), x.strides, x.dtype, x.owner)
    return x[:1]


def check_arrays(q, k, v, out, lse, tile: Tile):
    """The shapes and dtypes the kernel takes (the tensor maps check strides and alignment)."""
    B, H, n_q, d = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != d or tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}: "
                         "q and out (B, H, Nq, d), k and v (B, Hkv, Nk, d)")
    if H % k.shape[1]:
        raise ValueError(f"H={H} is not a multiple of Hkv={k.shape[1]}")
    if d > tile.head_dim:
        raise ValueError(f"head dim {d} > the tile's head_dim={tile.head_dim}")
    if len({np.dtype(x.dtype) for x in (q, k, v, out)}) != 1 or np.dtype(q.dtype) not in (np.dtype(np.float16), WORD):
        raise ValueError(f"q, k, v, out must share dtype float16 or uint16 (bf16 bits); got "
                         f"{[str(x.dtype) for x in (q, k, v, out)]}")
    if tuple(lse.shape) != (B, H, n_q) or np.dtype(lse.dtype) != np.float32:
        raise ValueError(f"lse: float32 (B, H, Nq) = {(B, H, n_q)}, got {lse.dtype} {tuple(lse.shape)}")


def launch(q, k, v, out, lse, tile: Tile, *, causal, softmax_scale, stream=0, mods: Mods = NO_MODS, window=(0, 0),
           softcap=0.0, alibi=None, aux=(), n_sm=None, varlen=None):
    """Run the warp-specialised forward on device arrays (B, H, N, d), f16 or bf16 bits as uint16; L float32 (B, H,
    Nq). q, k, v (and out with tma_store) need 16-byte aligned data and byte strides of 16-byte multiples (TMA).
    mods, window, softcap, alibi, aux: as wgmma_forward.launch's. n_sm: the GPU's SM count, which a persistent
    tile's grid takes. varlen: None, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) as
    wgmma_forward.launch takes it (views of the packed arrays with a batch stride of 0); the tile's tma_store is
    dropped (the fragment stores stop at each sequence's end) and a persistent tile refused."""
    if varlen is not None and tile.has("tma_store"):
        tile = tile.with_(flags=tile.flags - {"tma_store"})
    check_arrays(q, k, v, out, lse, tile)
    B, H, n_q, d = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if varlen is not None:
        n_q, n_k = int(varlen[2]), int(varlen[3])
    if B * H * n_q == 0:
        return
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    if n_k == 0:
        raise ValueError("wgmma_ws forward: Nk = 0 (no keys)")
    if not mods.any and (alibi is not None or aux):
        raise ValueError(f"wgmma_ws forward: alibi / aux arrays without the mods that read them (mods {mods})")
    words = [x if np.dtype(x.dtype) == WORD else x.view(WORD) for x in (q, k, v, out)]
    dtype = "bfloat16" if np.dtype(q.dtype) == WORD else "float16"
    mapped = [one_batch(x) for x in words[:3]] if varlen is not None else words[:3]
    specs = [(mapped[0], tile.block_q), (mapped[1], tile.block_k), (mapped[2], tile.block_k)]
    if tile.has("tma_store"):
        specs.append((words[3], 64))
    maps = device_maps(specs, stream) if ptx.SIMULATOR else maps_view(specs, stream)
    q_tiles = (n_q + tile.block_q - 1) // tile.block_q
    if tile.has("persistent") and varlen is not None:
        raise ValueError(f"wgmma_ws forward: a persistent tile ({tile}) has no varlen build")
    if tile.has("persistent"):  # one block per SM (or per work item, if fewer) walks the work items
        if not n_sm or n_sm < 1:
            raise ValueError(f"wgmma_ws forward: a persistent tile needs n_sm (the GPU's SM count), got {n_sm!r}")
        grid = (min(B * H * q_tiles, int(n_sm)),)
    else:
        grid, tile = forward_grid(tile, B * H, q_tiles)
    args = (maps, words[3], lse, H, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))
    if mods.any:
        args += launch_args(window, softcap, softmax_scale, alibi, unused_slopes(lse)) + tuple(aux)
    extra = {}
    if varlen is not None:
        args += (varlen[0], varlen[1])
        extra["varlen"] = True  # passed only when on: the dense builds keep their cache key
    launch_kernel(build(tile, bool(causal), dtype, mods, **extra), grid, threads(tile), stream, smem_bytes(tile),
                  *args)
