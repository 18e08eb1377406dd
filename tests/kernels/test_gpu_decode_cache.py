"""numba_flash.decode's cache layouts on a real GPU at real sizes (skipped where there is none): paged caches
(block_table, pages of 16 to 256 keys), cache_batch_idx, cache_leftpad, causal=False, more than 16 queries.

Reference as test_gpu_decode.py (float64 attention in torch, the flash-attention error rule for fp16 / bf16)
on each sequence's logical cache; a paged cache must also give bitwise the contiguous cache's result (the
kernels run the same tiles in the same order, only the addresses differ).

    pytest -m gpu tests/kernels/test_gpu_decode_cache.py -q
"""
from __future__ import annotations

import contextlib
import math

import pytest

from gpu_helpers import HAVE_TORCH_CUDA, needs_gpu, torch
from test_gpu_decode import make, ragged

from numba_flash import PerformanceWarning
from numba_flash.decode import decode, plan

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]


def reference(q, k, v, lens, causal, dtype=None):
    """(out, lse) in float64 (dtype None) or the 'naive' same-dtype attention over keys < lens[b]; causal is
    bottom-right (query i sees j <= i + len_b - Nq)."""
    dtype = dtype or torch.float64
    n_q, n_max = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(G, dim=1).to(dtype) for x in (k, v))
    s = (q.to(dtype) @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    j = torch.arange(n_max, device=q.device)[None, None, :]
    lim = lens.long()[:, None, None] - 1
    if causal:
        lim = lim + torch.arange(n_q, device=q.device)[None, :, None] - (n_q - 1)
    s = s.masked_fill(~(j <= lim)[:, None], -math.inf)
    if dtype == torch.float64:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None])
        return p @ v, lse
    return torch.nan_to_num(torch.nan_to_num(torch.softmax(s.float(), dim=-1)).to(dtype) @ v), None


def assert_matches(out, lse, q, k, v, lens, causal=True):
    ref_o, ref_l = reference(q, k, v, lens, causal)
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin), "queries seeing no key must be exactly the -inf ones"
    assert (out[~fin] == 0).all()
    err = (out.double() - ref_o).abs().max().item()
    if q.dtype == torch.float32:
        assert err <= 2e-5 * max(1.0, ref_o.abs().max().item()), err
    else:
        naive_err = (reference(q, k, v, lens, causal, q.dtype)[0].double() - ref_o).abs().max().item()
        assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive {q.dtype} {naive_err:.3e}"
    if fin.any():
        assert (lse.double()[fin] - ref_l[fin]).abs().max().item() <= 1e-4 * max(1.0, ref_l[fin].abs().max().item())


