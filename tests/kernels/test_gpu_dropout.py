"""Dropout at real sizes on the GPU, forward and backward, against PyTorch autograd of materialised attention with
the same keep mask (reference.dropout.dropout_factor): float64 (the truth) and the same formulas in the inputs'
dtype for flash-attention's error rule, err(ours) <= 2 * err(naive same-dtype) + 1 ulp of max|ref|, each output and
gradient on its own. Also: the kept fraction of the kernel's mask (read back through V = identity columns), the
same seed giving the same bits, and another offset other bits."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_helpers import HAVE_TORCH_CUDA, needs_gpu, torch

import numba_flash
from reference.dropout import dropout_factor, keep16

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
CASES = [  # (dtype, Hkv, n_q, n_k, d, causal, p), B = 2, H = 4
    ("float16", 4, 1024, 1024, 64, True, 0.1),
    ("bfloat16", 2, 777, 1024, 128, False, 0.3),
    ("float16", 2, 512, 700, 256, True, 0.5),  # d 256: the split-layout dkdv
    ("bfloat16", 4, 1000, 1500, 192, False, 0.2),
]
SEED, OFFSET = 0x1234_5678_9ABC, 17


def _torch_attention(q, k, v, causal, factor):
    """(B, H, N, d) materialised attention with GQA and bottom-right causal, P times the dropout factor."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))
    p = torch.softmax(s.float(), -1).to(s.dtype).nan_to_num(0.0)
    return (p * factor.to(p.dtype)) @ v


@pytest.mark.parametrize("dtype,Hkv,n_q,n_k,d,causal,p", CASES)
def test_dropout_error_rule(dtype, Hkv, n_q, n_k, d, causal, p):
    tdt = getattr(torch, dtype)
    B, H = 2, 4
    g = torch.Generator(device="cuda").manual_seed(n_q + d)
    mk = lambda h, n: torch.randn(B, h, n, d, device="cuda", generator=g).to(tdt)  # noqa: E731
    q, k, v, dout = mk(H, n_q), mk(Hkv, n_k), mk(Hkv, n_k), mk(H, n_q)
    kw = dict(causal=causal, dropout_p=p, dropout_seed=SEED, dropout_offset=OFFSET)
    out, lse = numba_flash.forward(q, k, v, **kw)
    grads = numba_flash.backward(q, k, v, out, lse, dout, **kw)
    factor = torch.from_numpy(dropout_factor((B, H), n_q, n_k, p, SEED, OFFSET, np.dtype(np.float64))).cuda()

    def run(dt):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        o = _torch_attention(*leaves, causal, factor)
        o.backward(dout.to(dt))
        return (o.detach(), *(x.grad for x in leaves))

    exact, naive = run(torch.float64), run(tdt)
    for name, ours, x, nv in zip(("out", "dq", "dk", "dv"), (out, *grads), exact, naive):
        err = (ours.double() - x).abs().max().item()
        ref_err = (nv.double() - x).abs().max().item()
        floor = EPS[dtype] * x.abs().max().item()
        assert err <= 2 * ref_err + floor, f"{name}: {err:.3e} > 2 x {ref_err:.3e} + {floor:.1e}"
    again = numba_flash.forward(q, k, v, **kw)[0]
    assert torch.equal(out, again), "the same seed and offset give the same bits"
    other = numba_flash.forward(q, k, v, **{**kw, "dropout_offset": OFFSET + 1})[0]
    assert not torch.equal(out, other)


def test_kept_fraction_on_the_device():
    """V = the identity's columns makes O = P ∘ Z · s, so the kernel's own mask comes back: its kept fraction and
    every entry against reference.dropout.keep_mask."""
    B, H, n, p = 1, 2, 256, 0.37
    q = torch.zeros(B, H, n, 256, device="cuda", dtype=torch.float16)  # equal scores: P = 1 / n (non-causal)
    v = torch.eye(n, 256, device="cuda", dtype=torch.float16)[None, None].expand(B, H, n, 256).contiguous()
    out, _ = numba_flash.forward(q, q, v, dropout_p=p, dropout_seed=5, dropout_offset=0)
    kept = out[..., :n].float() > 0
    want = torch.from_numpy(dropout_factor((B, H), n, n, p, 5, 0, np.dtype(np.float64)) > 0).cuda()
    assert torch.equal(kept, want)
    assert abs(kept.float().mean().item() - keep16(p) / 65536) < 0.01


def test_torch_attention_dropout_gradients_and_generator():
    """numba_flash.torch.attention with dropout_p: the seed comes from the generator (the same generator state,
    the same output), autograd's gradients are numba_flash.backward's with that seed, and torch.compile refuses."""
    from numba_flash.torch import attention, draw_seed

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    gen = torch.Generator().manual_seed(42)
    out = attention(q, k, v, causal=True, dropout_p=0.2, generator=gen)
    seed = draw_seed(torch.Generator().manual_seed(42))
    ref, lse = numba_flash.forward(q.detach(), k.detach(), v.detach(), causal=True, dropout_p=0.2, dropout_seed=seed)
    assert torch.equal(out.detach(), ref)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = numba_flash.backward(q.detach(), k.detach(), v.detach(), ref, lse, dout, causal=True, dropout_p=0.2,
                                dropout_seed=seed)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert torch.equal(got, w)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough(), pytest.raises(NotImplementedError, match="dropout_p under torch.compile, tracing"):
        attention(q, k, v, dropout_p=0.1)
    with pytest.raises(Exception) as info:  # dynamo may wrap the error: the message somewhere in the chain
        torch.compile(lambda a, b, c: attention(a, b, c, dropout_p=0.1), fullgraph=True)(q, k, v)
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("dropout_p under torch.compile" in m for m in chain), chain
