"""User mods (numba_flash.mods) at real sizes on the GPU: mask_mod, score_mod with aux tensors, document_mask.

The truth is materialised attention in float64 with the same mask and bias written in torch; the naive
same-dtype attention gives flash-attention's error rule, err(ours vs fp64) <= 2 err(naive vs fp64) + 1 ulp of
max |ref|, on O (the forward: the backward kernels have no user mods) and L.
"""
from __future__ import annotations

import math

import pytest

from gpu_helpers import HAVE_TORCH_CUDA, needs_gpu, torch

import numba_flash
from numba_flash.mods import MaskMod, ScoreMod, document_mask

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + table.shape[1] // 2]


def stripes(b, h, q_idx, kv_idx):
    return (kv_idx // 64 + h) % 4 != 1


CASES = [  # (dtype, Nq, Nk, d, causal, mods)
    ("bfloat16", 2048, 2048, 128, True, "document+relbias"),
    ("float16", 1000, 1500, 64, False, "stripes"),
    ("bfloat16", 777, 1024, 256, True, "relbias"),
]


@pytest.mark.parametrize("dtype,n_q,n_k,d,causal,mods", CASES)
def test_user_mods_error_rule(dtype, n_q, n_k, d, causal, mods):
    tdt = getattr(torch, dtype)
    B, H = 2, 4
    g = torch.Generator(device="cuda").manual_seed(n_q + d)
    q = torch.randn(B, H, n_q, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(B, H, n_k, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    i = torch.arange(n_q, device="cuda")[:, None]
    j = torch.arange(n_k, device="cuda")[None, :]
    bias = torch.zeros(B, H, n_q, n_k, device="cuda", dtype=torch.float64)
    seen = (j <= i + n_k - n_q) if causal else torch.ones(n_q, n_k, dtype=torch.bool, device="cuda")
    seen = seen.expand(B, H, n_q, n_k).clone()
    kw = {}
    if "relbias" in mods:
        table = torch.randn(H, 2 * max(n_q, n_k) + 1, device="cuda", generator=g)
        kw["score_mod"] = ScoreMod(rel_bias, aux=(table,))
        bias += table[:, i - j + table.shape[1] // 2].double()[None]
    if "document" in mods:
        seg = torch.sort(torch.randint(0, 8, (B, n_q), device="cuda", generator=g, dtype=torch.int32), dim=1)[0]
        kw["mask_mod"] = document_mask(seg)
        seen &= seg[:, None, :, None] == seg[:, None, None, :]
    if mods == "stripes":
        kw["mask_mod"] = MaskMod(stripes)
        seen &= ((j // 64 + torch.arange(H, device="cuda")[:, None, None]) % 4 != 1)[None]
    out, lse = numba_flash.forward(q, k, v, causal=causal, **kw)
    scale = 1.0 / math.sqrt(d)

    def attend(x_dtype):
        s = (q.to(x_dtype) @ k.to(x_dtype).transpose(-1, -2)) * scale + bias.to(x_dtype)
        s = s.masked_fill(~seen, -math.inf)
        if x_dtype == torch.float64:
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
            return p @ v.double(), lse
        p = torch.nan_to_num(torch.softmax(s.float(), -1)).to(tdt)
        return p @ v, None

    o64, l64 = attend(torch.float64)
    o_naive, _ = attend(tdt)
    err = (out.double() - o64).abs().max().item()
    naive = (o_naive.double() - o64).abs().max().item()
    assert err <= 2 * naive + EPS[dtype] * o64.abs().max().item(), (err, naive)
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin].double() - l64[fin]).abs().max().item() <= 1e-3 * max(1.0, l64[fin].abs().max().item())
    assert (out[~fin] == 0).all()
