"""numba_flash.decode with flash-attn's variants (sliding window, softcap, ALiBi) on a real GPU at real sizes
(skipped where there is none), on the shipped tiles: warp_split (GQA groups of a few rows) and block-wide (32 rows).

Reference: each sequence's valid keys through gpu_helpers.attention_mods_torch in float64 (bottom-right aligned:
the queries are the last Nq positions), and the flash-attention error rule for fp16 / bf16 (ours <= 2x the naive
same-dtype attention's error + 1e-4). The window case fills the V rows left of every row's window with NaN: the
kernel must never load those tiles.

    pytest -m gpu tests/kernels/test_gpu_decode_mods.py -q
"""
from __future__ import annotations

import pytest

from gpu_helpers import HAVE_TORCH_CUDA, attention_mods_torch, needs_gpu, torch
from test_gpu_decode import make, ragged
from test_gpu_decode_cache import paged

from numba_flash.decode import decode, plan

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")]


def per_sequence(q, k, v, lens, causal, window_size, softcap, slopes, naive=False):
    """(out, lse or None): float64 truth (naive=False) or the naive same-dtype attention, one sequence at a time."""
    outs, lses = [], []
    G = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        kb, vb = (x[b:b + 1, :, :n].repeat_interleave(G, dim=1) for x in (k, v))
        qb = q[b:b + 1]
        s_b = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        if naive:
            outs.append(attention_mods_torch(qb, kb, vb, causal, None, window_size, softcap, s_b, naive=True))
            continue
        qd, kd, vd = (x.double() for x in (qb, kb, vb))
        outs.append(attention_mods_torch(qd, kd, vd, causal, None, window_size, softcap,
                                         None if s_b is None else s_b.double()))
        lses.append(lse_of(qd, kd, causal, window_size, softcap, None if s_b is None else s_b.double()))
    return torch.cat(outs), (torch.cat(lses) if lses else None)


def lse_of(q, k, causal, window_size, softcap, slopes):
    """The natural-log logsumexp of each query's final scores (-inf where it sees no key)."""
    from gpu_helpers import _masked_scores

    s, _ = _masked_scores(q, k, k, causal, None, window_size, softcap, slopes)
    return torch.logsumexp(s, dim=-1)


def assert_rule(out, lse, q, k, v, lens, causal, window_size, softcap, slopes):
    v = torch.nan_to_num(v)  # the reference masks the NaN rows out (its 0 · NaN would not)
    ref_o, ref_l = per_sequence(q, k, v, lens, causal, window_size, softcap, slopes)
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin), "queries seeing no key must be exactly the -inf ones"
    assert torch.isfinite(out).all() and (out[~fin] == 0).all()
    err = (out.double() - ref_o).abs().max().item()
    naive_o, _ = per_sequence(q, k, v, lens, causal, window_size, softcap, slopes, naive=True)
    naive_err = (torch.nan_to_num(naive_o).double() - ref_o).abs().max().item()
    assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive {q.dtype} {naive_err:.3e}"
    if fin.any():
        assert (lse.double()[fin] - ref_l[fin]).abs().max().item() <= 1e-4 * max(1.0, ref_l[fin].abs().max().item())


CASES = [  # dtype, (H, Hkv), Nq, d, causal, window_size, softcap, alibi ("H" / "BH" / None)
    ("float16", (32, 8), 1, 128, True, (1000, 0), 0.0, None),       # Mistral-style decode window
    ("bfloat16", (32, 8), 1, 128, True, (-1, -1), 30.0, "H"),       # Gemma-2 softcap, ALiBi
    ("float16", (32, 32), 3, 128, True, (700, 0), 50.0, "BH"),      # block-wide tile, all three
    ("bfloat16", (16, 2), 4, 64, False, (300, 40), 0.0, "H"),       # a two-sided window without causal
    ("float16", (8, 8), 16, 256, True, (513, 0), 20.0, None),       # d 256, 16 queries
]


@pytest.mark.parametrize("dtype, heads, n_q, d, causal, window_size, softcap, alibi", CASES)
def test_mods_by_the_error_rule(dtype, heads, n_q, d, causal, window_size, softcap, alibi):
    dtype = getattr(torch, dtype)
    H, Hkv = heads
    B, n_max = 4, 3000
    seed = H + 7 * n_q + d
    q, k, v = make(B, H, Hkv, n_q, n_max, d, dtype, seed, scale=1.5)
    lens = ragged(B, n_max, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    slopes = None
    if alibi:
        slopes = torch.rand((H,) if alibi == "H" else (B, H), device="cuda", generator=g) * 0.05
    left = window_size[0]
    if left >= 0:  # the tiles left of every row's window: NaN V, never to be loaded (64-key tiles at most)
        for b in range(B):
            first = max(int(lens[b]) - n_q - left, 0) // 64 * 64
            v[b, :, :first] = float("nan")
    for n_splits in (None, 1, 7):
        out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=slopes)
        assert_rule(out, lse, q, k, v, lens, causal, window_size, softcap, slopes)


