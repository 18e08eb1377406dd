"""numba_flash.flash_attn: flash-attn 2.x's functions, layouts, defaults and returns.

Anywhere PyTorch is installed: the adapter on the CPU with numba_flash's attention and decode replaced by
float64 materialised twins (their conventions: (B, H, N, d), bottom-right causal, decode's per-sequence
lengths), against the same attention computed directly in flash-attn's layout; packing, the KV-cache
append, and every refusal. On a GPU (marked gpu): the real kernels by the flash-attention error rule.
"""
from __future__ import annotations

import inspect
import math

import pytest

torch = pytest.importorskip("torch")

from gpu_helpers import HAVE_TORCH_CUDA, attention_mods_torch, needs_gpu  # noqa: E402

import numba_flash.flash_attn as fa  # noqa: E402


def _twin_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, return_lse=False, deterministic=True, dropout_p=0.0, dropout_seed=None):
    if dropout_p:  # the record of what the adapter passed (test_dropout_reaches_attention_and_s_dmask)
        _twin_attention.dropout = (dropout_p, dropout_seed)
    out = attention_mods_torch(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes)
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32)  # shape only (the GPU test checks values)
    return (out, lse) if return_lse else out


def _logical_cache(x, b, block_table, cache_batch_idx):
    """Sequence b's cache rows (1, Hkv, N, d) in key order: its pages in table order, or its cache row."""
    if block_table is not None:
        return torch.cat([x[p] for p in block_table[b].tolist()], dim=1)[None]
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return x[row:row + 1]


def _twin_decode(q, k, v, *, cache_seqlens=None, softmax_scale=None, num_splits=None, block_table=None,
                 cache_batch_idx=None, cache_leftpad=None, causal=True, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None):
    outs = []
    for b in range(q.shape[0]):
        kb, vb = (_logical_cache(x, b, block_table, cache_batch_idx) for x in (k, v))
        n = kb.shape[2] if cache_seqlens is None else int(cache_seqlens[b])
        s = 0 if cache_leftpad is None else int(cache_leftpad[b])
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        outs.append(attention_mods_torch(q[b:b + 1], kb[:, :, s:n], vb[:, :, s:n], causal, softmax_scale,
                                         window_size, softcap, slopes))
    return torch.cat(outs), torch.zeros(q.shape[:-1], dtype=torch.float32)


def _twin_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, return_lse=False, deterministic=True):
    out = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert rq.stop - rq.start <= max_q and rk.stop - rk.start <= max_k
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        out[rq] = _twin_attention(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None], v[rk].transpose(0, 1)[None],
                                  causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=slopes)[0].transpose(0, 1)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)  # shape only (the GPU test checks values)
    return (out, lse) if return_lse else out


@pytest.fixture
def twin(monkeypatch):
    monkeypatch.setattr(fa, "attention", _twin_attention)
    monkeypatch.setattr(fa, "decode", _twin_decode)
    monkeypatch.setattr(fa, "varlen_attention", _twin_varlen)


def _bnhd(B, N, H, d, seed):
    return torch.randn(B, N, H, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _ref(q, k, v, **kw):
    """The same attention in flash-attn's layout, computed directly."""
    return attention_mods_torch(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)


def test_signatures_are_flash_attns():
    """Argument names and defaults of flash-attn 2.x (2.6 - 2.8), so keyword calls port unchanged."""
    params = inspect.signature(fa.flash_attn_func).parameters
    assert list(params) == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                            "alibi_slopes", "deterministic", "return_attn_probs"]
    assert params["deterministic"].default is False and params["window_size"].default == (-1, -1)
    vl = inspect.signature(fa.flash_attn_varlen_func).parameters
    assert list(vl) == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                        "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                        "return_attn_probs", "block_table"]
    assert list(inspect.signature(fa.flash_attn_varlen_qkvpacked_func).parameters)[:4] == [
        "qkv", "cu_seqlens", "max_seqlen", "dropout_p"]
    kvc = inspect.signature(fa.flash_attn_with_kvcache).parameters
    assert list(kvc)[:8] == ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens"]
    assert kvc["num_splits"].default == 0 and kvc["return_softmax_lse"].default is False


