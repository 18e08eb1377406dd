"""Shared helpers for tests that need a real GPU (imported only by test_gpu_*.py)."""
from __future__ import annotations

import math

import pytest
from numba import config as nb_config
from numba import cuda

HAVE_GPU = (not nb_config.ENABLE_CUDASIM) and cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a real CUDA GPU (none here, or the simulator is on)")

try:
    import torch

    HAVE_TORCH_CUDA = HAVE_GPU and torch.cuda.is_available()
except ImportError:  # torch is optional
    torch = None
    HAVE_TORCH_CUDA = False


def _masked_scores(q, k, v, causal, scale, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """S = q kᵀ · scale with GQA heads repeated, capped (softcap·tanh(s / softcap)), ALiBi's -slope·|i + shift - j|,
    then masked: query i sees key j iff i + shift - left <= j <= i + shift + right (shift = Nk - Nq, -1 unbounded,
    causal: right = 0, bottom-right aligned). Returns (S, v with its heads repeated)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    H, Hkv = q.shape[-3], k.shape[-3]
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=-3)
        v = v.repeat_interleave(H // Hkv, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    n_q, n_k = s.shape[-2:]
    i = torch.arange(n_q, device=q.device)[:, None]
    j = torch.arange(n_k, device=q.device)[None, :]
    shift = n_k - n_q
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).reshape((-1, H) if alibi_slopes.dim() == 1 else alibi_slopes.shape)
        s = s - slopes[..., None, None] * (i + shift - j).abs().to(s.dtype)
    left, right = window_size
    right = 0 if causal else right
    if left >= 0 or right >= 0:
        hidden = torch.zeros(n_q, n_k, dtype=torch.bool, device=q.device)
        if left >= 0:
            hidden |= j < i + shift - left
        if right >= 0:
            hidden |= j > i + shift + right
        s = s.masked_fill(hidden, -math.inf)
    return s, v


def _softmax_pv(s, v):
    """(softmax(S) V, logsumexp S) in S's dtype; a row that sees no key gets O = 0, L = -inf."""
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    return p @ v, lse


def attention_f64_torch(q, k, v, causal, scale=None):
    """float64 attention on the GPU (torch), same conventions as reference.standard_attention."""
    return _softmax_pv(*_masked_scores(*(t.double() for t in (q, k, v)), causal, scale))


def attention_naive_same_dtype(q, k, v, causal, scale=None):
    """The 'naive same-dtype implementation' of the flash-attention error rule: every step in q's dtype."""
    s, v = _masked_scores(q, k, v, causal, scale)
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.nan_to_num(p) @ v  # rows that see no key: P = 0 (not NaN), so their gradients are 0 too


def attention_mods_torch(q, k, v, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         naive=False):
    """Materialised attention with flash-attn's variants (``_masked_scores``), in q's dtype (naive=True: the error
    rule's naive same-dtype implementation, softmax in fp32 as torch's) or, for float64 inputs, the truth;
    differentiable."""
    s, v = _masked_scores(q, k, v, causal, scale, window_size, softcap, alibi_slopes)
    if naive:
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        return torch.nan_to_num(p) @ v
    return _softmax_pv(s, v)[0]
