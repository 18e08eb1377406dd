"""numba_flash.decode's cache layouts in the CUDA simulator: paged caches (block_table), cache_batch_idx,
cache_leftpad, causal=False and more than 16 queries, against reference.decode and against the same
kernel on the equivalent contiguous cache (bitwise: only the addressing differs).

Tiny problems on one- and two-warp configs at head dim 16 (test_decode_sim.py says why); both kernels,
the block-wide one (each copied row finds its page, so a 32-key tile spans two 16-key pages) and
warp_split (one page per tile).
"""
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ptx import in_simulator  # noqa: E402

from numba_flash import PerformanceWarning  # noqa: E402
from numba_flash.decode import decode, plan  # noqa: E402
from numba_flash.kernels.decode import DecodeConfig  # noqa: E402
from reference.decode import decode_attention  # noqa: E402

CONFIGS = {
    "block": lambda dt, rows: DecodeConfig(16, dt, rows, block_n=8, stages=2, warps=1),
    "block32": lambda dt, rows: DecodeConfig(16, dt, rows, block_n=32, stages=2, warps=1),  # a tile spans pages
    "warp": lambda dt, rows: DecodeConfig(16, dt, rows, block_n=16, stages=2, warps=2, warp_split=True),
}


def check(out, lse, q, ref_o, ref_l):
    """Against the float64 reference (inputs already rounded to their dtype)."""
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_l), err_msg="rows seeing no key must be -inf")
    assert (out[np.isneginf(ref_l)] == 0).all()
    tol = 2e-6 if q.dtype == np.float32 else 2e-3  # fp16: output rounding dominates
    assert np.abs(out.astype(np.float64) - ref_o).max() <= tol * max(1.0, np.abs(ref_o).max())
    fin = np.isfinite(ref_l)
    assert np.abs(lse[fin] - ref_l[fin]).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref_l[fin]).max(initial=0))


def paged(rng, k, v, page, spare=2):
    """(k_pages, v_pages, table): contiguous (B, Hkv, N, d) caches cut into pages at random physical places,
    with spare pages of NaN that nothing must read, and table entries past each cache's pages of -1."""
    B, Hkv, n, d = k.shape
    per = -(-n // page)
    n_pages = B * per + spare
    where = rng.permutation(n_pages)[:B * per].reshape(B, per)
    kp = np.full((n_pages, Hkv, page, d), np.nan, k.dtype)
    vp = np.full_like(kp, np.nan)
    pad = per * page - n
    kz, vz = (np.concatenate([x, np.zeros((B, Hkv, pad, d), x.dtype)], axis=2) for x in (k, v))
    for b in range(B):
        for i in range(per):
            kp[where[b, i]] = kz[b, :, i * page:(i + 1) * page]
            vp[where[b, i]] = vz[b, :, i * page:(i + 1) * page]
    table = np.concatenate([where, np.full((B, 1), -1)], axis=1).astype(np.int32)  # a spare column, never read
    return kp, vp, table


def inputs(rng, B, H, Hkv, n_q, n, d, dtype):
    mk = lambda *s: rng.standard_normal(s).astype(dtype)
    return mk(B, H, n_q, d), mk(B, Hkv, n, d), mk(B, Hkv, n, d)


@in_simulator
@pytest.mark.slow
@pytest.mark.parametrize("kind, dtype, G, n_q, page, splits, causal", [
    ("block32", "float16", 1, 3, 16, 2, True),     # 32-key tiles over 16-key pages
    pytest.param("warp", "float16", 4, 1, 16, 3, True, marks=pytest.mark.heavy),
    ("block", "float32", 2, 2, 48, None, False),   # a page size that is not a power of two
])
def test_paged_against_reference_and_contiguous_sim(kind, dtype, G, n_q, page, splits, causal, rng):
    B, Hkv, n, d = 3, 1, 40, 16
    q, k, v = inputs(rng, B, G * Hkv, Hkv, n_q, n, d, dtype)
    kp, vp, table = paged(rng, k, v, page)
    lens = np.array([n, 19, 0], np.int32)  # full, ragged, empty: the NaN pages and -1 entries are never read
    cfg = CONFIGS[kind](dtype, 4)
    out, lse = decode(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=splits, config=cfg, causal=causal)
    assert np.isfinite(out).all()
    ref_o, ref_l = decode_attention(q, kp, vp, cache_seqlens=lens, block_table=table, causal=causal)
    check(out, lse, q, ref_o, ref_l)
    n_splits = plan(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=splits, config=cfg)[2]
    out_c, lse_c = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, config=cfg, causal=causal)
    np.testing.assert_array_equal(out, out_c)  # the same tiles and splits in the same order: bitwise equal
    np.testing.assert_array_equal(lse, lse_c)


@in_simulator
@pytest.mark.slow
@pytest.mark.parametrize("kind, dtype, d", [pytest.param("warp", "float16", 16, marks=pytest.mark.heavy),
                                            ("block", "float16", 12)])  # d 12: scalar loads
