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

from ..configs import SimtConfig
from ..launch import launch as launch_kernel
from ..vec import bits_from_f32, f32_from_bits, ld_shared_f32x4, st_shared_f32x4

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# How the kernel reads and writes the input dtype. bfloat16 travels as uint16 bit patterns
# (Numba has no bfloat16 array type) and is widened by a shift through an aliased shared word.
STORAGE = {"float32": types.float32, "float16": types.float16, "bfloat16": types.uint16}

# Only the flags that cannot change -inf/nan semantics: masking relies on exact -inf.
FASTMATH = {"contract", "arcp", "afn"}


def kernel_signature(dtype: str):
    """The one signature each specialisation is compiled for: strided 4-D arrays ('A' layout)."""
    io = types.Array(STORAGE[dtype], 4, "A")
    lse = types.Array(types.float32, 3, "A")
    return types.void(io, io, io, io, lse, int32, int32, int32, int32, float32)


def kernel_source(cfg: SimtConfig, causal: bool, dtype: str):
    """The Python kernel for one specialisation (before cuda.jit; compile_ptx tests use it)."""
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
    CAUSAL = bool(causal)
    BF16 = dtype == "bfloat16"
    UNROLL = 4  # inner-product steps per unrolled group (divides every HEAD_DIM and BLOCK_K)
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

    def flash_forward(q, k, v, out, lse, n_q, n_k, d, group, scale_log2):
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

        for j in range(n_tiles):
            k0 = j * BLOCK_K
            load_transposed(k, b, h_kv, k0, n_k, d, smem, K_OFF, KT, BLOCK_K)
            if not SHARE_KV:
                load_rows(v, b, h_kv, k0, n_k, d, smem, V_OFF, VS, BLOCK_K)
            cuda.syncthreads()

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
            for i in range(ROWS):
                r = (i // 4) * ROW_STEP + 4 * tr + i % 4
                row_max = NEG_INF
                for jj in range(S_COLS):
                    x = s[i, jj] * scale_log2
                    if needs_mask:
                        col = k0 + (jj // 4) * COL_STEP + 4 * tc + jj % 4
                        if col >= n_k or (CAUSAL and col > q0 + r + shift):
                            x = NEG_INF
                    s[i, jj] = x
                    row_max = max(row_max, x)
                smem[U(RED_OFF + r * COL_THREADS + tc)] = row_max
            cuda.syncthreads()
            if SHARE_KV:  # every thread is past S = QK^T, so K's buffer is free for V
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
            inv_l = float32(1.0) / l_row if l_row > ZERO else ZERO
            if row < n_q:
                if tc == 0:
                    if l_row > ZERO:
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

    return flash_forward


@lru_cache(maxsize=None)
def make_forward_kernel(cfg: SimtConfig, causal: bool, dtype: str):
    """Compiled kernel for one (config, causal, dtype); cached so each compiles once."""
    problems = cfg.problems()
    if problems:
        raise ValueError(f"SIMT config {cfg} cannot run: {'; '.join(problems)}")
    if dtype not in STORAGE:
        raise ValueError(f"dtype {dtype!r} not in {sorted(STORAGE)}")
    from numba import config as nb_config

    # A register cap is a ptxas option: the simulator's jit() has no such argument.
    cap = {"max_registers": cfg.max_registers} if cfg.max_registers and not nb_config.ENABLE_CUDASIM else {}
    return cuda.jit(kernel_signature(dtype), fastmath=FASTMATH, **cap)(kernel_source(cfg, causal, dtype))


def launch(cfg: SimtConfig, q, k, v, out, lse, *, causal: bool, softmax_scale: float,
           dtype: str, d: int, stream=0) -> None:
    """Launch on device arrays (``launch.DeviceView``s or any CUDA array interface): q/out (B, H, Nq, d),
    k/v (B, Hkv, Nk, d), lse (B, H, Nq)."""
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if B * H * n_q == 0:
        return
    kernel = make_forward_kernel(cfg, bool(causal), dtype)
    grid = ((n_q + cfg.block_q - 1) // cfg.block_q, B * H)
    launch_kernel(kernel, grid, cfg.threads, stream, cfg.smem_bytes,
                  q, k, v, out, lse, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E))
