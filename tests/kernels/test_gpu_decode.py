"""numba_flash.decode on a real GPU at real sizes (skipped where there is none).

Reference: float64 attention on the GPU (torch) over each sequence's valid prefix, bottom-right
causal. fp32: relative error. fp16 / bf16: the flash-attention rule, err(ours vs fp64) <= 2 ·
err(naive same-dtype vs fp64) + small, both errors printed on failure.

    pytest -m gpu tests/kernels/test_gpu_decode.py -q
"""
from __future__ import annotations

import itertools
import math

import pytest

from gpu_helpers import HAVE_TORCH_CUDA, needs_gpu, torch

from numba_flash.decode import decode

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]


def visible_mask(lens, n_q, n_max, device):
    """(B, 1, Nq, Nmax) bool: query i of sequence b sees key j iff j <= i + len_b - Nq (and j < len_b)."""
    i = torch.arange(n_q, device=device)[None, :, None]
    j = torch.arange(n_max, device=device)[None, None, :]
    limit = lens.to(device).long()[:, None, None] + i - n_q
    return (j <= limit)[:, None]


def attention_ref(q, k, v, lens, scale, dtype=None):
    """Masked attention with every step in dtype (None = float64: the reference; q's dtype: 'naive')."""
    dtype = dtype or torch.float64
    G = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(G, dim=1) for x in (k, v))
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    s = s.masked_fill(~visible_mask(lens, q.shape[2], k.shape[2], q.device), -math.inf)
    if dtype == torch.float64:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        return p @ v.double(), lse
    p = torch.nan_to_num(torch.softmax(s.float(), dim=-1)).to(dtype)
    return torch.nan_to_num(p @ v.to(dtype)), None