def test_batch_idx_and_leftpad_sim(kind, dtype, d, rng):
    B, H, Hkv, n_q, n = 3, 2, 1, 2, 24
    q = rng.standard_normal((B, H, n_q, d)).astype(dtype)
    k = rng.standard_normal((5, Hkv, n, d)).astype(dtype)
    v = rng.standard_normal((5, Hkv, n, d)).astype(dtype)
    idx = np.array([4, 0, 4], np.int32)  # cache rows, one used twice
    pad = np.array([3, 0, 9], np.int32)
    lens = np.array([24, 13, 9], np.int32)  # the last: all padding, no key
    cfg = CONFIGS[kind](dtype, 4)
    out, lse = decode(q, k, v, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad, num_splits=2, config=cfg)
    ref_o, ref_l = decode_attention(q, k, v, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad)
    check(out, lse, q, ref_o, ref_l)
    assert np.isneginf(lse[2]).all()
    # batch_idx alone, lengths None (Nmax), not causal
    out3, lse3 = decode(q, k, v, cache_batch_idx=idx, num_splits=3, config=cfg, causal=False)
    check(out3, lse3, q, *decode_attention(q, k, v, cache_batch_idx=idx, causal=False))


@in_simulator
@pytest.mark.slow
@pytest.mark.parametrize("kind, causal", [("block", True), pytest.param("warp", False, marks=pytest.mark.heavy)])
def test_many_queries_sim(kind, causal, rng):
    """17 queries: 17 rows over three 8-row blocks, each block reading the cache."""
    q, k, v = inputs(rng, 2, 1, 1, 17, 20, 16, "float32")
    lens = np.array([20, 12], np.int32)  # 12 < 17: the first 5 causal queries see nothing
    with pytest.warns(PerformanceWarning, match="Nq = 17 queries"):
        out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=1 if causal else 2,
                          config=CONFIGS[kind]("float32", 8), causal=causal)
    check(out, lse, q, *decode_attention(q, k, v, cache_seqlens=lens, causal=causal))


@in_simulator
def test_device_indices_are_clamped_sim(rng):
    """Device indices are not read on the host: out-of-range ones are clamped into the arrays (the simulator
    would raise on a stray read), so a bad page or row reads a wrong row, never past the arrays."""
    from numba import cuda

    q, k, v = inputs(rng, 2, 1, 1, 1, 32, 16, "float32")
    kp, vp, table = paged(rng, k, v, 16, spare=0)
    bad = table.copy()
    bad[0, 1] = 10**6  # used: clamped to the last page
    bad[1, 0] = -5     # used: clamped to page 0
    cfg = CONFIGS["block"]("float32", 2)
    lens = np.array([32, 32], np.int32)
    out, lse = decode(*(cuda.to_device(x) for x in (q, kp, vp)), cache_seqlens=cuda.to_device(lens),
                      block_table=cuda.to_device(bad), config=cfg, num_splits=1)
    fixed = np.clip(bad, 0, kp.shape[0] - 1)
    ref = decode(q, kp, vp, cache_seqlens=lens, block_table=fixed, config=cfg, num_splits=1)
    np.testing.assert_array_equal(out.copy_to_host(), ref[0])
    idx = cuda.to_device(np.array([7, -1], np.int32))
    pad = cuda.to_device(np.array([40, -3], np.int32))  # past the length: no key; negative: 0
    out2, lse2 = decode(*(cuda.to_device(x) for x in (q, k, v)), cache_batch_idx=idx, cache_leftpad=pad, config=cfg)
    ref2 = decode(q, k, v, cache_batch_idx=np.array([1, 0], np.int32), cache_leftpad=np.array([32, 0], np.int32),
                  config=cfg)
    np.testing.assert_array_equal(out2.copy_to_host(), ref2[0])
    np.testing.assert_array_equal(lse2.copy_to_host(), ref2[1])


def _qkv(B=2, pages=4, page=16, n_q=1):
    z = lambda *s: np.zeros(s, np.float32)
    return z(B, 4, n_q, 16), z(pages, 2, page, 16), z(pages, 2, page, 16)


