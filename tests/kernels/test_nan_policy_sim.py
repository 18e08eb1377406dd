"""The NaN / inf policy, the same in every kernel family and the reference: IEEE arithmetic.

A row whose visible scores hold a nan (or +inf: exp2(inf − inf)) gets nan in O and L, where the
kernels used to test l > 0 and so stored O = 0, L = −inf for it, the marker of a fully masked row
(a confident wrong answer in decode). A fully masked row (l = 0) keeps O = 0, L = −inf. Rows the
nan does not reach stay what they were, and agree with the float64 reference.

On the simulator (CI) and on the GPU alike; the shapes are small and cut tiles at odd places.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import numba_flash
import reference

pytestmark = pytest.mark.anywhere  # the same test on the simulator (CI) and in the GPU suite

FORWARD = [  # (dtype, kernel, d): each forward family
    ("float32", "simt", 24),
    ("float16", "mma", 40),
    ("float32", "tf32x3", 32),
]


def _inputs(seed, n_q, n_k, d, dtype, H=2, Hkv=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, H, n_q, d)).astype(dtype)
    k = rng.standard_normal((1, Hkv, n_k, d)).astype(dtype)
    v = rng.standard_normal((1, Hkv, n_k, d)).astype(dtype)
    return q, k, v


def _visible(n_q, n_k, causal):
    """visible[i, j]: query i sees key j (the bottom-right causal mask)."""
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    return np.ones((n_q, n_k), bool) if not causal else j <= i + n_k - n_q


def _forward(q, k, v, causal, kernel):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", numba_flash.PerformanceWarning)
        return numba_flash.forward(q, k, v, causal=causal, kernel=kernel)


def _same_where_clean(out, lse, ref_o, ref_l, nan_rows, dtype):
    """Rows without nan: finite exactly where the reference is, and close to it; the nan rows: all nan."""
    assert np.isnan(out[nan_rows]).all() and np.isnan(lse[nan_rows]).all(), "a nan row lost its nan"
    clean = ~nan_rows
    assert not np.isnan(out[clean]).any() and not np.isnan(lse[clean]).any(), "nan leaked into another row"
    tol = 1e-5 if dtype == "float32" else 4e-3
    np.testing.assert_allclose(out[clean].astype(np.float64), ref_o[clean], atol=tol, rtol=0)
    fin = np.isfinite(ref_l[clean])
    np.testing.assert_array_equal(np.isfinite(lse[clean]), fin)
    np.testing.assert_allclose(lse[clean][fin], ref_l[clean][fin], atol=tol, rtol=0)


@pytest.mark.parametrize("dtype,kernel,d", FORWARD, ids=[f[1] for f in FORWARD])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_nan_in_q_and_k(dtype, kernel, d, causal):
    """A nan in q's row 5 of head 0, and one in key 9 of kv head 0 (heads 0 and 1 share it: GQA 2): the rows
    that see them are nan in O and L; the rest (Nq > Nk causal: rows that see no key, O = 0 and L = −inf)
    match the reference."""
    n_q, n_k = 37, 21
    q, k, v = _inputs(3, n_q, n_k, d, dtype)
    q[0, 0, 5, 3] = np.nan
    k[0, 0, 9, 1] = np.nan
    out, lse = _forward(q, k, v, causal, kernel)
    ref_o, ref_l = reference.standard_attention(q, k, v, causal=causal)
    nan_rows = np.zeros((1, 2, n_q), bool)
    nan_rows[0, :, :] = _visible(n_q, n_k, causal)[:, 9]  # every row that sees key 9
    nan_rows[0, 0, 5] = _visible(n_q, n_k, causal)[5].any()  # (causal: row 5 sees no key, masked all the same)
    np.testing.assert_array_equal(np.isnan(ref_l), nan_rows)  # the reference follows the same policy
    _same_where_clean(out, lse, ref_o, ref_l, nan_rows, dtype)
    if causal:  # rows 0 .. n_q - n_k - 1 see no key: still the masked-row marker, not nan
        assert (lse[0, 1, : n_q - n_k] == -np.inf).all() and (out[0, 1, : n_q - n_k] == 0).all()


@pytest.mark.parametrize("dtype,kernel,d", FORWARD, ids=[f[1] for f in FORWARD])
def test_forward_posinf_score_is_nan(dtype, kernel, d):
    """+inf in a score has no softmax (exp2(inf − inf)): nan in that row's O and L, as float64 gives."""
    q, k, v = _inputs(4, 19, 30, d, dtype)
    q[0, 1, 2] = 0
    q[0, 1, 2, 0] = np.inf
    k[0, 0, :, 0] = np.abs(k[0, 0, :, 0]) + 0.5  # every score of row 2 is +inf · positive
    out, lse = _forward(q, k, v, False, kernel)
    ref_o, ref_l = reference.standard_attention(q, k, v)
    nan_rows = np.zeros((1, 2, 19), bool)
    nan_rows[0, 1, 2] = True
    np.testing.assert_array_equal(np.isnan(ref_l), nan_rows)
    _same_where_clean(out, lse, ref_o, ref_l, nan_rows, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_nan_in_a_valid_key_and_in_q(dtype, num_splits):
    """decode with num_splits = 1 stored O = 0, L = −inf for a nan in a valid key or in q; with several
    splits O was nan but L was not. Now both: nan in O and L of the queries it reaches, and a nan past a
    sequence's length (never read) changes nothing."""
    rng = np.random.default_rng(7 + num_splits)
    B, H, Hkv, n_max, d = 2, 4, 2, 150, 64
    q = rng.standard_normal((B, H, 1, d)).astype(dtype)
    kc = rng.standard_normal((B, Hkv, n_max, d)).astype(dtype)
    vc = rng.standard_normal((B, Hkv, n_max, d)).astype(dtype)
    lens = np.array([150, 77], np.int32)
    kc[0, 1, 100, 5] = np.nan  # a valid key of batch 0, kv head 1: query heads 2 and 3
    q[1, 0, 0, 7] = np.nan  # batch 1, head 0
    kc[1, 0, 120:, :] = np.nan  # past batch 1's length 77: never read
    out, lse = numba_flash.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits)
    nan_rows = np.zeros((B, H, 1), bool)
    nan_rows[0, 2:] = True
    nan_rows[1, 0] = True
    ref_o, ref_l = reference.decode_attention(q, kc, vc, cache_seqlens=lens)
    np.testing.assert_array_equal(np.isnan(ref_l), nan_rows)
    _same_where_clean(out, lse, ref_o, ref_l, nan_rows, dtype)


