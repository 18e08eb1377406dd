"""The NumPy reference's user mods (mask_mod, score_mod with its gradient): FlexAttention's semantics.

Properties, drawn by hypothesis over shapes, tiles, masks and mods: the tile loop's result does not depend
on the order it visits the key blocks under any user mask; keys a mask_mod hides from every query have no
effect on O, L, dq (their dk, dv rows are 0); the backward through a score_mod matches finite differences;
the tiled forward and backward equal the materialising ones; a mod ANDs with causal.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference

SETTINGS = settings(max_examples=8, deadline=None)


def table_mask(b, h, q_idx, kv_idx, table):
    return table[b, h, q_idx, kv_idx]


def rel_bias(score, b, h, q_idx, kv_idx, bias, n_k):
    return score * 0.75 + bias[h, q_idx - kv_idx + n_k[0]] + np.tanh(score)


def rel_bias_grad(score, b, h, q_idx, kv_idx, bias, n_k):
    return 0.75 + 1.0 - np.tanh(score) ** 2


def _problem(seed, B, H, n_q, n_k, d, density):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, n, d)) for n in (n_q, n_k, n_k))
    do = rng.standard_normal((B, H, n_q, d))
    table = rng.random((B, H, n_q, n_k)) < density
    bias = rng.standard_normal((H, n_q + n_k))
    return q, k, v, do, table, bias


shapes = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 11), st.integers(1, 13), st.integers(1, 5))


@SETTINGS
@given(shapes, st.integers(0, 2**31), st.floats(0.1, 1.0), st.integers(1, 7), st.integers(1, 7), st.booleans(),
       st.booleans())
def test_block_order_does_not_matter_under_a_user_mask(shape, seed, density, block_q, block_k, causal, with_score):
    B, H, n_q, n_k, d = shape
    q, k, v, _, table, bias = _problem(seed, B, H, n_q, n_k, d, density)
    kw = dict(causal=causal, mask_mod=table_mask, mask_aux=(table,))
    if with_score:
        kw.update(score_mod=rel_bias, score_aux=(bias, np.array([n_k])))
    o_ref, l_ref = reference.standard_attention(q, k, v, **kw)
    perm = np.random.default_rng(seed + 1).permutation
    for order in (None, "reverse", lambda n: perm(n)):
        o, l = reference.flash_attention(q, k, v, block_q=block_q, block_k=block_k, kv_order=order, **kw)
        np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=0)
        np.testing.assert_allclose(l, l_ref, atol=1e-12, rtol=0)
    seen = table & reference.visible_mask(0, n_q, 0, n_k, n_q, n_k, causal)
    rows_dark = ~seen.any(-1)
    assert (o_ref[rows_dark] == 0).all() and np.isneginf(l_ref[rows_dark]).all()


@SETTINGS
@given(shapes, st.integers(0, 2**31), st.floats(0.2, 1.0), st.integers(1, 3))
def test_keys_a_mask_mod_hides_have_no_effect(shape, seed, density, n_hidden):
    B, H, n_q, n_k, d = shape
    n_k = max(n_k, n_hidden + 1)
    q, k, v, do, _, bias = _problem(seed, B, H, n_q, n_k, d, density)
    hidden = np.random.default_rng(seed).choice(n_k, n_hidden, replace=False)
    keep = np.ones(n_k, bool)
    keep[hidden] = False
    mask = lambda b, h, q_idx, kv_idx, keep: keep[kv_idx]  # noqa: E731
    kw = dict(mask_mod=mask, mask_aux=(keep,), score_mod=rel_bias, score_aux=(bias, np.array([n_k])))
    o, l = reference.standard_attention(q, k, v, **kw)
    grads = reference.attention_backward(q, k, v, o, l, do, score_mod_grad=rel_bias_grad, **kw)
    k2, v2 = k.copy(), v.copy()
    k2[..., hidden, :] = np.random.default_rng(seed + 2).standard_normal(k2[..., hidden, :].shape) * 50
    v2[..., hidden, :] = 1e6
    o2, l2 = reference.standard_attention(q, k2, v2, **kw)
    grads2 = reference.attention_backward(q, k2, v2, o2, l2, do, score_mod_grad=rel_bias_grad, **kw)
    np.testing.assert_allclose(o2, o, atol=1e-12, rtol=0)
    np.testing.assert_allclose(l2, l, atol=1e-12, rtol=0)
    np.testing.assert_allclose(grads2[0], grads[0], atol=1e-10, rtol=0)
    for g in (grads[1], grads[2], grads2[1], grads2[2]):
        assert (g[..., hidden, :] == 0).all()


@SETTINGS
@given(st.integers(0, 2**31), st.booleans())
def test_score_mod_backward_matches_finite_differences(seed, causal):
    B, H, n_q, n_k, d = 1, 2, 6, 9, 4
    q, k, v, do, table, bias = _problem(seed, B, H, n_q, n_k, d, 0.7)
    kw = dict(causal=causal, mask_mod=table_mask, mask_aux=(table,), score_mod=rel_bias,
              score_aux=(bias, np.array([n_k])), softcap=4.0)
    o, l = reference.standard_attention(q, k, v, **kw)
    grads = reference.flash_attention_backward(q, k, v, o, l, do, block_q=4, block_k=3,
                                               score_mod_grad=rel_bias_grad, **kw)

    def loss(q_, k_, v_):
        return float((reference.standard_attention(q_, k_, v_, **kw)[0] * do).sum())

    rng = np.random.default_rng(seed)
    eps = 1e-6
    for which, x in enumerate((q, k, v)):
        for _ in range(3):
            ix = tuple(rng.integers(0, n) for n in x.shape)
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[which][ix] += eps
            minus[which][ix] -= eps
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(fd - grads[which][ix]) <= 1e-6 + 1e-5 * abs(fd), (which, ix, fd, grads[which][ix])


def test_tiled_backward_equals_the_materialising_one(rng):
    q, k, v, do, table, bias = _problem(int(rng.integers(2**31)), 2, 2, 11, 14, 5, 0.6)
    kw = dict(causal=True, mask_mod=table_mask, mask_aux=(table,), score_mod=rel_bias,
              score_aux=(bias, np.array([14])), alibi_slopes=np.array([0.1, 0.3]))
    o, l = reference.standard_attention(q, k, v, **kw)
    full = reference.attention_backward(q, k, v, o, l, do, score_mod_grad=rel_bias_grad, **kw)
    tiled = reference.flash_attention_backward(q, k, v, o, l, do, block_q=3, block_k=4, dq_splits=2,
                                               score_mod_grad=rel_bias_grad, **kw)
    for a, b in zip(full, tiled):
        np.testing.assert_allclose(b, a, atol=1e-12, rtol=0)


def test_a_user_mask_ands_with_causal(rng):
    q, k, v, _, _, _ = _problem(int(rng.integers(2**31)), 1, 1, 9, 12, 4, 1.0)
    even = lambda b, h, i, j: j % 2 == 0  # noqa: E731
    both = lambda b, h, i, j: j % 2 == 0 and j <= i + 3  # noqa: E731  shift = Nk - Nq = 3
    o, l = reference.standard_attention(q, k, v, causal=True, mask_mod=even)
    o2, l2 = reference.standard_attention(q, k, v, mask_mod=both)
    np.testing.assert_allclose(o, o2, atol=1e-12, rtol=0)
    np.testing.assert_allclose(l, l2, atol=1e-12, rtol=0)


def test_bad_mods_are_refused():
    q = np.ones((1, 1, 3, 2))
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        reference.standard_attention(q, q, q, mask_mod=3)
    with pytest.raises(TypeError, match="mask_aux must be a tuple"):
        reference.standard_attention(q, q, q, mask_mod=lambda b, h, i, j, a: True, mask_aux=np.ones(3))
    with pytest.raises(ValueError, match="score_mod_grad without score_mod"):
        reference.attention_backward(q, q, q, q, q[..., 0], q, score_mod_grad=lambda *a: 1.0)
    with pytest.raises(ValueError, match="needs its derivative"):
        reference.attention_backward(q, q, q, q, q[..., 0], q, score_mod=lambda s, b, h, i, j: 2 * s)
    with pytest.raises(ValueError, match="at most 2"):
        reference.standard_attention(np.ones((1, 1, 1, 3, 2)), q, q, mask_mod=lambda b, h, i, j: True)


@SETTINGS
@given(shapes, st.integers(0, 2**31), st.integers(1, 5), st.integers(1, 5), st.booleans())
def test_a_block_mask_skips_empty_tiles_and_unmasks_full_ones_without_changing_the_result(shape, seed, block_q,
                                                                                           block_k, causal):
    """Documents of random lengths: whole tiles are EMPTY (off the diagonal blocks) or FULL (inside one)."""
    B, H, n_q, n_k, d = shape
    q, k, v, _, _, bias = _problem(seed, B, H, n_q, n_k, d, 1.0)
    rng = np.random.default_rng(seed)
    seg_q = np.sort(rng.integers(0, 3, (B, n_q)), axis=1)
    seg_k = np.sort(rng.integers(0, 3, (B, n_k)), axis=1)
    same = lambda b, h, i, j, sq, sk: sq[b, i] == sk[b, j]  # noqa: E731
    kw = dict(causal=causal, mask_mod=same, mask_aux=(seg_q, seg_k), score_mod=rel_bias,
              score_aux=(bias, np.array([n_k])))
    classes, kv_num, kv_idx = reference.block_mask(same, B, H, n_q, n_k, block_q, block_k, mask_aux=(seg_q, seg_k))
    seen = seg_q[:, None, :, None] == seg_k[:, None, None, :]
    for b, h, a, c in np.ndindex(*classes.shape):
        tile = seen[b, 0, a * block_q:(a + 1) * block_q, c * block_k:(c + 1) * block_k]
        assert classes[b, h, a, c] == (reference.attention.FULL if tile.all() else
                                       reference.attention.PARTIAL if tile.any() else reference.attention.EMPTY)
    assert (kv_num == (classes != reference.attention.EMPTY).sum(-1)).all()
    assert ((kv_idx >= 0).sum(-1) == kv_num).all()
    o_ref, l_ref = reference.standard_attention(q, k, v, **kw)
    o, l = reference.flash_attention(q, k, v, block_q=block_q, block_k=block_k, block_classes=classes, **kw)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, rtol=0)
    np.testing.assert_allclose(l, l_ref, atol=1e-12, rtol=0)
