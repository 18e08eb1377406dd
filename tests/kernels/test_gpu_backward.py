"""backward and numba_flash.torch.attention on a real GPU at real sizes (skipped where there is none).

References are PyTorch autograd of materialised attention: float64 (the truth) and, for the
flash-attention error rule, the same formulas in the inputs' 16-bit dtype.
    fp16 / bf16: err(ours vs fp64) <= 2 * err(naive same-dtype autograd vs fp64) + 1 ulp of max|ref|
    fp32:        err(ours vs fp64) <= 1e-4 * max|ref|  (fp32 sums of <= 2048 terms; a bug is O(1))
Every gradient is checked on its own. The case list is chosen so that few (dtype, d, causal)
specialisations compile (~1 minute of the budget); the kernels themselves take milliseconds.
"""
from __future__ import annotations

import sys
import zlib

import pytest

from gpu_helpers import HAVE_TORCH_CUDA, attention_f64_torch, attention_naive_same_dtype, needs_gpu, torch

import numba_flash
from numba_flash.backward import backward
from numba_flash import backward_plan

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]

if HAVE_TORCH_CUDA:
    from numba_flash.torch import attention

CASES = [  # (dtype, Hkv, n_q, n_k, d, causal), B = 2, H = 4
    ("float32", 4, 2048, 2048, 128, True),
    ("float32", 2, 1000, 1500, 64, False),   # GQA group 2, lengths off the tile grid
    ("float32", 4, 1500, 700, 64, True),     # Nq > Nk: the first 800 rows see no key
    ("float16", 4, 2048, 2048, 128, False),
    ("float16", 2, 1024, 1024, 64, True),
    ("bfloat16", 2, 2048, 2048, 128, True),
    ("bfloat16", 4, 513, 1000, 64, False),
    # d > 128: the tensor-core backward's split-layout dkdv (padded: 160 -> 192, 200 -> 256)
    ("float16", 2, 1000, 1000, 256, True),
    ("bfloat16", 4, 513, 700, 192, False),
    ("float16", 2, 700, 513, 160, True),
    ("bfloat16", 2, 1000, 1000, 200, True),
]