TABLE = np.array([[0, 1], [2, 3]], np.int32)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(block_table=TABLE.astype(np.int64)), TypeError, r"block_table has dtype int64; accepted: int32"),
    (dict(block_table=TABLE[:1]), ValueError, r"block_table has shape \(1, 2\); accepted: \(B, max_pages\)"),
    (dict(block_table=np.array([[0, 4], [2, 3]], np.int32)), ValueError,
     r"block_table\[0, 1\] = 4; accepted: page indices in \[0, num_pages = 4\)"),
    (dict(block_table=TABLE, cache_batch_idx=np.array([0, 1], np.int32)), ValueError,
     r"block_table and cache_batch_idx were both given"),
    (dict(block_table=TABLE, cache_leftpad=np.array([0, 1], np.int32)), NotImplementedError,
     r"cache_leftpad with block_table"),
    (dict(block_table=TABLE, cache_seqlens=np.array([33, 1], np.int32)), ValueError,
     r"cache_seqlens\[0\] = 33; accepted: 0 <= length <= Nmax = 32"),
    (dict(block_table=TABLE, causal=1), TypeError, r"causal must be a bool"),
])
def test_paged_validation_messages(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        decode(*_qkv(), **kwargs)


def test_paged_entries_past_the_length_are_not_checked():
    table = np.array([[0, -1], [2, 99]], np.int32)  # the second pages hold no key of these lengths
    decode(*_qkv(), block_table=table, cache_seqlens=np.array([16, 3], np.int32))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(page=24), ValueError, r"pages of 24 keys .* accepted: page_size a multiple of 16"),
])
def test_page_size_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        decode(*_qkv(**kwargs), block_table=TABLE)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(cache_batch_idx=np.array([0, 3], np.int32)), ValueError, r"cache_batch_idx\[1\] = 3; accepted: cache rows in \[0, 3\)"),
    (dict(cache_batch_idx=np.array([0, 1, 2], np.int32)), ValueError, r"cache_batch_idx has shape \(3,\); accepted: \(2,\)"),
    (dict(cache_leftpad=np.array([0, 9], np.int32), cache_seqlens=np.array([8, 8], np.int32),
          cache_batch_idx=np.array([0, 1], np.int32)), ValueError,
     r"cache_leftpad\[1\] = 9; accepted: 0 <= cache_leftpad\[b\] <= cache_seqlens\[b\]"),
    (dict(cache_leftpad=[0, 1], cache_batch_idx=np.array([0, 1], np.int32)), TypeError,
     r"cache_leftpad must be an int32 array"),
    (dict(), ValueError, r"batch mismatch: q has B=2, k_cache / v_cache have 3 rows; pass cache_batch_idx"),
])
def test_batch_idx_and_leftpad_validation_messages(kwargs, exc, match):
    z = lambda *s: np.zeros(s, np.float32)
    with pytest.raises(exc, match=match):
        decode(z(2, 4, 1, 16), z(3, 2, 8, 16), z(3, 2, 8, 16), **kwargs)


def test_paged_numpy_matches_reference_without_kernel_layout_tricks(rng):
    """reference.decode's paged layout is the gather it describes (a check of the reference itself)."""
    q, k, v = inputs(rng, 2, 2, 1, 2, 40, 8, "float64")
    kp, vp, table = paged(rng, k, v, 16)
    lens = np.array([40, 17])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = decode_attention(q, kp, vp, cache_seqlens=lens, block_table=table, splits=3, block_n=16)
    want = decode_attention(q, k, v, cache_seqlens=lens)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12)


PAGED_COMPILE = """
import pathlib
from numba import cuda
from numba_flash.kernels import decode as dk
for i, (rows, mode) in enumerate([(4, dk.CacheMode(paged=True)), (1, dk.CacheMode(paged=True)),
                                  (4, dk.CacheMode(batch_idx=True, leftpad=True, causal=False))]):
    cfg = dk.decode_config(128, "float16", rows)
    ptx, _ = cuda.compile_ptx(dk.kernel_source(cfg, True, True, mode), dk.kernel_signature("float16"), cc=(9, 0),
                              fastmath=dk.FASTMATH)
    pathlib.Path({tmp!r}, f"k{{i}}.ptx").write_text(ptx)
"""


@pytest.mark.heavy
def test_cache_mode_kernels_compile_for_sm90_without_spills(tmp_path):
    """The paged builds of the shipped fp16 d128 tiles (warp_split and block-wide) and an indexed, non-causal one:
    sm_90 PTX through ptxas with no stack, no spills, and the cp.async copies."""
    import os
    import re
    import subprocess
    import textwrap

    from test_ptx import NO_GPU_PATCH, _pythonpath, find_ptxas, ptxas_report

    if find_ptxas() is None:
        pytest.skip("ptxas not found")
    script = tmp_path / "compile.py"
    script.write_text(NO_GPU_PATCH + textwrap.dedent(PAGED_COMPILE.format(tmp=str(tmp_path))))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = _pythonpath()
    r = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).resolve().parents[2], env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and re.search(r"libNVVM|NVVM.*not found|nvrtc|CudaSupportError", r.stderr, re.I):
        pytest.skip(f"no NVVM to compile with: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-4000:]
    for i in range(3):
        ptx_text = (tmp_path / f"k{i}.ptx").read_text()
        assert "cp.async.cg.shared.global" in ptx_text
        rep = ptxas_report(ptx_text, tmp_path)
        print(i, rep["registers"], "registers", rep["stack"], rep["spill_stores"], rep["spill_loads"])
        assert rep["stack"] == 0 and rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["text"]
