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

from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

# Indices are cast to unsigned (a no-op bitcast from int64) before indexing: Numba then skips the negative-index
# wraparound test it otherwise emits for every access (64-bit compare, shift, add).
U = uint64

from ..configs import SMEM_STATIC_MAX, SimtConfig

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
    ROWS = cfg.rows_per_thread
    S_COLS = cfg.s_cols_per_thread
    O_COLS = cfg.o_cols_per_thread
    QK_STRIDE = cfg.qk_stride
    words = cfg.smem_words
    Q_OFF = 0
    K_OFF = Q_OFF + words["q"]
    V_OFF = K_OFF if cfg.share_kv else K_OFF + words["k"]
    V_STRIDE = QK_STRIDE if cfg.share_kv else HEAD_DIM
    SHARE_KV = cfg.share_kv
    P_OFF = K_OFF + words["k"] + words["v"]
    RED_OFF = P_OFF + words["p"]
    Q_LOADS = BLOCK_Q * HEAD_DIM // THREADS + (BLOCK_Q * HEAD_DIM % THREADS > 0)
    KV_LOADS = BLOCK_K * HEAD_DIM // THREADS + (BLOCK_K * HEAD_DIM % THREADS > 0)
    CAUSAL = bool(causal)
    UNROLL = 4  # inner-product steps per unrolled group (divides every HEAD_DIM and BLOCK_K)
    BF16 = dtype == "bfloat16"
    NEG_INF = float32(-math.inf)

    @cuda.jit(device=True, inline=True)
    def load_tile(src, b, h, row0, n_rows, d, smem_f, smem_u, off, stride, N_LOADS, TILE_ROWS):
        # Rows past the sequence and columns past d are zero-filled: padded head dims then add
        # nothing to q·k, and masked probabilities (exactly 0) never meet garbage V values.
        tid = cuda.threadIdx.x
        for it in range(N_LOADS):
            idx = tid + it * THREADS
            if idx < TILE_ROWS * HEAD_DIM:
                r = idx // HEAD_DIM
                c = idx - r * HEAD_DIM
                row = row0 + r
                if row < n_rows and c < d:
                    x = src[U(b), U(h), U(row), U(c)]
                    if BF16:
                        smem_u[U(off + r * stride + c)] = uint32(x) << 16
                    else:
                        smem_f[U(off + r * stride + c)] = float32(x)
                else:
                    smem_f[U(off + r * stride + c)] = float32(0.0)

    def flash_forward(q, k, v, out, lse, n_q, n_k, d, group, scale_log2):
        smem_f = cuda.shared.array(0, float32)
        smem_u = cuda.shared.array(0, uint32)  # same bytes, seen as bits (bf16 in/out)
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

        load_tile(q, b, h, q0, n_q, d, smem_f, smem_u, Q_OFF, QK_STRIDE, Q_LOADS, BLOCK_Q)

        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)  # per-thread partial sums; reduced once at the end
        acc = cuda.local.array((ROWS, O_COLS), float32)
        s = cuda.local.array((ROWS, S_COLS), float32)
        a_frag = cuda.local.array(ROWS, float32)
        # Loop-invariant shared-memory row offsets of this thread's Q, K and P rows.
        q_row = cuda.local.array(ROWS, int64)
        p_row = cuda.local.array(ROWS, int64)
        k_row = cuda.local.array(S_COLS, int64)
        for i in range(ROWS):
            q_row[i] = Q_OFF + (tr + i * ROW_THREADS) * QK_STRIDE
            p_row[i] = P_OFF + (tr + i * ROW_THREADS) * BLOCK_K
        for jj in range(S_COLS):
            k_row[jj] = K_OFF + (tc + jj * COL_THREADS) * QK_STRIDE
        k_frag = cuda.local.array(S_COLS, float32)
        v_frag = cuda.local.array(O_COLS, float32)
        for i in range(ROWS):
            m_i[i] = NEG_INF
            l_i[i] = float32(0.0)
            for c in range(O_COLS):
                acc[i, c] = float32(0.0)

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
            load_tile(k, b, h_kv, k0, n_k, d, smem_f, smem_u, K_OFF, QK_STRIDE, KV_LOADS, BLOCK_K)
            if not SHARE_KV:
                load_tile(v, b, h_kv, k0, n_k, d, smem_f, smem_u, V_OFF, V_STRIDE, KV_LOADS, BLOCK_K)
            cuda.syncthreads()

            # S = Q K^T for this thread's ROWS x S_COLS slice (register tiling).
            for i in range(ROWS):
                for jj in range(S_COLS):
                    s[i, jj] = float32(0.0)
            for e0 in range(0, HEAD_DIM, UNROLL):
                for u in range(UNROLL):  # constant trip count: fully unrolled, loads run ahead
                    for i in range(ROWS):
                        a_frag[i] = smem_f[U(q_row[i] + e0 + u)]
                    for jj in range(S_COLS):
                        k_frag[jj] = smem_f[U(k_row[jj] + e0 + u)]
                    for i in range(ROWS):
                        for jj in range(S_COLS):
                            s[i, jj] = cuda.fma(a_frag[i], k_frag[jj], s[i, jj])

            # Mask only where the tile crosses the end of the keys or the causal diagonal.
            needs_mask = k0 + BLOCK_K > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_K - 1 > q0 + shift)
            for i in range(ROWS):
                row = q0 + tr + i * ROW_THREADS
                row_max = NEG_INF
                for jj in range(S_COLS):
                    x = s[i, jj] * scale_log2
                    if needs_mask:
                        col = k0 + tc + jj * COL_THREADS
                        if col >= n_k or (CAUSAL and col > row + shift):
                            x = NEG_INF
                    s[i, jj] = x
                    row_max = max(row_max, x)
                smem_f[U(RED_OFF + (tr + i * ROW_THREADS) * COL_THREADS + tc)] = row_max
            cuda.syncthreads()
            if SHARE_KV:  # every thread is past S = QK^T, so K's buffer is free for V
                load_tile(v, b, h_kv, k0, n_k, d, smem_f, smem_u, V_OFF, V_STRIDE, KV_LOADS, BLOCK_K)

            for i in range(ROWS):
                r = tr + i * ROW_THREADS
                m_new = m_i[i]
                for t in range(COL_THREADS):
                    m_new = max(m_new, smem_f[U(RED_OFF + r * COL_THREADS + t)])
                # A row with nothing visible yet keeps m = -inf; subtract 0 so exp gives 0, not nan.
                m_use = float32(0.0) if m_new == NEG_INF else m_new
                alpha = math.exp2(m_i[i] - m_use)
                row_sum = float32(0.0)
                for jj in range(S_COLS):
                    p = math.exp2(s[i, jj] - m_use)
                    row_sum += p
                    smem_f[U(P_OFF + r * BLOCK_K + tc + jj * COL_THREADS)] = p
                l_i[i] = alpha * l_i[i] + row_sum
                for c in range(O_COLS):
                    acc[i, c] *= alpha
                m_i[i] = m_new
            cuda.syncthreads()

            # acc += P V_j
            for t0 in range(0, BLOCK_K, UNROLL):
                for u in range(UNROLL):
                    for i in range(ROWS):
                        a_frag[i] = smem_f[U(p_row[i] + t0 + u)]
                    for c in range(O_COLS):
                        v_frag[c] = smem_f[U(V_OFF + (t0 + u) * V_STRIDE + tc + c * COL_THREADS)]
                    for i in range(ROWS):
                        for c in range(O_COLS):
                            acc[i, c] = cuda.fma(a_frag[i], v_frag[c], acc[i, c])
            cuda.syncthreads()  # before the next tile overwrites K, V, P and the row buffer

        # l_i: sum the per-thread partials of each row.
        for i in range(ROWS):
            smem_f[U(RED_OFF + (tr + i * ROW_THREADS) * COL_THREADS + tc)] = l_i[i]
        cuda.syncthreads()
        for i in range(ROWS):
            r = tr + i * ROW_THREADS
            row = q0 + r
            l_row = float32(0.0)
            for t in range(COL_THREADS):
                l_row += smem_f[U(RED_OFF + r * COL_THREADS + t)]
            # A fully masked row (l = 0) is defined as O = 0, L = -inf.
            inv_l = float32(1.0) / l_row if l_row > float32(0.0) else float32(0.0)
            if row < n_q:
                if tc == 0:
                    if l_row > float32(0.0):
                        lse[U(b), U(h), U(row)] = (m_i[i] + math.log2(l_row)) * float32(LN2)
                    else:
                        lse[U(b), U(h), U(row)] = NEG_INF
                for c in range(O_COLS):
                    col = tc + c * COL_THREADS
                    if col < d:
                        o = acc[i, c] * inv_l
                        if BF16:
                            # Round to nearest even through this thread's own Q slot (no sync needed).
                            slot = U(Q_OFF + r * QK_STRIDE + col)
                            smem_f[slot] = o
                            bits = smem_u[slot]
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
    return cuda.jit(kernel_signature(dtype), fastmath=FASTMATH)(kernel_source(cfg, causal, dtype))