def _inputs(B, H, Hkv, n_q, n_k, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h, n: torch.randn(B, h, n, d, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(H, n_q), mk(Hkv, n_k), mk(Hkv, n_k), mk(H, n_q)  # q, k, v, dout


def _autograd(fn, q, k, v, dout, dtype=None):
    """(out, dq, dk, dv) of fn by torch autograd, on leaf copies of q, k, v in dtype."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return (out.detach(), *(x.grad for x in leaves))


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype,Hkv,n_q,n_k,d,causal", CASES)
def test_backward_error_rule(dtype, Hkv, n_q, n_k, d, causal):
    tdt = getattr(torch, dtype)
    q, k, v, dout = _inputs(2, 4, Hkv, n_q, n_k, d, tdt, seed=zlib.crc32(repr((dtype, n_q, n_k, d, causal)).encode()))
    ours = _autograd(lambda *x: attention(*x, causal=causal), q, k, v, dout)  # numba_flash.torch end to end
    ref = _autograd(lambda *x: attention_f64_torch(*x, causal)[0], q, k, v, dout, torch.float64)
    torch.cuda.synchronize()
    for name, g, r, x in zip(("dq", "dk", "dv"), ours[1:], ref[1:], (q, k, v)):
        assert g.dtype == tdt and g.shape == x.shape, (name, g.dtype, g.shape)
        assert torch.isfinite(g).all(), name
    if n_q > n_k and causal:  # rows that see no key: exactly zero
        assert (ours[1][:, :, : n_q - n_k] == 0).all()
    if dtype == "float32":
        for name, g, r in zip(("dq", "dk", "dv"), ours[1:], ref[1:]):
            err, mag = _max_err(g, r), r.abs().max().item()
            assert err <= 1e-4 * mag, f"{name}: error {err:.3e}, max |ref| {mag:.3e}"
        return
    naive = _autograd(lambda *x: attention_naive_same_dtype(*x, causal), q, k, v, dout)
    ulp = torch.finfo(tdt).eps
    for name, g, nv, r in zip(("dq", "dk", "dv"), ours[1:], naive[1:], ref[1:]):
        err, naive_err, mag = _max_err(g, r), _max_err(nv, r), r.abs().max().item()
        print(f"{dtype} {name}: ours {err:.3e}, naive {dtype} {naive_err:.3e}, max |ref| {mag:.3e}")
        assert err <= 2 * naive_err + ulp * mag, f"{name}: ours {err:.3e} vs naive {dtype} {naive_err:.3e}"


@pytest.mark.parametrize("dtype,d", [("float32", 128), ("float16", 64), ("float16", 128), ("float16", 256),
                                     ("bfloat16", 192)])
def test_backward_deterministic(dtype, d):
    """20 runs, bitwise the same gradients: the deterministic splits (every fp32 plane of dQ owned by one block,
    planes summed in order) at d128 (fp16, and fp32's 3xTF32) and, on sm_90 (the wgmma dkdv), at fp16 d64;
    elsewhere fp16 d64 takes the dq kernel (no atomics); d 192 / 256 whichever dq_scheme picks."""
    from numba_flash.ptx import current_wgmma

    Hkv, causal = (4 if dtype == "float32" else 2), True  # compiled above
    q, k, v, dout = _inputs(2, 4, Hkv, 1000, 1000, d, getattr(torch, dtype), 3)
    how = numba_flash.explain_backward(q, k, v, causal=causal).splitlines()[3]
    splits = d == 128 or current_wgmma()
    assert how.startswith("dQ: " if d > 128 else "dQ: deterministic splits" if splits else "dQ: a separate dq kernel"), how
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    first = backward(q, k, v, out, lse, dout, causal=causal)
    for _ in range(20):
        again = backward(q, k, v, out, lse, dout, causal=causal)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def test_float32_autograd_matches_float64_autograd():
    """gradcheck-like (the kernels take no float64): fp32 autograd through numba_flash against
    torch float64 autograd, on a tiny GQA causal case with a ragged length and a loss that is not a
    plain sum."""
    q, k, v, _ = _inputs(1, 2, 1, 37, 53, 64, torch.float32, 11)
    w = torch.randn(1, 2, 37, 64, device="cuda", dtype=torch.float64)
    grads = []
    for dtype, fn in ((torch.float32, lambda *x: attention(*x, causal=True)),
                      (torch.float64, lambda *x: attention_f64_torch(*x, True)[0])):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        loss = (fn(*leaves).double() * w).square().sum()
        loss.backward()
        grads.append([x.grad.double() for x in leaves])
    for name, g32, g64 in zip(("dq", "dk", "dv"), *grads):
        rel = ((g32 - g64).abs().max() / g64.abs().max()).item()
        assert rel < 1e-5, f"{name}: relative error {rel:.3e}"


def test_autograd_with_strided_inputs_and_expanded_dout():
    """q, k, v as (B, N, H, d) storage seen as (B, H, N, d); out.sum() hands backward an all-zero-stride
    dout, which numba_flash.torch makes contiguous; other strides are read in place."""
    leaves = [torch.randn(1, 300, 4, 64, device="cuda").transpose(1, 2).requires_grad_() for _ in range(3)]
    assert not leaves[0].is_contiguous() and leaves[0].stride(-1) == 1
    out = attention(*leaves, causal=True)
    out.sum().backward()
    ref = _autograd(lambda *x: attention_f64_torch(*x, True)[0], *(x.detach() for x in leaves),
                    torch.ones(1, 4, 300, 64, device="cuda"), torch.float64)
    for x, r in zip(leaves, ref[1:]):
        assert x.grad.shape == x.shape
        assert _max_err(x.grad, r) <= 1e-4 * r.abs().max().item()


def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    q, k, v, dout = (cp.asarray(t) for t in _inputs(1, 4, 4, 300, 200, 64, torch.float32, 5))
    out, lse = numba_flash.forward(q, k, v, causal=True)
    grads = backward(q, k, v, out, lse, dout, causal=True)
    assert all(isinstance(g, cp.ndarray) for g in grads)
    ref = _autograd(lambda *x: attention_f64_torch(*x, True)[0], *(torch.as_tensor(x, device="cuda") for x in (q, k, v)),
                    torch.as_tensor(dout, device="cuda"), torch.float64)
    for g, r in zip(grads, ref[1:]):
        assert _max_err(torch.as_tensor(g, device="cuda"), r) <= 1e-4 * r.abs().max().item()



TF32_CASES = [  # (Hkv, n_q, n_k, d, causal), B = 1, H = 4: every shipped head dim, both dkdv plans
    (4, 4096, 4096, 128, False),  # long rows: the tensor core's truncating accumulation would drift here
    (2, 2048, 2048, 128, True),   # GQA, causal d128
    (2, 1000, 1500, 64, False),   # lengths off the tile grid
    (4, 1500, 700, 64, True),     # Nq > Nk: the first 800 rows see no key
    (4, 777, 777, 32, True),
    (4, 300, 500, 40, False),     # d 40 -> 64
]


@pytest.mark.parametrize("Hkv,n_q,n_k,d,causal", TF32_CASES)
def test_tf32x3_backward_as_accurate_as_simt(Hkv, n_q, n_k, d, causal):
    """kernel='tf32x3' (3xTF32 on tensor cores) against the SIMT backward: each gradient's max error
    vs float64 autograd within 2x the SIMT one's (+ 1e-6 of max|ref|), and bitwise repeatable."""
    q, k, v, dout = _inputs(1, 4, Hkv, n_q, n_k, d, torch.float32, seed=zlib.crc32(repr((n_q, n_k, d)).encode()))
    out, lse = numba_flash.forward(q, k, v, causal=causal, kernel="simt")
    ref = _autograd(lambda *x: attention_f64_torch(*x, causal)[0], q, k, v, dout, torch.float64)
    tf = backward(q, k, v, out, lse, dout, causal=causal, kernel="tf32x3")
    simt = backward(q, k, v, out, lse, dout, causal=causal, kernel="simt")
    torch.cuda.synchronize()
    for name, a, b, r in zip(("dq", "dk", "dv"), tf, simt, ref[1:]):
        err, err_simt, mag = _max_err(a, r), _max_err(b, r), r.abs().max().item()
        print(f"tf32x3 d{d} causal={causal} {name}: {err:.3e}, simt {err_simt:.3e}, max |ref| {mag:.3e}")
        assert torch.isfinite(a).all(), name
        assert err <= 2 * err_simt + 1e-6 * mag, f"{name}: tf32x3 {err:.3e} vs simt {err_simt:.3e}"
    if n_q > n_k and causal:
        assert (tf[0][:, :, : n_q - n_k] == 0).all()
    again = backward(q, k, v, out, lse, dout, causal=causal, kernel="tf32x3")
    assert all(torch.equal(a, b) for a, b in zip(tf, again))
    if "dkdv_atomic" in backward_plan.tf32_config(d, causal):  # dQ in dkdv: the atomic grid too
        atomic = backward(q, k, v, out, lse, dout, causal=causal, kernel="tf32x3", deterministic=False)
        for name, a, b, r in zip(("dq", "dk", "dv"), atomic, simt, ref[1:]):
            err, err_simt, mag = _max_err(a, r), _max_err(b, r), r.abs().max().item()
            print(f"tf32x3 atomic d{d} causal={causal} {name}: {err:.3e}, simt {err_simt:.3e}")
            assert err <= 2 * err_simt + 1e-6 * mag, f"{name}: tf32x3 atomic {err:.3e} vs simt {err_simt:.3e}"


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype,d,causal", [("float16", 128, False), ("bfloat16", 64, True)])
def test_mma_sync_dq_in_dkdv_error_rule(monkeypatch, deterministic, dtype, d, causal):
    """The mma.sync kernels that sm_80-89 run, on this GPU whatever it is: configs.MMA_BWD_WGMMA emptied, so
    an sm_90 takes them too (the dQ-in-dkdv kernel of the splits / atomic grid at d128, the dq kernel or the
    atomic 64-key dkdv at d64). GQA 2, lengths off the tile grid, the error rule per gradient."""
    from numba_flash import plans
    from numba_flash.kernels import wgmma_backward

    monkeypatch.setattr(sys.modules["numba_flash.backward"], "MMA_BWD_WGMMA", {})
    plans.clear()  # a recorded plan would replay the wgmma kernels
    monkeypatch.setattr(plans, "_state", dict(plans._state, enabled=False))
    monkeypatch.setattr(wgmma_backward, "build", None)  # launching it would fail
    tdt = getattr(torch, dtype)
    q, k, v, dout = _inputs(2, 4, 2, 1000, 1300, d, tdt, seed=7 * d + causal)
    assert "wgmma" not in numba_flash.explain_backward(q, k, v, causal=causal)
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    grads = backward(q, k, v, out, lse, dout, causal=causal, deterministic=deterministic)
    ref = _autograd(lambda *x: attention_f64_torch(*x, causal)[0], q, k, v, dout, torch.float64)
    naive = _autograd(lambda *x: attention_naive_same_dtype(*x, causal), q, k, v, dout)
    ulp = torch.finfo(tdt).eps
    for name, g, nv, r in zip(("dq", "dk", "dv"), grads, naive[1:], ref[1:]):
        err, naive_err, mag = _max_err(g, r), _max_err(nv, r), r.abs().max().item()
        assert err <= 2 * naive_err + ulp * mag, f"{name}: ours {err:.3e} vs naive {dtype} {naive_err:.3e}"


def test_sm90_runs_the_wgmma_dkdv():
    """On sm_90 the default backward launches wgmma_backward's kernel (and explain says so); elsewhere not."""
    from numba_flash.kernels import wgmma_backward
    from numba_flash.ptx import current_wgmma

    q, k, v, dout = _inputs(1, 2, 2, 300, 300, 128, torch.float16, 11)
    said = "wgmma" in numba_flash.explain_backward(q, k, v)
    assert said == current_wgmma()
    before = wgmma_backward.build.cache_info().misses + wgmma_backward.build.cache_info().hits
    out, lse = numba_flash.forward(q, k, v)
    backward(q, k, v, out, lse, dout, deterministic=False)
    after = wgmma_backward.build.cache_info().misses + wgmma_backward.build.cache_info().hits
    assert (after > before) == current_wgmma()


@pytest.mark.parametrize("scheme", ["atomic", "splits", "kernel"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_short_sequences_large_logits(monkeypatch, scheme, dtype, d):
    """flash-attention's test_flash_attn_bwd_overflow, through numba_flash.torch.attention: q·5, k·3, v·3, B2 H5,
    N = 1 .. 17 keys, so the key block that forms dQ is mostly past n_k and some rows' L are very negative
    (their zero-filled keys' exp(0 - L) overflowed fp16; q·20 overflows fp32 too). Every dQ scheme: atomic
    (deterministic=False), the splits (forced: at these sizes the default takes the dq kernel) and the dq kernel.
    Finite gradients, and the error rule against the same formulas materialised in the dtype."""
    from numba_flash import plans
    from numba_flash.blocks import schedule

    plans.clear()
    monkeypatch.setattr(plans, "_state", dict(plans._state, enabled=False))
    if scheme == "splits":
        monkeypatch.setattr(schedule, "SPLITS_SLOWER_OK", float("inf"))
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(d)
    for n in (1, 2, 5, 17):
        for big in ((5.0, 3.0, 3.0), (20.0, 20.0, 1.0)):
            q, k, v, dout = (torch.randn(2, 5, n, d, device="cuda", generator=g) * s for s in (*big, 1.0))
            q, k, v, dout = (x.to(tdt) for x in (q, k, v, dout))
            run = lambda *x: attention(*x, deterministic=scheme != "atomic")  # noqa: E731
            ours = _autograd(run, q, k, v, dout)
            ref = _autograd(lambda *x: attention_f64_torch(*x, False)[0], q, k, v, dout, torch.float64)
            naive = _autograd(lambda *x: attention_naive_same_dtype(*x, False), q, k, v, dout)
            torch.cuda.synchronize()
            ulp = torch.finfo(tdt).eps
            # one scale for the three: at N = 1, dQ and dK are 0 (one key: P = 1, dS = P (dP - D) = 0), and what
            # ours and naive give there is rounding in dP - D
            mag = max(r.abs().max().item() for r in ref[1:])
            for name, gr, nv, r in zip(("dq", "dk", "dv"), ours[1:], naive[1:], ref[1:]):
                bad = (~torch.isfinite(gr)).sum().item()
                assert bad == 0, f"N={n} scale {big}: {name} has {bad} non-finite entries"
                if not torch.isfinite(nv).all():  # the materialised same-dtype softmax itself overflowed
                    continue
                err, naive_err = _max_err(gr, r), _max_err(nv, r)
                slack = 1e-4 * mag if dtype == "float32" else ulp * mag
                assert err <= 2 * naive_err + slack, \
                    f"N={n} scale {big}: {name} ours {err:.3e} vs naive {dtype} {naive_err:.3e}, max |ref grads| {mag:.3e}"