@pytest.mark.parametrize("causal", [False, True])
def test_func_layouts_and_returns(twin, causal):
    q, k, v = _bnhd(2, 50, 4, 32, 1), _bnhd(2, 70, 2, 32, 2), _bnhd(2, 70, 2, 32, 3)
    out = fa.flash_attn_func(q, k, v, causal=causal, window_size=(20, -1))
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, _ref(q, k, v, causal=causal, window_size=(20, -1)))
    # flash-attn's rule: causal is right = 0, whatever right was given (numba_flash.forward refuses it)
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, causal=causal, window_size=(20, 7)),
                               _ref(q, k, v, causal=causal, window_size=(20, 0 if causal else 7)))
    out2, lse, probs = fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert lse.shape == (2, 4, 50) and probs is None
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, causal=causal), out2)
    qkv = torch.stack([q, q, q], dim=2)
    torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, causal=causal, softcap=5.0),
                               _ref(q, q, q, causal=causal, softcap=5.0))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_layouts_and_returns(twin, causal):
    lens = [5, 30, 12]
    cu = torch.tensor([0, 5, 35, 47], dtype=torch.int32)
    q, k, v = (torch.randn(47, h, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for h, s in ((4, 1), (2, 2), (2, 3)))
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, 47) and probs is None
    for b in range(3):
        s = slice(int(cu[b]), int(cu[b + 1]))
        ref = _ref(q[None, s], k[None, s], v[None, s], causal=causal)[0]
        torch.testing.assert_close(out[s], ref)
    torch.testing.assert_close(fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 30, 30,
                                                                  causal=causal), out)
    slopes = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))  # (B, H)
    mods = dict(causal=causal, window_size=(6, 3), alibi_slopes=slopes, softcap=4.0)
    out_m = fa.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, **mods)
    for b in range(3):  # per sequence, its own slopes; causal makes the window's right 0 (flash-attn's rule)
        s = slice(int(cu[b]), int(cu[b + 1]))
        ref = _ref(q[None, s], k[None, s], v[None, s], causal=causal, window_size=(6, 0 if causal else 3),
                   alibi_slopes=slopes[b:b + 1], softcap=4.0)[0]
        torch.testing.assert_close(out_m[s], ref)
    k4, v4 = (torch.randn(47, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    qkv = torch.stack([q, k4, v4], 1)  # distinct q, k, v: a mix-up of the three would show
    torch.testing.assert_close(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 30, causal=causal),
                               fa.flash_attn_varlen_func(q, k4, v4, cu, cu, 30, 30, causal=causal))


def test_kvcache_appends_in_place_and_attends(twin):
    B, Nmax, H, Hkv, d = 3, 40, 4, 2, 16
    k_cache, v_cache = _bnhd(B, Nmax, Hkv, d, 4), _bnhd(B, Nmax, Hkv, d, 5)
    k0, v0 = k_cache.clone(), v_cache.clone()
    lens = torch.tensor([5, 0, 30], dtype=torch.int32)
    q, k_new, v_new = _bnhd(B, 2, H, d, 6), _bnhd(B, 2, Hkv, d, 7), _bnhd(B, 2, Hkv, d, 8)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens, causal=True)
    for b in range(B):
        n = int(lens[b])
        assert torch.equal(k_cache[b, n:n + 2], k_new[b]) and torch.equal(v_cache[b, n:n + 2], v_new[b])
        assert torch.equal(k_cache[b, :n], k0[b, :n]) and torch.equal(k_cache[b, n + 2:], k0[b, n + 2:])
        ref = _ref(q[b:b + 1], k_cache[b:b + 1, :n + 2], v_cache[b:b + 1, :n + 2], causal=True)
        torch.testing.assert_close(out[b:b + 1], ref)
    assert not torch.equal(v_cache, v0)
    out1, lse = fa.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, cache_seqlens=7, return_softmax_lse=True)
    assert out1.shape == (B, 1, H, d) and lse.shape == (B, H, 1)
    torch.testing.assert_close(out1, _ref(q[:, :1], k_cache[:, :7], v_cache[:, :7]))