def paged(k, v, page, seed, width=None):
    """flash-attn's paged layout of contiguous (B, Hkv, N, d) caches, pages at random physical places with
    NaN spare pages: (k_pages, v_pages) viewed heads first (num_pages, Hkv, page, d), and block_table
    (B, width) with -1 past each sequence's pages."""
    B, Hkv, n, d = k.shape
    per = -(-n // page)
    width = width or per
    g = torch.Generator().manual_seed(seed)
    n_pages = B * per + 3
    where = torch.randperm(n_pages, generator=g)[:B * per].view(B, per)
    out = []
    for x in (k, v):
        flat = torch.full((n_pages, page, Hkv, d), float("nan"), device=x.device, dtype=x.dtype)
        pad = torch.zeros(B, Hkv, per * page - n, d, device=x.device, dtype=x.dtype)
        flat[where.reshape(-1).cuda()] = torch.cat([x, pad], 2).transpose(1, 2).reshape(B * per, page, Hkv, d)
        out.append(flat.transpose(1, 2))
    table = torch.full((B, width), -1, dtype=torch.int32)
    table[:, :per] = where
    return out[0], out[1], table.cuda()


PAGED_GRID = ([("float16", page, (32, 8), 1) for page in (16, 48, 64, 256)]  # the benchmark's warp_split tile
              + [(dt, page, heads, n_q) for dt in ("bfloat16", "float32") for page in (16, 256)
                 for heads, n_q in (((32, 8), 1), ((32, 32), 3))]
              + [("float16", page, (16, 2), 2) for page in (16, 256)])


@pytest.mark.parametrize("dtype, page, heads, n_q", PAGED_GRID)
def test_paged_matches_contiguous_and_reference(dtype, page, heads, n_q):
    dtype = getattr(torch, dtype)
    H, Hkv = heads
    B, n_max, d = 4, 2000, 128
    seed = page + 10 * Hkv + n_q
    q, k, v = make(B, H, Hkv, n_q, n_max, d, dtype, seed)
    lens = ragged(B, n_max, seed)
    kp, vp, table = paged(k, v, page, seed, width=-(-n_max // page) + 1)
    for n_splits in (None, 1, 5):
        out, lse = decode(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=n_splits)
        # None: the rule counts Nmax = the table's pages; the contiguous cache gets the same number
        n_splits = plan(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=n_splits)[2]
        ref = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), "paged must equal contiguous bitwise"
    assert torch.isfinite(out).all()  # the NaN spare pages and -1 entries were never read
    assert_matches(out, lse, q, k, v, lens)


def test_paged_lengths_none_and_plan_replay_with_other_tables():
    """Lengths None (every table entry used), and a second call of the same signature (a replayed plan)
    with another table and other pages: the plan must read the new pointers."""
    q, k, v = make(2, 8, 2, 1, 1024, 128, torch.float16, 21)
    kp, vp, table = paged(k, v, 64, 1)
    out, lse = decode(q, kp, vp, block_table=table)
    assert_matches(out, lse, q, k, v, torch.full((2,), 1024, device="cuda", dtype=torch.int32))
    q2, k2, v2 = make(2, 8, 2, 1, 1024, 128, torch.float16, 22)
    kp2, vp2, table2 = paged(k2, v2, 64, 2)
    for _ in range(3):
        out2, lse2 = decode(q2, kp2, vp2, block_table=table2)
    assert torch.equal(out2, decode(q2, k2, v2)[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel_rows", [(32, 8), (32, 32)])  # warp_split (4-row groups) and block-wide tiles
def test_batch_idx_and_leftpad(dtype, kernel_rows):
    dtype = getattr(torch, dtype)
    H, Hkv = kernel_rows
    Bc, B, n_max, d = 6, 4, 1500, 128
    q, _, _ = make(B, H, Hkv, 2, 1, d, dtype, 31)
    _, k, v = make(Bc, H, Hkv, 1, n_max, d, dtype, 32)
    idx = torch.tensor([5, 0, 5, 2], dtype=torch.int32, device="cuda")
    pad = torch.tensor([100, 0, 1499, 37], dtype=torch.int32, device="cuda")
    lens = torch.tensor([1500, 900, 1500, 38], dtype=torch.int32, device="cuda")
    for n_splits in (None, 3):
        out, lse = decode(q, k, v, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad, num_splits=n_splits)
        # each sequence's keys moved to the front of a contiguous cache of its own
        kl, vl = (torch.zeros(B, Hkv, n_max, d, device="cuda", dtype=dtype) for _ in range(2))
        for b in range(B):
            r, s, e = int(idx[b]), int(pad[b]), int(lens[b])
            kl[b, :, :e - s], vl[b, :, :e - s] = k[r, :, s:e], v[r, :, s:e]
        assert_matches(out, lse, q, kl, vl, lens - pad)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("n_q, causal", [(40, True), (40, False), (5, False), (200, True)])
def test_many_queries_causal_or_not(dtype, n_q, causal):
    dtype = getattr(torch, dtype)
    B, H, Hkv, n_max, d = 3, 16, 4, 3000, 128
    q, k, v = make(B, H, Hkv, n_q, n_max, d, dtype, n_q)
    lens = torch.tensor([3000, 150, 17], dtype=torch.int32, device="cuda")  # 17 < Nq: early queries see nothing
    with pytest.warns(PerformanceWarning) if n_q > 16 else contextlib.nullcontext():
        out, lse = decode(q, k, v, cache_seqlens=lens, causal=causal)
    assert_matches(out, lse, q, k, v, lens, causal=causal)
    kp, vp, table = paged(k, v, 64, n_q)
    n_splits = plan(q, k, v, cache_seqlens=lens, causal=causal)[2]
    with pytest.warns(PerformanceWarning) if n_q > 16 else contextlib.nullcontext():
        out_p, lse_p = decode(q, kp, vp, cache_seqlens=lens, block_table=table, causal=causal, num_splits=n_splits)
    assert torch.equal(out_p, out) and torch.equal(lse_p, lse)


def test_decode_op_with_a_paged_cache():
    """torch.ops.numba_flash.decode with block_table and with batch_idx / leftpad / causal=False: opcheck
    (schema, fake tensor, no mutation) and numba_flash.torch.decode against the plain call."""
    from numba_flash import torch as nft

    q, k, v = make(2, 8, 2, 3, 512, 128, torch.float16, 41)
    kp, vp, table = paged(k, v, 64, 3)
    lens = torch.tensor([512, 77], dtype=torch.int32, device="cuda")
    torch.library.opcheck(nft.decode_op, (q, kp, vp, lens, None, None, table, None, None, True))
    idx = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    pad = torch.tensor([5, 70], dtype=torch.int32, device="cuda")
    torch.library.opcheck(nft.decode_op, (q, k, v, lens, None, 2, None, idx, pad, False))
    out, lse = nft.decode(q, kp, vp, cache_seqlens=lens, block_table=table)
    assert torch.equal(out, decode(q, k, v, cache_seqlens=lens)[0])