def make(B, H, Hkv, n_q, n_max, d, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h, n: (torch.randn(B, h, n, d, device="cuda", generator=g) * scale).to(dtype)
    return mk(H, n_q), mk(Hkv, n_max), mk(Hkv, n_max)


def ragged(B, n_max, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, n_max + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = n_max
    if B > 2:
        lens[1] = 0
    return lens.cuda()


def assert_matches(out, lse, q, k, v, lens, dtype, scale=None):
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    ref_o, ref_l = attention_ref(q, k, v, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin), "queries seeing no key must be exactly the -inf ones"
    assert (out[~fin] == 0).all()
    err = (out.double() - ref_o).abs().max().item()
    if dtype == torch.float32:
        assert err <= 2e-5 * max(1.0, ref_o.abs().max().item()), err
    else:
        naive, _ = attention_ref(q, k, v, lens, scale, dtype=dtype)
        naive_err = (naive.double() - ref_o).abs().max().item()
        assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive {dtype} {naive_err:.3e}"
    lse_err = (lse.double()[fin] - ref_l[fin]).abs().max().item() if fin.any() else 0.0
    assert lse_err <= 1e-4 * max(1.0, ref_l[fin].abs().max().item() if fin.any() else 1.0), lse_err


GRID = list(itertools.product(
    ["float32", "float16", "bfloat16"],
    [(32, 32), (32, 8), (32, 4)],  # (H, Hkv): GQA ratios 1, 4, 8
    [1, 3, 16],  # Nq
    [None, 1, 7],  # num_splits
))


@pytest.mark.parametrize("dtype, heads, n_q, n_splits", GRID)
def test_decode_grid(dtype, heads, n_q, n_splits):
    dtype = getattr(torch, dtype)
    H, Hkv = heads
    B, n_max, d = 4, 3000, 128
    seed = 1000 * n_q + 10 * heads[1] + (n_splits or 0)
    q, k, v = make(B, H, Hkv, n_q, n_max, d, dtype, seed)
    lens = ragged(B, n_max, seed)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits)
    torch.cuda.synchronize()
    assert_matches(out, lse, q, k, v, lens, dtype)


@pytest.mark.parametrize("d", [32, 64, 72, 100, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_head_dims(d, dtype):
    """d = 72 pads to 80; d = 100 fp16 has 200-byte rows: the scalar-load path."""
    dtype = getattr(torch, dtype)
    q, k, v = make(2, 8, 2, 2, 1500, d, dtype, d)
    lens = torch.tensor([1500, 777], dtype=torch.int32, device="cuda")
    out, lse = decode(q, k, v, cache_seqlens=lens)
    assert_matches(out, lse, q, k, v, lens, dtype)


def test_long_cache_many_splits_and_more_splits_than_tiles():
    q, k, v = make(2, 8, 8, 1, 65536, 128, torch.float16, 11)
    lens = torch.tensor([65536, 40000], dtype=torch.int32, device="cuda")
    for n_splits in (None, 64, 5000):
        out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits)
        assert_matches(out, lse, q, k, v, lens, torch.float16)


def test_lengths_none_int64_and_clamped():
    q, k, v = make(3, 4, 2, 2, 999, 64, torch.float16, 5)
    out_none, lse_none = decode(q, k, v)
    full = torch.full((3,), 999, dtype=torch.int64, device="cuda")
    out64, lse64 = decode(q, k, v, cache_seqlens=full)
    assert torch.equal(out_none, out64) and torch.equal(lse_none, lse64)
    # device lengths are not checked on the host: the kernel clamps them to [0, Nmax]
    wild = torch.tensor([-5, 999 + 100, 400], dtype=torch.int32, device="cuda")
    clamped = torch.tensor([0, 999, 400], dtype=torch.int32, device="cuda")
    a = decode(q, k, v, cache_seqlens=wild, num_splits=3)
    b = decode(q, k, v, cache_seqlens=clamped, num_splits=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_stale_cache_slots_never_reach_the_result():
    q, k, v = make(2, 4, 4, 3, 500, 128, torch.float16, 9)
    lens = torch.tensor([123, 500], dtype=torch.int32, device="cuda")
    k[0, :, 123:] = float("nan")
    v[0, :, 123:] = float("inf")
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=4)
    assert torch.isfinite(out).all()
    k[0, :, 123:] = 0
    v[0, :, 123:] = 0
    assert_matches(out, lse, q, k, v, lens, torch.float16)


def test_cache_layouts():
    """A (B, Nmax, Hkv, d) cache viewed as (B, Hkv, Nmax, d), and a cache sliced from a longer buffer."""
    B, H, Hkv, n_max, d = 2, 8, 4, 700, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, H, 1, d, device="cuda", generator=g).half()
    k_bnhd = torch.randn(B, n_max, Hkv, d, device="cuda", generator=g).half()
    v_bnhd = torch.randn(B, n_max, Hkv, d, device="cuda", generator=g).half()
    k, v = k_bnhd.transpose(1, 2), v_bnhd.transpose(1, 2)
    lens = torch.tensor([700, 333], dtype=torch.int32, device="cuda")
    out, lse = decode(q, k, v, cache_seqlens=lens)
    assert_matches(out, lse, q, k.contiguous(), v.contiguous(), lens, torch.float16)
    big_k, big_v = (torch.randn(B, Hkv, 2048, d, device="cuda", generator=g).half() for _ in range(2))
    out2, lse2 = decode(q, big_k[:, :, :n_max], big_v[:, :, :n_max], cache_seqlens=lens)
    assert_matches(out2, lse2, q, big_k[:, :, :n_max], big_v[:, :, :n_max], lens, torch.float16)


def test_large_logits():
    q, k, v = make(2, 4, 2, 4, 2000, 64, torch.float32, 7, scale=30.0)  # logits ~ 1e4
    lens = torch.tensor([2000, 1500], dtype=torch.int32, device="cuda")
    out, lse = decode(q, k, v, cache_seqlens=lens, softmax_scale=1.0, num_splits=9)
    ref_o, _ = attention_ref(q, k, v, lens, 1.0)
    assert torch.isfinite(out).all()
    assert (out.double() - ref_o).abs().max().item() < 1e-3 * ref_o.abs().max().item()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("n_splits", [1, 8])
def test_deterministic(dtype, n_splits):
    dtype = getattr(torch, dtype)
    q, k, v = make(4, 32, 8, 2, 8192, 128, dtype, 3)
    lens = ragged(4, 8192, 3)
    first = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits)
    for _ in range(20):
        out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])


