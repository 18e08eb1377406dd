"""Bytes, FLOPs and roofline figures for attention: the arithmetic behind the 3.6.11 exercises.

Models, stated once (all counts per call, for B batches × H heads, Nq queries, Nk keys, head
dim d, ``bytes_per_element`` e for Q, K, V, O, S, P):

* FLOPs: the two GEMMs, 2·Nq·Nk·d each, so 4·B·H·Nq·Nk·d; with ``causal`` only the visible
  (query, key) pairs count (≈ half for Nq = Nk). The softmax's elementwise work is not counted.
* Standard attention (3.6.2), one kernel per step, every N² operand through HBM: read Q and K,
  write S, read S, write P, read P and V, write O.
* FlashAttention (FA2 forward): Q read once, O written once, L written once (fp32), and every Q
  block reads the K/V blocks it visits, so without causal masking K and V are read
  ceil(Nq / block_q) times. This is the no-cache model: on a GPU, Q blocks of one head running at
  the same time share K/V through L2, so real traffic lies between this and ``ideal`` (each of
  Q, K, V, O once), which is also reported.
* Standard backward: one kernel per line of the backward maths, every N² operand through HBM:
  read P twice (dV = Pᵀ dO, and dS), write and read dP, write dS and read it twice (dQ, dK):
  7 N² element transfers. Flash backward instead recomputes S = Q Kᵀ: 2·Nq·Nk·d extra FLOPs.
* Roofline: time ≥ max(FLOPs / peak, bytes / bandwidth); the ridge point is peak / bandwidth.

Device figures are the NVIDIA H200 SXM data-sheet numbers (dense, no sparsity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._validation import check_causal, check_positive_int

__all__ = [
    "Device",
    "H200",
    "BYTES_PER_ELEMENT",
    "visible_pairs",
    "score_matrix_bytes",
    "attention_flops",
    "standard_attention_hbm_bytes",
    "flash_attention_hbm_bytes",
    "arithmetic_intensity",
    "roofline",
    "lse_bytes",
    "backward_tradeoff",
    "q_tile_grid",
    "split_kv_plan",
]

BYTES_PER_ELEMENT = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    hbm_bytes_per_s: float
    hbm_capacity_bytes: float
    peak_flops: dict  # precision -> FLOP/s (dense)

    def ridge_point(self, precision: str = "fp16") -> float:
        """FLOP/byte at which the compute roof meets the memory roof."""
        return self.peak_flops[precision] / self.hbm_bytes_per_s


# fp16/bf16/tf32: dense tensor-core peak; fp32: CUDA-core FMA peak; tf32x3: fp32 products as 3 tf32 ones
H200 = Device(
    name="NVIDIA H200 SXM",
    sms=132,
    hbm_bytes_per_s=4.8e12,
    hbm_capacity_bytes=141e9,
    peak_flops={"fp16": 989e12, "bf16": 989e12, "fp32": 67e12, "tf32": 494e12, "tf32x3": 494e12 / 3},
)


def _shape(n_q, n_k, d=1, batch=1, heads=1):
    return tuple(
        check_positive_int(name, x) for name, x in (("n_q", n_q), ("n_k", n_k), ("d", d), ("batch", batch), ("heads", heads))
    )


def visible_pairs(n_q: int, n_k: int, causal: bool = False) -> int:
    """(query, key) pairs that are not masked; causal is bottom-right aligned (j ≤ i + Nk − Nq)."""
    n_q, n_k, *_ = _shape(n_q, n_k)
    if not check_causal(causal):
        return n_q * n_k
    # row i sees min(Nk, max(0, i + Nk - Nq + 1)) keys
    return int(np.clip(np.arange(n_q, dtype=np.int64) + (n_k - n_q + 1), 0, n_k).sum())


def score_matrix_bytes(n_q: int, n_k: int, *, bytes_per_element: int = 2, batch: int = 1, heads: int = 1) -> int:
    """Bytes of the S (or P) matrices: B·H·Nq·Nk·e."""
    n_q, n_k, _, batch, heads = _shape(n_q, n_k, 1, batch, heads)
    return batch * heads * n_q * n_k * check_positive_int("bytes_per_element", bytes_per_element)


def attention_flops(n_q: int, n_k: int, d: int, *, batch: int = 1, heads: int = 1, causal: bool = False) -> int:
    """4·B·H·(visible pairs)·d: the two GEMMs Q Kᵀ and P V, 2 FLOPs per multiply-add."""
    n_q, n_k, d, batch, heads = _shape(n_q, n_k, d, batch, heads)
    return 4 * batch * heads * visible_pairs(n_q, n_k, causal) * d


def standard_attention_hbm_bytes(
    n_q: int, n_k: int, d: int, *, bytes_per_element: int = 2, batch: int = 1, heads: int = 1
) -> dict:
    """HBM bytes of the materialising forward, by component, plus 'total' (see the module models)."""
    n_q, n_k, d, batch, heads = _shape(n_q, n_k, d, batch, heads)
    e, bh = check_positive_int("bytes_per_element", bytes_per_element), batch * heads
    parts = {
        "read Q": n_q * d,
        "read K": n_k * d,
        "write S": n_q * n_k,
        "read S": n_q * n_k,
        "write P": n_q * n_k,
        "read P": n_q * n_k,
        "read V": n_k * d,
        "write O": n_q * d,
    }
    out = {name: bh * e * n for name, n in parts.items()}
    out["total"] = sum(out.values())
    return out


def flash_attention_hbm_bytes(
    n_q: int,
    n_k: int,
    d: int,
    *,
    block_q: int = 128,
    block_k: int = 128,
    bytes_per_element: int = 2,
    batch: int = 1,
    heads: int = 1,
    causal: bool = False,
    lse_bytes_per_element: int = 4,
) -> dict:
    """HBM bytes of the FA2 forward, no-cache model, by component, plus 'total' and 'ideal'."""
    from .attention import kv_blocks_to_visit  # the kernels' own tile plan decides what is read

    n_q, n_k, d, batch, heads = _shape(n_q, n_k, d, batch, heads)
    block_q = check_positive_int("block_q", block_q)
    block_k = check_positive_int("block_k", block_k)
    e, bh = check_positive_int("bytes_per_element", bytes_per_element), batch * heads
    keys_read = 0
    for q_start in range(0, n_q, block_q):
        n_visit = kv_blocks_to_visit(q_start, min(q_start + block_q, n_q), n_q, n_k, block_k, check_causal(causal))
        keys_read += min(n_visit * block_k, n_k)
    out = {
        "read Q": bh * e * n_q * d,
        "read K": bh * e * keys_read * d,
        "read V": bh * e * keys_read * d,
        "write O": bh * e * n_q * d,
        "write L": bh * lse_bytes_per_element * n_q,
    }
    out["total"] = sum(out.values())
    out["ideal"] = bh * (e * (2 * n_q + 2 * n_k) * d + lse_bytes_per_element * n_q)
    out["k_v_reads_per_key"] = keys_read / n_k
    return out


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte of HBM traffic."""
    if bytes_moved <= 0:
        raise ValueError(f"bytes_moved must be > 0, got {bytes_moved}")
    return flops / bytes_moved


