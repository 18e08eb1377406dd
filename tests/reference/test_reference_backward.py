"""Attention backward references: finite differences, and the tiled backward against the materialised one.

Finite differences: central differences with step h = 1e−5 on tiny float64 problems with unit-size
logits. Truncation error ≈ h²·|f'''|/6 ≈ 1e−10 and rounding ≈ eps·|loss|/h ≈ 1e−10, so the
analytic gradient must match to rtol 1e−6, atol 1e−7 (a wrong term, e.g. a missing −D, is O(1)).

Tiled vs materialised (``backward_tolerance``): both evaluate the same formulas; they differ in
how the sums over keys (dq) and over queries (dk, dv) are split into tiles, and in the BLAS kernel
that computes each score. Summation: ≤ 4·(Nq + Nk + d + 2)·eps times the sum of the absolute terms
(e.g. scale·(P∘(|dP| + |D|))·|K| for dq). Scores: P = exp(S − L) carries S's error δS (bound as in
test_reference_attention.py), a relative 2·δS per weight, times the same absolute terms.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import attention_backward, flash_attention_backward, standard_attention

EPS = np.finfo(np.float64).eps
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def numeric_gradients(q, k, v, do, kwargs, h=1e-5):
    """Central differences of loss = Σ O ∘ dO with respect to every entry of q, k and v; kwargs go to
    standard_attention (causal, window_size, softcap, alibi_slopes: test_reference_variants uses it too)."""
    grads = []
    for x in (q, k, v):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + h
            plus = np.sum(standard_attention(q, k, v, **kwargs)[0] * do)
            x[idx] = old - h
            minus = np.sum(standard_attention(q, k, v, **kwargs)[0] * do)
            x[idx] = old
            g[idx] = (plus - minus) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize(
    "q_shape,kv_shape,causal",
    [
        ((4, 3), (4, 3), False),
        ((4, 3), (4, 3), True),
        ((3, 2), (5, 2), True),  # Nq < Nk: bottom-right aligned
        ((5, 2), (3, 2), True),  # Nq > Nk: the first two rows are fully masked
        ((1, 4, 3, 2), (1, 2, 4, 2), False),  # GQA, 2 query heads per K/V head
        ((2, 2, 3, 2), (2, 1, 3, 2), True),  # MQA by broadcasting
    ],
)
def test_backward_matches_finite_differences(rng, q_shape, kv_shape, causal):
    q = rng.standard_normal(q_shape)
    k, v = rng.standard_normal((2, *kv_shape))
    O, L = standard_attention(q, k, v, causal=causal)
    do = rng.standard_normal(O.shape)
    analytic = attention_backward(q, k, v, O, L, do, causal=causal)
    numeric = numeric_gradients(q, k, v, do, {"causal": causal})
    tiled = flash_attention_backward(q, k, v, O, L, do, block_q=2, block_k=3, causal=causal)
    for name, a, n, t in zip(("dq", "dk", "dv"), analytic, numeric, tiled):
        assert a.shape == n.shape, name
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-7, err_msg=name)


def backward_tolerance(q, k, v, o, lse, do, causal, scale):
    """Per-entry bounds on |tiled − materialised| for (dq, dk, dv): see the module docstring.

    The absolute terms are computed on the GQA/broadcast-expanded arrays and reduced like the
    gradients themselves, so they bound the same sums.
    """
    from reference.attention import _prepare, causal_mask

    pr = _prepare(q, k, v, causal=causal, softmax_scale=scale, dtype=None)
    S = pr.q @ np.swapaxes(pr.k, -1, -2) * pr.scale
    if causal:
        S = np.where(causal_mask(0, pr.n_q, 0, pr.n_k, pr.n_q, pr.n_k), -np.inf, S)
    P = np.exp(S - np.where(np.isneginf(lse), np.inf, lse)[..., None])
    dP_abs = np.abs(do) @ np.swapaxes(np.abs(pr.v), -1, -2)
    D_abs = np.sum(np.abs(do * o), axis=-1)
    A = P * (dP_abs + D_abs[..., None])  # |dS| and its rounding terms, entry by entry
    dS = 2 * (pr.d + 2) * EPS * pr.scale * np.linalg.norm(pr.q, axis=-1).max() * np.linalg.norm(pr.k, axis=-1).max()
    factor = 4 * (pr.n_q + pr.n_k + pr.d + 2) * EPS + 4 * dS
    return (
        factor * pr.reduce_dq(pr.scale * A @ np.abs(pr.k)),
        factor * pr.reduce_dkv(pr.scale * np.swapaxes(A, -1, -2) @ np.abs(pr.q)),
        factor * pr.reduce_dkv(np.swapaxes(P, -1, -2) @ np.abs(do)),
    )


@st.composite
def backward_problems(draw):
    layout = draw(st.sampled_from(["2d", "bhnd", "gqa", "broadcast"]))
    n_q, n_k = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    d = draw(st.sampled_from([1, 2, 4, 7, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    q_lead, kv_lead = {"2d": ((), ()), "bhnd": ((2, 2), (2, 2)), "gqa": ((1, 4), (1, 2)), "broadcast": ((3, 2), (2,))}[layout]
    sigma = math.sqrt(draw(st.sampled_from([1e-2, 1.0, 10.0, 1e3])))
    q = rng.standard_normal(q_lead + (n_q, d)) * sigma
    k = rng.standard_normal(kv_lead + (n_k, d)) * sigma
    v = rng.standard_normal(kv_lead + (n_k, d))
    causal = draw(st.booleans())
    O, L = standard_attention(q, k, v, causal=causal)
    do = rng.standard_normal(O.shape)
    return q, k, v, O, L, do, causal


@SETTINGS
@given(problem=backward_problems(), block_q=st.integers(1, 30), block_k=st.integers(1, 30),
       dq_splits=st.one_of(st.none(), st.integers(1, 5)))
def test_tiled_backward_equals_materialised(problem, block_q, block_k, dq_splits):
    """Any block sizes, and dQ added straight into dq (atomic adds in a kernel) or through any number of
    planes (the deterministic splits: K/V block j into plane j mod S, planes summed in order)."""
    q, k, v, O, L, do, causal = problem
    ref = attention_backward(q, k, v, O, L, do, causal=causal)
    planes = []
    tiled = flash_attention_backward(q, k, v, O, L, do, block_q=block_q, block_k=block_k, causal=causal,
                                     dq_splits=dq_splits, planes=planes)
    assert len(planes) == (dq_splits or 0)
    if dq_splits:  # dq is scale · the planes summed in order
        total = np.zeros_like(tiled[0])
        for plane in planes:
            total += plane
        np.testing.assert_allclose(total / math.sqrt(q.shape[-1]), tiled[0], rtol=1e-12, atol=1e-300)
    tols = backward_tolerance(q, k, v, O, L, do, causal, None)
    for name, r, t, tol, x in zip(("dq", "dk", "dv"), ref, tiled, tols, (q, k, v)):
        assert t.shape == r.shape == x.shape, name
        err = np.abs(t - r)
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert (err <= tol + 1e-300).all(), f"{name}: |tiled - ref| = {err[worst]:.3e} > {tol[worst]:.3e} at {worst}"


def test_fully_masked_rows_have_zero_gradients(rng):
    n_q, n_k, d = 6, 3, 4  # causal, Nq > Nk: queries 0..2 see no key
    q, k, v = rng.standard_normal((n_q, d)), rng.standard_normal((n_k, d)), rng.standard_normal((n_k, d))
    O, L = standard_attention(q, k, v, causal=True)
    do = rng.standard_normal(O.shape)
    for dq, dk, dv in (
        attention_backward(q, k, v, O, L, do, causal=True),
        flash_attention_backward(q, k, v, O, L, do, block_q=4, block_k=2, causal=True),
    ):
        # row 3 sees one key, so its softmax is constant and its dq is 0 up to rounding; rows 4, 5 are not
        assert (dq[:3] == 0).all() and np.abs(dq[3]).max() < 1e-14 and np.abs(dq[4:]).min() > 0
        assert np.isfinite(dk).all() and np.isfinite(dv).all()
        # dv only collects weights of rows that see keys: dv_j = Σ_i P_ij dO_i over i >= 3
        P = np.exp(np.where(np.arange(n_k)[None] > np.arange(n_q)[:, None] - 3, -np.inf, q @ k.T / 2) - np.where(np.isneginf(L), np.inf, L)[:, None])
        np.testing.assert_allclose(dv, P.T @ do, atol=1e-14)


def test_gqa_gradients_sum_over_the_group(rng):
    b, h_kv, g, n, d = 1, 2, 3, 5, 4
    q = rng.standard_normal((b, h_kv * g, n, d))
    k, v = rng.standard_normal((2, b, h_kv, n, d))
    O, L = standard_attention(q, k, v, causal=True)
    do = rng.standard_normal(O.shape)
    dq, dk, dv = flash_attention_backward(q, k, v, O, L, do, block_q=2, block_k=2, causal=True)
    assert dk.shape == k.shape and dv.shape == v.shape
    for h_k in range(h_kv):
        dk_sum, dv_sum = np.zeros((n, d)), np.zeros((n, d))
        for h in range(h_k * g, (h_k + 1) * g):
            dq_h, dk_h, dv_h = attention_backward(q[0, h], k[0, h_k], v[0, h_k], O[0, h], L[0, h], do[0, h], causal=True)
            np.testing.assert_allclose(dq[0, h], dq_h, atol=1e-13, rtol=0)
            dk_sum += dk_h
            dv_sum += dv_h
        np.testing.assert_allclose(dk[0, h_k], dk_sum, atol=1e-13, rtol=0)
        np.testing.assert_allclose(dv[0, h_k], dv_sum, atol=1e-13, rtol=0)


def test_backward_validation_messages(rng):
    q, k, v = rng.standard_normal((3, 4, 2))
    O, L = standard_attention(q, k, v)
    do = rng.standard_normal(O.shape)
    with pytest.raises(ValueError, match=r"lse has shape \(3,\); the forward of these q, k, v gives \(4,\)"):
        attention_backward(q, k, v, O, L[:3], do)
    with pytest.raises(ValueError, match=r"do has shape \(4, 3\)"):
        flash_attention_backward(q, k, v, O, L, np.ones((4, 3)), block_q=2, block_k=2)
    assert all(np.isnan(g).any() for g in attention_backward(q, k, v, O, np.full(4, np.nan), do))  # IEEE: nan out
    with pytest.raises(ValueError, match="block_k must be an int >= 1, got -1"):
        flash_attention_backward(q, k, v, O, L, do, block_q=2, block_k=-1)
    with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
        attention_backward(q, k, v, O, L, do, softmax_scale=0)


def test_backward_dtype(rng):
    q, k, v = (rng.standard_normal((3, 2)).astype(np.float32) for _ in range(3))
    O, L = standard_attention(q, k, v)
    grads = flash_attention_backward(q, k, v, O, L, np.ones_like(O), block_q=2, block_k=2)
    assert all(g.dtype == np.float64 for g in grads)
    grads32 = attention_backward(q, k, v, O, L, np.ones_like(O), dtype=np.float32)
    assert all(g.dtype == np.float32 for g in grads32)
    for g, g32 in zip(grads, grads32):
        np.testing.assert_allclose(g32, g, atol=1e-5)
