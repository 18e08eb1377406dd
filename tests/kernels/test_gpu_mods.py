"""Sliding window, softcap and ALiBi at real sizes on the GPU, forward and backward (numba_flash.torch).

References are PyTorch autograd of materialised attention with the same variants (gpu_helpers.attention_mods_torch):
float64 (the truth) and the same formulas in the inputs' dtype for flash-attention's error rule,
    err(ours vs fp64) <= 2 * err(naive same-dtype vs fp64) + 1 ulp of max|ref|,
each output and gradient on its own.
"""
from __future__ import annotations

import pytest

from gpu_helpers import HAVE_TORCH_CUDA, attention_mods_torch, needs_gpu, torch

import numba_flash

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]

if HAVE_TORCH_CUDA:
    from numba_flash.torch import attention

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
CASES = [  # (dtype, Hkv, n_q, n_k, d, causal, window, softcap, alibi, deterministic), B = 2, H = 4
    ("bfloat16", 4, 2048, 2048, 128, True, (256, 0), 0.0, None, True),
    ("float16", 2, 1000, 1500, 64, False, (100, 37), 0.0, None, False),
    ("bfloat16", 4, 1024, 1024, 128, True, (-1, -1), 50.0, None, True),
    ("float16", 4, 1500, 700, 64, True, (-1, -1), 0.0, "BH", False),  # Nq > Nk: rows that see no key
    ("bfloat16", 2, 777, 1024, 128, False, (300, 300), 30.0, "H", False),
    ("float16", 4, 1024, 1024, 128, True, (511, -1), 20.0, "H", True),
    ("float16", 2, 1000, 1500, 256, False, (100, 37), 20.0, "H", True),  # d 256: the split-layout dkdv
    ("bfloat16", 4, 1024, 777, 192, True, (-1, -1), 0.0, "BH", False),
]


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype,Hkv,n_q,n_k,d,causal,window,cap,alibi,det", CASES)
def test_mods_error_rule(dtype, Hkv, n_q, n_k, d, causal, window, cap, alibi, det):
    tdt = getattr(torch, dtype)
    B, H = 2, 4
    g = torch.Generator(device="cuda").manual_seed(n_q * 7 + n_k)
    mk = lambda h, n: torch.randn(B, h, n, d, device="cuda", generator=g).to(tdt)  # noqa: E731
    q, k, v, dout = mk(H, n_q), mk(Hkv, n_k), mk(Hkv, n_k), mk(H, n_q)
    slopes = None
    if alibi:
        slopes = torch.rand((H,) if alibi == "H" else (B, H), device="cuda", generator=g) * 0.3 + 0.01
    mods = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)

    def run(fn, dt=None):
        leaves = [x.detach().to(dt or x.dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout.to(out.dtype))
        return (out.detach(), *(x.grad for x in leaves))

    ours = run(lambda a, b, c: attention(a, b, c, deterministic=det, **mods))
    exact = run(lambda a, b, c: attention_mods_torch(a, b, c, **mods), torch.float64)
    naive = run(lambda a, b, c: attention_mods_torch(a, b, c, naive=True, **mods))
    for name, o, x, nv in zip(("out", "dq", "dk", "dv"), ours, exact, naive):
        assert torch.isfinite(o).all(), name
        bound = 2 * _max_err(nv, x) + EPS[dtype] * x.abs().max().item()
        assert _max_err(o, x) <= bound, f"{name}: {_max_err(o, x):.3e} > {bound:.3e}"
    out, lse = numba_flash.forward(q, k, v, **mods)  # L: the logsumexp of the modified scores
    s_rows = torch.isfinite(lse)
    assert (out[~s_rows] == 0).all()


def test_mods_deterministic_backward_is_bitwise_repeatable():
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, 4, 1500, 128, device="cuda", generator=g).half() for _ in range(4))
    mods = dict(causal=True, window_size=(200, 0), softcap=30.0, alibi_slopes=torch.rand(4, device="cuda"))
    out, lse = numba_flash.forward(q, k, v, **mods)
    a = numba_flash.backward(q, k, v, out, lse, do, **mods)
    b = numba_flash.backward(q, k, v, out, lse, do, **mods)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