def _allow_dynamic_smem(kernel, nbytes: int) -> None:
    """Opt in to more than 48 KiB of dynamic shared memory (a no-op under the simulator)."""
    from numba import config as nb_config

    if nbytes <= SMEM_STATIC_MAX or nb_config.ENABLE_CUDASIM:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    for compiled in kernel.overloads.values():
        cufunc = compiled._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)


_opted_in: set = set()


def launch(cfg: SimtConfig, q, k, v, out, lse, *, causal: bool, softmax_scale: float,
           dtype: str, d: int, stream=0) -> None:
    """Launch on numba device arrays: q/out (B, H, Nq, d), k/v (B, Hkv, Nk, d), lse (B, H, Nq)."""
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    if B * H * n_q == 0:
        return
    kernel = make_forward_kernel(cfg, bool(causal), dtype)
    key = (cfg, bool(causal), dtype, _device_id())
    if key not in _opted_in:
        _allow_dynamic_smem(kernel, cfg.smem_bytes)
        _opted_in.add(key)
    grid = ((n_q + cfg.block_q - 1) // cfg.block_q, B * H)
    kernel[grid, cfg.threads, stream, cfg.smem_bytes](
        q, k, v, out, lse, n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E)
    )


def _device_id() -> int:
    from numba import config as nb_config

    if nb_config.ENABLE_CUDASIM:
        return 0
    return cuda.get_current_device().id
