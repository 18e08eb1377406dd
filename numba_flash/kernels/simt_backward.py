"""SIMT FlashAttention-2 backward (any float dtype, fp32 accumulation): the 3.6.7 recomputation.

Maths (reference/backward.py), with S = scale·Q Kᵀ and P = exp(S − L) rebuilt from the forward's
saved logsumexp L (never stored as an N×N array):

    D  = rowsum(dO ∘ O)                    one fp32 number per query row (preprocessing kernel)
    dP = dO Vᵀ
    dS = P ∘ (dP − D)
    dV = Pᵀ dO          dK = scale · dSᵀ Q          dQ = scale · dS K

As in the forward, the exponent is base 2: P = exp2(S·scale·log2(e) − L·log2(e)). A fully masked
row has L = −inf; it is loaded as L·log2(e) = +inf, so exp2(anything − inf) = 0 and the row adds
nothing (never exp(−inf − (−inf)) = nan).

Three kernels, launched in order on one stream, none using atomics (so results are bitwise
repeatable run to run):

1. ``delta``: D = rowsum(dO ∘ O), one warp-width of lanes per row.
2. ``dkdv``: one thread block per (K/V tile, batch·kv-head). K_j and V_j are loaded once; dK_j
   and dV_j live in registers while the block streams every Q tile (and, for GQA/MQA, every
   query head of its group, so the group sum needs no atomics): Sᵀ and dPᵀ are computed as
   register tiles, turned into Pᵀ and dSᵀ in shared memory, and dV += Pᵀ dO, dK += dSᵀ Q.
3. ``dq``: one thread block per (Q tile, batch·head). Q_i, dO_i, L_i, D_i are loaded once; the
   block streams the K/V tiles, recomputes P and dS (written to shared memory) and accumulates
   dQ_i = dS K in registers. This repeats the S and dP products of kernel 2 (7 tile products
   instead of FA2's 5) in exchange for no atomic adds and deterministic dQ.

Register tiling, as in simt_forward: a block is a ROW_THREADS × COL_THREADS grid of threads. The
block's own tile (K/V rows in ``dkdv``, Q rows in ``dq``) is split over ROW_THREADS; the streamed
tile's rows and the head dim are split over COL_THREADS (head-dim columns in groups of 4). Every
shared-memory operand is read with 16-byte loads (``numba_flash.ptx.mem``): four FMA steps per load
instead of one, because the shared-memory pipe, not the FMA units, limits a scalar SIMT kernel.
Rows are padded by 4 words so that these loads are free of bank conflicts.

Causal (bottom-right aligned, query i sees key j iff j <= i + Nk − Nq): ``dkdv`` starts at the
first Q tile that sees its keys, ``dq`` stops after the last K/V tile its rows see, and only
tiles that cross the diagonal (or the end of the keys) pay for the mask.

fp16 / bf16 inputs are widened to fp32 in shared memory and the gradients rounded back on the
way out: this is a SIMT kernel, not a tensor-core one, so half precision runs at fp32 speed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import config as nb_config
from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

from ..configs import HEAD_DIMS, REGS_PER_SM, SMEM_PER_BLOCK_MAX, head_dim_bucket
from ..launch import launch as launch_kernel
from ..blocks.rows import DELTA_LANES, DELTA_ROWS, element_io, row_dot_helper
from ..ptx import bits_from_f32, f32_from_bits, ld_shared_f32x4, st_shared_f32x4
from ..blocks.numerics import FASTMATH, LOG2E, STORAGE
from ..jit_cache import compile_kernel

# Unsigned indices: Numba then skips its negative-index wraparound test (see simt_forward).
U = uint64

KERNELS = ("dkdv", "dq")


# --------------------------------------------------------------------------------------------
# Tile configurations (data)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackwardConfig:
    """One specialisation of the ``dkdv`` or the ``dq`` kernel.

    ``kernel`` says which tile the block owns: K/V rows (``dkdv``: BLOCK_K own, BLOCK_Q streamed)
    or Q rows (``dq``: BLOCK_Q own, BLOCK_K streamed). Thread (tr, tc) owns rows tr,
    tr + ROW_THREADS, ... of the own tile, rows tc, tc + COL_THREADS, ... of the streamed tile
    (as columns of S or Sᵀ) and head-dim columns tc, tc + COL_THREADS, ... of its accumulators.
    """

    kernel: str
    block_q: int
    block_k: int
    row_threads: int
    col_threads: int
    head_dim: int  # compiled (padded) head dim
    max_registers: int | None = None  # ptxas -maxrregcount, e.g. to fit 2 blocks per SM
    # Tile-load trips (4 floats each) whose global loads are all issued before their shared
    # stores; 0: one trip at a time (a runtime-trip loop: fewest registers, for capped configs).
    stage_trips: int = 0

    @property
    def threads(self) -> int:
        return self.row_threads * self.col_threads

    @property
    def block_own(self) -> int:
        return self.block_k if self.kernel == "dkdv" else self.block_q

    @property
    def block_streamed(self) -> int:
        return self.block_q if self.kernel == "dkdv" else self.block_k

    @property
    def own_rows_per_thread(self) -> int:
        return self.block_own // self.row_threads

    @property
    def streamed_per_thread(self) -> int:
        return self.block_streamed // self.col_threads

    @property
    def d_cols_per_thread(self) -> int:
        return self.head_dim // self.col_threads

    @property
    def qk_stride(self) -> int:
        """Row stride of the Q, dO, K, V tiles: 4 pad words, so 16-byte loads of 8 consecutive
        rows at the same column hit 8 disjoint groups of 4 banks (stride ≡ 4·odd mod 32)."""
        return self.head_dim + 4

    @property
    def p_stride(self) -> int:
        """Row stride of Pᵀ / dSᵀ (dkdv) or dS (dq), padded like qk_stride."""
        return self.block_streamed + 4

    @property
    def smem_words(self) -> dict:
        tiles = {"q": self.block_q, "do": self.block_q, "k": self.block_k, "v": self.block_k}
        words = {name: rows * self.qk_stride for name, rows in tiles.items()}
        n_p = 2 if self.kernel == "dkdv" else 1  # Pᵀ and dSᵀ, or dS alone
        words["p"] = n_p * self.block_own * self.p_stride
        words["rows"] = 2 * self.block_q if self.kernel == "dkdv" else 0  # L·log2(e), D of the Q tile
        return words

    @property
    def smem_bytes(self) -> int:
        return 4 * sum(self.smem_words.values())

    @property
    def accumulators_per_thread(self) -> int:
        """fp32 values each thread keeps live: gradient slices plus the S and dP tiles."""
        r = self.own_rows_per_thread
        grads = (2 if self.kernel == "dkdv" else 1) * r * self.d_cols_per_thread
        return grads + 2 * r * self.streamed_per_thread

    def problems(self) -> list[str]:
        """Why this config cannot run (empty when it can)."""
        out = []
        if self.kernel not in KERNELS:
            out.append(f"kernel={self.kernel!r} not in {KERNELS}")
            return out
        if self.block_own % self.row_threads:
            out.append(f"own tile {self.block_own} not a multiple of row_threads={self.row_threads}")
        if self.block_streamed % self.col_threads:
            out.append(f"streamed tile {self.block_streamed} not a multiple of col_threads={self.col_threads}")
        if self.head_dim % (4 * self.col_threads):
            out.append(f"head_dim={self.head_dim} not a multiple of 4 x col_threads={self.col_threads} "
                       f"(each thread's head-dim columns come in 16-byte groups)")
        for name, n in (("block_q", self.block_q), ("block_k", self.block_k)):
            if n % 4:
                out.append(f"{name}={n} not a multiple of 4 (16-byte loads along the tile)")
        if not 1 <= self.threads <= 1024:
            out.append(f"{self.threads} threads per block (1..1024 allowed)")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            out.append(f"{self.smem_bytes} B shared memory > {SMEM_PER_BLOCK_MAX}")
        if self.max_registers is not None and self.max_registers * self.threads > REGS_PER_SM:
            out.append(f"max_registers={self.max_registers} x {self.threads} threads > {REGS_PER_SM}")
        if self.accumulators_per_thread > 128:  # more and NVVM leaves local arrays in memory
            out.append(f"{self.accumulators_per_thread} accumulator registers per thread > 128")
        return out


def _configs_for(head_dim: int) -> tuple[BackwardConfig, BackwardConfig]:
    # COL_THREADS: the largest of 4, 8, 16 that splits the head dim into 16-byte groups; each
    # thread then holds 4-16 head-dim columns. Up to d = 128: 64 x 64 tiles and 256 threads
    # (128 for d = 16), so dK + dV are 2 x 4 x 8 = 64 accumulators at d = 128, the most that
    # stays in registers beside the S and dP slices. Above: 32 x 32 tiles, same slice sizes.
    # At d = 32 and 64 both kernels fit 128 registers without spilling (ptxas -v) and two blocks'
    # shared memory fit an SM, so the cap doubles the warps per SM (d = 16 has 128 threads).
    col = max(c for c in (4, 8, 16) if head_dim % (4 * c) == 0)
    # At d = 128 shared memory allows one block per SM anyway, so registers are free to stage
    # 16 loads of each tile at once (ptxas: 220 and 168 registers, no spills); capped or 2-block
    # configs keep the one-trip loop (staging spills at the 128-register cap).
    if head_dim <= 128:
        tiles = dict(block_q=64, block_k=64, row_threads=min(256 // col, 32), col_threads=col,
                     max_registers=128 if 32 <= head_dim <= 64 else None,
                     stage_trips=4 if head_dim == 128 else 0)
    else:
        tiles = dict(block_q=32, block_k=32, row_threads=16, col_threads=col)
    return (BackwardConfig("dkdv", head_dim=head_dim, **tiles),
            BackwardConfig("dq", head_dim=head_dim, **tiles))


BACKWARD_CONFIGS = {d: _configs_for(d) for d in HEAD_DIMS}

_bad = {d: [c.problems() for c in cs] for d, cs in BACKWARD_CONFIGS.items() if any(c.problems() for c in cs)}
if _bad:  # a table edit that does not fit is a bug, not a runtime surprise
    raise AssertionError(f"shipped backward configs that cannot run: {_bad}")


def backward_configs(d: int) -> tuple[BackwardConfig, BackwardConfig]:
    """(dkdv config, dq config) for a user head dim d."""
    return BACKWARD_CONFIGS[head_dim_bucket(d)]


# --------------------------------------------------------------------------------------------
# Kernel factories
# --------------------------------------------------------------------------------------------
def delta_signature(dtype: str):
    io = types.Array(STORAGE[dtype], 4, "A")
    return types.void(io, io, types.Array(types.float32, 3, "A"), int32, int32)


def kernel_signature(cfg: BackwardConfig, dtype: str):
    """dkdv(q, k, v, do, lse, delta, dk, dv, ...) / dq(q, k, v, do, lse, delta, dq, ...)."""
    io = types.Array(STORAGE[dtype], 4, "A")
    rows = types.Array(types.float32, 3, "A")
    grads = (io, io) if cfg.kernel == "dkdv" else (io,)
    return types.void(io, io, io, io, rows, rows, *grads, int32, int32, int32, int32, float32, float32)


def delta_source(dtype: str):
    """D[b, h, i] = Σ_c dO[b, h, i, c] · O[b, h, i, c], fp32 (the FA2 preprocessing pass)."""
    row_dot = row_dot_helper(dtype)
    ROWS, LANES = DELTA_ROWS, DELTA_LANES

    def flash_backward_delta(out, dout, delta, n_q, d):
        partial = cuda.shared.array((ROWS, LANES), float32)
        b, h, row, total = row_dot(out, dout, partial, n_q, d)
        if cuda.threadIdx.x % LANES == 0 and row < n_q:
            delta[U(b), U(h), U(row)] = total

    return flash_backward_delta


def kernel_source(cfg: BackwardConfig, causal: bool, dtype: str):
    """The Python kernel for one specialisation (before cuda.jit; compile_ptx tests use it).

    Shared memory holds every tile row-major (row stride ≡ 4·odd words mod 32, rows 16-byte
    aligned) and is read with 16-byte loads: along the head dim for S = Q Kᵀ and dP = dO Vᵀ,
    along the streamed rows for Pᵀ / dSᵀ / dS, along the head dim again for the gradient
    products. One ld.shared.v4 replaces four scalar loads; the shared-memory pipe, not the FMA
    units, is what limits a scalar SIMT kernel.
    """
    BLOCK_Q, BLOCK_K, HEAD_DIM = cfg.block_q, cfg.block_k, cfg.head_dim
    ROW_THREADS, COL_THREADS, THREADS = cfg.row_threads, cfg.col_threads, cfg.threads
    OWN = cfg.own_rows_per_thread       # own-tile rows per thread: tr + a·ROW_THREADS
    STREAMED = cfg.streamed_per_thread  # streamed-tile rows per thread: tc + jj·COL_THREADS
    D_COLS = cfg.d_cols_per_thread      # head-dim columns per thread, in groups of 4:
    D_GROUPS = D_COLS // 4              #   (cc // 4)·COL_STEP + 4·tc + cc % 4
    COL_STEP = 4 * COL_THREADS
    STRIDE = cfg.qk_stride
    P_STRIDE = cfg.p_stride
    words = cfg.smem_words
    Q_OFF = 0
    DO_OFF = Q_OFF + words["q"]
    K_OFF = DO_OFF + words["do"]
    V_OFF = K_OFF + words["k"]
    P_OFF = V_OFF + words["v"]  # Pᵀ (dkdv) or dS (dq)
    DS_OFF = P_OFF + cfg.block_own * P_STRIDE  # dSᵀ (dkdv only)
    ROWS_OFF = P_OFF + words["p"]  # dkdv: L·log2(e) then D of the current Q tile
    CAUSAL = bool(causal)
    NEG_INF = float32(-math.inf)
    POS_INF = float32(math.inf)
    ZERO = float32(0.0)
    STAGE_TRIPS = cfg.stage_trips
    load, store = element_io(dtype == "bfloat16")

    def tile_loader(TILE_ROWS):
        """load(src, b, h, row0, n_rows, d, smem, off): tile[r, e] -> smem[off + r·STRIDE + e],
        four head-dim entries per 16-byte store.

        The global loads go out in batches of STAGE_TRIPS x 4 before their shared stores: the
        loads are generic (they may alias shared memory), so one placed after a store waits for
        it, and with one block per SM each such round trip to L2 stalls the whole SM."""
        CHUNKS = HEAD_DIM // 4
        TOTAL = TILE_ROWS * CHUNKS
        TRIPS = (TOTAL + THREADS - 1) // THREADS
        BATCH = max(1, min(STAGE_TRIPS, TRIPS))
        BATCHES = (TRIPS + BATCH - 1) // BATCH  # constant trip counts: staging stays in registers

        @cuda.jit(device=True, inline=True)
        def load_tile_staged(src, b, h, row0, n_rows, d, smem, off):
            stage = cuda.local.array((BATCH, 4), float32)
            tid = cuda.threadIdx.x
            for n0 in range(BATCHES):
                for n in range(BATCH):
                    idx = tid + (n0 * BATCH + n) * THREADS
                    r = idx // CHUNKS
                    e = 4 * (idx - r * CHUNKS)  # fastest across lanes: coalesced global reads
                    row = row0 + r
                    if idx < TOTAL:
                        for u in range(4):
                            stage[n, u] = load(src, b, h, row, e + u, n_rows, d)
                for n in range(BATCH):
                    idx = tid + (n0 * BATCH + n) * THREADS
                    r = idx // CHUNKS
                    e = 4 * (idx - r * CHUNKS)
                    if idx < TOTAL:
                        st_shared_f32x4(smem, U(off + r * STRIDE + e), stage[n, 0], stage[n, 1], stage[n, 2], stage[n, 3])

        @cuda.jit(device=True, inline=True)
        def load_tile_loop(src, b, h, row0, n_rows, d, smem, off):
            for idx in range(cuda.threadIdx.x, TOTAL, THREADS):
                r = idx // CHUNKS
                e = 4 * (idx - r * CHUNKS)  # fastest across lanes: coalesced global reads
                row = row0 + r
                st_shared_f32x4(smem, U(off + r * STRIDE + e),
                                load(src, b, h, row, e, n_rows, d), load(src, b, h, row, e + 1, n_rows, d),
                                load(src, b, h, row, e + 2, n_rows, d), load(src, b, h, row, e + 3, n_rows, d))

        return load_tile_staged if STAGE_TRIPS else load_tile_loop

    load_q_tile = tile_loader(BLOCK_Q)  # Q and dO rows
    load_k_tile = tile_loader(BLOCK_K)  # K and V rows

    @cuda.jit(device=True, inline=True)
    def row_stats(lse, delta, b, h, row, n_q):
        """(L·log2(e), D) of one query row; a masked or missing row gives (+inf, 0): P = 0."""
        l2 = POS_INF
        dd = ZERO
        if row < n_q:
            lv = lse[U(b), U(h), U(row)]
            if lv != NEG_INF:
                l2 = lv * float32(LOG2E)
            dd = delta[U(b), U(h), U(row)]
        return l2, dd

    @cuda.jit(device=True, inline=True)
    def load4(smem, off, frag, i):
        """frag[i, 0:4] = smem[off:off + 4] in one 16-byte load."""
        x0, x1, x2, x3 = ld_shared_f32x4(smem, U(off))
        frag[i, 0] = x0
        frag[i, 1] = x1
        frag[i, 2] = x2
        frag[i, 3] = x3

    @cuda.jit(device=True, inline=True)
    def load_d_cols(smem, row_off, tc, frag):
        """frag[cc] = this thread's head-dim columns of one shared row (D_GROUPS 16-byte loads)."""
        for g in range(D_GROUPS):
            x0, x1, x2, x3 = ld_shared_f32x4(smem, U(row_off + g * COL_STEP + 4 * tc))
            frag[4 * g] = x0
            frag[4 * g + 1] = x1
            frag[4 * g + 2] = x2
            frag[4 * g + 3] = x3

    @cuda.jit(device=True, inline=True)
    def two_products(smem, a_off, b_off, c_off, d_off, a_row, b_row, A, B, a4, b4, c4, d4, x, y):
        """x = A·Bᵀ slice over the head dim (rows a_row of the A tile, b_row of the B tile), and
        y likewise for the C and D tiles at the same rows: S and dP in one pass over e."""
        for i in range(A):
            for j in range(B):
                x[i, j] = ZERO
                y[i, j] = ZERO
        for e0 in range(0, HEAD_DIM, 4):
            for i in range(A):
                load4(smem, a_off + a_row[i] + e0, a4, i)
                load4(smem, c_off + a_row[i] + e0, c4, i)
            for j in range(B):
                load4(smem, b_off + b_row[j] + e0, b4, j)
                load4(smem, d_off + b_row[j] + e0, d4, j)
            for u in range(4):  # constant trip counts: unrolled, everything in registers
                for i in range(A):
                    for j in range(B):
                        x[i, j] = cuda.fma(a4[i, u], b4[j, u], x[i, j])
                        y[i, j] = cuda.fma(c4[i, u], d4[j, u], y[i, j])

    if cfg.kernel == "dkdv":
        K_ROWS, Q_COLS = OWN, STREAMED

        def flash_backward_dkdv(q, k, v, do, lse, delta, dk, dv, n_q, n_k, d, group, scale_log2, scale):
            smem = cuda.shared.array(0, float32)
            tid = cuda.threadIdx.x
            tr = tid // COL_THREADS
            tc = tid - tr * COL_THREADS
            k0 = cuda.blockIdx.x * BLOCK_K  # causal: tile 0 has the most Q tiles and starts first
            bh = cuda.blockIdx.y
            n_kv_heads = k.shape[1]
            b = bh // n_kv_heads
            h_kv = bh - b * n_kv_heads
            shift = n_k - n_q  # bottom-right causal alignment: query i sees key j iff j <= i + shift

            load_k_tile(k, b, h_kv, k0, n_k, d, smem, K_OFF)
            load_k_tile(v, b, h_kv, k0, n_k, d, smem, V_OFF)

            dk_acc = cuda.local.array((K_ROWS, D_COLS), float32)
            dv_acc = cuda.local.array((K_ROWS, D_COLS), float32)
            s = cuda.local.array((K_ROWS, Q_COLS), float32)   # Sᵀ slice
            dp = cuda.local.array((K_ROWS, Q_COLS), float32)  # dPᵀ slice
            k4 = cuda.local.array((K_ROWS, 4), float32)
            v4 = cuda.local.array((K_ROWS, 4), float32)
            q4 = cuda.local.array((Q_COLS, 4), float32)
            do4 = cuda.local.array((Q_COLS, 4), float32)
            p4 = cuda.local.array((K_ROWS, 4), float32)
            ds4 = cuda.local.array((K_ROWS, 4), float32)
            q_d = cuda.local.array(D_COLS, float32)
            do_d = cuda.local.array(D_COLS, float32)
            # Loop-invariant shared-memory row offsets of this thread's K/V, Q/dO and Pᵀ rows.
            k_row = cuda.local.array(K_ROWS, int64)
            p_row = cuda.local.array(K_ROWS, int64)
            q_row = cuda.local.array(Q_COLS, int64)
            for a in range(K_ROWS):
                k_row[a] = (tr + a * ROW_THREADS) * STRIDE
                p_row[a] = (tr + a * ROW_THREADS) * P_STRIDE
                for c in range(D_COLS):
                    dk_acc[a, c] = ZERO
                    dv_acc[a, c] = ZERO
            for jj in range(Q_COLS):
                q_row[jj] = (tc + jj * COL_THREADS) * STRIDE

            # Causal: query rows i < k0 - shift see none of this tile's keys; skip their Q tiles.
            first_q_tile = 0
            if CAUSAL and k0 - shift > 0:
                first_q_tile = (k0 - shift) // BLOCK_Q
            n_q_tiles = (n_q + BLOCK_Q - 1) // BLOCK_Q

            for h in range(h_kv * group, h_kv * group + group):  # GQA: the group's query heads
                for i_tile in range(first_q_tile, n_q_tiles):
                    q0 = i_tile * BLOCK_Q
                    load_q_tile(q, b, h, q0, n_q, d, smem, Q_OFF)
                    load_q_tile(do, b, h, q0, n_q, d, smem, DO_OFF)
                    for r in range(tid, BLOCK_Q, THREADS):
                        l2, dd = row_stats(lse, delta, b, h, q0 + r, n_q)
                        smem[U(ROWS_OFF + r)] = l2
                        smem[U(ROWS_OFF + BLOCK_Q + r)] = dd
                    cuda.syncthreads()

                    # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for this thread's K_ROWS x Q_COLS slice.
                    two_products(smem, K_OFF, Q_OFF, V_OFF, DO_OFF, k_row, q_row, K_ROWS, Q_COLS,
                                 k4, q4, v4, do4, s, dp)

                    # Pᵀ = exp2(Sᵀ·scale·log2(e) − L·log2(e)), dSᵀ = Pᵀ ∘ (dPᵀ − D), to shared memory.
                    needs_mask = k0 + BLOCK_K > n_k
                    if CAUSAL:
                        needs_mask = needs_mask or (k0 + BLOCK_K - 1 > q0 + shift)
                    for jj in range(Q_COLS):
                        i = tc + jj * COL_THREADS
                        l2 = smem[U(ROWS_OFF + i)]
                        dd = smem[U(ROWS_OFF + BLOCK_Q + i)]
                        for a in range(K_ROWS):
                            x = s[a, jj] * scale_log2 - l2
                            if needs_mask:
                                col = k0 + tr + a * ROW_THREADS
                                if col >= n_k or (CAUSAL and col > q0 + i + shift):
                                    x = NEG_INF
                            p = math.exp2(x)
                            smem[U(P_OFF + p_row[a] + i)] = p
                            smem[U(DS_OFF + p_row[a] + i)] = p * (dp[a, jj] - dd)
                    cuda.syncthreads()

                    # dV += Pᵀ dO, dK += dSᵀ Q (this thread's K_ROWS x D_COLS slices).
                    for i0 in range(0, BLOCK_Q, 4):
                        for a in range(K_ROWS):
                            load4(smem, P_OFF + p_row[a] + i0, p4, a)
                            load4(smem, DS_OFF + p_row[a] + i0, ds4, a)
                        for u in range(4):
                            load_d_cols(smem, DO_OFF + (i0 + u) * STRIDE, tc, do_d)
                            load_d_cols(smem, Q_OFF + (i0 + u) * STRIDE, tc, q_d)
                            for a in range(K_ROWS):
                                for c in range(D_COLS):
                                    dv_acc[a, c] = cuda.fma(p4[a, u], do_d[c], dv_acc[a, c])
                                    dk_acc[a, c] = cuda.fma(ds4[a, u], q_d[c], dk_acc[a, c])
                    cuda.syncthreads()  # before the next tile overwrites Q, dO, Pᵀ, dSᵀ, L, D

            # Every K/V row is written, zeros included (no query sees it, or Nq = 0).
            for a in range(K_ROWS):
                row = k0 + tr + a * ROW_THREADS
                if row < n_k:
                    for c in range(D_COLS):
                        col = (c // 4) * COL_STEP + 4 * tc + c % 4
                        if col < d:
                            store(dk, b, h_kv, row, col, dk_acc[a, c] * scale)
                            store(dv, b, h_kv, row, col, dv_acc[a, c])

        return flash_backward_dkdv

    Q_ROWS, K_COLS = OWN, STREAMED

    def flash_backward_dq(q, k, v, do, lse, delta, dq, n_q, n_k, d, group, scale_log2, scale):
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
        shift = n_k - n_q

        load_q_tile(q, b, h, q0, n_q, d, smem, Q_OFF)
        load_q_tile(do, b, h, q0, n_q, d, smem, DO_OFF)

        dq_acc = cuda.local.array((Q_ROWS, D_COLS), float32)
        s = cuda.local.array((Q_ROWS, K_COLS), float32)   # S slice
        dp = cuda.local.array((Q_ROWS, K_COLS), float32)  # dP slice
        l2_i = cuda.local.array(Q_ROWS, float32)  # L·log2(e) and D of this thread's rows
        d_i = cuda.local.array(Q_ROWS, float32)
        q4 = cuda.local.array((Q_ROWS, 4), float32)
        do4 = cuda.local.array((Q_ROWS, 4), float32)
        k4 = cuda.local.array((K_COLS, 4), float32)
        v4 = cuda.local.array((K_COLS, 4), float32)
        ds4 = cuda.local.array((Q_ROWS, 4), float32)
        k_d = cuda.local.array(D_COLS, float32)
        q_row = cuda.local.array(Q_ROWS, int64)
        ds_row = cuda.local.array(Q_ROWS, int64)
        k_row = cuda.local.array(K_COLS, int64)
        for a in range(Q_ROWS):
            q_row[a] = (tr + a * ROW_THREADS) * STRIDE
            ds_row[a] = (tr + a * ROW_THREADS) * P_STRIDE
            l2, dd = row_stats(lse, delta, b, h, q0 + tr + a * ROW_THREADS, n_q)
            l2_i[a] = l2
            d_i[a] = dd
            for c in range(D_COLS):
                dq_acc[a, c] = ZERO
        for jj in range(K_COLS):
            k_row[jj] = (tc + jj * COL_THREADS) * STRIDE

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
            load_k_tile(k, b, h_kv, k0, n_k, d, smem, K_OFF)
            load_k_tile(v, b, h_kv, k0, n_k, d, smem, V_OFF)
            cuda.syncthreads()

            # S = Q Kᵀ and dP = dO Vᵀ for this thread's Q_ROWS x K_COLS slice.
            two_products(smem, Q_OFF, K_OFF, DO_OFF, V_OFF, q_row, k_row, Q_ROWS, K_COLS,
                         q4, k4, do4, v4, s, dp)

            # dS = P ∘ (dP − D) with P = exp2(S·scale·log2(e) − L·log2(e)), to shared memory.
            needs_mask = k0 + BLOCK_K > n_k
            if CAUSAL:
                needs_mask = needs_mask or (k0 + BLOCK_K - 1 > q0 + shift)
            for a in range(Q_ROWS):
                row = q0 + tr + a * ROW_THREADS
                for jj in range(K_COLS):
                    x = s[a, jj] * scale_log2 - l2_i[a]
                    if needs_mask:
                        col = k0 + tc + jj * COL_THREADS
                        if col >= n_k or (CAUSAL and col > row + shift):
                            x = NEG_INF
                    smem[U(P_OFF + ds_row[a] + tc + jj * COL_THREADS)] = math.exp2(x) * (dp[a, jj] - d_i[a])
            cuda.syncthreads()

            # dQ += dS K
            for t0 in range(0, BLOCK_K, 4):
                for a in range(Q_ROWS):
                    load4(smem, P_OFF + ds_row[a] + t0, ds4, a)
                for u in range(4):
                    load_d_cols(smem, K_OFF + (t0 + u) * STRIDE, tc, k_d)
                    for a in range(Q_ROWS):
                        for c in range(D_COLS):
                            dq_acc[a, c] = cuda.fma(ds4[a, u], k_d[c], dq_acc[a, c])
            cuda.syncthreads()  # before the next tile overwrites K, V and dS

        for a in range(Q_ROWS):
            row = q0 + tr + a * ROW_THREADS
            if row < n_q:
                for c in range(D_COLS):
                    col = (c // 4) * COL_STEP + 4 * tc + c % 4
                    if col < d:
                        store(dq, b, h, row, col, dq_acc[a, c] * scale)

    return flash_backward_dq


@lru_cache(maxsize=None)
def make_delta_kernel(dtype: str):
    if dtype not in STORAGE:
        raise ValueError(f"dtype {dtype!r} not in {sorted(STORAGE)}")
    return compile_kernel(("simt_backward.delta", dtype), delta_signature(dtype), delta_source(dtype),
                          fastmath=FASTMATH)


@lru_cache(maxsize=None)
def make_backward_kernel(cfg: BackwardConfig, causal: bool, dtype: str):
    """Compiled ``dkdv`` or ``dq`` kernel for one (config, causal, dtype); cached."""
    problems = cfg.problems()
    if problems:
        raise ValueError(f"backward config {cfg} cannot run: {'; '.join(problems)}")
    if dtype not in STORAGE:
        raise ValueError(f"dtype {dtype!r} not in {sorted(STORAGE)}")
    cap = {} if cfg.max_registers is None or nb_config.ENABLE_CUDASIM else {"max_registers": cfg.max_registers}
    return compile_kernel(("simt_backward", cfg, bool(causal), dtype), kernel_signature(cfg, dtype),
                          kernel_source(cfg, causal, dtype), fastmath=FASTMATH, **cap)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def launch(cfgs, q, k, v, out, dout, lse, delta, dq, dk, dv, *, causal: bool, softmax_scale: float,
           dtype: str, d: int, stream=0) -> None:
    """Launch the three kernels on device arrays (``launch.DeviceView``s or any CUDA array interface).

    q, out, dout, dq: (B, H, Nq, d); k, v, dk, dv: (B, Hkv, Nk, d); lse, delta: (B, H, Nq) fp32
    (delta is scratch, written here). ``cfgs`` = (dkdv config, dq config).
    """
    cfg_kv, cfg_q = cfgs
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    group = H // Hkv
    scalars = (n_q, n_k, d, group, float32(softmax_scale * LOG2E), float32(softmax_scale))
    if B * H * n_q > 0:
        delta_grid = ((n_q + DELTA_ROWS - 1) // DELTA_ROWS, B * H)
        launch_kernel(make_delta_kernel(dtype), delta_grid, DELTA_ROWS * DELTA_LANES, stream, 0,
                      out, dout, delta, n_q, d)
    if B * Hkv * n_k > 0:  # runs for Nq = 0 too: it writes dK = dV = 0
        grid = ((n_k + cfg_kv.block_k - 1) // cfg_kv.block_k, B * Hkv)
        launch_kernel(make_backward_kernel(cfg_kv, bool(causal), dtype), grid, cfg_kv.threads, stream, cfg_kv.smem_bytes,
                      q, k, v, dout, lse, delta, dk, dv, *scalars)
    if B * H * n_q > 0:  # runs for Nk = 0 too: it writes dQ = 0
        grid = ((n_q + cfg_q.block_q - 1) // cfg_q.block_q, B * H)
        launch_kernel(make_backward_kernel(cfg_q, bool(causal), dtype), grid, cfg_q.threads, stream, cfg_q.smem_bytes,
                      q, k, v, dout, lse, delta, dq, *scalars)