def test_kvcache_window_softcap_alibi(twin):
    """flash-attn's variants in the KV-cache call: each sequence's own bottom-right alignment (its cache length
    after the append), causal making the window's right 0, (B, H) slopes picked per sequence."""
    B, Nmax, H, Hkv, d = 2, 40, 4, 2, 16
    k_cache, v_cache = _bnhd(B, Nmax, Hkv, d, 40), _bnhd(B, Nmax, Hkv, d, 41)
    lens = torch.tensor([30, 12], dtype=torch.int32)
    q, kn, vn = _bnhd(B, 2, H, d, 42), _bnhd(B, 1, Hkv, d, 43), _bnhd(B, 1, Hkv, d, 44)
    slopes = torch.rand(B, H, generator=torch.Generator().manual_seed(45)) * 0.5
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, causal=True,
                                     window_size=(6, 3), softcap=3.0, alibi_slopes=slopes)
    for b in range(B):
        n = int(lens[b]) + 1
        ref = _ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal=True, window_size=(6, 0),
                   softcap=3.0, alibi_slopes=slopes[b])
        torch.testing.assert_close(out[b:b + 1], ref)
    windowless = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + 1, causal=True, softcap=3.0,
                                           alibi_slopes=slopes)
    assert not torch.allclose(out, windowless), "the window must change the result"


