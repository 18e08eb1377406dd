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
tile's rows and the head dim are split over COL_THREADS, interleaved so that neighbouring lanes
hit neighbouring banks. Shared-memory rows of Q, dO, K, V are padded by one word (reads down a
column hit distinct banks); Pᵀ, dSᵀ and dS rows are padded so that the rows one warp writes start
COL_THREADS banks apart.

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

from numba import cuda, float32, int32, int64, types, uint16, uint32, uint64

from ..configs import HEAD_DIMS, SMEM_PER_BLOCK_MAX, head_dim_bucket
from .simt_forward import FASTMATH, LOG2E, STORAGE, _allow_dynamic_smem, _device_id

# Unsigned indices: Numba then skips its negative-index wraparound test (see simt_forward).
U = uint64

KERNELS = ("dkdv", "dq")
UNROLL = 4  # inner-product steps per unrolled group (divides every tile size and HEAD_DIM)
DELTA_ROWS, DELTA_LANES = 8, 32  # the D kernel: 8 rows per block, 32 lanes summing each row


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
        return self.head_dim + 1  # one pad word: a column read of 32 rows hits 32 banks

    @property
    def p_stride(self) -> int:
        """Row stride of Pᵀ / dSᵀ / dS: ≡ COL_THREADS (mod 32), so the rows one warp writes
        start COL_THREADS banks apart and its writes are conflict-free."""
        n, ct = self.block_streamed, self.col_threads
        return n if ct >= 32 else n + (ct - n) % 32

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
        if self.head_dim % self.col_threads:
            out.append(f"head_dim={self.head_dim} not a multiple of col_threads={self.col_threads}")
        for name, n in (("block_q", self.block_q), ("block_k", self.block_k), ("head_dim", self.head_dim)):
            if n % UNROLL:
                out.append(f"{name}={n} not a multiple of the unroll factor {UNROLL}")
        if not 1 <= self.threads <= 1024:
            out.append(f"{self.threads} threads per block (1..1024 allowed)")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            out.append(f"{self.smem_bytes} B shared memory > {SMEM_PER_BLOCK_MAX}")
        if self.accumulators_per_thread > 128:  # more and NVVM leaves local arrays in memory
            out.append(f"{self.accumulators_per_thread} accumulator registers per thread > 128")
        return out


def _configs_for(head_dim: int) -> tuple[BackwardConfig, BackwardConfig]:
    # 64 x 64 tiles, 256 threads, 4 own rows x 4 streamed columns per thread, up to 8 head-dim
    # columns: dK + dV = 64 accumulators for d = 128, the most that stays in registers.
    # Above d = 128, 32 x 32 tiles and 16 columns per thread keep the slices at the same size.
    if head_dim <= 128:
        tiles = dict(block_q=64, block_k=64, row_threads=16, col_threads=16)
    else:
        tiles = dict(block_q=32, block_k=32, row_threads=16, col_threads=16)
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


def _widen_and_round(BF16: bool):
    """Device helpers shared by all kernels: bf16 travels as uint16 bits (no bfloat16 arrays in
    Numba) and is converted through a shared-memory word seen both as float32 and as uint32."""

    @cuda.jit(device=True, inline=True)
    def put(smem_f, smem_u, slot, x):
        if BF16:
            smem_u[slot] = uint32(x) << 16
        else:
            smem_f[slot] = float32(x)

    @cuda.jit(device=True, inline=True)
    def store(dst, b, h, row, col, x, smem_f, smem_u, slot):
        # slot: a shared word only this thread uses at this point (no sync needed)
        if BF16:
            smem_f[slot] = x
            bits = smem_u[slot]
            bits = bits + uint32(0x7FFF) + ((bits >> 16) & uint32(1))  # round to nearest even
            dst[U(b), U(h), U(row), U(col)] = uint16(bits >> 16)
        else:
            dst[U(b), U(h), U(row), U(col)] = x

    return put, store


