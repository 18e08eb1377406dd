"""numba_flash.decode in the CUDA simulator against reference.decode, and its sm_90 build.

Simulated threads are Python threads, so most cases run a one-warp config (32 threads, 8-key
tiles, head dim 16) that exercises the same code paths as the shipped ones: the cp.async ring,
quad-lane Q·Kᵀ with shuffles, one warp per softmax row, key groups summed at the end, row chunks
when G·Nq exceeds the config's rows, direct write (one split) or scratch + merge. One case runs
the shipped d = 64 config as it is. Tests re-run themselves in a child process with
NUMBA_ENABLE_CUDASIM=1 when this process does not have it (tests/kernels/test_ptx.py); the resource test
compiles the shipped kernels for sm_90 in one child without it and reads ptxas -v.
"""
import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ptx import NO_GPU_PATCH, _pythonpath, find_ptxas, in_simulator  # noqa: E402

from numba_flash.decode import choose_num_splits, decode  # noqa: E402
from numba_flash.kernels import decode as dk  # noqa: E402
from numba_flash.kernels.decode import DecodeConfig  # noqa: E402
from reference.decode import decode_attention  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def small(dtype, rows, stages=2):
    """A one-warp config: 32 threads, 8-key tiles, head dim 16."""
    return DecodeConfig(16, dtype, rows, block_n=8, stages=stages, warps=1)


def make_inputs(rng, B, H, Hkv, n_q, n_max, d, dtype):
    q = rng.standard_normal((B, H, n_q, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, n_max, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, n_max, d)).astype(dtype)
    return q, k, v


def check(out, lse, q, k, v, lens, scale=None):
    """Against the float64 reference on the same (already rounded) input values."""
    ref_o, ref_l = decode_attention(q, k, v, cache_seqlens=lens, softmax_scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_l), err_msg="rows seeing no key must be -inf")
    assert (out[np.isneginf(ref_l)] == 0).all()
    tol = 2e-6 if q.dtype == np.float32 else 2e-3  # fp16: output rounding (2^-11 relative) dominates
    err = np.abs(out.astype(np.float64) - ref_o).max(initial=0)
    if q.dtype == np.float32:
        # The flash-attention rule: a score of size |s| carries ~|s|·2^-24 rounding into its
        # weight in any fp32 implementation (|s| ~ 100 here); allow twice the fp32 reference's.
        naive_o, _ = decode_attention(q, k, v, cache_seqlens=lens, softmax_scale=scale, dtype=np.float32)
        tol = max(tol, 2 * np.abs(naive_o.astype(np.float64) - ref_o).max(initial=0))
    assert err <= tol * max(1.0, np.abs(ref_o).max(initial=0)), (err, tol)
    fin = np.isfinite(ref_l)
    assert np.abs(lse[fin] - ref_l[fin]).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref_l[fin]).max(initial=0))


# --------------------------------------------------------------------------------------------
# Against the reference
# --------------------------------------------------------------------------------------------
GRID = [  # dtype, G, Hkv, Nq, num_splits, rows, stages
    ("float32", 1, 2, 1, 1, 1, 2),     # one split: the kernel writes O and L itself
    ("float32", 4, 1, 3, 3, 16, 3),    # GQA 4, 12 rows in a 16-row block, 3-stage ring
    ("float16", 8, 1, 1, 2, 8, 2),     # GQA 8
    ("float16", 1, 2, 3, 9, 4, 3),     # more splits than tiles: empty splits merge as nothing
    ("float32", 8, 1, 3, None, 32, 2),  # automatic num_splits; 24 rows, 2 row chunks in S
    ("float16", 4, 1, 3, 2, 4, 2),     # 12 rows over three 4-row blocks (row chunks)
]


@in_simulator
@pytest.mark.parametrize("dtype, G, Hkv, n_q, n_splits, rows, stages", GRID)
def test_against_reference_sim(dtype, G, Hkv, n_q, n_splits, rows, stages, rng):
    n_max, d = 21, 16
    q, k, v = make_inputs(rng, 2, G * Hkv, Hkv, n_q, n_max, d, dtype)
    lens = np.array([n_max, 11], dtype=np.int32)  # full, and ragged (not a tile multiple)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, config=small(dtype, rows, stages))
    check(out, lse, q, k, v, lens)