def _paged(x, page, table_width, seed):
    """x (B, N, Hkv, d) cut into pages of ``page`` rows at random physical places: (pages, table), table
    (B, table_width) int32 with -1 past each row's pages."""
    B, N, Hkv, d = x.shape
    per = -(-N // page)
    where = torch.randperm(B * per + 2, generator=torch.Generator().manual_seed(seed))[:B * per].view(B, per)
    pages = torch.full((B * per + 2, page, Hkv, d), float("nan"), dtype=x.dtype)
    padded = torch.cat([x, torch.zeros(B, per * page - N, Hkv, d, dtype=x.dtype)], dim=1)
    for b in range(B):
        for i in range(per):
            pages[where[b, i]] = padded[b, i * page:(i + 1) * page]
    table = torch.full((B, table_width), -1, dtype=torch.int32)
    table[:, :per] = where
    return pages, table


def _logical(pages, table, b):
    """Sequence b's rows (1, N, Hkv, d) from flash-attn's page layout."""
    return torch.cat([pages[p] for p in table[b].tolist() if p >= 0])[None]


def test_kvcache_paged_append_in_place_and_attend(twin):
    B, N, H, Hkv, d, page = 2, 48, 4, 2, 16, 16
    k_pages, table = _paged(_bnhd(B, N, Hkv, d, 20), page, 4, 0)
    v_pages, _ = _paged(_bnhd(B, N, Hkv, d, 21), page, 4, 0)
    before = k_pages.clone()
    lens = torch.tensor([5, 31], dtype=torch.int32)  # 31 + 2 crosses into the third page
    q, kn, vn = _bnhd(B, 3, H, d, 22), _bnhd(B, 2, Hkv, d, 23), _bnhd(B, 2, Hkv, d, 24)
    out = fa.flash_attn_with_kvcache(q, k_pages, v_pages, k=kn, v=vn, cache_seqlens=lens, block_table=table,
                                     causal=True, num_splits=1)
    for b in range(B):
        n = int(lens[b])
        kb, vb = _logical(k_pages, table, b), _logical(v_pages, table, b)
        assert torch.equal(kb[0, n:n + 2], kn[b]) and torch.equal(vb[0, n:n + 2], vn[b])
        assert torch.equal(kb[0, :n], _logical(before, table, b)[0, :n])
        torch.testing.assert_close(out[b:b + 1], _ref(q[b:b + 1], kb[:, :n + 2], vb[:, :n + 2], causal=True))
    touched = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for b in range(B):
        for t in range(2):
            pos = int(lens[b]) + t
            touched[table[b, pos // page], pos % page] = True
    same = torch.equal(k_pages[~touched].nan_to_num(7.0), before[~touched].nan_to_num(7.0))
    assert same, "only the appended rows of the pages change"


def test_kvcache_batch_idx_leftpad_and_queries(twin):
    Bc, B, N, H, Hkv, d = 4, 2, 24, 4, 2, 16
    k_cache, v_cache = _bnhd(Bc, N, Hkv, d, 30), _bnhd(Bc, N, Hkv, d, 31)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    pad = torch.tensor([2, 0], dtype=torch.int32)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    q, kn, vn = _bnhd(B, 3, H, d, 32), _bnhd(B, 1, Hkv, d, 33), _bnhd(B, 1, Hkv, d, 34)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, cache_batch_idx=idx,
                                     cache_leftpad=pad, causal=False)
    for b in range(B):
        r, s, n = int(idx[b]), int(pad[b]), int(lens[b])
        assert torch.equal(k_cache[r, n], kn[b, 0]) and torch.equal(v_cache[r, n], vn[b, 0])
        torch.testing.assert_close(out[b:b + 1], _ref(q[b:b + 1], k_cache[r:r + 1, s:n + 1], v_cache[r:r + 1, s:n + 1]))
    q20 = _bnhd(B, 20, H, d, 35)  # more than 16 queries (chunked prefill), causal
    out20 = fa.flash_attn_with_kvcache(q20, k_cache, v_cache, cache_seqlens=22, cache_batch_idx=idx, causal=True)
    for b in range(B):
        r = int(idx[b])
        torch.testing.assert_close(out20[b:b + 1], _ref(q20[b:b + 1], k_cache[r:r + 1, :22], v_cache[r:r + 1, :22],
                                                        causal=True))


def _rotated(x, theta, interleaved):
    """x (B, N, H, d) with feature pairs turned by angles theta (B, N, rotary_dim / 2), as complex products."""
    rd = 2 * theta.shape[-1]
    if interleaved:
        pairs = torch.complex(x[..., 0:rd:2], x[..., 1:rd:2])
    else:
        pairs = torch.complex(x[..., :rd // 2], x[..., rd // 2:rd])
    turned = pairs * torch.polar(torch.ones_like(theta), theta)[:, :, None, :]
    parts = (torch.stack([turned.real, turned.imag], -1).flatten(-2) if interleaved
             else torch.cat([turned.real, turned.imag], -1))
    return torch.cat([parts, x[..., rd:]], -1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_rotary(twin, interleaved, causal):
    B, N, H, Hkv, d, rd = 2, 40, 4, 2, 16, 8
    k_cache, v_cache = _bnhd(B, N, Hkv, d, 40), _bnhd(B, N, Hkv, d, 41)
    q, kn, vn = _bnhd(B, 3, H, d, 42), _bnhd(B, 2, Hkv, d, 43), _bnhd(B, 2, Hkv, d, 44)
    lens = torch.tensor([4, 30], dtype=torch.int32)
    freq = 1.0 / 10000 ** (torch.arange(rd // 2, dtype=torch.float64) * 2 / rd)
    angles = torch.arange(N, dtype=torch.float64)[:, None] * freq  # (seqlen_ro, rd / 2)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                     cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved)
    for b in range(B):
        n = int(lens[b])
        q_pos = n + (torch.arange(3) if causal else torch.zeros(3, dtype=torch.long))
        k_rot = _rotated(kn[b:b + 1], (n + torch.arange(2))[None, :, None] * freq, interleaved)
        assert torch.allclose(k_cache[b, n:n + 2], k_rot[0]) and torch.equal(v_cache[b, n:n + 2], vn[b])
        q_rot = _rotated(q[b:b + 1], q_pos[None, :, None] * freq, interleaved)
        torch.testing.assert_close(out[b:b + 1], _ref(q_rot, k_cache[b:b + 1, :n + 2], v_cache[b:b + 1, :n + 2],
                                                      causal=causal))
    with pytest.raises(NotImplementedError, match="rotary_cos / rotary_sin with cache_leftpad"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                   cache_seqlens=lens, cache_leftpad=torch.zeros(B, dtype=torch.int32))
    with pytest.raises(ValueError, match="pass both rotary_cos and rotary_sin"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=angles.cos(), cache_seqlens=lens)


@pytest.mark.parametrize("call, match", [
    (lambda q, c: fa.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 8, 8, dropout_p=0.1), "dropout_p=0.1"),
    (lambda q, c: fa.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 8, 8, block_table=torch.zeros(1, 1)),
     "block_table"),
])
def test_what_is_not_supported_is_named(twin, call, match):
    q, c = _bnhd(1, 17, 2, 16, 9), _bnhd(1, 40, 2, 16, 10)
    with pytest.raises(NotImplementedError, match=match):
        call(q, c)


def test_bad_layouts_are_named(twin):
    q = _bnhd(1, 8, 2, 16, 11)
    with pytest.raises(ValueError, match="kv must be"):
        fa.flash_attn_kvpacked_func(q, torch.stack([q, q, q], dim=2))
    with pytest.raises(ValueError, match="q must be a 4-D torch tensor"):
        fa.flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match="pass cache_seqlens"):
        fa.flash_attn_with_kvcache(q[:, :1], q, q, k=q[:, :1], v=q[:, :1])


# --------------------------------------------------------------------------------------------
# Real GPU
# --------------------------------------------------------------------------------------------
def _grads(fn, leaves, dout, cast):
    """[out, dq, dk, dv] of fn on copies of leaves cast to ``cast``, backward from dout."""
    leaves = [x.detach().to(cast).requires_grad_() for x in leaves]
    out = fn(*leaves)
    out.backward(dout.to(cast))
    return [out.detach()] + [x.grad for x in leaves]


def _error_rule(ours, truth, naive, dt):
    """flash-attention's rule on out and each gradient: error <= 2 x naive's + eps · max."""
    for name, o, t, n in zip(("out", "dq", "dk", "dv"), ours, truth, naive):
        err, ref_err = (o.double() - t).abs().max().item(), (n.double() - t).abs().max().item()
        assert err <= 2 * ref_err + torch.finfo(dt).eps * t.abs().max().item(), (name, err, ref_err)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="needs PyTorch with CUDA")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_func_error_rule_with_gradients(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(12)
    q, k, v = (torch.randn(2, n, h, 64, device="cuda", generator=g).to(dt) for n, h in ((300, 8), (500, 2), (500, 2)))
    dout = torch.randn_like(q)

    ref = lambda a, b, c: _ref(a, b, c, causal=True, window_size=(100, 0))  # noqa: E731
    ours = _grads(lambda a, b, c: fa.flash_attn_func(a, b, c, causal=True, window_size=(100, 0)), (q, k, v), dout, dt)
    _error_rule(ours, _grads(ref, (q, k, v), dout, torch.float64), _grads(ref, (q, k, v), dout, dt), dt)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="needs PyTorch with CUDA")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_varlen_error_rule_with_gradients(dtype):
    """flash_attn_varlen_func with gradients, each sequence against the dense reference of its own rows."""
    dt = getattr(torch, dtype)
    g = torch.Generator("cuda").manual_seed(14)
    lens_q, lens_k = [1, 300, 0, 129, 640], [7, 300, 5, 100, 640]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", generator=g)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", generator=g) for _ in range(2))
    dout = torch.randn_like(q)

    def per_sequence(a, b, c):
        outs = []
        for i in range(len(lens_q)):
            rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            if rk.stop == rk.start:
                outs.append(torch.zeros_like(a[rq]) + 0 * b.sum() + 0 * c.sum())
                continue
            outs.append(_ref(a[None, rq], b[None, rk], c[None, rk], causal=True, softcap=20.0)[0])
        return torch.cat(outs)

    ours = _grads(lambda a, b, c: fa.flash_attn_varlen_func(a, b, c, cu_q, cu_k, 640, 640, causal=True, softcap=20.0,
                                                            deterministic=True), (q, k, v), dout, dt)
    _error_rule(ours, _grads(per_sequence, (q, k, v), dout, torch.float64), _grads(per_sequence, (q, k, v), dout, dt),
                dt)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="needs PyTorch with CUDA")
