"""forward on a real GPU at real sizes (skipped where there is none).

fp32: relative error vs a float64 reference. fp16/bf16: the flash-attention rule,
err(ours vs fp64) <= 2 * err(naive same-dtype vs fp64) + small.
"""
from __future__ import annotations


import pytest

from gpu_helpers import HAVE_TORCH_CUDA, attention_f64_torch, attention_naive_same_dtype, needs_gpu, torch

import numba_flash

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]

LENGTHS = [(1, 1), (1, 4096), (129, 257), (300, 100), (4096, 4096)]
HEAD_DIMS = [32, 64, 96, 128, 192, 256]


def _inputs(B, H, Hkv, n_q, n_k, d, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h, n: (torch.randn(B, h, n, d, device="cuda", generator=g) * scale).to(dtype)
    return mk(H, n_q), mk(Hkv, n_k), mk(Hkv, n_k)


@pytest.mark.parametrize("n_q,n_k", LENGTHS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_grid(n_q, n_k, d, dtype, causal):
    tdt = getattr(torch, dtype)
    seed = hash((n_q, n_k, d, dtype, causal)) % 2**31
    q, k, v = _inputs(2, 4, 2, n_q, n_k, d, tdt, seed)
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    torch.cuda.synchronize()
    ref_o, ref_l = attention_f64_torch(q, k, v, causal)
    assert out.dtype == tdt and out.shape == q.shape and lse.dtype == torch.float32
    err = (out.double() - ref_o).abs().max().item()
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin), "fully-masked rows must be exactly the -inf ones"
    assert (out[~fin] == 0).all()
    lse_err = (lse.double()[fin] - ref_l[fin]).abs().max().item() if fin.any() else 0.0
    if dtype == "float32":
        assert err <= 2e-5 * max(1.0, ref_o.abs().max().item()), err
    else:
        naive = attention_naive_same_dtype(q, k, v, causal)
        naive_err = (naive.double() - ref_o).abs().max().item()
        assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive {dtype} {naive_err:.3e}"
    assert lse_err <= 1e-4, lse_err


@pytest.mark.parametrize("causal", [False, True])
def test_forward_huge_logits(causal):
    q, k, v = _inputs(1, 2, 2, 257, 300, 64, torch.float32, 7, scale=30.0)  # logits ~ 1e4
    out, lse = numba_flash.forward(q, k, v, causal=causal, softmax_scale=1.0)
    ref_o, ref_l = attention_f64_torch(q, k, v, causal, scale=1.0)
    assert torch.isfinite(out).all()
    assert (out.double() - ref_o).abs().max().item() < 1e-3 * ref_o.abs().max().item()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_forward_deterministic(dtype):
    q, k, v = _inputs(2, 4, 4, 1000, 1000, 128, getattr(torch, dtype), 3)
    first, first_lse = numba_flash.forward(q, k, v, causal=True)
    for _ in range(20):
        out, lse = numba_flash.forward(q, k, v, causal=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    rng = cp.random.default_rng(5)
    q = rng.standard_normal((2, 4, 200, 64), dtype=cp.float32)
    k = rng.standard_normal((2, 2, 300, 64), dtype=cp.float32)
    v = rng.standard_normal((2, 2, 300, 64), dtype=cp.float32)
    out, lse = numba_flash.forward(q, k, v)
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
    ref_o, _ = attention_f64_torch(*(torch.as_tensor(x, device="cuda") for x in (q, k, v)), False)
    assert float(cp.abs(out - cp.asarray(ref_o.float())).max()) < 2e-5


def test_strided_views_are_not_copied():
    base = torch.randn(2, 300, 4, 64, device="cuda")  # (B, N, H, d): heads interleaved
    q = k = v = base.transpose(1, 2)                    # (B, H, N, d), last dim contiguous
    out, _ = numba_flash.forward(q, k, v, causal=True)
    ref_o, _ = attention_f64_torch(q, k, v, True)
    assert (out.double() - ref_o).abs().max().item() < 2e-5


# The fp32 tensor-core kernel (3xTF32) against the SIMT kernel (fp32 FMA) on the same inputs: long
# sequences are where accumulation errors show (before per-tile accumulators and the alpha fix,
# max |O - fp64| grew to 9e-6 and |L - fp64| to 4.4e-5 at N = 16384, against 5e-7 and 1.7e-6).
@pytest.mark.parametrize("n,d,causal", [(16384, 128, False), (4096, 64, True), (1000, 96, False)])
def test_tf32x3_as_accurate_as_simt(n, d, causal):
    q, k, v = _inputs(1, 2, 1, n, n, d, torch.float32, n + d)
    ref_o, ref_l = attention_f64_torch(q, k, v, causal)
    errs = {}
    for kernel in ("tf32x3", "simt", "tf32"):
        out, lse = numba_flash.forward(q, k, v, causal=causal, kernel=kernel)
        errs[kernel] = ((out.double() - ref_o).abs().max().item(), (lse.double() - ref_l).abs().max().item())
    (o3, l3), (os_, ls), (o1, l1) = errs["tf32x3"], errs["simt"], errs["tf32"]
    assert o3 <= 2 * os_ + 1e-7 and l3 <= 2 * ls + 1e-6, errs
    assert o1 > 4 * o3, errs  # one pass is visibly tf32 (the split is doing something)
    assert o1 <= 2e-3 * ref_o.abs().max().item(), errs


def test_fp16_lse_does_not_drift_with_length():
    """mma_forward's L on long rows (fp16 inputs: exact products, fp32 sums): L's error stays the
    softmax's own as Nk grows (alpha is exactly 1 while the row maximum holds; it drifted to 4e-5)."""
    q, k, v = _inputs(1, 2, 2, 512, 16384, 128, torch.float16, 11)
    _, lse = numba_flash.forward(q, k, v)
    _, ref_l = attention_f64_torch(q, k, v, False)
    assert (lse.double() - ref_l).abs().max().item() < 5e-6


@pytest.mark.parametrize("d", [20, 44, 100])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_head_dim_not_a_multiple_of_8(d, dtype, causal):
    """Rows of a padded buffer (16-byte strides, as cp.async needs) whose padding holds NaN: the tensor-core
    kernel runs with PARTIAL_CHUNK (the chunk holding column d - 1 is part data, part zeros), and a byte
    copied past column d - 1 would put NaN into S."""
    tdt = getattr(torch, dtype)
    pad = -(-d // 8) * 8
    g = torch.Generator(device="cuda").manual_seed(d)
    bufs = [torch.randn(1, 4, n, pad, device="cuda", generator=g).to(tdt) for n in (300, 517, 517)]
    for b in bufs:
        b[..., d:] = float("nan")
    q, k, v = (b[..., :d] for b in bufs)
    assert "part data" in numba_flash.explain(q, k, v, causal=causal)
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    ref_o, ref_l = attention_f64_torch(q, k, v, causal)
    naive_err = (attention_naive_same_dtype(q, k, v, causal).double() - ref_o).abs().max().item()
    err = (out.double() - ref_o).abs().max().item()
    assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive {dtype} {naive_err:.3e}"
    fin = torch.isfinite(ref_l)
    assert (lse.double()[fin] - ref_l[fin]).abs().max().item() <= 1e-4