def delta_source(dtype: str):
    """D[b, h, i] = Σ_c dO[b, h, i, c] · O[b, h, i, c], fp32 (the FA2 preprocessing pass)."""
    BF16 = dtype == "bfloat16"
    put, _ = _widen_and_round(BF16)
    ROWS, LANES = DELTA_ROWS, DELTA_LANES

    def flash_backward_delta(out, dout, delta, n_q, d):
        smem_f = cuda.shared.array(0, float32)
        smem_u = cuda.shared.array(0, uint32)
        tid = cuda.threadIdx.x
        tr = tid // LANES
        lane = tid - tr * LANES
        bh = cuda.blockIdx.y
        b = bh // out.shape[1]
        h = bh - b * out.shape[1]
        row = cuda.blockIdx.x * ROWS + tr
        slot = U(tid)  # this thread's word: bf16 widening, then its partial sum
        acc = float32(0.0)
        if row < n_q:
            for c in range(lane, d, LANES):  # neighbouring lanes, neighbouring addresses
                put(smem_f, smem_u, slot, out[U(b), U(h), U(row), U(c)])
                o = smem_f[slot]
                put(smem_f, smem_u, slot, dout[U(b), U(h), U(row), U(c)])
                acc = cuda.fma(o, smem_f[slot], acc)
        smem_f[slot] = acc
        cuda.syncthreads()
        if lane == 0 and row < n_q:
            total = float32(0.0)
            for t in range(LANES):
                total += smem_f[U(tr * LANES + t)]
            delta[U(b), U(h), U(row)] = total

    return flash_backward_delta


