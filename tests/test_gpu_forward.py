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
HEAD_DIMS = [32, 64, 96, 128, 256]


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
