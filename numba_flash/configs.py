"""Tile configurations as data.

A config fixes everything a kernel specialisation needs at compile time. The tables below are
the shipped choices; ``keep`` drops any that would not fit the hardware budget, so a bad edit
fails loudly at import (and in tests) rather than at launch.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_HEAD_DIM = 256
SMEM_PER_BLOCK_MAX = 227 * 1024  # sm_80 / sm_90 opt-in maximum of dynamic shared memory per block
SMEM_STATIC_MAX = 48 * 1024      # above this a kernel must opt in (cuFuncSetAttribute)
REGS_PER_SM = 65536


# Compiled head dims (buckets): a user head dim d is zero-padded up to the next one.
HEAD_DIMS = tuple(range(16, 129, 16)) + tuple(range(160, MAX_HEAD_DIM + 1, 32))


def head_dim_bucket(d: int) -> int:
    """The compiled head dim for a user head dim d (1 <= d <= MAX_HEAD_DIM)."""
    return next(h for h in HEAD_DIMS if h >= d)


@dataclass(frozen=True)
class SimtConfig:
    """One SIMT forward specialisation.

    The thread block is a ROW_THREADS × COL_THREADS grid. Thread (tr, tc) owns query rows
    tr, tr + ROW_THREADS, ... of the Q tile (BLOCK_Q / ROW_THREADS of them), S columns
    tc, tc + COL_THREADS, ... and O columns likewise: interleaved so that neighbouring lanes hit
    neighbouring shared-memory banks.
    """

    block_q: int
    block_k: int
    row_threads: int
    col_threads: int
    head_dim: int  # compiled (padded) head dim
    share_kv: bool = False  # V reuses K's buffer once S is computed: less smem, more blocks per SM

    @property
    def threads(self) -> int:
        return self.row_threads * self.col_threads

    @property
    def rows_per_thread(self) -> int:
        return self.block_q // self.row_threads

    @property
    def s_cols_per_thread(self) -> int:
        return self.block_k // self.col_threads

    @property
    def o_cols_per_thread(self) -> int:
        return self.head_dim // self.col_threads

    # Shared-memory layout, in 4-byte words. Q and K rows are padded by one word so that the
    # rows read by one warp fall in different banks; V and P are read along rows and need none.
    @property
    def qk_stride(self) -> int:
        return self.head_dim + 1

    @property
    def smem_words(self) -> dict:
        return {
            "q": self.block_q * self.qk_stride,
            "k": self.block_k * self.qk_stride,
            "v": 0 if self.share_kv else self.block_k * self.head_dim,
            "p": self.block_q * self.block_k,
            "red": self.block_q * self.col_threads,  # per-row partial maxima / sums
        }

    @property
    def smem_bytes(self) -> int:
        return 4 * sum(self.smem_words.values())

    @property
    def accumulators_per_thread(self) -> int:
        """Registers the maths needs per thread: S tile, O tile, m_i, l_i (a lower bound)."""
        r = self.rows_per_thread
        return r * self.s_cols_per_thread + r * self.o_cols_per_thread + 2 * r

    def problems(self) -> list[str]:
        """Why this config cannot run (empty when it can)."""
        out = []
        if self.block_q % self.row_threads:
            out.append(f"block_q={self.block_q} not a multiple of row_threads={self.row_threads}")
        if self.block_k % self.col_threads:
            out.append(f"block_k={self.block_k} not a multiple of col_threads={self.col_threads}")
        if self.head_dim % self.col_threads:
            out.append(f"head_dim={self.head_dim} not a multiple of col_threads={self.col_threads}")
        if not 1 <= self.threads <= 1024:
            out.append(f"{self.threads} threads per block (1..1024 allowed)")
        if self.smem_bytes > SMEM_PER_BLOCK_MAX:
            out.append(f"{self.smem_bytes} B shared memory > {SMEM_PER_BLOCK_MAX}")
        if self.accumulators_per_thread > 200:
            out.append(f"{self.accumulators_per_thread} accumulator registers per thread > 200")
        return out


def keep(configs):
    """Triton-style filter: only configs that fit the shared-memory and register budget."""
    return [c for c in configs if not c.problems()]


def _simt_for(head_dim: int) -> SimtConfig:
    # 256 threads, 4 rows per thread, V reusing K's buffer: the fastest of the sweep in
    # benchmarks/results (fp32 d=128, H200). Above d=128 the O slice stays <= 8 columns per
    # thread: 8 rows x 8-16 columns left NVVM with unpromoted local arrays (192-704 B stack
    # frames in ptxas -v), which tests/test_kernel_resources.py guards against.
    if head_dim <= 128:
        return SimtConfig(block_q=64, block_k=64, row_threads=16, col_threads=16, head_dim=head_dim,
                          share_kv=True)
    return SimtConfig(block_q=32, block_k=32, row_threads=8, col_threads=32, head_dim=head_dim,
                      share_kv=True)


SIMT_CONFIGS = {d: _simt_for(d) for d in HEAD_DIMS}

_bad = {d: c.problems() for d, c in SIMT_CONFIGS.items() if c.problems()}
if _bad:  # a table edit that does not fit is a bug, not a runtime surprise
    raise AssertionError(f"shipped SIMT configs that cannot run: {_bad}")


def simt_config(d: int) -> SimtConfig:
    return SIMT_CONFIGS[head_dim_bucket(d)]
