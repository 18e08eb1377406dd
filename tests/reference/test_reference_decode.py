"""reference.decode: split-and-merge decoding equals standard attention on the valid prefix.

Tolerance in float64, per unit of max|v| (as in test_reference_softmax): the split path rounds
each exponent argument and each rescale by exp(m_s − m) (a few eps per split), and both paths sum
up to Nmax terms in different orders, so 4·(Nmax + 2·S + 50)·eps·max|v| bounds the difference
(about 1e−13 here), while a real mistake (a split not rescaled, a wrong mask) is O(1).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import standard_attention
from reference.decode import decode_attention, decode_partials, merge_partials, split_bounds

EPS = np.finfo(np.float64).eps
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tolerance(n_keys: int, n_splits: int) -> float:
    return 4 * (n_keys + 2 * n_splits + 50) * EPS


def expected(q, k_cache, v_cache, lens, scale=None):
    """standard_attention per sequence on its valid prefix, causal (bottom-right aligned)."""
    O = np.zeros(q.shape)
    L = np.full(q.shape[:-1], -np.inf)
    for b, n in enumerate(lens):
        if n > 0:
            O[b], L[b] = standard_attention(q[b], k_cache[b, :, :n], v_cache[b, :, :n], causal=True,
                                            softmax_scale=scale)
    return O, L


@st.composite
def decode_problems(draw):
    """Shapes with GQA, ragged lengths (0 and Nmax included), big logits, and per-sequence cuts."""
    B = draw(st.integers(1, 3))
    Hkv = draw(st.sampled_from([1, 2]))
    G = draw(st.sampled_from([1, 2, 4]))
    n_q = draw(st.integers(1, 5))
    n_max = draw(st.integers(0, 40))
    d = draw(st.sampled_from([1, 3, 8]))
    lens = draw(st.lists(st.integers(0, n_max), min_size=B, max_size=B))
    n_splits = draw(st.integers(1, 6))
    cuts = [sorted(draw(st.lists(st.integers(0, n), min_size=n_splits - 1, max_size=n_splits - 1))) for n in lens]
    seed = draw(st.integers(0, 2**32 - 1))
    logit_scale = draw(st.sampled_from([1.0, 30.0]))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hkv * G, n_q, d)) * logit_scale
    k = rng.standard_normal((B, Hkv, n_max, d))
    v = rng.standard_normal((B, Hkv, n_max, d))
    return q, k, v, np.array(lens), cuts


@SETTINGS
@given(decode_problems())
def test_any_split_points_give_standard_attention(problem):
    q, k, v, lens, cuts = problem
    O, L = decode_attention(q, k, v, cache_seqlens=lens, splits=lambda b, n: cuts[b])
    O_ref, L_ref = expected(q, k, v, lens)
    scale = max(1.0, np.abs(v).max()) if v.size else 1.0
    tol = tolerance(k.shape[2], len(cuts[0]) + 1)
    np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref))
    assert np.abs(O - O_ref).max(initial=0) <= tol * scale
    fin = np.isfinite(L_ref)
    assert np.abs(L[fin] - L_ref[fin]).max(initial=0) <= tol * (1 + np.abs(L_ref[fin]).max(initial=0))
    assert (O[~fin] == 0).all()


@SETTINGS
@given(decode_problems(), st.integers(1, 12), st.sampled_from([1, 4, 16]))
def test_kernel_split_rule_gives_standard_attention(problem, n_splits, block_n):
    """The kernel's rule: whole tiles, ceil(tiles / S) per split, more splits than tiles allowed."""
    q, k, v, lens, _ = problem
    O, L = decode_attention(q, k, v, cache_seqlens=lens, splits=n_splits, block_n=block_n)
    O_ref, L_ref = expected(q, k, v, lens)
    np.testing.assert_array_equal(np.isneginf(L), np.isneginf(L_ref))
    assert np.abs(O - O_ref).max(initial=0) <= tolerance(k.shape[2], n_splits) * max(1.0, np.abs(v).max(initial=0))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(1, 20), st.integers(1, 64))