@in_simulator
def test_shipped_config_sim(rng):
    """The config decode() picks for d = 64 fp16 (128 threads, 64-key tiles), lengths None."""
    q, k, v = make_inputs(rng, 1, 2, 1, 2, 100, 64, "float16")
    cfg = dk.decode_config(64, "float16", 2)
    assert cfg.threads == 128 and cfg.block_n == 64
    out, lse = decode(q, k, v, num_splits=2)
    check(out, lse, q, k, v, None)


@in_simulator
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scalar_load_path_and_strided_cache_sim(dtype, rng):
    """Rows cp.async cannot copy (d = 12 fp16: 24-byte rows) take scalar loads; a cache that is
    a slice of a longer buffer (strided, still aligned) takes cp.async. Head dim padded to 16."""
    d = 12 if dtype == "float16" else 7
    q, k_big, v_big = make_inputs(rng, 2, 2, 2, 3, 40, d, dtype)
    k, v = k_big[:, :, :21], v_big[:, :, :21]
    lens = np.array([21, 5], dtype=np.int64)  # int64 lengths are accepted too
    assert not dk.cp_async_ok(k, d)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=2, config=small(dtype, 4))
    check(out, lse, q, k, v, lens)
    # a 16-wide fp32 slice of a 40-key buffer: rows 64 B apart, base aligned
    q2, k2, v2 = make_inputs(rng, 1, 1, 1, 1, 40, 16, "float32")
    assert dk.cp_async_ok(k2[:, :, :21], 16)
    out2, lse2 = decode(q2, k2[:, :, :21], v2[:, :, :21], num_splits=3, config=small("float32", 1))
    check(out2, lse2, q2, k2[:, :, :21], v2[:, :, :21], None)


# --------------------------------------------------------------------------------------------
# warp_split (split-in-block): each warp its own tiles and ring, states merged at the end
# --------------------------------------------------------------------------------------------
def small_warp(dtype, rows, block_n=16, stages=2, warps=2):
    """warp_split at head dim 16: block_n keys per warp tile (16: 2 lanes per key; 32: one)."""
    return DecodeConfig(16, dtype, rows, block_n=block_n, stages=stages, warps=warps, warp_split=True)


WARP_GRID = [  # dtype, G, Hkv, Nq, num_splits, rows, block_n, stages, warps
    ("float32", 1, 2, 1, 1, 1, 16, 2, 2),    # one split: O and L written after the warps' merge
    ("float16", 1, 2, 1, 1, 1, 32, 3, 1),    # one lane per key, one warp
    ("float16", 4, 2, 1, 2, 4, 16, 2, 2),    # GQA 4
    ("float32", 4, 1, 3, 3, 8, 32, 2, 2),    # GQA 4 x Nq 3 = 12 rows over two 8-row blocks
    ("float16", 8, 1, 1, 4, 8, 16, 3, 2),    # GQA 8, 3-stage rings
    ("float32", 8, 1, 1, None, 8, 16, 2, 1),  # automatic num_splits
    ("float16", 1, 2, 3, 9, 2, 16, 2, 2),    # more splits than tiles; warps with no tile
]


@in_simulator
@pytest.mark.parametrize("dtype, G, Hkv, n_q, n_splits, rows, block_n, stages, warps", WARP_GRID)
def test_warp_split_against_reference_sim(dtype, G, Hkv, n_q, n_splits, rows, block_n, stages, warps, rng):
    n_max, d = 70, 16
    q, k, v = make_inputs(rng, 3, G * Hkv, Hkv, n_q, n_max, d, dtype)
    lens = np.array([n_max, 23, 0], dtype=np.int32)  # full, ragged, and an empty cache
    cfg = small_warp(dtype, rows, block_n, stages, warps)
    assert cfg.problems() == []
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, config=cfg)
    check(out, lse, q, k, v, lens)


