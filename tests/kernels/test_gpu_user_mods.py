"""User mods (numba_flash.mods) at real sizes on the GPU: mask_mod, score_mod with aux tensors, document_mask.

The truth is materialised attention in float64 with the same mask and bias written in torch; the naive
same-dtype attention gives flash-attention's error rule, err(ours vs fp64) <= 2 err(naive vs fp64) + 1 ulp of
max |ref|, on O and L (the forward) and on dQ, dK, dV (the backward through numba_flash.torch.attention's
autograd, the score mod with its grad; the truth's gradients by torch autograd in float64).
"""
from __future__ import annotations

import importlib
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


def documents(g, B, n_q, n_k):
    """(document_mask of sorted random ids over 8 documents, separate for queries and keys; its visibility
    (B, 1, Nq, Nk))."""
    seg_q, seg_k = (torch.sort(torch.randint(0, 8, (B, n), device="cuda", generator=g, dtype=torch.int32), dim=1)[0]
                    for n in (n_q, n_k))
    return document_mask(seg_q, seg_k), seg_q[:, None, :, None] == seg_k[:, None, None, :]


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
        kw["mask_mod"], same_doc = documents(g, B, n_q, n_k)
        seen &= same_doc
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


def rel_bias_grad(score, b, h, q_idx, kv_idx, table):
    return 1.0


def tanh30(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


def tanh30_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / 30.0)
    return 1.0 - t * t


BWD_CASES = [  # (dtype, Nq, Nk, d, causal, mods, deterministic, wgmma dkdv on sm_90)
    ("bfloat16", 1024, 1024, 128, True, "document+relbias", True, True),
    ("float16", 1000, 1500, 64, False, "stripes+tanh", False, True),
    ("bfloat16", 777, 1024, 128, True, "document+relbias", False, False),  # the mma.sync atomic dkdv
    ("float16", 700, 900, 64, True, "tanh", True, False),
    ("float16", 600, 900, 256, True, "relbias", True, True),  # d 256: the split-layout dkdv
]


@pytest.mark.parametrize("dtype,n_q,n_k,d,causal,mods,deterministic,wgmma", BWD_CASES)
def test_user_mods_backward_error_rule(dtype, n_q, n_k, d, causal, mods, deterministic, wgmma, monkeypatch):
    import numba_flash.torch as nft

    if not wgmma:
        monkeypatch.setattr(importlib.import_module("numba_flash.backward"), "current_wgmma", lambda: False)
    tdt = getattr(torch, dtype)
    B, H = 2, 4
    g = torch.Generator(device="cuda").manual_seed(n_q + d + 7)
    q = torch.randn(B, H, n_q, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(B, H, n_k, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    dout = torch.randn(B, H, n_q, d, device="cuda", generator=g).to(tdt)
    i = torch.arange(n_q, device="cuda")[:, None]
    j = torch.arange(n_k, device="cuda")[None, :]
    bias = torch.zeros(B, H, n_q, n_k, device="cuda", dtype=torch.float64)
    seen = (j <= i + n_k - n_q) if causal else torch.ones(n_q, n_k, dtype=torch.bool, device="cuda")
    seen = seen.expand(B, H, n_q, n_k).clone()
    kw = {}
    if "relbias" in mods:
        table = torch.randn(H, 2 * max(n_q, n_k) + 1, device="cuda", generator=g)
        kw["score_mod"] = ScoreMod(rel_bias, grad=rel_bias_grad, aux=(table,))
        bias += table[:, i - j + table.shape[1] // 2].double()[None]
    if "tanh" in mods:
        kw["score_mod"] = ScoreMod(tanh30, grad=tanh30_grad)
    if "document" in mods:
        kw["mask_mod"], same_doc = documents(g, B, n_q, n_k)
        seen &= same_doc
    if "stripes" in mods:
        kw["mask_mod"] = MaskMod(stripes)
        seen &= ((j // 64 + torch.arange(H, device="cuda")[:, None, None]) % 4 != 1)[None]
    scale = 1.0 / math.sqrt(d)

    def grads(x_dtype):
        leaves = [x.detach().to(x_dtype).requires_grad_() for x in (q, k, v)]
        s = (leaves[0] @ leaves[1].transpose(-1, -2)) * scale
        if "tanh" in mods:
            s = 30.0 * torch.tanh(s / 30.0)
        s = (s + bias.to(x_dtype)).masked_fill(~seen, -math.inf)
        p = torch.nan_to_num(torch.softmax(s.float() if x_dtype != torch.float64 else s, -1)).to(x_dtype)
        (p @ leaves[2]).backward(dout.to(x_dtype))
        return [x.grad.double() for x in leaves]

    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    out = nft.attention(ql, kl, vl, causal=causal, deterministic=deterministic, **kw)
    out.backward(dout)
    exact, naive = grads(torch.float64), grads(tdt)
    for name, ours, x, nv in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), exact, naive):
        err = (ours.double() - x).abs().max().item()
        ref_err = (nv - x).abs().max().item()
        assert err <= 2 * ref_err + EPS[dtype] * x.abs().max().item(), (name, err, ref_err)