def roofline(flops: float, bytes_moved: float, *, device: Device = H200, precision: str = "fp16") -> dict:
    """Lower-bound time and the bound that sets it: max(FLOPs / peak, bytes / bandwidth)."""
    t_compute = flops / device.peak_flops[precision]
    t_memory = bytes_moved / device.hbm_bytes_per_s
    ai = arithmetic_intensity(flops, bytes_moved)
    ridge = device.ridge_point(precision)
    return {
        "flops": flops,
        "bytes": bytes_moved,
        "intensity_flop_per_byte": ai,
        "ridge_flop_per_byte": ridge,
        "bound": "memory" if ai < ridge else "compute",
        "t_compute_s": t_compute,
        "t_memory_s": t_memory,
        "t_min_s": max(t_compute, t_memory),
    }


def lse_bytes(n_q: int, *, batch: int = 1, heads: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes of the saved row statistic L (one fp32 per query row): the O(N) the backward needs."""
    n_q, _, _, batch, heads = _shape(n_q, 1, 1, batch, heads)
    return batch * heads * n_q * check_positive_int("bytes_per_element", bytes_per_element)


def backward_tradeoff(
    n_q: int,
    n_k: int,
    d: int,
    *,
    bytes_per_element: int = 2,
    batch: int = 1,
    heads: int = 1,
    device: Device = H200,
    precision: str = "fp16",
) -> dict:
    """Recompute (flash) vs store (standard) in the backward, per the module's models."""
    n_q, n_k, d, batch, heads = _shape(n_q, n_k, d, batch, heads)
    e, bh = check_positive_int("bytes_per_element", bytes_per_element), batch * heads
    recompute_flops = 2 * bh * n_q * n_k * d  # S = Q Kᵀ once more, tile by tile
    backward_gemm_flops = 4 * 2 * bh * n_q * n_k * d  # dV, dP, dQ, dK: both versions do these
    n2_traffic = 7 * bh * n_q * n_k * e
    return {
        "stored_P_bytes": bh * n_q * n_k * e,
        "stored_L_bytes": lse_bytes(n_q, batch=batch, heads=heads),
        "recompute_flops": recompute_flops,
        "recompute_fraction_of_backward_flops": recompute_flops / backward_gemm_flops,
        "t_recompute_s": recompute_flops / device.peak_flops[precision],
        "standard_n2_traffic_bytes": n2_traffic,
        "t_standard_n2_traffic_s": n2_traffic / device.hbm_bytes_per_s,
    }


def q_tile_grid(n_q: int, *, block_q: int = 128, batch: int = 1, heads: int = 1) -> int:
    """Thread blocks in a Q-tile grid: ceil(Nq / block_q) · B · H."""
    n_q, _, _, batch, heads = _shape(n_q, 1, 1, batch, heads)
    return math.ceil(n_q / check_positive_int("block_q", block_q)) * batch * heads


def split_kv_plan(n_q: int, n_k: int, *, block_q: int = 128, batch: int = 1, heads: int = 1, device: Device = H200) -> dict:
    """Decoding (FlashDecoding): split the keys so the grid covers every SM at least once.

    Each split produces a partial (m, ℓ, O) state over its keys; the splits are combined by the
    logsumexp merge (``OnlineSoftmaxState.merge``).
    """
    grid = q_tile_grid(n_q, block_q=block_q, batch=batch, heads=heads)
    n_k = check_positive_int("n_k", n_k)
    splits = min(n_k, max(1, math.ceil(device.sms / grid)))
    return {
        "q_tile_grid": grid,
        "sms": device.sms,
        "sm_fraction_busy": min(1.0, grid / device.sms),
        "q_rows_used_per_tile": min(n_q, block_q) / block_q,
        "splits": splits,
        "split_grid": grid * splits,
        "keys_per_split": math.ceil(n_k / splits),
    }