def test_gpu_kvcache_append_and_decode():
    g = torch.Generator("cuda").manual_seed(13)
    B, Nmax, H, Hkv, d = 4, 1000, 8, 2, 128
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).half()  # noqa: E731
    k_cache, v_cache, q, kn, vn = mk(B, Nmax, Hkv, d), mk(B, Nmax, Hkv, d), mk(B, 3, H, d), mk(B, 3, Hkv, d), mk(B, 3, Hkv, d)
    lens = torch.tensor([0, 17, 500, 997], device="cuda", dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, causal=True,
                                          return_softmax_lse=True)
    for b in range(B):
        n = int(lens[b]) + 3
        ref = _ref(q[b:b + 1].double(), k_cache[b:b + 1, :n].double(), v_cache[b:b + 1, :n].double(), causal=True)
        assert (out[b:b + 1].double() - ref).abs().max().item() < 2e-3
        assert torch.isfinite(lse[b]).all()
    assert math.isfinite(out.float().abs().max().item())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="needs PyTorch with CUDA")
@pytest.mark.parametrize("page", [16, 256])
def test_gpu_kvcache_paged_append_leftpad_batch_idx_and_queries(page):
    """flash-attn's paged cache with the append through block_table; cache_batch_idx with cache_leftpad;
    20 queries causal and 3 not: the fp64 attention over each sequence's logical keys."""
    B, N, H, Hkv, d = 3, 1024, 8, 2, 128
    g = torch.Generator().manual_seed(page)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k_pages, table = _paged(mk(B, N, Hkv, d), page, N // page + 1, 1)
    v_pages, _ = _paged(mk(B, N, Hkv, d), page, N // page + 1, 1)
    k_pages, v_pages, table = k_pages.half().cuda(), v_pages.half().cuda(), table.cuda()
    q, kn, vn = mk(B, 3, H, d).half().cuda(), mk(B, 3, Hkv, d).half().cuda(), mk(B, 3, Hkv, d).half().cuda()
    lens = torch.tensor([0, 300, N - 3], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_with_kvcache(q, k_pages, v_pages, k=kn, v=vn, cache_seqlens=lens, block_table=table,
                                          causal=True, return_softmax_lse=True)
    for b in range(B):
        n = int(lens[b]) + 3
        kb, vb = _logical(k_pages, table, b)[:, :n], _logical(v_pages, table, b)[:, :n]
        assert torch.equal(kb[0, n - 3:], kn[b]) and torch.equal(vb[0, n - 3:], vn[b])
        ref = _ref(q[b:b + 1].double(), kb.double(), vb.double(), causal=True)
        assert (out[b:b + 1].double() - ref).abs().max().item() < 2e-3
        assert torch.isfinite(lse[b]).all()
    k_cache, v_cache = mk(5, N, Hkv, d).half().cuda(), mk(5, N, Hkv, d).half().cuda()
    idx = torch.tensor([4, 1, 4], dtype=torch.int32, device="cuda")
    pad = torch.tensor([10, 0, 500], dtype=torch.int32, device="cuda")
    for n_q, causal in ((20, True), (3, False)):
        qq = mk(B, n_q, H, d).half().cuda()
        out = fa.flash_attn_with_kvcache(qq, k_cache, v_cache, cache_seqlens=700, cache_batch_idx=idx,
                                         cache_leftpad=pad, causal=causal, num_splits=2)
        for b in range(B):
            r, s = int(idx[b]), int(pad[b])
            ref = _ref(qq[b:b + 1].double(), k_cache[r:r + 1, s:700].double(), v_cache[r:r + 1, s:700].double(),
                       causal=causal)
            assert (out[b:b + 1].double() - ref).abs().max().item() < 2e-3


def test_kvcache_refused_cache_arguments_leave_the_cache_as_it_was(twin):
    """block_table with cache_batch_idx or cache_leftpad is refused before k / v are appended."""
    B, H, d, page = 2, 2, 16, 16
    k_cache, v_cache = _bnhd(4, page, H, d, 50), _bnhd(4, page, H, d, 51)  # 4 pages of 16 keys
    q, kn, vn = _bnhd(B, 1, H, d, 52), _bnhd(B, 1, H, d, 53), _bnhd(B, 1, H, d, 54)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([3, 20], dtype=torch.int32)
    before = k_cache.clone(), v_cache.clone()
    for kw, err in ((dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)), ValueError),
                    (dict(cache_leftpad=torch.zeros(B, dtype=torch.int32)), NotImplementedError)):
        with pytest.raises(err, match="block_table"):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, block_table=table, **kw)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("append", [False, True])