def test_window_on_a_paged_cache_is_bitwise_the_contiguous_one():
    q, k, v = make(3, 32, 8, 1, 2048, 128, torch.float16, 5)
    lens = ragged(3, 2048, 5)
    kp, vp, table = paged(k, v, 64, 5)
    kw = dict(window_size=(511, 0), softcap=30.0)
    out, lse = decode(q, kp, vp, cache_seqlens=lens, block_table=table, **kw)
    n_splits = plan(q, kp, vp, cache_seqlens=lens, block_table=table, **kw)[2]
    ref = decode(q, k, v, cache_seqlens=lens, num_splits=n_splits, **kw)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    assert_rule(out, lse, q, k, v, lens, True, (511, 0), 30.0, None)


def test_replayed_plan_reads_new_slopes():
    """A second call of the same signature replays a plan: it must read the new slopes' pointer and values."""
    q, k, v = make(2, 16, 4, 1, 1024, 128, torch.bfloat16, 9)
    lens = ragged(2, 1024, 9)
    s1 = torch.full((16,), 0.01, device="cuda")
    s2 = torch.full((16,), 0.2, device="cuda")
    o1 = decode(q, k, v, cache_seqlens=lens, alibi_slopes=s1)[0]
    for _ in range(2):
        o2, l2 = decode(q, k, v, cache_seqlens=lens, alibi_slopes=s2)
    assert not torch.equal(o1, o2)
    assert_rule(o2, l2, q, k, v, lens, True, (-1, -1), 0.0, s2)



def _same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
    return q_doc[b, q_idx] == kv_doc[b, kv_idx]


def _rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, kv_idx % 64]


@pytest.mark.parametrize("dtype, heads, n_q", [("float16", (32, 8), 1), ("bfloat16", (16, 16), 3)])
def test_user_mods_by_the_error_rule(dtype, heads, n_q):
    """mask_mod / score_mod with aux arrays (a document mask from per-position ids, a bias table) through
    numba_flash.torch.decode (eager), against reference.decode in float64 and its naive same-dtype run."""
    import numpy as np

    from numba_flash.mods import MaskMod, ScoreMod
    from numba_flash.torch import decode as torch_decode
    from reference.decode import decode_attention

    tdt = getattr(torch, dtype)
    H, Hkv = heads
    B, n_max, d = 3, 900, 128
    q, k, v = make(B, H, Hkv, n_q, n_max, d, tdt, 31 + n_q)
    lens = ragged(B, n_max, 31)
    g = torch.Generator(device="cuda").manual_seed(7)
    kv_doc = torch.cumsum(torch.rand(B, n_max, device="cuda", generator=g) < 0.01, dim=1).to(torch.int32)
    # the queries are the last positions of each sequence: they belong to its last document
    q_doc = kv_doc.gather(1, (lens.long()[:, None] - 1).clamp(min=0)).expand(B, n_q).contiguous()
    table = torch.randn(H, 64, device="cuda", generator=g) * 0.5
    out, lse = torch_decode(q, k, v, cache_seqlens=lens, mask_mod=MaskMod(_same_document, aux=(q_doc, kv_doc)),
                            score_mod=ScoreMod(_rel_bias, aux=(table,)))
    host = [x.cpu().float().numpy() for x in (q, k, v)]
    aux_np = dict(cache_seqlens=lens.cpu().numpy(), mask_mod=_same_document, score_mod=_rel_bias,
                  mask_aux=(q_doc.cpu().numpy(), kv_doc.cpu().numpy()), score_aux=(table.cpu().numpy(),))
    ref_o, ref_l = decode_attention(*host, **aux_np)
    naive_o, _ = decode_attention(*host, **aux_np, dtype=np.float32)
    naive_o = torch.tensor(naive_o).to(tdt).double().numpy()  # rounded to the output dtype, as a naive kernel's
    err = np.abs(out.double().cpu().numpy() - ref_o).max()
    naive_err = np.abs(naive_o - ref_o).max()
    assert err <= 2 * naive_err + 1e-4, (err, naive_err)
    fin = np.isfinite(ref_l)
    assert np.array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert np.abs(lse.cpu().numpy()[fin] - ref_l[fin]).max() <= 1e-4 * max(1.0, np.abs(ref_l[fin]).max())
