"""numba_flash.forward against reference.standard_attention (float64).

Runs on the CUDA simulator where there is no GPU (CI), and on the GPU where there is one.
Two ways in: the public ``forward`` with the shipped configs (few, fixed cases: 256 simulated
threads per block are slow), and ``simt_forward.launch`` with small tile configs, which lets
hypothesis cover many tiles, odd lengths and block-boundary cases quickly.

Tolerance for float32 inputs: each output is a convex combination of V rows computed in fp32
with fp32 exp2; errors are a few ulp of max|V| times log(Nk) growth, far under 1e-5 for the
sizes here. An indexing or masking bug gives errors of order 1.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from numba_flash.configs import SimtConfig, head_dim_bucket, simt_config
from numba_flash.kernels import simt_forward

F32_TOL = 1e-5


def _qkv(rng, B, H, Hkv, n_q, n_k, d, dtype=np.float32, scale=1.0):
    q = (rng.standard_normal((B, H, n_q, d)) * scale).astype(dtype)
    k = (rng.standard_normal((B, Hkv, n_k, d)) * scale).astype(dtype)
    v = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
    return q, k, v


def _check(out, lse, q, k, v, causal, scale=None, tol=F32_TOL):
    ref_o, ref_l = reference.standard_attention(q, k, v, causal=causal, softmax_scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == np.float32
    fin = np.isfinite(ref_l)
    np.testing.assert_array_equal(np.isfinite(lse), fin)   # masked rows: exactly the -inf ones
    assert np.all(lse[~fin] == -np.inf) and np.all(out[~fin] == 0)
    err = np.abs(out.astype(np.float64) - ref_o).max(initial=0)
    lse_err = np.abs(lse[fin] - ref_l[fin]).max(initial=0)
    assert err <= tol * max(1.0, np.abs(ref_o).max(initial=0)), f"O error {err:.3e}"
    assert lse_err <= tol * max(1.0, np.abs(ref_l[fin]).max(initial=0)), f"L error {lse_err:.3e}"


# ---- the public API, shipped configs ---------------------------------------------------------
@pytest.mark.parametrize(
    "B,H,Hkv,n_q,n_k,d,causal",
    [
        (1, 2, 1, 70, 50, 24, False),   # GQA, odd head dim padded 24 -> 32, N not a tile multiple
        (1, 2, 2, 40, 70, 72, True),    # Nq < Nk causal (bottom-right), d = 72 -> 96
        (1, 1, 1, 70, 30, 64, True),    # Nq > Nk causal: the first 40 rows see nothing
        (2, 1, 1, 1, 65, 128, False),   # one query, two K/V tiles
    ],
)
def test_forward_shipped_configs(rng, B, H, Hkv, n_q, n_k, d, causal):
    q, k, v = _qkv(rng, B, H, Hkv, n_q, n_k, d)
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    _check(out, lse, q, k, v, causal)


def test_forward_large_head_dim(rng):
    q, k, v = _qkv(rng, 1, 1, 1, 33, 40, 200)  # a d > 128 config (200 -> 256)
    out, lse = numba_flash.forward(q, k, v, causal=True)
    _check(out, lse, q, k, v, True)


def test_forward_batchless_forms(rng):
    q, k, v = _qkv(rng, 1, 2, 2, 20, 20, 16)
    out3, lse3 = numba_flash.forward(q[0], k[0], v[0])
    out2, lse2 = numba_flash.forward(q[0, 1], k[0, 1], v[0, 1])
    assert out3.shape == (2, 20, 16) and lse3.shape == (2, 20)
    assert out2.shape == (20, 16) and lse2.shape == (20,)
    _check(out3, lse3, q[0], k[0], v[0], False)
    np.testing.assert_array_equal(out2, out3[1])


def test_forward_fp16(rng):
    """fp16 in, fp16 out; error within 2x the naive fp16 error (+ fp16 output rounding)."""
    q, k, v = _qkv(rng, 1, 2, 2, 48, 80, 64, dtype=np.float16)
    out, lse = numba_flash.forward(q, k, v, causal=True)
    ref_o, _ = reference.standard_attention(q, k, v, causal=True)
    naive_o, _ = reference.standard_attention(q, k, v, causal=True, dtype=np.float16)
    err = np.abs(out.astype(np.float64) - ref_o).max()
    naive_err = np.abs(naive_o.astype(np.float64) - ref_o).max()
    assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive fp16 {naive_err:.3e}"


def test_forward_huge_logits(rng):
    """Logits up to ~1e4: the max subtraction keeps everything finite."""
    q, k, v = _qkv(rng, 1, 1, 1, 30, 40, 16, scale=25.0)
    out, lse = numba_flash.forward(q, k, v, causal=False, softmax_scale=1.0)
    s = np.abs(q.astype(np.float64) @ k[0, 0].T.astype(np.float64)).max()
    assert s > 1e3
    assert np.isfinite(out).all()
    # An fp32 score of size |s| carries ~|s|·d·eps32 absolute error, which exp turns into that
    # relative error in the weights; masking or indexing bugs give O(1) errors instead.
    _check(out, lse, q, k, v, False, scale=1.0, tol=s * q.shape[-1] * 2.0**-24)


@pytest.mark.parametrize("n_q,n_k", [(0, 10), (10, 0)])
def test_forward_empty_sequences(rng, n_q, n_k):
    q, k, v = _qkv(rng, 1, 2, 1, n_q, n_k, 8)
    out, lse = numba_flash.forward(q, k, v)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    if n_q:  # no keys at all: every row is fully masked
        assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("kernel,dtype", [("mma", np.float16), ("tf32x3", np.float32), ("tf32", np.float32),
                                          ("simt", np.float16), ("auto", np.float32)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_no_keys_explicit_kernel(rng, kernel, dtype, causal):
    """Nk = 0 with a named tensor-core kernel gives O = 0, L = -inf as auto does (it raised on k's zero strides)."""
    q, k, v = _qkv(rng, 1, 2, 1, 5, 0, 32, dtype=dtype)
    out, lse = numba_flash.forward(q, k, v, kernel=kernel, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == np.float32
    assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("kernel,dtype,words", [("mma", np.float32, "float32"), ("tf32x3", np.float16, "float16"),
                                                ("mma", np.float16, "cp.async")])
def test_forward_no_keys_still_refuses(rng, kernel, dtype, words):
    """The empty-keys shortcut comes after the kernel's checks: a kernel that cannot take the problem raises."""
    q, k, v = _qkv(rng, 1, 2, 1, 5, 0, 12 if words == "cp.async" else 32, dtype=dtype)  # d = 12: 24-byte rows
    with pytest.raises(ValueError, match=f"kernel='{kernel}' cannot run.*{words}"):
        numba_flash.forward(q, k, v, kernel=kernel)


def test_forward_no_heads(rng):
    """H = 0 with Hkv = 0 gives empty outputs, as the docstring says (the H % Hkv check refused it)."""
    q, k, v = _qkv(rng, 2, 0, 0, 3, 5, 8)
    out, lse = numba_flash.forward(q, k, v)
    assert out.shape == (2, 0, 3, 8) and lse.shape == (2, 0, 3)
    assert numba_flash.explain(q, k, v).startswith("simt:")
    with pytest.raises(ValueError, match=r"H=2 heads and k/v have Hkv=0; H must be a multiple of Hkv >= 1 "
                                         r"\(GQA/MQA\), or H = Hkv = 0"):
        numba_flash.forward(*_qkv(rng, 1, 2, 0, 3, 5, 8))


# ---- many tiles, small configs ---------------------------------------------------------------
SMALL_CONFIGS = [  # (block_q, block_k, row_threads, col_threads, share_kv): few threads, many tiles
    (8, 8, 2, 2, False),
    (16, 8, 4, 2, True),
    (8, 16, 1, 4, True),
    (16, 16, 4, 2, False),
]


def _launch_small(cfg_tuple, q, k, v, causal, scale):
    bq, bk, rt, ct, share = cfg_tuple
    d = q.shape[-1]
    cfg = SimtConfig(bq, bk, rt, ct, head_dim_bucket(d), share_kv=share)
    out = cuda.device_array(q.shape, q.dtype)
    lse = cuda.device_array(q.shape[:-1], np.float32)
    simt_forward.launch(cfg, cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse,
                        causal=causal, softmax_scale=scale, dtype=str(q.dtype), d=d)
    return out.copy_to_host(), lse.copy_to_host()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cfg=st.sampled_from(SMALL_CONFIGS),
    n_q=st.integers(1, 40),
    n_k=st.integers(1, 40),
    d=st.sampled_from([1, 5, 16, 24]),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
    log_scale=st.floats(-2, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_forward_small_tiles_property(cfg, n_q, n_k, d, group, causal, log_scale, seed):
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, 1, 2, 2 // group, n_q, n_k, d)
    scale = float(10 ** log_scale) / math.sqrt(d)
    out, lse = _launch_small(cfg, q, k, v, causal, scale)
    _check(out, lse, q, k, v, causal, scale=scale, tol=1e-4 if scale * math.sqrt(d) > 10 else F32_TOL)


# ---- K/V copy variants (stage_trips, prefetch_trips): same maths, other copies ----------------
# Each case: the variant must match the reference and be bitwise equal to the original per-trip
# loop with the same tiles (only the global -> shared copies differ). Tile configs cover a copy
# plan with a constant row jump between trips (16 threads, d <= 16), per-trip index maths (6 or
# 4 threads), and trips that only some threads have (48 threads, 32 K groups).
COPY_VARIANTS = [
    dict(stage_trips=1),
    dict(stage_trips=3),
    dict(prefetch_trips=1),
    dict(prefetch_trips=2, stage_trips=1),
    dict(prefetch_trips=64),  # more than any tile has: the whole tile travels in registers
]
COPY_CASES = [  # (block_q, block_k, row_threads, col_threads, share_kv), n_q, n_k, d, group, causal
    ((16, 16, 4, 4, True), 37, 45, 16, 2, True),    # row-jump plan; last K/V tile partial; GQA
    ((16, 16, 4, 4, False), 30, 48, 16, 1, False),  # row-jump plan, every tile whole (no checks)
    ((16, 16, 4, 4, True), 20, 33, 5, 1, False),    # odd d: the checked copy
    ((12, 8, 3, 2, True), 25, 19, 24, 2, True),     # 6 threads: trips by index maths, uneven
    ((8, 8, 2, 2, False), 9, 30, 7, 1, True),       # Nq < Nk causal (bottom-right)
    ((96, 8, 24, 2, True), 40, 21, 16, 1, False),   # 48 threads, 32 K groups: partial trip
]


def _launch_cfg(cfg, q, k, v, causal, scale, dtype=None):
    out = cuda.device_array(q.shape, q.dtype)
    lse = cuda.device_array(q.shape[:-1], np.float32)
    dev = lambda x: cuda.to_device(x) if isinstance(x, np.ndarray) else x  # noqa: E731
    simt_forward.launch(cfg, dev(q), dev(k), dev(v), out, lse,
                        causal=causal, softmax_scale=scale, dtype=dtype or str(q.dtype), d=q.shape[-1])
    return out.copy_to_host(), lse.copy_to_host()


@pytest.mark.parametrize("variant", COPY_VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: f"{c[0][:4]}-share{int(c[0][4])}-d{c[3]}")
def test_forward_copy_variants(rng, variant, case):
    (bq, bk, rt, ct, share), n_q, n_k, d, group, causal = case
    q, k, v = _qkv(rng, 1, 2, 2 // group, n_q, n_k, d)
    scale = 1.0 / math.sqrt(d)
    base = SimtConfig(bq, bk, rt, ct, head_dim_bucket(d), share_kv=share)
    cfg = SimtConfig(bq, bk, rt, ct, head_dim_bucket(d), share_kv=share, **variant)
    assert not cfg.problems()
    out, lse = _launch_cfg(cfg, q, k, v, causal, scale)
    _check(out, lse, q, k, v, causal, scale=scale)
    out0, lse0 = _launch_cfg(base, q, k, v, causal, scale)
    np.testing.assert_array_equal(out, out0)
    np.testing.assert_array_equal(lse, lse0)


def test_forward_copy_variant_strided_bf16(rng):
    """A strided (non-contiguous) K/V view and bf16 storage through the planned copies."""
    cfg = SimtConfig(16, 16, 4, 4, 16, share_kv=True, prefetch_trips=2, stage_trips=1)
    q, k, v = _qkv(rng, 1, 2, 1, 21, 40, 16)
    kk = np.zeros((1, 1, 40, 40), np.float32)
    kk[..., 3:19] = k  # rows of 40 floats, head dim at column 3: strides the wrapper never makes
    k_view = cuda.to_device(kk)[..., 3:19]
    out, lse = _launch_cfg(cfg, q, k_view, v, True, 0.25)
    _check(out, lse, q, k, v, True, scale=0.25)
    bits = lambda x: (x.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 - truncate to bf16
    widen = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    qb, kb, vb = bits(q), bits(k), bits(v)
    out_b, lse_b = _launch_cfg(cfg, qb, kb, vb, True, 0.25, "bfloat16")
    base = SimtConfig(16, 16, 4, 4, 16, share_kv=True)
    out_0, lse_0 = _launch_cfg(base, qb, kb, vb, True, 0.25, "bfloat16")
    np.testing.assert_array_equal(out_b, out_0)
    ref_o, _ = reference.standard_attention(widen(qb), widen(kb), widen(vb), causal=True, softmax_scale=0.25)
    assert np.abs(widen(out_b).astype(np.float64) - ref_o).max() < 1e-2


# ---- validation: one function, clear messages --------------------------------------------------
def _ok(rng, d=8):
    return _qkv(rng, 1, 2, 1, 4, 4, d)


@pytest.mark.parametrize(
    "mutate,exc,words",
    [
        (lambda q, k, v: (q, k[..., :4], v[..., :4]), ValueError, ["head dim", "d=8", "d=4"]),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, ["same shape"]),
        (lambda q, k, v: (np.concatenate([q, q[:, :1]], 1), k, np.concatenate([v, v], 1)), ValueError, ["same shape"]),
        (lambda q, k, v: (q, np.concatenate([k] * 2, 0), np.concatenate([v] * 2, 0)), ValueError, ["batch", "B=1", "B=2"]),
        (lambda q, k, v: (np.concatenate([q, q[:, :1]], 1), np.concatenate([k, k], 1), np.concatenate([v, v], 1)), ValueError, ["H=3", "Hkv=2", "multiple"]),
        (lambda q, k, v: (q.astype(np.float64), k, v), TypeError, ["float64", "float32"]),
        (lambda q, k, v: (q, k.astype(np.float16), v), TypeError, ["one dtype", "float16"]),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, ["list", "NumPy"]),
        (lambda q, k, v: (q[0, 0, 0], k, v), ValueError, ["shape", "(B, H, N, d)"]),
        (lambda q, k, v: (q[0], k, v), ValueError, ["same number of dims"]),
    ],
)
def test_validation_errors(rng, mutate, exc, words):
    q, k, v = mutate(*_ok(rng))
    with pytest.raises(exc) as e:
        numba_flash.forward(q, k, v)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("d", [0, 257, 300])
def test_validation_head_dim(rng, d):
    q, k, v = _qkv(rng, 1, 1, 1, 2, 2, d)
    with pytest.raises(ValueError, match=rf"d={d}.*1 <= d <= 256"):
        numba_flash.forward(q, k, v)


@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                       (math.nan, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_validation_softmax_scale(rng, scale, exc):
    with pytest.raises(exc, match="softmax_scale"):
        numba_flash.forward(*_ok(rng), softmax_scale=scale)


@pytest.mark.parametrize("scale", [2.0**64 * (1 + 2**-52), 1e30, 1e38, 1e300, 10**400])
def test_validation_softmax_scale_too_large(rng, scale):
    """scale·log2(e)·s is formed in fp32: above 2**64 the kernels gave NaN O or L = -inf."""
    with pytest.raises(ValueError, match=re.escape(f"softmax_scale = {scale!r}") + r".*at most 2\*\*64"):
        numba_flash.forward(*_ok(rng), softmax_scale=scale)
    with pytest.raises(ValueError, match=r"at most 2\*\*64"):
        numba_flash.explain(*_ok(rng), softmax_scale=scale)


@pytest.mark.parametrize("scale", [2.0**64, 1e-30, 1e-300])
def test_softmax_scale_extremes_accepted(rng, scale):
    """The bound itself, and scales whose scale·log2(e) underflows fp32 (uniform weights: the exact limit)."""
    q, k, v = _ok(rng)
    out, lse = numba_flash.forward(q, k, v, softmax_scale=scale)
    ref_o, ref_l = reference.standard_attention(q, k, v, softmax_scale=scale)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, ref_o, atol=F32_TOL)
    np.testing.assert_allclose(lse, ref_l, rtol=1e-5)


def test_validation_causal_and_kernel(rng):
    with pytest.raises(TypeError, match="causal must be a bool"):
        numba_flash.forward(*_ok(rng), causal="yes")
    with pytest.raises(ValueError, match="kernel='fast'; accepted"):
        numba_flash.forward(*_ok(rng), kernel="fast")


@pytest.mark.parametrize("causal", [np.array([True, False]), np.array([], bool), np.ones((2, 1), bool)])
def test_validation_causal_array(rng, causal):
    """A bool array of any size was let through, then numpy's 'truth value is ambiguous'."""
    with pytest.raises(TypeError, match=r"causal must be a bool \(a Python bool, or a NumPy bool scalar or "
                                        r"one-element bool array\); got a bool array of shape"):
        numba_flash.forward(*_ok(rng), causal=causal)


def test_validation_causal_numpy_bools_accepted(rng):
    """What worked before keeps working: NumPy bool scalars and one-element bool arrays."""
    q, k, v = _ok(rng)
    ref, _ = numba_flash.forward(q, k, v, causal=True)
    for causal in (np.bool_(True), np.array(True), np.ones((1, 1), bool)):
        np.testing.assert_array_equal(numba_flash.forward(q, k, v, causal=causal)[0], ref)


def test_numba_device_arrays(rng):
    """Numba device arrays, which the accepted list names, were refused on the simulator (they have no
    __cuda_array_interface__ there); they are taken and give Numba device arrays back."""
    q, k, v = _ok(rng)
    ref_o, ref_l = numba_flash.forward(q, k, v, causal=True)
    out, lse = numba_flash.forward(*(cuda.to_device(x) for x in (q, k, v)), causal=True)
    assert type(out) is type(cuda.to_device(q)) and out.shape == q.shape
    np.testing.assert_array_equal(out.copy_to_host(), ref_o)
    np.testing.assert_array_equal(lse.copy_to_host(), ref_l)


class _FakeTorchTensor:
    """What validate reads of a PyTorch CUDA tensor (torch is not needed to test the sparse check)."""

    __module__ = "torch"
    is_cuda = True
    device = "cuda:0"

    def __init__(self, x, layout, is_sparse):
        self.shape, self.dtype, self.layout, self.is_sparse = x.shape, f"torch.{x.dtype}", layout, is_sparse


@pytest.mark.parametrize("layout,is_sparse", [("torch.sparse_coo", True), ("torch.sparse_csr", False)])
def test_validation_sparse_torch_tensor(rng, layout, is_sparse):
    """A sparse CUDA tensor got as far as launch.py's RuntimeError; refused up front, without importing torch."""
    q, k, v = _ok(rng)
    with pytest.raises(TypeError, match=rf"k is a PyTorch tensor with layout {layout}; accepted: dense "
                                        r"\(torch.strided\) tensors"):
        numba_flash.forward(_FakeTorchTensor(q, "torch.strided", False), _FakeTorchTensor(k, layout, is_sparse),
                            _FakeTorchTensor(v, "torch.strided", False))


def test_validation_masked_array(rng):
    """The mask of a NumPy masked array was silently dropped."""
    q, k, v = _ok(rng)
    with pytest.raises(TypeError, match=r"v is a NumPy masked array; its mask would be ignored"):
        numba_flash.forward(q, k, np.ma.masked_array(v, mask=v > 0))


def test_explain_names_config_and_padding(rng):
    q, k, v = _qkv(rng, 1, 1, 1, 4, 4, 72)
    text = numba_flash.explain(q, k, v)
    cfg = simt_config(72)
    assert f"{cfg.block_q}x{cfg.block_k}" in text and f"padded to {head_dim_bucket(72)}" in text


# ---- kernel choice: tensor cores where they apply, said out loud where they do not -------------
def test_fp16_routes_to_tensor_cores(rng):
    q, k, v = _qkv(rng, 1, 2, 1, 70, 40, 40, dtype=np.float16)  # d=40 padded to 64, GQA
    assert numba_flash.explain(q, k, v).startswith("mma:")
    out, lse = numba_flash.forward(q, k, v, causal=True)
    ref_o, _ = reference.standard_attention(q, k, v, causal=True)
    naive_o, _ = reference.standard_attention(q, k, v, causal=True, dtype=np.float16)
    err = np.abs(out.astype(np.float64) - ref_o).max()
    naive_err = np.abs(naive_o.astype(np.float64) - ref_o).max()
    assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive fp16 {naive_err:.3e}"


def test_fp16_unaligned_rows_fall_back_with_a_warning(rng):
    q, k, v = _qkv(rng, 1, 1, 1, 9, 9, 12, dtype=np.float16)  # 24-byte rows: no cp.async
    text = numba_flash.explain(q, k, v)
    assert text.startswith("simt:") and "widened to fp32" in text
    with pytest.warns(numba_flash.PerformanceWarning, match="16 B"):
        out, lse = numba_flash.forward(q, k, v)
    ref_o, _ = reference.standard_attention(q, k, v)
    assert np.abs(out.astype(np.float64) - ref_o).max() < 2e-3


@pytest.mark.parametrize("n_q", [0, 1])
def test_kernel_check_before_empty_shortcut(rng, n_q):
    """kernel='mma' on float32 raised at Nq = 1 but was accepted at Nq = 0: both raise now."""
    q, k, v = _qkv(rng, 1, 1, 1, n_q, 4, 8)
    with pytest.raises(ValueError, match="kernel='mma' cannot run.*float32"):
        numba_flash.forward(q, k, v, kernel="mma")


def test_kernel_argument(rng):
    q, k, v = _ok(rng)
    with pytest.raises(ValueError, match="kernel='mma' cannot run.*float32"):
        numba_flash.forward(q, k, v, kernel="mma")
    qh, kh, vh = (x.astype(np.float16) for x in _qkv(rng, 1, 1, 1, 8, 8, 16))
    assert numba_flash.explain(qh, kh, vh, kernel="simt").startswith("simt:")
    out, _ = numba_flash.forward(qh, kh, vh, kernel="simt")  # asked for: no warning needed
    assert out.dtype == np.float16
