"""Dropout's generator and its counter layout (reference/dropout.py, numba_flash/blocks/rng.py), and dropout in the
NumPy reference: Philox4x32-10 against the Random123 known answers, the kernels' fragment helpers against
``keep_mask`` lane by lane, the kept fraction, fresh bits per seed and offset, an unbiased O, and the backward
against finite differences of the forward with the same mask. No GPU: the helpers are called as Python."""
from __future__ import annotations

import numpy as np
import pytest

import reference
from numba_flash.blocks import rng as krng
from reference.dropout import keep16, keep_mask, keep_scale, philox

# Random123's kat_vectors, the "philox4x32 10" lines: counter, key, result
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", KAT)
def test_philox_known_answers(counter, key, want):
    assert philox(counter, key).tolist() == list(want)
    assert [int(w) for w in krng.philox(*counter, *key)] == list(want)  # the kernels' device function, as Python


def test_keep_one_is_keep_mask():
    """The one-score form the kernels could call anywhere gives keep_mask's decision for every pair."""
    B, H, n_q, n_k, p, seed, offset = 2, 3, 19, 37, 0.35, 2**40 + 5, 9
    z = keep_mask(B, H, n_q, n_k, p, seed, offset)
    lo, hi = krng.seed_words(seed)
    for b, h, i, j in [(1, 2, 18, 36), (0, 0, 0, 0), (1, 0, 8, 9), (0, 1, 15, 16), (1, 1, 7, 31)]:
        assert bool(krng.keep_one(i, j, b * H + h, offset, lo, hi, keep16(p))) == z[b, h, i, j]


@pytest.mark.parametrize("m_tiles", [1, 2])
def test_fragment_helpers_follow_the_counter_layout(m_tiles):
    """drop_tile / keep_tile (forward orientation: rows = queries) and keep_t (dK/dV's: rows = keys) against
    keep_mask at every lane's coordinates: the mma C layout, lane (g, t) holding rows g, g + 8 and columns 8 nt + 2t,
    8 nt + 2t + 1. Blocks start at multiples of 16 that are not multiples of 32 or 64, so the counter's block bits
    are exercised."""
    S_TILES, row0, k0, bh, offset, p = 8, 48, 80, 5, 3, 0.4
    H = 3
    b, h = divmod(bh, H)
    seed = 123456789012
    lo, hi = krng.seed_words(seed)
    z = keep_mask(2, H, row0 + 16 * m_tiles, k0 + 8 * S_TILES, p, seed, offset)[b, h]
    drop = krng.fragment_dropout(S_TILES, m_tiles)
    keep = krng.fragment_keep(S_TILES, m_tiles)
    keep_t = krng.fragment_dropout_t(S_TILES)
    k16 = keep16(p)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        s = np.ones((m_tiles * S_TILES, 4), np.float32)
        drop(s, k0, row0, g, t, bh, offset, lo, hi, k16)
        zz = np.full((m_tiles * S_TILES, 4), -1.0, np.float32)
        keep(zz, k0, row0, g, t, bh, offset, lo, hi, k16)
        zt = np.full((S_TILES, 4), -1.0, np.float32)
        keep_t(zt, row0, k0, g, t, bh, offset, lo, hi, k16)  # keys from row0, queries from k0
        for mt in range(m_tiles):
            for nt in range(S_TILES):
                for r in range(4):
                    i, j = row0 + 16 * mt + g + 8 * (r >> 1), k0 + 8 * nt + 2 * t + (r & 1)
                    assert s[mt * S_TILES + nt, r] == float(z[i, j]), (lane, mt, nt, r)
                    assert zz[mt * S_TILES + nt, r] == float(z[i, j]), (lane, mt, nt, r)
        zfull = keep_mask(2, H, k0 + 8 * S_TILES, row0 + 16, p, seed, offset)[b, h]  # (queries, keys)
        for nt in range(S_TILES):
            for r in range(4):
                key, query = row0 + g + 8 * (r >> 1), k0 + 8 * nt + 2 * t + (r & 1)
                assert zt[nt, r] == float(zfull[query, key]), (lane, nt, r)


def test_kept_fraction_and_fresh_bits():
    p = 0.17
    z = keep_mask(2, 4, 128, 256, p, 7, 0)
    frac = z.mean()
    n = z.size
    assert abs(frac - keep16(p) / 65536) < 5 * np.sqrt(p * (1 - p) / n), frac
    # another offset, seed, head or batch: independent bits (agreement near keep² + drop²)
    expect = (1 - p) ** 2 + p ** 2
    for other in (keep_mask(2, 4, 128, 256, p, 7, 1), keep_mask(2, 4, 128, 256, p, 8, 0)):
        assert abs((z == other).mean() - expect) < 0.01
    assert abs((z[0] == z[1]).mean() - expect) < 0.01 and abs((z[:, 0] == z[:, 1]).mean() - expect) < 0.01
    assert keep_scale(p) * keep16(p) == pytest.approx(65536, rel=1e-15)
    assert np.array_equal(z, keep_mask(2, 4, 128, 256, p, 7, 0))  # a pure function of its arguments


def test_dropout_zero_is_attention_and_dropout_is_unbiased(rng):
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (12, 20, 20))
    o, lse = reference.standard_attention(q, k, v, causal=True)
    o0, lse0 = reference.standard_attention(q, k, v, causal=True, dropout_p=0.0, dropout_seed=3)
    assert np.array_equal(o, o0) and np.array_equal(lse, lse0)
    runs = [reference.standard_attention(q, k, v, causal=True, dropout_p=0.5, dropout_seed=s) for s in range(400)]
    assert all(np.array_equal(r[1], lse) for r in runs[:3]), "L is the undropped softmax's"
    mean = np.mean([r[0] for r in runs], axis=0)
    spread = np.std([r[0] for r in runs], axis=0) / np.sqrt(len(runs))
    assert (np.abs(mean - o) <= 5 * spread + 1e-12).all()
    assert np.abs(runs[0][0] - o).max() > 0.05  # and it does drop


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (5, 0))])
def test_backward_matches_finite_differences(rng, causal, window):
    q, k, v = (rng.standard_normal((2, 2, n, 8)) for n in (11, 23, 23))
    do = rng.standard_normal((2, 2, 11, 8))
    kw = dict(causal=causal, window_size=window, dropout_p=0.3, dropout_seed=99, dropout_offset=2)
    o, lse = reference.standard_attention(q, k, v, **kw)
    grads = reference.attention_backward(q, k, v, o, lse, do, **kw)
    eps = 1e-6
    for which, x, g in zip("qkv", (q, k, v), grads):
        for idx in [(0, 1, 3, 2), (1, 0, 7, 5)]:
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args = {"q": q, "k": k, "v": v}
            args[which] = xp
            fp = (reference.standard_attention(**args, **kw)[0] * do).sum()
            args[which] = xm
            fm = (reference.standard_attention(**args, **kw)[0] * do).sum()
            np.testing.assert_allclose(g[idx], (fp - fm) / (2 * eps), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad, err", [(1.0, ValueError), (-0.1, ValueError), (True, ValueError)])
def test_bad_dropout_is_named(bad, err):
    q = np.ones((1, 4, 8))
    with pytest.raises(err, match="dropout_p"):
        reference.standard_attention(q, q, q, dropout_p=bad, dropout_seed=1)
    with pytest.raises(TypeError, match="dropout_seed"):
        reference.standard_attention(q, q, q, dropout_p=0.2, dropout_seed=1.5)
