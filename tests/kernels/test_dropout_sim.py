"""Dropout in the tensor-core kernels (the mma.sync forward, dK/dV and dQ kernels) against the float64 reference
with the same keep mask (reference.dropout), by flash-attention's error rule, on the simulator (CI) and on the GPU
alike (``anywhere``); the refusals outside those kernels. Shapes cut tiles at odd places (Nq != Nk, GQA, a d that
is padded), so the counter layout is checked at tile, warp and lane offsets that are not 0."""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
import reference

pytestmark = pytest.mark.anywhere

# (B, H, Hkv, Nq, Nk, d, causal, window, softcap, p)
CASES = [
    (1, 2, 1, 40, 70, 64, True, (-1, -1), 0.0, 0.3),
    pytest.param((2, 2, 2, 65, 47, 40, False, (7, 3), 2.0, 0.5), marks=pytest.mark.heavy),  # d 40 -> 64, mods
    pytest.param((1, 2, 1, 33, 50, 200, True, (-1, -1), 0.0, 0.2), marks=pytest.mark.heavy),  # d 256: split dkdv
]


def _inputs(seed, B, H, Hkv, n_q, n_k, d):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, H, n_q, d)) * 1.5).astype(np.float16)
    k, v = (rng.standard_normal((B, Hkv, n_k, d)).astype(np.float16) for _ in range(2))
    return q, k, v, rng.standard_normal((B, H, n_q, d)).astype(np.float16)


def _bound(ours, exact, naive, floor=1e-3):
    err = np.abs(ours.astype(np.float64) - exact).max(initial=0)
    ref_err = np.abs(naive.astype(np.float64) - exact).max(initial=0)
    assert err <= 2 * ref_err + floor, f"error {err:.3e} > 2 x naive {ref_err:.3e} + {floor:g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Nq{c[3]}-Nk{c[4]}-d{c[5]}-p{c[9]}")
def test_dropout_forward_and_backward(case):
    B, H, Hkv, n_q, n_k, d, causal, window, cap, p = case
    q, k, v, do = _inputs(1, B, H, Hkv, n_q, n_k, d)
    kw = dict(causal=causal, window_size=window, softcap=cap, dropout_p=p, dropout_seed=2**33 + 7, dropout_offset=5)
    out, lse = numba_flash.forward(q, k, v, **kw)
    o64, l64 = reference.standard_attention(q, k, v, **kw)
    o16, _ = reference.standard_attention(q, k, v, **kw, dtype=np.float16)
    _bound(out, o64, o16)
    fin = np.isfinite(l64)
    np.testing.assert_allclose(lse[fin], l64[fin], atol=1e-4 * max(1.0, np.abs(l64[fin]).max()), rtol=0)
    undropped, _ = reference.standard_attention(q, k, v, causal=causal, window_size=window, softcap=cap)
    assert np.abs(out - undropped).max() > 0.05, "the mask must drop something"
    exact = reference.attention_backward(q, k, v, out, lse, do, **kw)
    naive = reference.attention_backward(q, k, v, out, lse, do, **kw, dtype=np.float16)
    # deterministic: the dq kernel (or, where the model says so, the splits); False: dQ in the dK/dV kernel, on
    # sm_90 (and in the simulator) the wgmma one
    for det in (True, False):
        grads = numba_flash.backward(q, k, v, out, lse, do, deterministic=det, **kw)
        for g, x, nv in zip(grads, exact, naive):
            _bound(g, x, nv)


def test_dropout_refusals():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 16, 64)).astype(np.float16)
    with pytest.raises(TypeError, match="dropout_seed"):
        numba_flash.forward(q, q, q, dropout_p=0.1)
    for bad in (1.0, -0.5, "0.1"):
        with pytest.raises(ValueError, match="dropout_p"):
            numba_flash.forward(q, q, q, dropout_p=bad, dropout_seed=1)
    with pytest.raises(TypeError, match="dropout_offset"):
        numba_flash.forward(q, q, q, dropout_p=0.1, dropout_seed=1, dropout_offset=2**32)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1.*mma.sync forward only"):
        numba_flash.forward(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32), dropout_p=0.1,
                            dropout_seed=1)
    with pytest.raises(NotImplementedError, match="dropout"):
        numba_flash.forward(q, q, q, dropout_p=0.1, dropout_seed=1, kernel="simt")
    text = numba_flash.explain(q, q, q, dropout_p=0.25)
    assert "mma.sync" in text and "dropout p=0.25" in text, text
    assert "dropout" in numba_flash.explain_backward(q, q, q, dropout_p=0.25)


def test_dropout_argument_checks_and_block_mask_tile():
    """dropout_p that is not a real in [0, 1) is refused on every path (None does not mean 0), one that rounds to
    keeping nothing too; a BlockMask for a call with dropout is built at forward_tile(..., dropout=True), the
    mma.sync forward's tile, and another tile is refused naming it."""
    from numba_flash.mods import document_mask
    from numba_flash.sparsity import forward_tile

    q = np.random.default_rng(3).standard_normal((1, 1, 40, 64)).astype(np.float16)
    for bad in (None, "0", [0.1]):
        with pytest.raises(ValueError, match="dropout_p"):
            numba_flash.forward(q, q, q, dropout_p=bad, dropout_seed=1)
        with pytest.raises(ValueError, match="dropout_p"):
            numba_flash.backward(q, q, q, q, q[..., 0].astype(np.float32), q, dropout_p=bad, dropout_seed=1)
    with pytest.raises(ValueError, match="keeps less than one draw"):
        numba_flash.forward(q, q, q, dropout_p=1 - 2.0**-18, dropout_seed=1)
    with pytest.raises(ValueError, match="dropout_p"):
        numba_flash.validate(q, q, q, dropout_p=1.5)
    seg = np.zeros((1, 40), np.int32)
    seg[0, 20:] = 1
    bq, bk = forward_tile(64, causal=True, dropout=True)
    bm = numba_flash.block_mask(document_mask(seg), 1, 1, 40, 40, bq, bk)
    out, _ = numba_flash.forward(q, q, q, causal=True, block_mask=bm, dropout_p=0.5, dropout_seed=9)
    ref, _ = reference.standard_attention(q, q, q, causal=True, dropout_p=0.5, dropout_seed=9,
                                          mask_mod=lambda b, h, i, j, s: s[b, i] == s[b, j], mask_aux=(seg,))
    naive, _ = reference.standard_attention(q, q, q, causal=True, dropout_p=0.5, dropout_seed=9, dtype=np.float16,
                                            mask_mod=lambda b, h, i, j, s: s[b, i] == s[b, j], mask_aux=(seg,))
    _bound(out, ref, naive)
    other = numba_flash.block_mask(document_mask(seg), 1, 1, 40, 40, bq, 2 * bk)
    with pytest.raises(ValueError, match="forward_tile"):
        numba_flash.forward(q, q, q, causal=True, block_mask=other, dropout_p=0.5, dropout_seed=9)