def test_kvcache_past_capacity_is_refused_before_the_append(twin, append):
    """flash-attn's block_table guard: cache_seqlens (+ the appended keys) past the pages' capacity raise
    RuntimeError naming block_table, and the cache is left as it was; the same against a contiguous cache's rows."""
    H, d, page = 1, 16, 16
    pages_k, pages_v = _bnhd(4, page, H, d, 60), _bnhd(4, page, H, d, 61)
    q, kn, vn = _bnhd(1, 1, H, d, 62), _bnhd(1, 1, H, d, 63), _bnhd(1, 1, H, d, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)  # one page: 16 tokens
    lens = torch.tensor([page if append else page + 1], dtype=torch.int32)
    new = dict(k=kn, v=vn) if append else {}
    before = pages_k.clone()
    with pytest.raises(RuntimeError, match="block_table's 1 pages x 16 tokens = 16"):
        fa.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=lens, block_table=table, **new)
    assert torch.equal(pages_k, before)
    with pytest.raises(RuntimeError, match="the cache's 16 rows"):
        fa.flash_attn_with_kvcache(q, pages_k[:1], pages_v[:1], cache_seqlens=lens, **new)
    ok = lens - (1 if append else 1)  # at capacity exactly: runs
    fa.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=ok, block_table=table, **new)