@in_simulator
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_warp_split_scalar_path_strided_and_bf16_sim(dtype, rng):
    """Unaligned rows (scalar loads), an aligned strided slice (cp.async), bf16 bits, large logits."""
    d = 12 if dtype == "float16" else 7
    q, k_big, v_big = make_inputs(rng, 2, 2, 2, 3, 60, d, dtype)
    k, v = k_big[:, :, :37], v_big[:, :, :37]
    lens = np.array([37, 5], dtype=np.int64)
    assert not dk.cp_async_ok(k, d)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=2, config=small_warp(dtype, 4))
    check(out, lse, q, k, v, lens)
    q2, k2, v2 = make_inputs(rng, 1, 1, 1, 2, 60, 16, dtype)
    q2 *= 40.0
    lens2 = np.array([1], dtype=np.int32)  # query 0 sees no key
    ks, vs = k2[:, :, :45], v2[:, :, :45]
    assert dk.cp_async_ok(ks, 16)
    out2, lse2 = decode(q2, ks, vs, cache_seqlens=lens2, num_splits=1, config=small_warp(dtype, 2, 32, 2, 1))
    assert np.isneginf(lse2[0, 0, 0]) and np.isfinite(lse2[0, 0, 1])
    check(out2, lse2, q2, ks, vs, lens2)
    out3, lse3 = decode(q2, ks, vs, num_splits=3, config=small_warp(dtype, 2, 16, 3, 2))
    check(out3, lse3, q2, ks, vs, None)