def test_split_bounds_cover_in_whole_tiles(length, n_splits, block_n):
    bounds = split_bounds(length, n_splits, block_n)
    assert len(bounds) == n_splits
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    for (a0, a1), (b0, _) in zip(bounds, bounds[1:]):
        assert a0 <= a1 == b0
    for a0, a1 in bounds:
        assert a0 % block_n == 0 or a0 == a1 == length  # empty trailing splits sit at the end
        assert a1 % block_n == 0 or a1 == length
    sizes = [a1 - a0 for a0, a1 in bounds]
    per = -(-(-(-length // block_n)) // n_splits) * block_n
    assert max(sizes) <= per


def test_partials_are_the_states_of_each_split():
    """Split states by hand: m = max visible score, l = Σ exp(s − m), acc = Σ exp(s − m) v."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 2, 4))
    k = rng.standard_normal((1, 1, 10, 4))
    v = rng.standard_normal((1, 1, 10, 4))
    m, l, acc = decode_partials(q, k, v, cache_seqlens=[7], splits=[3, 3, 6])  # [0,3) [3,3) [3,6) [6,7)
    assert m.shape == (1, 2, 2, 4) and acc.shape == (1, 2, 2, 4, 4)
    assert np.isneginf(m[..., 1]).all() and (l[..., 1] == 0).all() and (acc[..., 1, :] == 0).all()
    # query 0 (of 2) sees keys <= 0 + 7 - 2 = 5, so split [6, 7) is empty for it, not for query 1
    assert np.isneginf(m[0, :, 0, 3]).all() and np.isfinite(m[0, :, 1, 3]).all()
    s = q[0, 1, 1] @ k[0, 0, 3:6].T / 2.0
    np.testing.assert_allclose(m[0, 1, 1, 2], s.max())
    np.testing.assert_allclose(l[0, 1, 1, 2], np.exp(s - s.max()).sum())
    np.testing.assert_allclose(acc[0, 1, 1, 2], np.exp(s - s.max()) @ v[0, 0, 3:6])
    O, L = merge_partials(m, l, acc)
    O_ref, L_ref = expected(q, k, v, [7])
    np.testing.assert_allclose(O, O_ref, atol=1e-14)
    np.testing.assert_allclose(L, L_ref, atol=1e-14)


def test_stale_cache_slots_are_never_read():
    """Slots past len_b may hold anything (nan included): they must not touch the result."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 2, 3, 8))
    k = rng.standard_normal((2, 2, 12, 8))
    v = rng.standard_normal((2, 2, 12, 8))
    k[0, :, 5:] = np.nan
    v[0, :, 5:] = np.inf
    O, L = decode_attention(q, k, v, cache_seqlens=np.array([5, 12]), splits=3, block_n=4)
    assert np.isfinite(O).all()
    O_ref, _ = expected(q, np.nan_to_num(k), np.nan_to_num(v), [5, 12])
    np.testing.assert_allclose(O, O_ref, atol=1e-13)


def test_empty_and_fully_masked():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, 4, 3))
    k = rng.standard_normal((2, 1, 6, 3))
    O, L = decode_attention(q, k, k, cache_seqlens=[0, 2], splits=2, block_n=2)
    assert (O[0] == 0).all() and np.isneginf(L[0]).all()
    # len 2, Nq 4: queries 0 and 1 see keys <= i - 2 < 0, i.e. nothing
    assert np.isneginf(L[1, 0, :2]).all() and np.isfinite(L[1, 0, 2:]).all()
    O0, L0 = decode_attention(np.zeros((2, 1, 0, 3)), k, k)
    assert O0.shape == (2, 1, 0, 3) and L0.shape == (2, 1, 0)


@pytest.mark.parametrize("bad, match", [
    (dict(cache_seqlens=[1, 9]), r"0 <= length <= Nmax = 6"),
    (dict(cache_seqlens=[1]), r"shape \(1,\); accepted: \(B,\) = \(2,\)"),
    (dict(cache_seqlens=[1.0, 2.0]), r"dtype float64"),
    (dict(splits=[4, 1]), r"sorted cut points"),
    (dict(splits=lambda b, n: [0] * b), r"same number of splits"),
    (dict(splits=0), r"num_splits must be an int >= 1"),
    (dict(splits="two"), r"splits must be an int"),
])
def test_validation_messages(bad, match):
    q = np.zeros((2, 2, 1, 3))
    k = np.zeros((2, 1, 6, 3))
    with pytest.raises((TypeError, ValueError), match=match):
        decode_attention(q, k, k, **{"cache_seqlens": [3, 4], **bad})


def test_gqa_shape_mismatch():
    with pytest.raises(ValueError, match="positive multiple of Hkv"):
        decode_attention(np.zeros((1, 3, 1, 4)), np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 4)))