@pytest.mark.parametrize("dtype,d", [("float32", 24), ("float16", 40)])
def test_backward_nan_reaches_the_gradients(dtype, d):
    """A nan in one q row of head 0: head 0's dq row and the dk / dv rows of the keys it saw are nan (not
    dropped); head 1 (its own kv head) is unaffected and matches the reference."""
    rng = np.random.default_rng(11)
    n_q, n_k = 23, 18
    q, k, v = _inputs(12, n_q, n_k, d, dtype, H=2, Hkv=2)
    do = rng.standard_normal(q.shape).astype(dtype)
    q[0, 0, 4, 2] = np.nan
    out, lse = _forward(q, k, v, False, "auto")
    dq, dk, dv = numba_flash.backward(q, k, v, out, lse, do)
    assert np.isnan(dq[0, 0, 4]).all() and np.isnan(dk[0, 0]).any() and np.isnan(dv[0, 0]).any()
    for g in (dq, dk, dv):
        assert not np.isnan(g[0, 1]).any()
    refs = reference.attention_backward(q[:, 1:], k[:, 1:], v[:, 1:], out[:, 1:].astype(np.float64),
                                        lse[:, 1:].astype(np.float64), do[:, 1:])
    tol = 1e-4 if dtype == "float32" else 3e-2
    for g, r in zip((dq, dk, dv), refs):
        np.testing.assert_allclose(g[:, 1:].astype(np.float64), r, atol=tol * max(1.0, np.abs(r).max()), rtol=0)
