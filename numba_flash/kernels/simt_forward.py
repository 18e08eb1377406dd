"""SIMT FlashAttention-2 forward (any float dtype, fp32 accumulation): the 3.6.6 tile loop.

Maths (section 3.6.4), per query row, for each K/V tile j with scaled scores s = q·kᵀ·scale:

    m_new = max(m_i, rowmax(s))          running maximum
    alpha = exp(m_i - m_new)             rescales what was accumulated under the old maximum
    p     = exp(s - m_new)
    l_i   = alpha * l_i + rowsum(p)      running denominator ℓ
    acc   = alpha * acc + p @ V_j        running numerator O
    m_i   = m_new

and at the end O = acc / l_i, L = m_i + log(l_i). The kernel works in base 2 (scores are scaled
by softmax_scale·log2(e), so exp is one ex2 instruction) and converts L back to natural log.

Structure: one thread block per (Q tile, batch·head). The Q tile is loaded once into shared
memory; K and V tiles stream through shared memory; each thread keeps m_i, l_i and its slice of
acc in registers (local arrays with compile-time sizes, which NVVM promotes to registers); only
O and L are written to global memory. Causal: K/V tiles entirely above the (bottom-right
aligned) diagonal are never loaded, and only tiles that cross it (or the end of the keys) pay
for the mask.

Row maxima and sums are combined across the COL_THREADS threads that share a row through a
small shared-memory buffer rather than warp shuffles, so the CUDA simulator runs this kernel
unchanged and the result is bitwise deterministic.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, types, uint16, uint32, uint64

# Indices are cast to unsigned (a no-op bitcast from int64) before indexing: Numba then skips the negative-index
# wraparound test it otherwise emits for every access (64-bit compare, shift, add).
U = uint64

import ctypes

import numpy as np
from llvmlite import ir
from numba.cuda.extending import intrinsic, register_jitable

from .. import ptx
from ..blocks.numerics import FASTMATH, LN2, LOG2E, STORAGE
from ..configs import SimtConfig
from ..blocks.entry import forward_entry
from ..blocks.mask import window_rules
from ..blocks.mods import NO_MODS, Mods, alibi_bias, capped, head_slope, launch_args
from ..launch import launch as launch_kernel
from ..launch import unused_slopes
from ..ptx import SIMULATOR, bits_from_f32, f32_from_bits, ld_shared_f32x4, st_shared_f32x4
from ..jit_cache import compile_kernel




@intrinsic
def _ldg(typingctx, src, offset):
    """src's element at flat element offset ``offset`` from its data pointer (strides are the
    caller's), as an ``ld.global.nc``: a global-space load of memory that the kernel never writes.
    Unlike Numba's generic ``ld`` it cannot alias shared memory, so NVVM and ptxas may issue it
    ahead of earlier shared stores (a generic load waits for them)."""
    if not (isinstance(src, types.Array) and isinstance(offset, types.Integer)):
        return None
    sig = src.dtype(src, offset)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        elem = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.intp)])
        value = builder.load(builder.addrspacecast(elem, ir.PointerType(elem.type.pointee, 1)))
        value.set_metadata("invariant.load", builder.module.add_metadata([]))
        return value

    return sig, codegen


def _ldg_twin(src, offset):
    ary = ptx.sim._numpy_of(src)
    low, high = np.lib.array_utils.byte_bounds(ary)
    address = ary.ctypes.data + int(offset) * ary.itemsize
    if not low <= address <= high - ary.itemsize:
        raise IndexError(f"ldg: element offset {offset} outside the {high - low} bytes the array spans")
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * ary.itemsize).from_address(address))
    return raw.view(ary.dtype)[0]


ldg = _ldg_twin if SIMULATOR else _ldg


def kernel_signature(dtype: str, mods: Mods = NO_MODS):
    """The one signature each specialisation is compiled for: strided 4-D arrays ('A' layout); with mods also
    the window bounds, cap_a, cap_b, the ALiBi slopes (Ba, H) and 1 / scale (blocks/mods.py)."""
    io = types.Array(STORAGE[dtype], 4, "A")
    lse = types.Array(types.float32, 3, "A")
    if not mods.any:
        return types.void(io, io, io, io, lse, int32, int32, int32, int32, float32)
    return types.void(io, io, io, io, lse, int32, int32, int32, int32, float32, int32, int32, float32, float32,
                      types.Array(types.float32, 2, "A"), float32)


def kernel_source(cfg: SimtConfig, causal: bool, dtype: str, mods: Mods = NO_MODS):
    """The Python kernel for one specialisation (before cuda.jit; compile_ptx tests use it). mods: a window
    (its tile range and edges replace causal's), softcap and ALiBi on each score before the mask."""
    BLOCK_Q, BLOCK_K, HEAD_DIM = cfg.block_q, cfg.block_k, cfg.head_dim
    ROW_THREADS, COL_THREADS, THREADS = cfg.row_threads, cfg.col_threads, cfg.threads
    ROWS, S_COLS, O_COLS = cfg.rows_per_thread, cfg.s_cols_per_thread, cfg.o_cols_per_thread
    ROW_GROUPS, S_GROUPS, O_GROUPS = ROWS // 4, S_COLS // 4, O_COLS // 4
    ROW_STEP, COL_STEP = 4 * ROW_THREADS, 4 * COL_THREADS  # distance between a thread's groups
    st, words = cfg.strides, cfg.smem_words
    QT, KT, VS, PT = st["qt"], st["kt"], st["v"], st["pt"]
    Q_OFF = 0
    K_OFF = Q_OFF + words["q"]
    V_OFF = K_OFF if cfg.share_kv else K_OFF + words["k"]
    P_OFF = K_OFF + words["k"] + words["v"]
    RED_OFF = P_OFF + words["p"]
    SHARE_KV = cfg.share_kv
    WINDOW, SOFTCAP, ALIBI = bool(mods.window), bool(mods.softcap), bool(mods.alibi)
    CAUSAL = bool(causal) and not WINDOW
    window_range, window_edge, window_hidden = window_rules(BLOCK_K, BLOCK_Q)
    BF16 = dtype == "bfloat16"
    ITEMSIZE = 4 if dtype == "float32" else 2
    UNROLL = 4  # inner-product steps per unrolled group (divides every HEAD_DIM and BLOCK_K)
    STAGE_TRIPS, PREFETCH_TRIPS = cfg.stage_trips, cfg.prefetch_trips
    PLANNED = bool(STAGE_TRIPS or PREFETCH_TRIPS)  # K/V copies by tile_copier, not the loops below
    V_LATE = SHARE_KV or PREFETCH_TRIPS > 0  # V_j is stored after S_j (its registers were in flight)
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def load(src, b, h, row, c, n_rows, d):
        """One element as float32; zero past the sequence or the head dim (padding adds nothing,
        and masked probabilities, exactly 0, never meet garbage V values)."""
        if row < n_rows and c < d:
            x = src[U(b), U(h), U(row), U(c)]
            if BF16:
                return f32_from_bits(uint32(x) << 16)
            return float32(x)
        return ZERO

    @cuda.jit(device=True, inline=True)
    def load_transposed(src, b, h, row0, n_rows, d, smem, off, stride, TILE_ROWS):
        """tile[row, e] -> smem[off + e*stride + row]: four rows per 16-byte store."""
        for idx in range(cuda.threadIdx.x, HEAD_DIM * (TILE_ROWS // 4), THREADS):
            r4 = idx // HEAD_DIM
            e = idx - r4 * HEAD_DIM  # fastest across lanes: coalesced global reads
            row = row0 + 4 * r4
            st_shared_f32x4(smem, U(off + e * stride + 4 * r4),
                            load(src, b, h, row, e, n_rows, d), load(src, b, h, row + 1, e, n_rows, d),
                            load(src, b, h, row + 2, e, n_rows, d), load(src, b, h, row + 3, e, n_rows, d))

    @cuda.jit(device=True, inline=True)
    def load_rows(src, b, h, row0, n_rows, d, smem, off, stride, TILE_ROWS):
        """tile[row, e] -> smem[off + row*stride + e]: four head-dim entries per store."""
        for idx in range(cuda.threadIdx.x, TILE_ROWS * (HEAD_DIM // 4), THREADS):
            r = idx // (HEAD_DIM // 4)
            e = 4 * (idx - r * (HEAD_DIM // 4))
            row = row0 + r
            st_shared_f32x4(smem, U(off + r * stride + e),
                            load(src, b, h, row, e, n_rows, d), load(src, b, h, row, e + 1, n_rows, d),
                            load(src, b, h, row, e + 2, n_rows, d), load(src, b, h, row, e + 3, n_rows, d))

    @cuda.jit(device=True, inline=True)
    def widen(x):
        if BF16:
            return f32_from_bits(uint32(x) << 16)
        return float32(x)

    def tile_copier(TRANSPOSED, STRIDE, OFF):
        """(fetch, store, copy, PRE) for one BLOCK_K-row tile of K (TRANSPOSED: tile[row, e] ->
        smem[OFF + e*STRIDE + row]) or V (tile[row, e] -> smem[OFF + row*STRIDE + e]).

        Trip n of thread tid is group tid + n*THREADS of the tile: 4 elements, one 16-byte shared
        store (four rows of one column when transposed, else four columns of one row; consecutive
        lanes read consecutive columns, so the global reads stay coalesced).
        fetch(stage, ..., n0, COUNT) loads trips n0..n0+COUNT-1 into stage[0:COUNT, 0:4] (zeros
        past the tile); store(stage, smem, n0, COUNT) writes them to shared memory; copy(...,
        N_LO) does both for trips N_LO.. in batches of STAGE_TRIPS (all at once when 0). COUNT
        is a constant and stage is indexed by it alone, so stage arrays stay in registers. A tile
        wholly inside the keys at d = HEAD_DIM skips the element checks; otherwise rows past n_k
        and columns past d read as 0, as load() does."""
        GROUPS = HEAD_DIM if TRANSPOSED else HEAD_DIM // 4  # groups per 4 rows (T) / per row
        TOTAL = HEAD_DIM * (BLOCK_K // 4)
        TRIPS = (TOTAL + THREADS - 1) // THREADS
        EVEN = TOTAL % THREADS == 0  # then trip n exists for every thread iff n < TRIPS
        # Tile rows between a thread's trips when THREADS is a multiple of GROUPS (every shipped
        # config): its column is the same each trip, so addresses are one base plus constants.
        ROW_JUMP = (THREADS // GROUPS) * (4 if TRANSPOSED else 1) if THREADS % GROUPS == 0 else 0
        DR, DC = (1, 0) if TRANSPOSED else (0, 1)  # element u of a group: (row + u*DR, col + u*DC)

        @cuda.jit(device=True, inline=True)
        def group_of(idx):
            """(tile row, column, shared offset) of group idx's first element."""
            a = idx // GROUPS
            c = idx - a * GROUPS
            if TRANSPOSED:
                return 4 * a, c, OFF + c * STRIDE + 4 * a
            return a, 4 * c, OFF + a * STRIDE + 4 * c

        @cuda.jit(device=True, inline=True)
        def fetch(stage, src, b, h, row0, n_rows, d, n0, COUNT):
            tid = cuda.threadIdx.x
            s_row = src.strides[2] // ITEMSIZE  # element strides: a constant divisor is a shift
            s_col = src.strides[3] // ITEMSIZE
            base = b * (src.strides[0] // ITEMSIZE) + h * (src.strides[1] // ITEMSIZE)
            inside = row0 + BLOCK_K <= n_rows and d == HEAD_DIM  # the whole tile: no element checks
            # Trips addressed as one base plus constant row jumps: computed per trip instead, each
            # trip's (loop-invariant) offset is hoisted out of the K/V loop into its own 64-bit
            # register, up to 32 of them live through the GEMMs (255 registers, or spills at a cap).
            if ROW_JUMP:
                r, c, _ = group_of(tid)
                row_t = row0 + r
                at = base + row_t * s_row + c * s_col
                for m in range(COUNT):
                    n = n0 + m
                    ok = n < TRIPS if EVEN else tid + n * THREADS < TOTAL
                    for u in range(4):
                        x = ZERO
                        if inside:
                            if ok:
                                x = widen(ldg(src, U(at + (n * ROW_JUMP + u * DR) * s_row + u * DC * s_col)))
                        elif ok and row_t + n * ROW_JUMP + u * DR < n_rows and c + u * DC < d:
                            x = widen(ldg(src, U(at + (n * ROW_JUMP + u * DR) * s_row + u * DC * s_col)))
                        stage[m, u] = x
            else:
                for m in range(COUNT):
                    idx = tid + (n0 + m) * THREADS
                    r, c, _ = group_of(idx)
                    for u in range(4):
                        row = row0 + r + u * DR
                        col = c + u * DC
                        x = ZERO
                        if idx < TOTAL and row < n_rows and col < d:
                            x = widen(ldg(src, U(base + row * s_row + col * s_col)))
                        stage[m, u] = x

        @cuda.jit(device=True, inline=True)
        def store(stage, smem, n0, COUNT):
            tid = cuda.threadIdx.x
            for m in range(COUNT):
                idx = tid + (n0 + m) * THREADS
                if idx < TOTAL:
                    _, _, at = group_of(idx)
                    st_shared_f32x4(smem, U(at), stage[m, 0], stage[m, 1], stage[m, 2], stage[m, 3])

        REST = max(0, TRIPS - min(PREFETCH_TRIPS, TRIPS))
        BATCH = max(1, min(STAGE_TRIPS or REST, REST))
        BATCHES = (REST + BATCH - 1) // BATCH

        @cuda.jit(device=True, inline=True)
        def copy(src, b, h, row0, n_rows, d, smem, N_LO):
            stage = cuda.local.array((BATCH, 4), float32)
            for i in range(BATCHES):
                fetch(stage, src, b, h, row0, n_rows, d, N_LO + i * BATCH, BATCH)
                store(stage, smem, N_LO + i * BATCH, BATCH)

        return fetch, store, copy, min(PREFETCH_TRIPS, TRIPS)

    fetch_k, store_k, copy_k, PRE_K = tile_copier(True, KT, K_OFF)
    fetch_v, store_v, copy_v, PRE_V = tile_copier(False, VS, V_OFF)
    PRE = max(1, PRE_K, PRE_V)

    @cuda.jit(device=True, inline=True)
    def load_groups(frag, smem, base, n_groups, group_step):
        """frag[4g:4g+4] = smem[base + g*group_step :][:4]: one 16-byte load per group of 4."""
        for g in range(n_groups):
            x0, x1, x2, x3 = ld_shared_f32x4(smem, U(base + g * group_step))
            frag[4 * g] = x0
            frag[4 * g + 1] = x1
            frag[4 * g + 2] = x2
            frag[4 * g + 3] = x3

    @cuda.jit(device=True, inline=True)
    def outer_fma(acc, a, b, M, N):
        """acc += a bᵀ: one inner-product step of both GEMMs (register tiling)."""
        for i in range(M):
            for j in range(N):
                acc[i, j] = cuda.fma(a[i], b[j], acc[i, j])

    @register_jitable(inline="never", fastmath=FASTMATH)  # the kernel's fastmath flags (inline_device has none)
    def forward_body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, slopes,
                     inv_scale):
        smem = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        tr = tid // COL_THREADS
        tc = tid - tr * COL_THREADS
        # Heaviest causal tiles first: they start while the light ones fill the tail.
        q_tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
        bh = cuda.blockIdx.y
        n_heads = q.shape[1]
        b = bh // n_heads
        h = bh - b * n_heads
        h_kv = h // group
        q0 = q_tile * BLOCK_Q
        shift = n_k - n_q  # bottom-right causal alignment: query i sees key j iff j <= i + shift

        load_transposed(q, b, h, q0, n_q, d, smem, Q_OFF, QT, BLOCK_Q)

        # Local row i = 4*g + ii is tile row g*ROW_STEP + 4*tr + ii; likewise for columns.
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)  # per-thread partial sums; reduced once at the end
        acc = cuda.local.array((ROWS, O_COLS), float32)
        s = cuda.local.array((ROWS, S_COLS), float32)
        a_frag = cuda.local.array(ROWS, float32)
        k_frag = cuda.local.array(S_COLS, float32)
        v_frag = cuda.local.array(O_COLS, float32)
        for i in range(ROWS):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for c in range(O_COLS):
                acc[i, c] = ZERO

        n_tiles = (n_k + BLOCK_K - 1) // BLOCK_K
        if CAUSAL:
            last_row = min(q0 + BLOCK_Q, n_q) - 1
            visible = last_row + shift + 1  # keys the tile's last row can see
            if visible <= 0:
                n_tiles = 0
            else:
                n_tiles = min(n_tiles, (visible + BLOCK_K - 1) // BLOCK_K)
        j_first = 0  # the window: tiles left of every row's window are never loaded
        if WINDOW:
            j_first, n_tiles = window_range(q0, min(q0 + BLOCK_Q, n_q), n_k, shift, left, right)
        slope = ZERO
        if ALIBI:  # (Ba, H): Ba = 1 broadcasts over the batch
            slope = head_slope(slopes, b, h, inv_scale)

        pre = cuda.local.array((PRE, 4), float32)  # prefetched trips: K_{j+1} or V_j, in turn
        if PREFETCH_TRIPS and n_tiles > j_first:
            fetch_k(pre, k, b, h_kv, j_first * BLOCK_K, n_k, d, 0, PRE_K)
        for j in range(j_first, n_tiles):
            k0 = j * BLOCK_K
            if PREFETCH_TRIPS:
                store_k(pre, smem, 0, PRE_K)
                copy_k(k, b, h_kv, k0, n_k, d, smem, PRE_K)
            elif PLANNED:
                copy_k(k, b, h_kv, k0, n_k, d, smem, 0)
            else:
                load_transposed(k, b, h_kv, k0, n_k, d, smem, K_OFF, KT, BLOCK_K)
            if not V_LATE:
                if PLANNED:
                    copy_v(v, b, h_kv, k0, n_k, d, smem, 0)
                else:
                    load_rows(v, b, h_kv, k0, n_k, d, smem, V_OFF, VS, BLOCK_K)
            cuda.syncthreads()
            if PREFETCH_TRIPS:  # V_j's loads fly while S_j is computed
                fetch_v(pre, v, b, h_kv, k0, n_k, d, 0, PRE_V)

            # S = Q K^T for this thread's ROWS x S_COLS slice: per head-dim step e, one 16-byte
            # load per group of 4 rows / columns, then ROWS x S_COLS FMAs.
            for i in range(ROWS):
                for jj in range(S_COLS):
                    s[i, jj] = ZERO
            for e0 in range(0, HEAD_DIM, UNROLL):
                for u in range(UNROLL):  # constant trip count: fully unrolled, loads run ahead
                    e = e0 + u
                    load_groups(a_frag, smem, Q_OFF + e * QT + 4 * tr, ROW_GROUPS, ROW_STEP)
                    load_groups(k_frag, smem, K_OFF + e * KT + 4 * tc, S_GROUPS, COL_STEP)
                    outer_fma(s, a_frag, k_frag, ROWS, S_COLS)

            # Mask only where the tile crosses the end of the keys or the causal diagonal.
            needs_mask = k0 + BLOCK_K > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_K - 1 > q0 + shift)
            if WINDOW:
                needs_mask = window_edge(k0, k0 + BLOCK_K, q0, n_k, shift, left, right)
            for i in range(ROWS):
                r = (i // 4) * ROW_STEP + 4 * tr + i % 4
                row_max = NEG_INF
                for jj in range(S_COLS):
                    if SOFTCAP or ALIBI:  # (blocks/mods.py: in raw-score units, before the mask)
                        x = s[i, jj]
                        if SOFTCAP:
                            x = capped(x, cap_a, cap_b)
                        if ALIBI:
                            x -= alibi_bias(slope, q0 + r, k0 + (jj // 4) * COL_STEP + 4 * tc + jj % 4, shift)
                        x = x * scale_log2
                    else:
                        x = s[i, jj] * scale_log2
                    if WINDOW:
                        if needs_mask and window_hidden(q0 + r, k0 + (jj // 4) * COL_STEP + 4 * tc + jj % 4, n_k, shift,
                                                        left, right):
                            x = NEG_INF
                    elif needs_mask:
                        col = k0 + (jj // 4) * COL_STEP + 4 * tc + jj % 4
                        if col >= n_k or (CAUSAL and col > q0 + r + shift):
                            x = NEG_INF
                    s[i, jj] = x
                    row_max = max(row_max, x)
                smem[U(RED_OFF + r * COL_THREADS + tc)] = row_max
            cuda.syncthreads()
            # Every thread is past S = QK^T, so K's buffer is free for V (share_kv).
            if PREFETCH_TRIPS:
                store_v(pre, smem, 0, PRE_V)
                copy_v(v, b, h_kv, k0, n_k, d, smem, PRE_V)
            elif SHARE_KV:
                if PLANNED:
                    copy_v(v, b, h_kv, k0, n_k, d, smem, 0)
                else:
                    load_rows(v, b, h_kv, k0, n_k, d, smem, V_OFF, VS, BLOCK_K)

            for i in range(ROWS):
                r = (i // 4) * ROW_STEP + 4 * tr + i % 4
                m_new = m_i[i]
                for t in range(COL_THREADS):
                    m_new = max(m_new, smem[U(RED_OFF + r * COL_THREADS + t)])
                # A row with nothing visible yet keeps m = -inf; subtract 0 so exp gives 0, not nan.
                m_use = ZERO if m_new == NEG_INF else m_new
                alpha = math.exp2(m_i[i] - m_use)
                row_sum = ZERO
                for jj in range(S_COLS):
                    p = math.exp2(s[i, jj] - m_use)
                    s[i, jj] = p
                    row_sum += p
                l_i[i] = alpha * l_i[i] + row_sum
                for c in range(O_COLS):
                    acc[i, c] *= alpha
                m_i[i] = m_new
            # P^T to shared memory: for each of this thread's columns, its 4 rows in one store.
            for g in range(ROW_GROUPS):
                for jj in range(S_COLS):
                    col = (jj // 4) * COL_STEP + 4 * tc + jj % 4
                    st_shared_f32x4(smem, U(P_OFF + col * PT + g * ROW_STEP + 4 * tr),
                                    s[4 * g, jj], s[4 * g + 1, jj], s[4 * g + 2, jj], s[4 * g + 3, jj])
            cuda.syncthreads()
            if PREFETCH_TRIPS and j + 1 < n_tiles:  # K_{j+1}'s loads fly while P V_j is computed
                fetch_k(pre, k, b, h_kv, k0 + BLOCK_K, n_k, d, 0, PRE_K)

            # acc += P V_j
            for t0 in range(0, BLOCK_K, UNROLL):
                for u in range(UNROLL):
                    t = t0 + u
                    load_groups(a_frag, smem, P_OFF + t * PT + 4 * tr, ROW_GROUPS, ROW_STEP)
                    load_groups(v_frag, smem, V_OFF + t * VS + 4 * tc, O_GROUPS, COL_STEP)
                    outer_fma(acc, a_frag, v_frag, ROWS, O_COLS)
            cuda.syncthreads()  # before the next tile overwrites K, V, P and the row buffer

        # l_i: sum the per-thread partials of each row.
        for i in range(ROWS):
            r = (i // 4) * ROW_STEP + 4 * tr + i % 4
            smem[U(RED_OFF + r * COL_THREADS + tc)] = l_i[i]
        cuda.syncthreads()
        for i in range(ROWS):
            r = (i // 4) * ROW_STEP + 4 * tr + i % 4
            row = q0 + r
            l_row = ZERO
            for t in range(COL_THREADS):
                l_row += smem[U(RED_OFF + r * COL_THREADS + t)]
            # A fully masked row (l = 0) is defined as O = 0, L = -inf.
            inv_l = float32(1.0) / l_row if l_row != ZERO else ZERO
            if row < n_q:
                if tc == 0:
                    if l_row != ZERO:
                        lse[U(b), U(h), U(row)] = (m_i[i] + math.log2(l_row)) * float32(LN2)
                    else:
                        lse[U(b), U(h), U(row)] = NEG_INF
                for c in range(O_COLS):
                    col = (c // 4) * COL_STEP + 4 * tc + c % 4
                    if col < d:
                        o = acc[i, c] * inv_l
                        if BF16:
                            bits = bits_from_f32(o)  # round to nearest even
                            bits = bits + uint32(0x7FFF) + ((bits >> 16) & uint32(1))
                            out[U(b), U(h), U(row), U(col)] = uint16(bits >> 16)
                        else:
                            out[U(b), U(h), U(row), U(col)] = o

    return forward_entry(forward_body, globals(), "flash_forward", mods.any, slopes_stand_in="lse[0]")


@lru_cache(maxsize=None)
def make_forward_kernel(cfg: SimtConfig, causal: bool, dtype: str, mods: Mods = NO_MODS):
    """Compiled kernel for one (config, causal, dtype); cached so each compiles once."""
    problems = cfg.problems()
    if problems:
        raise ValueError(f"SIMT config {cfg} cannot run: {'; '.join(problems)}")
    if dtype not in STORAGE:
        raise ValueError(f"dtype {dtype!r} not in {sorted(STORAGE)}")
    from numba import config as nb_config

    # A register cap is a ptxas option: the simulator's jit() has no such argument.
    cap = {"max_registers": cfg.max_registers} if cfg.max_registers and not nb_config.ENABLE_CUDASIM else {}
    return compile_kernel(("simt_forward", cfg, bool(causal), dtype, mods), kernel_signature(dtype, mods),
                          kernel_source(cfg, causal, dtype, mods), fastmath=FASTMATH, **cap)


def launch(cfg: SimtConfig, q, k, v, out, lse, *, causal: bool, softmax_scale: float,
           dtype: str, d: int, stream=0, mods: Mods = NO_MODS, window=(0, 0), softcap=0.0, alibi=None) -> None:
    """Launch on device arrays (``launch.DeviceView``s or any CUDA array interface): q/out (B, H, Nq, d),
    k/v (B, Hkv, Nk, d), lse (B, H, Nq). mods and their values as mma_forward.launch takes them."""
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if B * H * n_q == 0:
        return
    kernel = make_forward_kernel(cfg, bool(causal), dtype, mods) if mods.any else \
        make_forward_kernel(cfg, bool(causal), dtype)
    grid = ((n_q + cfg.block_q - 1) // cfg.block_q, B * H)
    args = (q, k, v, out, lse, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))
    if mods.any:
        args += launch_args(window, softcap, softmax_scale, alibi, unused_slopes(lse))
    launch_kernel(kernel, grid, cfg.threads, stream, cfg.smem_bytes, *args)
