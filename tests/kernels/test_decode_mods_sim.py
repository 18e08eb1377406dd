"""numba_flash.decode with flash-attn's variants (sliding window, softcap, ALiBi) in the CUDA simulator, against
reference.decode in float64, on both split kernels (block-wide and warp_split).

Tiny problems on the one- and two-warp configs of test_decode_cache_sim.py. The window case also fills the V rows of
the tiles left of every row's window with NaN: the kernel must never load them (a loaded NaN row would reach O
through 0 · NaN), so the test fails if the tile range ignored the window's left edge.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ptx import in_simulator  # noqa: E402

from numba_flash.decode import decode, plan  # noqa: E402
from numba_flash.kernels.decode import DecodeConfig  # noqa: E402
from reference.decode import decode_attention  # noqa: E402

CONFIGS = {
    "block": lambda dt, rows: DecodeConfig(16, dt, rows, block_n=8, stages=2, warps=1),
    "warp": lambda dt, rows: DecodeConfig(16, dt, rows, block_n=16, stages=2, warps=2, warp_split=True),
}


def check(out, lse, ref_o, ref_l, dtype):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_l), err_msg="rows seeing no key must be -inf")
    assert (out[np.isneginf(ref_l)] == 0).all()
    assert np.isfinite(out).all()
    tol = 2e-6 if dtype == "float32" else 2e-3  # fp16: output rounding (2^-11 relative) dominates
    err = np.abs(out.astype(np.float64) - ref_o).max(initial=0)
    assert err <= tol * max(1.0, np.abs(ref_o).max(initial=0)), err
    fin = np.isfinite(ref_l)
    assert np.abs(lse[fin] - ref_l[fin]).max(initial=0) <= 1e-5 * max(1.0, np.abs(ref_l[fin]).max(initial=0))


CASES = [  # kind, dtype, G, Nq, splits, causal, window_size, softcap, alibi
    ("block", "float16", 2, 2, 3, True, (9, -1), 0.0, False),   # causal window: tiles left of it are skipped
    ("block", "float32", 1, 3, 2, False, (5, 3), 4.0, True),    # a two-sided window, softcap and ALiBi together
    ("warp", "float16", 4, 1, 2, True, (-1, -1), 2.5, True),    # softcap + ALiBi, no window
    ("warp", "float32", 2, 2, 1, True, (20, 0), 0.0, False),    # warp_split's tile range from the window
]


@in_simulator
@pytest.mark.slow
@pytest.mark.parametrize("kind, dtype, G, n_q, splits, causal, window_size, softcap, alibi", CASES)
def test_mods_against_reference_sim(kind, dtype, G, n_q, splits, causal, window_size, softcap, alibi, rng):
    B, Hkv, n_max, d = 3, 1, 48, 16
    H = G * Hkv
    q = (2 * rng.standard_normal((B, H, n_q, d))).astype(dtype)  # scores of a few units: the softcap bites
    k = rng.standard_normal((B, Hkv, n_max, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, n_max, d)).astype(dtype)
    lens = np.array([n_max, 29, 1], np.int32)  # full, ragged, one key
    slopes = rng.uniform(0.05, 0.5, (B, H)).astype(np.float32) if alibi else None
    cfg = CONFIGS[kind](dtype, 4)
    left = window_size[0]
    if left >= 0:  # V rows of the tiles left of every row's window: NaN, never to be loaded
        for b, n in enumerate(lens):
            first = max(int(n) - n_q - left, 0) // cfg.block_n * cfg.block_n
            v[b, :, :first] = np.nan
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=splits, config=cfg, causal=causal,
                      window_size=window_size, softcap=softcap, alibi_slopes=slopes)
    v_ref = np.nan_to_num(v)  # the reference masks those keys out; its 0 · NaN would not
    ref_o, ref_l = decode_attention(q, k, v_ref, cache_seqlens=lens, causal=causal, window_size=window_size,
                                    softcap=softcap, alibi_slopes=slopes)
    check(out, lse, ref_o, ref_l, dtype)
    if left >= 0:  # the window changed the result (not a window wider than every sequence)
        full_o, _ = decode_attention(q, k, v_ref, cache_seqlens=lens, causal=causal, softcap=softcap,
                                     alibi_slopes=slopes)
        assert np.abs(full_o - ref_o).max() > 1e-2


@in_simulator
def test_window_sizes_the_splits():
    """The split rule counts the keys a window lets the rows see, not Nmax."""
    q = np.ones((1, 8, 1, 64), np.float16)
    k = np.ones((1, 8, 32768, 64), np.float16)
    full = plan(q, k, k)[2]
    windowed = plan(q, k, k, window_size=(255, 0))[2]
    assert windowed < full, (windowed, full)


@in_simulator
def test_user_mask_with_leftpad_batch_idx_and_padding_rows_sim(rng):
    """A bare mask_mod (no aux) on cache rows picked by cache_batch_idx and left-padded: kv_idx counts from the pad;
    G·Nq = 2 rows in 4-row blocks (two padding rows, clamped for the mod's indices); a row whose mask hides every key
    gets O = 0, L = -inf."""
    def odd_keys_for_head1(b, h, q_idx, kv_idx):
        return h == 0 or (kv_idx % 2 == 1 and q_idx == 0)

    B, H, n_q, d = 2, 3, 1, 16
    q = rng.standard_normal((B, H, n_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((3, 3, 30, d)).astype(np.float32) for _ in range(2))  # Hkv 3: G = 1 x Nq 1
    q = np.concatenate([q, q[:, :, :1] + 1], axis=2)  # Nq 2: rows of head 1 at q_idx 1 see nothing
    idx, pad, lens = np.array([2, 0], np.int32), np.array([3, 0], np.int32), np.array([25, 9], np.int32)
    kw = dict(cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad, causal=False)
    out, lse = decode(q, k, v, num_splits=2, config=CONFIGS["block"]("float32", 4), mask_mod=odd_keys_for_head1, **kw)
    ref_o, ref_l = decode_attention(q, k, v, mask_mod=odd_keys_for_head1, **kw)
    check(out, lse, ref_o, ref_l, "float32")
    assert np.isneginf(lse[:, 1, 1]).all() and np.isfinite(lse[:, 1, 0]).all()


def test_score_mod_refuses_a_scale_whose_inverse_overflows():
    q = np.ones((1, 1, 1, 16), np.float32)
    k = np.ones((1, 1, 8, 16), np.float32)
    with pytest.raises(ValueError, match="1 / scale in fp32"):
        decode(q, k, k, softmax_scale=1e-39, score_mod=lambda s, b, h, i, j: s + 1.0)


@in_simulator
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(window_size=(4, 2)), ValueError, "right"),  # causal decoding takes right 0 or -1
    (dict(window_size=(-2, 0)), ValueError, "window_size left"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes has shape"),
    (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes"),
])
def test_mods_refusals_name_the_argument(kwargs, exc, match):
    q = np.ones((1, 2, 1, 16), np.float16)
    k = np.ones((1, 1, 8, 16), np.float16)
    with pytest.raises(exc, match=match):
        decode(q, k, k, **kwargs)


def _every_third(b, h, q_idx, kv_idx, drop):
    return (kv_idx + q_idx + h) % 3 != drop[b]


def _table_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, kv_idx % 7] - 0.25 * q_idx


@in_simulator
@pytest.mark.slow
@pytest.mark.parametrize("kind, dtype, causal, window_size, softcap", [
    ("block", "float32", True, (13, 0), 3.0),    # with a window and the softcap: the mods' order
    ("warp", "float16", False, (-1, -1), 0.0),
])
def test_user_mods_against_reference_sim(kind, dtype, causal, window_size, softcap, rng):
    """mask_mod and score_mod with aux arrays, compiled into both split kernels: (b, h, q_idx, kv_idx) as the reference
    passes them (q_idx the query's index in q, kv_idx the key's in its sequence), the score mod after softcap, the
    mask ANDed with causal / window; ragged lengths (keys past a length never reach the mods: the aux table is
    read at kv_idx % 7 anyway, the drop array only at b)."""
    from numba_flash.mods import MaskMod, ScoreMod

    B, H, Hkv, n_q, n_max, d = 3, 2, 1, 2, 40, 16
    q = (2 * rng.standard_normal((B, H, n_q, d))).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, n_max, d)).astype(dtype) for _ in range(2))
    lens = np.array([n_max, 23, 2], np.int32)
    drop = np.array([0, 1, 2], np.int32)
    table = rng.standard_normal((H, 7)).astype(np.float32)
    cfg = CONFIGS[kind](dtype, 4)
    out, lse = decode(q, k, v, cache_seqlens=lens, num_splits=2, config=cfg, causal=causal, window_size=window_size,
                      softcap=softcap, mask_mod=MaskMod(_every_third, aux=(drop,)),
                      score_mod=ScoreMod(_table_bias, aux=(table,)))
    ref_o, ref_l = decode_attention(q, k, v, cache_seqlens=lens, causal=causal, window_size=window_size,
                                    softcap=softcap, mask_mod=_every_third, mask_aux=(drop,), score_mod=_table_bias,
                                    score_aux=(table,))
    check(out, lse, ref_o, ref_l, dtype)
    plain_o, _ = decode_attention(q, k, v, cache_seqlens=lens, causal=causal, window_size=window_size,
                                  softcap=softcap)
    assert np.abs(plain_o - ref_o).max() > 1e-2, "the mods must change the result"


@in_simulator
def test_window_on_a_paged_cache_sim(rng):
    """A paged cache: Nk is Nmax (pages x page size), not one page, so a window wider than a page stays a window; the
    same bits as the contiguous cache."""
    from test_decode_cache_sim import paged

    B, Hkv, n, d = 2, 1, 64, 16
    q = (2 * rng.standard_normal((B, 2, 1, d))).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, n, d)).astype(np.float32) for _ in range(2))
    kp, vp, table = paged(rng, k, v, 16)
    lens = np.array([60, 37], np.int32)
    cfg = CONFIGS["block"]("float32", 4)
    kw = dict(cache_seqlens=lens, num_splits=2, config=cfg, window_size=(20, 0))
    out, lse = decode(q, kp, vp, block_table=table, **kw)
    ref_o, ref_l = decode_attention(q, k, v, cache_seqlens=lens, window_size=(20, 0))
    check(out, lse, ref_o, ref_l, "float32")
    out_c, lse_c = decode(q, k, v, **kw)
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)