def test_runs_on_torch_current_stream():
    q, k, v = make(2, 8, 8, 1, 4096, 128, torch.float16, 1)
    ref = decode(q, k, v)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out, lse = decode(q, k, v)
    s.synchronize()
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    rng = cp.random.default_rng(5)
    q = rng.standard_normal((2, 4, 1, 64), dtype=cp.float32)
    k = rng.standard_normal((2, 2, 300, 64), dtype=cp.float32)
    v = rng.standard_normal((2, 2, 300, 64), dtype=cp.float32)
    lens = cp.asarray([300, 17], dtype=cp.int32)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=3)
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
    qt, kt, vt = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    assert_matches(torch.as_tensor(out, device="cuda"), torch.as_tensor(lse, device="cuda"), qt, kt, vt,
                   torch.as_tensor(lens, device="cuda"), torch.float32)


# DecodeConfig.bulk: K/V tiles by cp.async.bulk + mbarrier (sm_90 and newer only).
def _bulk_config(d, dtype, H, Hkv, n_q, block_n, stages):
    from numba_flash.kernels.decode import DecodeConfig, decode_config

    rows = decode_config(d, dtype, H // Hkv * n_q).rows
    return DecodeConfig(d, dtype, min(rows, 16), block_n=block_n, stages=stages, warps=4, bulk=True)


needs_sm90 = pytest.mark.skipif(not HAVE_TORCH_CUDA or torch.cuda.get_device_capability() < (9, 0),
                                reason="cp.async.bulk needs sm_90")


@needs_sm90
@pytest.mark.parametrize("dtype, heads, n_q, n_splits, tile", list(itertools.product(
    ["float16", "bfloat16", "float32"], [(32, 32), (32, 8), (32, 4)], [1, 3], [None, 1, 7], [(64, 3)]))
    + [("float16", heads, 1, None, (32, 6)) for heads in [(32, 32), (32, 8), (32, 4)]])
def test_bulk_grid(dtype, heads, n_q, n_splits, tile):
    H, Hkv = heads
    B, n_max, d = 4, 3001, 128  # ragged lengths, one of them 0, the longest not a tile multiple
    cfg = _bulk_config(d, dtype, H, Hkv, n_q, *tile)
    dtype = getattr(torch, dtype)
    seed = 7 + 1000 * n_q + 10 * Hkv + (n_splits or 0)
    q, k, v = make(B, H, Hkv, n_q, n_max, d, dtype, seed)
    lens = ragged(B, n_max, seed)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, config=cfg)
    torch.cuda.synchronize()
    assert_matches(out, lse, q, k, v, lens, dtype)


@needs_sm90
def test_bulk_stale_slots_layouts_and_determinism():
    cfg = _bulk_config(128, "float16", 4, 4, 3, 64, 4)
    q, k, v = make(2, 4, 4, 3, 500, 128, torch.float16, 9)
    lens = torch.tensor([123, 500], dtype=torch.int32, device="cuda")
    k[0, :, 123:] = float("nan")
    v[0, :, 123:] = float("inf")
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=4, config=cfg)
    assert torch.isfinite(out).all()
    for _ in range(10):
        again = decode(q, k, v, cache_seqlens=lens, num_splits=4, config=cfg)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    k[0, :, 123:] = 0
    v[0, :, 123:] = 0
    assert_matches(out, lse, q, k, v, lens, torch.float16)
    # (B, Nmax, Hkv, d) viewed as (B, Hkv, Nmax, d): rows not back to back, the cp.async fallback
    kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    out2, lse2 = decode(q, kt, vt, cache_seqlens=lens, num_splits=4, config=cfg)
    assert_matches(out2, lse2, q, k, v, lens, torch.float16)