def kernel_source(cfg: BackwardConfig, causal: bool, dtype: str):
    """The Python kernel for one specialisation (before cuda.jit; compile_ptx tests use it)."""
    BLOCK_Q, BLOCK_K, HEAD_DIM = cfg.block_q, cfg.block_k, cfg.head_dim
    ROW_THREADS, COL_THREADS, THREADS = cfg.row_threads, cfg.col_threads, cfg.threads
    OWN = cfg.own_rows_per_thread     # own-tile rows per thread (K rows in dkdv, Q rows in dq)
    STREAMED = cfg.streamed_per_thread  # streamed-tile rows per thread, as S / Sᵀ columns
    D_COLS = cfg.d_cols_per_thread
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
    Q_LOADS = -(-BLOCK_Q * HEAD_DIM // THREADS)
    KV_LOADS = -(-BLOCK_K * HEAD_DIM // THREADS)
    CAUSAL = bool(causal)
    BF16 = dtype == "bfloat16"
    NEG_INF = float32(-math.inf)
    POS_INF = float32(math.inf)
    put, store = _widen_and_round(BF16)

    @cuda.jit(device=True, inline=True)
    def load_tile(src, b, h, row0, n_rows, d, smem_f, smem_u, off, N_LOADS, TILE_ROWS):
        # Rows past the sequence and columns past d are zero-filled: padded head dims add nothing
        # to the inner products, and zero dO / Q rows give zero dP and zero gradient terms.
        tid = cuda.threadIdx.x
        for it in range(N_LOADS):
            idx = tid + it * THREADS
            if idx < TILE_ROWS * HEAD_DIM:
                r = idx // HEAD_DIM
                c = idx - r * HEAD_DIM
                row = row0 + r
                slot = U(off + r * STRIDE + c)
                if row < n_rows and c < d:
                    put(smem_f, smem_u, slot, src[U(b), U(h), U(row), U(c)])
                else:
                    smem_f[slot] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def row_stats(lse, delta, b, h, row, n_q):
        """(L·log2(e), D) of one query row; a masked or missing row gives (+inf, 0): P = 0."""
        l2 = POS_INF
        dd = float32(0.0)
        if row < n_q:
            lv = lse[U(b), U(h), U(row)]
            if lv != NEG_INF:
                l2 = lv * float32(LOG2E)
            dd = delta[U(b), U(h), U(row)]
        return l2, dd

    if cfg.kernel == "dkdv":
        K_ROWS, Q_COLS = OWN, STREAMED

        def flash_backward_dkdv(q, k, v, do, lse, delta, dk, dv, n_q, n_k, d, group, scale_log2, scale):
            smem_f = cuda.shared.array(0, float32)
            smem_u = cuda.shared.array(0, uint32)
            tid = cuda.threadIdx.x
            tr = tid // COL_THREADS
            tc = tid - tr * COL_THREADS
            k0 = cuda.blockIdx.x * BLOCK_K  # causal: tile 0 has the most Q tiles and starts first
            bh = cuda.blockIdx.y
            n_kv_heads = k.shape[1]
            b = bh // n_kv_heads
            h_kv = bh - b * n_kv_heads
            shift = n_k - n_q  # bottom-right causal alignment: query i sees key j iff j <= i + shift

            load_tile(k, b, h_kv, k0, n_k, d, smem_f, smem_u, K_OFF, KV_LOADS, BLOCK_K)
            load_tile(v, b, h_kv, k0, n_k, d, smem_f, smem_u, V_OFF, KV_LOADS, BLOCK_K)

            dk_acc = cuda.local.array((K_ROWS, D_COLS), float32)
            dv_acc = cuda.local.array((K_ROWS, D_COLS), float32)
            s = cuda.local.array((K_ROWS, Q_COLS), float32)   # Sᵀ slice, then Pᵀ
            dp = cuda.local.array((K_ROWS, Q_COLS), float32)  # dPᵀ slice
            k_frag = cuda.local.array(K_ROWS, float32)
            v_frag = cuda.local.array(K_ROWS, float32)
            q_frag = cuda.local.array(Q_COLS, float32)
            do_frag = cuda.local.array(Q_COLS, float32)
            p_frag = cuda.local.array(K_ROWS, float32)
            ds_frag = cuda.local.array(K_ROWS, float32)
            qd_frag = cuda.local.array(D_COLS, float32)
            dod_frag = cuda.local.array(D_COLS, float32)
            # Loop-invariant shared-memory row offsets of this thread's K/V, Q/dO and Pᵀ rows.
            k_row = cuda.local.array(K_ROWS, int64)
            p_row = cuda.local.array(K_ROWS, int64)
            q_row = cuda.local.array(Q_COLS, int64)
            for a in range(K_ROWS):
                k_row[a] = (tr + a * ROW_THREADS) * STRIDE
                p_row[a] = (tr + a * ROW_THREADS) * P_STRIDE
                for c in range(D_COLS):
                    dk_acc[a, c] = float32(0.0)
                    dv_acc[a, c] = float32(0.0)
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
                    load_tile(q, b, h, q0, n_q, d, smem_f, smem_u, Q_OFF, Q_LOADS, BLOCK_Q)
                    load_tile(do, b, h, q0, n_q, d, smem_f, smem_u, DO_OFF, Q_LOADS, BLOCK_Q)
                    for r in range(tid, BLOCK_Q, THREADS):
                        l2, dd = row_stats(lse, delta, b, h, q0 + r, n_q)
                        smem_f[U(ROWS_OFF + r)] = l2
                        smem_f[U(ROWS_OFF + BLOCK_Q + r)] = dd
                    cuda.syncthreads()

                    # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for this thread's K_ROWS x Q_COLS slice.
                    for a in range(K_ROWS):
                        for jj in range(Q_COLS):
                            s[a, jj] = float32(0.0)
                            dp[a, jj] = float32(0.0)
                    for e0 in range(0, HEAD_DIM, UNROLL):
                        for u in range(UNROLL):  # constant trip count: unrolled, loads run ahead
                            for a in range(K_ROWS):
                                k_frag[a] = smem_f[U(K_OFF + k_row[a] + e0 + u)]
                                v_frag[a] = smem_f[U(V_OFF + k_row[a] + e0 + u)]
                            for jj in range(Q_COLS):
                                q_frag[jj] = smem_f[U(Q_OFF + q_row[jj] + e0 + u)]
                                do_frag[jj] = smem_f[U(DO_OFF + q_row[jj] + e0 + u)]
                            for a in range(K_ROWS):
                                for jj in range(Q_COLS):
                                    s[a, jj] = cuda.fma(k_frag[a], q_frag[jj], s[a, jj])
                                    dp[a, jj] = cuda.fma(v_frag[a], do_frag[jj], dp[a, jj])

                    # Pᵀ = exp2(Sᵀ·scale·log2(e) − L·log2(e)), dSᵀ = Pᵀ ∘ (dPᵀ − D), to shared memory.
                    needs_mask = k0 + BLOCK_K > n_k
                    if CAUSAL:
                        needs_mask = needs_mask or (k0 + BLOCK_K - 1 > q0 + shift)
                    for jj in range(Q_COLS):
                        i = tc + jj * COL_THREADS
                        l2 = smem_f[U(ROWS_OFF + i)]
                        dd = smem_f[U(ROWS_OFF + BLOCK_Q + i)]
                        row = q0 + i
                        for a in range(K_ROWS):
                            x = s[a, jj] * scale_log2 - l2
                            if needs_mask:
                                col = k0 + tr + a * ROW_THREADS
                                if col >= n_k or (CAUSAL and col > row + shift):
                                    x = NEG_INF
                            p = math.exp2(x)
                            smem_f[U(P_OFF + p_row[a] + i)] = p
                            smem_f[U(DS_OFF + p_row[a] + i)] = p * (dp[a, jj] - dd)
                    cuda.syncthreads()

                    # dV += Pᵀ dO, dK += dSᵀ Q (this thread's K_ROWS x D_COLS slices).
                    for i0 in range(0, BLOCK_Q, UNROLL):
                        for u in range(UNROLL):
                            for a in range(K_ROWS):
                                p_frag[a] = smem_f[U(P_OFF + p_row[a] + i0 + u)]
                                ds_frag[a] = smem_f[U(DS_OFF + p_row[a] + i0 + u)]
                            for c in range(D_COLS):
                                dod_frag[c] = smem_f[U(DO_OFF + (i0 + u) * STRIDE + tc + c * COL_THREADS)]
                                qd_frag[c] = smem_f[U(Q_OFF + (i0 + u) * STRIDE + tc + c * COL_THREADS)]
                            for a in range(K_ROWS):
                                for c in range(D_COLS):
                                    dv_acc[a, c] = cuda.fma(p_frag[a], dod_frag[c], dv_acc[a, c])
                                    dk_acc[a, c] = cuda.fma(ds_frag[a], qd_frag[c], dk_acc[a, c])
                    cuda.syncthreads()  # before the next tile overwrites Q, dO, Pᵀ, dSᵀ, L, D

            # Every K/V row is written, zeros included (no query sees it, or Nq = 0).
            cuda.syncthreads()  # the K slots below double as this thread's bf16 rounding words
            for a in range(K_ROWS):
                r = tr + a * ROW_THREADS
                row = k0 + r
                if row < n_k:
                    for c in range(D_COLS):
                        col = tc + c * COL_THREADS
                        if col < d:
                            slot = U(K_OFF + r * STRIDE + col)
                            store(dk, b, h_kv, row, col, dk_acc[a, c] * scale, smem_f, smem_u, slot)
                            store(dv, b, h_kv, row, col, dv_acc[a, c], smem_f, smem_u, slot)

        return flash_backward_dkdv

    Q_ROWS, K_COLS = OWN, STREAMED

    def flash_backward_dq(q, k, v, do, lse, delta, dq, n_q, n_k, d, group, scale_log2, scale):
        smem_f = cuda.shared.array(0, float32)
        smem_u = cuda.shared.array(0, uint32)
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

        load_tile(q, b, h, q0, n_q, d, smem_f, smem_u, Q_OFF, Q_LOADS, BLOCK_Q)
        load_tile(do, b, h, q0, n_q, d, smem_f, smem_u, DO_OFF, Q_LOADS, BLOCK_Q)

        dq_acc = cuda.local.array((Q_ROWS, D_COLS), float32)
        s = cuda.local.array((Q_ROWS, K_COLS), float32)   # S slice
        dp = cuda.local.array((Q_ROWS, K_COLS), float32)  # dP slice
        l2_i = cuda.local.array(Q_ROWS, float32)  # L·log2(e) and D of this thread's rows
        d_i = cuda.local.array(Q_ROWS, float32)
        q_frag = cuda.local.array(Q_ROWS, float32)
        do_frag = cuda.local.array(Q_ROWS, float32)
        k_frag = cuda.local.array(K_COLS, float32)
        v_frag = cuda.local.array(K_COLS, float32)
        ds_frag = cuda.local.array(Q_ROWS, float32)
        kd_frag = cuda.local.array(D_COLS, float32)
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
                dq_acc[a, c] = float32(0.0)
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
            load_tile(k, b, h_kv, k0, n_k, d, smem_f, smem_u, K_OFF, KV_LOADS, BLOCK_K)
            load_tile(v, b, h_kv, k0, n_k, d, smem_f, smem_u, V_OFF, KV_LOADS, BLOCK_K)
            cuda.syncthreads()

            # S = Q Kᵀ and dP = dO Vᵀ for this thread's Q_ROWS x K_COLS slice.
            for a in range(Q_ROWS):
                for jj in range(K_COLS):
                    s[a, jj] = float32(0.0)
                    dp[a, jj] = float32(0.0)
            for e0 in range(0, HEAD_DIM, UNROLL):
                for u in range(UNROLL):
                    for a in range(Q_ROWS):
                        q_frag[a] = smem_f[U(Q_OFF + q_row[a] + e0 + u)]
                        do_frag[a] = smem_f[U(DO_OFF + q_row[a] + e0 + u)]
                    for jj in range(K_COLS):
                        k_frag[jj] = smem_f[U(K_OFF + k_row[jj] + e0 + u)]
                        v_frag[jj] = smem_f[U(V_OFF + k_row[jj] + e0 + u)]
                    for a in range(Q_ROWS):
                        for jj in range(K_COLS):
                            s[a, jj] = cuda.fma(q_frag[a], k_frag[jj], s[a, jj])
                            dp[a, jj] = cuda.fma(do_frag[a], v_frag[jj], dp[a, jj])

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
                    smem_f[U(P_OFF + ds_row[a] + tc + jj * COL_THREADS)] = math.exp2(x) * (dp[a, jj] - d_i[a])
            cuda.syncthreads()

            # dQ += dS K
            for t0 in range(0, BLOCK_K, UNROLL):
                for u in range(UNROLL):
                    for a in range(Q_ROWS):
                        ds_frag[a] = smem_f[U(P_OFF + ds_row[a] + t0 + u)]
                    for c in range(D_COLS):
                        kd_frag[c] = smem_f[U(K_OFF + (t0 + u) * STRIDE + tc + c * COL_THREADS)]
                    for a in range(Q_ROWS):
                        for c in range(D_COLS):
                            dq_acc[a, c] = cuda.fma(ds_frag[a], kd_frag[c], dq_acc[a, c])
            cuda.syncthreads()  # before the next tile overwrites K, V and dS

        cuda.syncthreads()  # the Q slots below double as this thread's bf16 rounding words
        for a in range(Q_ROWS):
            r = tr + a * ROW_THREADS
            row = q0 + r
            if row < n_q:
                for c in range(D_COLS):
                    col = tc + c * COL_THREADS
                    if col < d:
                        store(dq, b, h, row, col, dq_acc[a, c] * scale, smem_f, smem_u,
                              U(Q_OFF + r * STRIDE + col))

    return flash_backward_dq


@lru_cache(maxsize=None)
def make_delta_kernel(dtype: str):
    if dtype not in STORAGE:
        raise ValueError(f"dtype {dtype!r} not in {sorted(STORAGE)}")
    return cuda.jit(delta_signature(dtype), fastmath=FASTMATH)(delta_source(dtype))


@lru_cache(maxsize=None)
def make_backward_kernel(cfg: BackwardConfig, causal: bool, dtype: str):
    """Compiled ``dkdv`` or ``dq`` kernel for one (config, causal, dtype); cached."""
    problems = cfg.problems()
    if problems:
        raise ValueError(f"backward config {cfg} cannot run: {'; '.join(problems)}")
    if dtype not in STORAGE:
        raise ValueError(f"dtype {dtype!r} not in {sorted(STORAGE)}")
    return cuda.jit(kernel_signature(cfg, dtype), fastmath=FASTMATH)(kernel_source(cfg, causal, dtype))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
_opted_in: set = set()


def _prepared(cfg: BackwardConfig, causal: bool, dtype: str):
    kernel = make_backward_kernel(cfg, bool(causal), dtype)
    key = (cfg, bool(causal), dtype, _device_id())
    if key not in _opted_in:
        _allow_dynamic_smem(kernel, cfg.smem_bytes)
        _opted_in.add(key)
    return kernel


def launch(cfgs, q, k, v, out, dout, lse, delta, dq, dk, dv, *, causal: bool, softmax_scale: float,
           dtype: str, d: int, stream=0) -> None:
    """Launch the three kernels on Numba device arrays.

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
        make_delta_kernel(dtype)[delta_grid, DELTA_ROWS * DELTA_LANES, stream, 4 * DELTA_ROWS * DELTA_LANES](
            out, dout, delta, n_q, d)
    if B * Hkv * n_k > 0:  # runs for Nq = 0 too: it writes dK = dV = 0
        grid = ((n_k + cfg_kv.block_k - 1) // cfg_kv.block_k, B * Hkv)
        _prepared(cfg_kv, causal, dtype)[grid, cfg_kv.threads, stream, cfg_kv.smem_bytes](
            q, k, v, dout, lse, delta, dk, dv, *scalars)
    if B * H * n_q > 0:  # runs for Nk = 0 too: it writes dQ = 0
        grid = ((n_q + cfg_q.block_q - 1) // cfg_q.block_q, B * H)
        _prepared(cfg_q, causal, dtype)[grid, cfg_q.threads, stream, cfg_q.smem_bytes](
            q, k, v, dout, lse, delta, dq, *scalars)