@in_simulator
def test_warp_split_bfloat16_and_deterministic_sim(rng):
    from numba import cuda

    B, H, Hkv, n_q, n_max, d = 2, 4, 1, 2, 50, 16
    (qb, qv), (kb, kv), (vb, vv) = (to_bf16(rng.standard_normal(s)) for s in
                                    ((B, H, n_q, d), (B, Hkv, n_max, d), (B, Hkv, n_max, d)))
    lens = np.array([50, 6], dtype=np.int32)
    outs = []
    for _ in range(2):
        out = cuda.device_array((B, H, n_q, d), np.uint16)
        lse = cuda.device_array((B, H, n_q), np.float32)
        partials = tuple(cuda.device_array(s, np.float32) for s in dk.scratch_shapes(B, H, n_q, 2, d))
        dk.launch(small_warp("bfloat16", 8), cuda.to_device(qb), cuda.to_device(kb), cuda.to_device(vb),
                  cuda.to_device(lens), out, lse, softmax_scale=d ** -0.5, d=d, num_splits=2, partials=partials)
        outs.append((out.copy_to_host(), lse.copy_to_host()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    got = (outs[0][0].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref_o, ref_l = decode_attention(qv, kv, vv, cache_seqlens=lens)
    assert np.abs(got - ref_o).max() <= 2 ** -7 * max(1.0, np.abs(ref_o).max())
    np.testing.assert_allclose(outs[0][1], ref_l, rtol=1e-5, atol=1e-5)


def test_warp_split_configs():
    ok = DecodeConfig(128, "float16", 1, block_n=16, stages=2, warps=4, warp_split=True)
    assert ok.problems() == [] and ok.kq == 2 and ok.row_words == 64 + 4 and ok.split_keys == 64
    assert ok.blocks_per_sm == 3 and ok.bytes_in_flight == 4 * 2 * 16 * 256
    assert DecodeConfig(128, "float16", 1, block_n=48, warps=2, warp_split=True).problems()
    assert DecodeConfig(128, "float16", 16, block_n=16, warps=2, warp_split=True).problems()  # 16 score rows
    assert DecodeConfig(16, "float16", 1, block_n=8, warps=1, warp_split=True).problems()  # 4 lanes, 2 chunks
    with pytest.raises(ValueError, match="cannot run"):
        dk.make_split_kernel(DecodeConfig(128, "float16", 1, block_n=48, warp_split=True), True, True)


# --------------------------------------------------------------------------------------------
# bulk: K/V tiles by cp.async.bulk + one mbarrier per stage (block-wide kernel)
# --------------------------------------------------------------------------------------------
def small_bulk(dtype, rows, stages=3, head_dim=16):
    """The one-warp block-wide config with bulk-copied tiles (8 keys, unpadded rows)."""
    return DecodeConfig(head_dim, dtype, rows, block_n=8, stages=stages, warps=1, bulk=True)


BULK_GRID = [  # dtype, G, Hkv, Nq, num_splits, rows, stages, head dim
    ("float32", 1, 2, 1, 1, 1, 2, 16),    # one split, 2-stage ring: each barrier flips parity per tile
    ("float16", 4, 1, 1, 2, 4, 4, 16),    # GQA 4, 4 stages
    ("float16", 8, 1, 1, 3, 8, 3, 64),    # GQA 8; d = 64: 8 chunks per row, the full swizzle and q flip
    ("float32", 4, 1, 3, 2, 4, 3, 16),    # 12 rows over three 4-row blocks
    ("float16", 1, 1, 1, 1, 1, 2, 96),    # d = 96: 12 chunks, a 4-chunk swizzle, so chunk steps j0 > 0 flip q
]


@in_simulator
@pytest.mark.parametrize("dtype, G, Hkv, n_q, n_splits, rows, stages, head_dim", BULK_GRID)
def test_bulk_against_reference_sim(dtype, G, Hkv, n_q, n_splits, rows, stages, head_dim, rng):
    n_max = 29  # 4 tiles of 8, the last ragged
    q, k, v = make_inputs(rng, 3, G * Hkv, Hkv, n_q, n_max, head_dim, dtype)
    lens = np.array([n_max, 11, 0], dtype=np.int32)  # full, ragged, and an empty cache
    cfg = small_bulk(dtype, rows, stages, head_dim)
    assert cfg.problems() == [] and dk.bulk_ok(k, head_dim, cfg.head_dim)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, config=cfg)
    check(out, lse, q, k, v, lens)


@in_simulator
@pytest.mark.parametrize("tile, G, n_splits", [((64, 3, 4), 1, 1), ((32, 6, 4), 4, 2)])
def test_bulk_sweep_candidate_sim(tile, G, n_splits, rng):
    """A bulk candidate the GPU sweep times, as it is (fp16 d128, 128 threads, 8-chunk swizzle)."""
    cfg = DecodeConfig(128, "float16", dk.decode_config(128, "float16", G).rows, *tile, bulk=True)
    q, k, v = make_inputs(rng, 3, G, 1, 1, 150, 128, "float16")
    lens = np.array([150, 70, 0], dtype=np.int32)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, config=cfg)
    check(out, lse, q, k, v, lens)


@in_simulator
def test_bulk_falls_back_and_bfloat16_sim(rng):
    """Caches one bulk copy per tile cannot fetch (padded rows, d < head_dim) run the cp.async
    path of the same config; bf16 bits through the bulk path."""
    from numba import cuda

    q, k_big, v_big = make_inputs(rng, 2, 2, 1, 1, 30, 24, "float16")
    q, k, v = q[..., :16], k_big[..., :16], v_big[..., :16]  # rows 48 B apart: not back to back
    assert dk.cp_async_ok(k, 16) and not dk.bulk_ok(k, 16, 16)
    lens = np.array([30, 9], dtype=np.int32)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=2, config=small_bulk("float16", 2))
    check(out, lse, q, k, v, lens)
    q2, k2, v2 = make_inputs(rng, 1, 2, 1, 1, 20, 12, "float32")  # d = 12 in a 16-wide tile
    assert not dk.bulk_ok(k2, 12, 16)
    out2, lse2 = decode(q2, k2, v2, num_splits=1, config=small_bulk("float32", 2))
    check(out2, lse2, q2, k2, v2, None)

    B, H, Hkv, n_q, n_max, d = 2, 4, 1, 2, 27, 16
    (qb, qv), (kb, kv), (vb, vv) = (to_bf16(rng.standard_normal(s)) for s in
                                    ((B, H, n_q, d), (B, Hkv, n_max, d), (B, Hkv, n_max, d)))
    lens = np.array([27, 6], dtype=np.int32)
    out = cuda.device_array((B, H, n_q, d), np.uint16)
    lse = cuda.device_array((B, H, n_q), np.float32)
    dk.launch(small_bulk("bfloat16", 8), cuda.to_device(qb), cuda.to_device(kb), cuda.to_device(vb),
              cuda.to_device(lens), out, lse, softmax_scale=d ** -0.5, d=d, num_splits=1)
    got = (out.copy_to_host().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref_o, ref_l = decode_attention(qv, kv, vv, cache_seqlens=lens)
    assert np.abs(got - ref_o).max() <= 2 ** -7 * max(1.0, np.abs(ref_o).max())
    np.testing.assert_allclose(lse.copy_to_host(), ref_l, rtol=1e-5, atol=1e-5)


def test_bulk_configs():
    cfg = DecodeConfig(128, "float16", 1, block_n=64, stages=4, warps=4, bulk=True)
    assert cfg.problems() == [] and cfg.row_words == 64  # unpadded: a tile is one 16 KiB span
    assert cfg.smem_words["bar"] == 16 and cfg.smem_bytes == 4 * (cfg.kv_offset + 4 * 2 * 64 * 64 + 16)
    assert cfg.bytes_in_flight == 3 * 2 * 64 * 256
    assert DecodeConfig(128, "float16", 1).smem_words["bar"] == 0
    assert DecodeConfig(128, "float16", 4, block_n=16, warps=4, warp_split=True, bulk=True).problems()


def to_bf16(x):
    """float -> (bf16 bits as uint16, the values they hold as float64), rounding to nearest even."""
    u = np.asarray(x, np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@in_simulator
def test_bfloat16_through_the_launcher_sim(rng):
    """bf16 travels as uint16 bits (NumPy has no bfloat16 without ml_dtypes)."""
    from numba import cuda

    B, H, Hkv, n_q, n_max, d = 2, 4, 1, 2, 19, 16
    (qb, qv), (kb, kv), (vb, vv) = (to_bf16(rng.standard_normal(s)) for s in
                                    ((B, H, n_q, d), (B, Hkv, n_max, d), (B, Hkv, n_max, d)))
    lens = np.array([19, 6], dtype=np.int32)
    out = cuda.device_array((B, H, n_q, d), np.uint16)
    lse = cuda.device_array((B, H, n_q), np.float32)
    shapes = dk.scratch_shapes(B, H, n_q, 3, d)
    partials = tuple(cuda.device_array(s, np.float32) for s in shapes)
    dk.launch(small("bfloat16", 8), cuda.to_device(qb), cuda.to_device(kb), cuda.to_device(vb), cuda.to_device(lens),
              out, lse, softmax_scale=d ** -0.5, d=d, num_splits=3, partials=partials)
    got = (out.copy_to_host().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref_o, ref_l = decode_attention(qv, kv, vv, cache_seqlens=lens)
    assert np.abs(got - ref_o).max() <= 2 ** -7 * max(1.0, np.abs(ref_o).max())  # bf16 output rounding
    np.testing.assert_allclose(lse.copy_to_host(), ref_l, rtol=1e-5, atol=1e-5)


@in_simulator
def test_queries_seeing_no_key_and_large_logits_sim(rng):
    """len < Nq: the first Nq - len queries see nothing (O = 0, L = -inf); a zero-length cache sees
    nothing at all; logits ~ 1e3 stay finite."""
    q, k, v = make_inputs(rng, 2, 2, 2, 3, 9, 16, "float32")
    q *= 60.0
    lens = np.array([1, 0], dtype=np.int32)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=2, config=small("float32", 4))
    assert np.isneginf(lse[0, :, :2]).all() and np.isfinite(lse[0, :, 2]).all() and np.isneginf(lse[1]).all()
    check(out, lse, q, k, v, lens)


@in_simulator
def test_deterministic_and_split_invariant_sim(rng):
    q, k, v = make_inputs(rng, 1, 4, 1, 1, 30, 16, "float32")
    cfg = small("float32", 4)
    first = decode(q, k, v, num_splits=3, config=cfg)
    again = decode(q, k, v, num_splits=3, config=cfg)
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    one = decode(q, k, v, num_splits=1, config=cfg)
    np.testing.assert_allclose(one[0], first[0], rtol=1e-5, atol=1e-6)


def test_empty_query_block():
    out, lse = decode(np.zeros((2, 2, 0, 16), np.float32), np.zeros((2, 1, 5, 16), np.float32),
                      np.zeros((2, 1, 5, 16), np.float32))
    assert out.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_empty_cache(dtype, num_splits):
    """Nmax = 0 (caches with no slots): every query sees no key, O = 0 and L = -inf, as forward with Nk = 0."""
    q = np.ones((2, 2, 1, 16), dtype)
    out, lse = decode(q, np.zeros((2, 1, 0, 16), dtype), np.zeros((2, 1, 0, 16), dtype), num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 2, 1)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_no_heads():
    """H = Hkv = 0: empty outputs, as forward (the split rule's H // Hkv divided by zero)."""
    out, lse = decode(np.zeros((2, 0, 1, 16), np.float32), np.zeros((2, 0, 5, 16), np.float32),
                      np.zeros((2, 0, 5, 16), np.float32))
    assert out.shape == (2, 0, 1, 16) and lse.shape == (2, 0, 1)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------
def _qkv(n_q=1, B=2, H=4, Hkv=2, n_max=8, d=16, dtype="float32"):
    return (np.zeros((B, H, n_q, d), dtype), np.zeros((B, Hkv, n_max, d), dtype),
            np.zeros((B, Hkv, n_max, d), dtype))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(cache_seqlens=np.array([1, 2], np.float32)), TypeError, r"dtype float32; accepted: int32 or int64"),
    (dict(cache_seqlens=np.array([1, 2, 3], np.int32)), ValueError, r"shape \(3,\); accepted: \(B,\) = \(2,\)"),
    (dict(cache_seqlens=np.array([1, 9], np.int32)), ValueError, r"cache_seqlens\[1\] = 9; accepted: 0 <= length <= Nmax = 8"),
    (dict(cache_seqlens=np.array([-1, 2], np.int32)), ValueError, r"cache_seqlens\[0\] = -1"),
    (dict(cache_seqlens=np.ma.masked_array(np.array([1, 2], np.int32), mask=[0, 1])), TypeError,
     r"cache_seqlens is a NumPy masked array; its mask would be ignored"),
    (dict(cache_seqlens=[1, 2]), TypeError, r"cache_seqlens must be an int32 or int64 array .*; got builtins.list"),
    (dict(num_splits=0), ValueError, r"num_splits must be an int in \[1, 8192\] or None"),
    (dict(num_splits=10**6), ValueError, r"num_splits must be an int in \[1, 8192\] or None"),
    (dict(num_splits=True), TypeError, r"num_splits must be an int >= 1 or None"),
    (dict(num_splits=2.0), TypeError, r"num_splits must be an int >= 1 or None"),
    (dict(softmax_scale=-1.0), ValueError, r"softmax_scale must be finite and > 0"),
    (dict(softmax_scale=1e30), ValueError, r"softmax_scale = 1e\+30 .*at most 2\*\*64"),
    (dict(config=DecodeConfig(16, "float16", 1)), ValueError, r"dtype float16 is not the inputs' float32"),
    (dict(config="fast"), TypeError, r"config must be a numba_flash.kernels.decode.DecodeConfig"),
])
def test_validation_messages(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        decode(*_qkv(), **kwargs)


def test_many_queries_warn_when_they_take_several_row_blocks():
    from numba_flash import PerformanceWarning

    with pytest.warns(PerformanceWarning, match=r"Nq = 17 queries: the 34 rows .* blocks of .*numba_flash.forward"):
        decode(*_qkv(n_q=17), config=DecodeConfig(16, "float32", 16, block_n=8, stages=2, warps=1))


def test_shapes_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"decode needs q of shape \(B, H, Nq, d\)"):
        decode(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="H must be a multiple of Hkv >= 1"):
        decode(np.zeros((2, 3, 1, 16), np.float32), k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        decode(q, k.astype(np.float16), v)


def test_device_lengths_need_a_device_q():
    from numba import cuda

    with pytest.raises(TypeError, match=r"cache_seqlens is a numba array but q is a numpy array"):
        decode(*_qkv(), cache_seqlens=cuda.to_device(np.array([1, 2], np.int32)))


def test_numba_device_arrays():
    """The simulator's Numba device arrays (no __cuda_array_interface__ there) are accepted, lengths too."""
    from numba import cuda

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(x.shape).astype(np.float32) for x in _qkv(n_q=2))
    lens = np.array([3, 8], np.int32)
    ref_o, ref_l = decode(q, k, v, cache_seqlens=lens)
    out, lse = decode(*(cuda.to_device(x) for x in (q, k, v)), cache_seqlens=cuda.to_device(lens))
    np.testing.assert_array_equal(out.copy_to_host(), ref_o)
    np.testing.assert_array_equal(lse.copy_to_host(), ref_l)