@pytest.mark.parametrize("causal, window, softcap, alibi", [(True, (-1, -1), 0.0, False), (False, (6, 2), 5.0, True)])
def test_dropout_reaches_attention_and_s_dmask(twin, monkeypatch, causal, window, softcap, alibi):
    """dropout_p goes to numba_flash's attention with a seed drawn from PyTorch's default generator (so
    torch.manual_seed repeats it), and return_attn_probs gives S_dmask: |S| / rowsum |S| is the softmax with the
    same variants, its sign the kernels' keep mask of that seed (reference.dropout.keep_mask standing in for the
    device kernel here)."""
    import numpy as np

    from reference.dropout import keep_mask

    monkeypatch.setattr(fa, "dropout_mask", lambda B, H, n_q, n_k, p, seed: torch.from_numpy(
        keep_mask(B, H, n_q, n_k, p, seed).astype(np.uint8)))
    B, n_q, n_k, H, Hkv, d, p = 2, 13, 29, 4, 2, 16, 0.3
    q, k, v = _bnhd(B, n_q, H, d, 70), _bnhd(B, n_k, Hkv, d, 71), _bnhd(B, n_k, Hkv, d, 72)
    slopes = torch.rand(B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) if alibi else None
    kw = dict(dropout_p=p, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
              return_attn_probs=True)
    torch.manual_seed(11)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, **kw)
    p_seen, seed = _twin_attention.dropout
    torch.manual_seed(11)
    fa.flash_attn_func(q, k, v, **kw)
    assert p_seen == p and isinstance(seed, int) and _twin_attention.dropout[1] == seed
    assert s_dmask.shape == (B, H, n_q, n_k) and s_dmask.dtype == q.dtype
    mag = s_dmask.abs()
    probs = mag / mag.sum(-1, keepdim=True).clamp_min(1e-300)
    ident = torch.eye(n_k, dtype=torch.float64).expand(B, Hkv, n_k, n_k)  # V = I: out = P
    want = attention_mods_torch(q.transpose(1, 2), k.transpose(1, 2), ident, causal, None,
                                fa._window(causal, window), softcap, slopes)
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-6)  # S_dmask is fp32 maths
    z = torch.from_numpy(keep_mask(B, H, n_q, n_k, p, seed))
    seen = mag > 0
    assert torch.equal((s_dmask > 0)[seen], z[seen]) and seen.any() and (~z[seen]).any()