# --------------------------------------------------------------------------------------------
# The num_splits rule and the configs
# --------------------------------------------------------------------------------------------
def test_num_splits_rule_on_an_h200():
    cfg = DecodeConfig(128, "float16", 1, block_n=64, stages=3, warps=4)  # the earlier default tile
    assert cfg.blocks_per_sm == 2  # shared memory: 2 x ~103 KiB per SM
    assert choose_num_splits(8 * 32, 32768, cfg, n_sms=132) == 1  # 256 blocks ~ one full wave of 264
    assert choose_num_splits(8 * 8, 32768, cfg, n_sms=132) == 4  # 64 blocks -> 256
    assert choose_num_splits(1 * 8, 32768, cfg, n_sms=132) == 29  # 8 blocks -> 232 (within 85 % of 264)
    assert choose_num_splits(1 * 8, 1024, cfg, n_sms=132) == 4  # capped: every split >= 4 tiles
    assert choose_num_splits(1, 10, cfg, n_sms=132) == 1  # a single tile is never split
    two = dk.decode_config(128, "float16", 1)  # shipped: 2 stages, 3 blocks/SM by shared memory
    assert (two.block_n, two.stages, two.warps, two.warp_split, two.blocks_per_sm) == (64, 2, 4, False, 3)
    gqa = dk.decode_config(128, "float16", 4)  # shipped for groups of 4: warp_split, 4 splits at B8 Hkv8
    assert (gqa.block_n, gqa.stages, gqa.warps, gqa.warp_split) == (16, 3, 4, True)
    assert choose_num_splits(8 * 8, 32768, gqa, n_sms=132) == 4
    assert choose_num_splits(8 * 32, 32768, two, n_sms=132) == 1  # waves of 2/SM: measured best, not 3 splits
    assert choose_num_splits(8 * 8, 32768, two, n_sms=132) == 4
    ws = DecodeConfig(128, "float16", 1, block_n=16, stages=2, warps=4, warp_split=True)
    assert choose_num_splits(1, 64 * 4 * 3 + 1, ws, n_sms=132) == 3  # 13 steps of 64 keys: splits of >= 4
    for base in (1, 3, 17, 100, 500):
        for n_max in (1, 64, 4096, 100000):
            s = choose_num_splits(base, n_max, cfg, n_sms=132)
            assert 1 <= s <= max(1, min(128, -(-n_max // 64) // 4))


def test_shipped_configs_fit():
    for d in (16, 64, 96, 128, 160, 256):
        for dtype in dk.DTYPES:
            for rows in (1, 3, 8, 24, 64, 128):
                cfg = dk.decode_config(d, dtype, rows)
                assert cfg.problems() == [], (d, dtype, rows, cfg.problems())
                assert cfg.head_dim >= d and (cfg.rows >= rows or cfg.rows >= 16)
    assert DecodeConfig(128, "float16", 3).problems()  # rows must be a power of two
    assert DecodeConfig(128, "float16", 1, block_n=48).problems()  # 8 keys per warp per step
    with pytest.raises(ValueError, match="cannot run"):
        dk.make_split_kernel(DecodeConfig(128, "float16", 1, stages=1), True, True)


# --------------------------------------------------------------------------------------------
# sm_90 build: the shipped kernels compile without spills or stack
# --------------------------------------------------------------------------------------------
SHIPPED = [  # (d, dtype, G·Nq, vec, split): the benchmark's shapes, the extremes, both load paths
    (128, "float16", 1, True, False), (128, "float16", 1, True, True), (128, "float16", 4, True, True),
    (128, "bfloat16", 8, True, True), (128, "float32", 1, True, True), (128, "float16", 128, True, True),
    (128, "float16", 1, False, True), (256, "float32", 32, True, True),
]

# Variants the sweep times: (d, dtype, G·Nq, vec, split, (block_n, stages, warps, warp_split)).
VARIANTS = [
    (128, "float16", 1, True, False, (64, 2, 4, False)), (128, "float16", 4, True, True, (64, 2, 4, False)),
    (128, "float16", 1, True, False, (16, 2, 4, True)), (128, "float16", 1, True, True, (16, 3, 4, True)),
    (128, "float16", 4, True, True, (16, 2, 4, True)), (128, "float16", 4, True, True, (32, 2, 2, True)),
    (128, "float16", 1, True, True, (32, 3, 2, True)), (128, "bfloat16", 8, True, True, (16, 2, 4, True)),
    (128, "float32", 1, True, True, (16, 2, 4, True)), (128, "float16", 1, False, True, (16, 2, 4, True)),
]

BATCH_COMPILE = """
import re, subprocess, sys
from numba import cuda
from numba_flash.kernels import decode as dk
out = []
for d, dtype, rows, vec, split, *tile in {specs!r}:
    cfg = dk.decode_config(d, dtype, rows)
    if tile:
        bn, st, w, ws, *bulk = tile[0]
        cfg = dk.DecodeConfig(cfg.head_dim, dtype, cfg.rows, block_n=bn, stages=st, warps=w, warp_split=ws,
                              bulk=bool(bulk and bulk[0]))
    ptx, _ = cuda.compile_ptx(dk.kernel_source(cfg, vec, split), dk.kernel_signature(dtype), cc=(9, 0),
                              fastmath=dk.FASTMATH)
    out.append((repr((d, dtype, rows, vec, split, *tile)), ptx))
for dtype in (dk.DTYPES if {merges!r} else ()):
    ptx, _ = cuda.compile_ptx(dk.merge_source(dtype), dk.merge_signature(dtype), cc=(9, 0), fastmath=dk.FASTMATH)
    out.append((repr(("merge", dtype)), ptx))
import pathlib
for i, (name, ptx) in enumerate(out):
    pathlib.Path({tmp!r}, f"k{{i}}.ptx").write_text(ptx)
    pathlib.Path({tmp!r}, f"k{{i}}.name").write_text(name)
"""


def compile_batch(specs, tmp_path, merges=True):
    """Compile specs (and the merge kernels) for sm_90 in one child process (numba's import and NVVM
    start-up paid once); ptxas each. Returns [(spec, PTX text, registers)]; asserts no spills."""
    if find_ptxas() is None:
        pytest.skip("ptxas not found")
    script = tmp_path / "compile_all.py"
    script.write_text(NO_GPU_PATCH + textwrap.dedent(BATCH_COMPILE.format(specs=specs, tmp=str(tmp_path),
                                                                          merges=merges)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = _pythonpath()
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and re.search(r"libNVVM|NVVM.*not found|nvrtc|CudaSupportError", r.stderr, re.I):
        pytest.skip(f"no NVVM to compile with: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-4000:]
    lines, results = [], []
    for i in range(len(specs) + (len(dk.DTYPES) if merges else 0)):
        name = (tmp_path / f"k{i}.name").read_text()
        ptx_text = (tmp_path / f"k{i}.ptx").read_text()
        src = tmp_path / f"k{i}.ptx"
        rep = subprocess.run([find_ptxas(), "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / f"k{i}.cubin")],
                             capture_output=True, text=True)
        assert rep.returncode == 0, rep.stderr
        text = rep.stderr + rep.stdout
        stack, stores, loads = map(int, re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text).groups())
        regs = int(re.search(r"Used (\d+) registers", text).group(1))
        lines.append(f"{name}: {regs} registers, stack {stack}, spills {stores}/{loads}")
        assert stack == 0 and stores == 0 and loads == 0, f"{name}:\n{text}"
        assert "ld.local" not in ptx_text and "st.local" not in ptx_text, name  # accumulators in registers
        results.append((ast.literal_eval(name), ptx_text, regs))
    print("\n".join(lines))
    return results


@pytest.mark.heavy  # CI checks these builds' PTX hashes (tests/shipped_ptx.py)
def test_shipped_kernels_compile_for_sm90_without_spills(tmp_path):
    for spec, ptx_text, _ in compile_batch(SHIPPED, tmp_path):
        if spec[0] != "merge" and spec[3]:  # the vec path copies with cp.async
            assert "cp.async.cg.shared.global" in ptx_text, spec


@pytest.mark.variant
def test_variant_kernels_compile_for_sm90_without_spills(tmp_path):
    """The sweep's non-shipped decode tiles (VARIANTS), as the shipped ones above."""
    for spec, ptx_text, _ in compile_batch(VARIANTS, tmp_path, merges=False):
        if spec[0] != "merge" and spec[3]:  # the vec path copies with cp.async
            assert "cp.async.cg.shared.global" in ptx_text, spec


@pytest.mark.variant
def test_bulk_kernels_compile_for_sm90_without_spills(tmp_path):
    """The sweep's bulk candidates at the issue's shapes (1 row: Hkv32, 4 rows: Hkv8), and fp32 / bf16:
    one bulk copy per K and V tile, mbarrier waits, no per-thread cp.async, no spills."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import sweep_decode

    tiles = [c for c in sweep_decode.CANDIDATES if sweep_decode.kind(c) == "bulk"]
    assert tiles
    specs = [(128, "float16", 1, True, False, c) for c in tiles] + [(128, "float16", 4, True, True, c) for c in tiles]
    specs += [(128, "float32", 1, True, True, (32, 4, 4, False, True)), (64, "bfloat16", 8, True, True, (64, 3, 4, False, True))]
    for spec, ptx_text, regs in compile_batch(specs, tmp_path, merges=False):
        for instr in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                      "mbarrier.arrive.expect_tx", "mbarrier.try_wait.parity", "mbarrier.init", "fence.proxy.async"):
            assert instr in ptx_text, (spec, instr)
        assert "cp.async.cg" not in ptx_text, spec
        assert regs <= 128, spec  # DecodeConfig.blocks_per_sm assumes it
