"""Softmax references: naive vs standard, and the online recurrence (3.6.4) against the standard.

Tolerance for "online equals standard" in float64 (``online_tolerance``), per unit of max|v|:
only weights with s − m ≥ −40 matter (the rest add < N·e⁻⁴⁰ ≈ N·4e−18, below one eps). For those,
the online path rounds each exponent argument (≤ eps/2·|s − m| ≤ 20 eps, and the α exponents
telescope to another ≤ 20 eps), each exp and each rescale (≤ 2 eps per block), and both paths
sum up to N terms in different orders (≤ N eps, worst case). A relative weight error δ moves O by
≤ 2δ·max|v|; counting both paths gives 4·(N + 2·n_blocks + 50)·eps·max|v| — about 1e−13 for
the sizes drawn here, while any real mistake (an α not applied to O, a wrong max) is O(1).
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import (
    OnlineSoftmaxState,
    logsumexp,
    naive_softmax,
    online_softmax_attention,
    online_softmax_step,
    standard_softmax,
)

EPS = np.finfo(np.float64).eps
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def online_tolerance(n_keys: int, n_blocks: int) -> float:
    """Bound on |online − standard| per unit of max|v| (derivation in the module docstring)."""
    return 4 * (n_keys + 2 * n_blocks + 50) * EPS


@st.composite
def split_and_order(draw, n):
    """Uneven block sizes summing to n, and a random order to consume them in."""
    n_blocks = draw(st.integers(1, min(n, 9)))
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=n_blocks - 1, max_size=n_blocks - 1, unique=True))) if n_blocks > 1 else []
    sizes = list(np.diff([0, *cuts, n]))
    order = draw(st.permutations(range(len(sizes))))
    return [int(s) for s in sizes], list(order)


@st.composite
def score_problems(draw):
    """(scores (R, N), values (N, d), blocks, order): logits up to ±1e4, −inf masks, masked rows."""
    rows = draw(st.integers(1, 6))
    n = draw(st.integers(1, 64))
    d = draw(st.integers(1, 5))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e4]))
    offset = draw(st.sampled_from([0.0, 1e4, -1e4, 700.0]))
    mask_prob = draw(st.sampled_from([0.0, 0.0, 0.3, 0.9]))
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    scores = np.clip(offset + scale * rng.standard_normal((rows, n)), -1e4, 1e4)
    scores[rng.random((rows, n)) < mask_prob] = -np.inf
    if draw(st.booleans()):
        scores[rng.integers(rows)] = -np.inf  # a fully masked row
    values = rng.standard_normal((n, d)) * draw(st.sampled_from([1.0, 1e3]))
    blocks, order = draw(split_and_order(n))
    return scores, values, blocks, order


def standard_result(scores, values):
    return standard_softmax(scores) @ values, logsumexp(scores)


def assert_close_to_standard(O, L, scores, values, n_blocks):
    O_std, L_std = standard_result(scores, values)
    masked = np.isneginf(scores).all(axis=-1)
    assert np.array_equal(np.isneginf(L), masked), "L must be -inf exactly on the fully masked rows"
    assert (O[masked] == 0).all(), "fully masked rows must give O = 0"
    tol = online_tolerance(scores.shape[-1], n_blocks)
    err_O = np.abs(O - O_std).max() / np.abs(values).max()
    err_L = np.abs(L[~masked] - L_std[~masked]).max(initial=0) if (~masked).any() else 0.0
    tol_L = tol + 2 * EPS * np.abs(L_std[~masked]).max(initial=0)
    assert err_O <= tol, f"|O - O_std|/max|v| = {err_O:.3e} > {tol:.3e}"
    assert err_L <= tol_L, f"|L - L_std| = {err_L:.3e} > {tol_L:.3e}"


# --- naive vs standard -------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 50), top=st.floats(710, 1e4), seed=st.integers(0, 2**63 - 1))
def test_standard_stays_finite_where_naive_overflows(n, top, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-50, 0, size=(3, n)) + top
    x[:, rng.integers(n)] = top  # exp(top) overflows float64 for top > ~709.78
    naive = naive_softmax(x)
    assert not np.isfinite(naive).all(), "naive softmax should overflow here (that is its point)"
    p = standard_softmax(x)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=0, atol=4 * n * EPS)
    # shifting every logit by the same amount leaves softmax unchanged; shift to where naive is exact
    np.testing.assert_allclose(p, naive_softmax(x - top), rtol=8 * EPS * 50, atol=1e-300)


def test_float16_overflow_happens_early(rng):
    x = np.array([12.0, 0.0, -3.0]) + rng.uniform(0, 1, 3)  # exp(12) = 162754 > float16 max 65504
    assert np.isnan(naive_softmax(x, dtype=np.float16)).any()
    p = standard_softmax(x, dtype=np.float16)
    assert p.dtype == np.float16 and np.isfinite(p).all()
    np.testing.assert_allclose(p.astype(np.float64), standard_softmax(x), atol=2e-3)


@SETTINGS
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 30)), axis=st.sampled_from([0, 1, -1]), seed=st.integers(0, 2**63 - 1))
def test_standard_matches_the_definition_where_nothing_overflows(shape, axis, seed):
    x = np.random.default_rng(seed).uniform(-30, 30, size=shape)
    # independent check: the definition exp(x)/Σexp(x) in extended precision, summed with fsum
    e = np.exp(x.astype(np.longdouble))
    expected = e / np.sum(e, axis=axis, keepdims=True)
    np.testing.assert_allclose(standard_softmax(x, axis=axis), expected.astype(np.float64), rtol=64 * EPS, atol=0)
    np.testing.assert_allclose(naive_softmax(x, axis=axis), expected.astype(np.float64), rtol=64 * EPS, atol=0)
    lse = np.array([math.log(math.fsum(np.exp(row))) for row in np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])])
    np.testing.assert_allclose(logsumexp(x, axis=axis).ravel(), lse, rtol=64 * EPS, atol=64 * EPS)


def test_fully_masked_row_gives_zeros_and_minus_inf(rng):
    x = rng.standard_normal((3, 5))
    x[1] = -np.inf
    x[2, :3] = -np.inf
    p = standard_softmax(x)
    assert (p[1] == 0).all() and np.isfinite(p).all()
    assert (p[2, :3] == 0).all() and p[2, 3:].sum() == pytest.approx(1.0, abs=1e-15)
    L = logsumexp(x)
    assert L[1] == -np.inf and np.isfinite(L[[0, 2]]).all()


def test_dtypes_default_to_float64_and_never_truncate(rng):
    x = rng.standard_normal(7)
    assert standard_softmax(x.astype(np.float16)).dtype == np.float64
    assert standard_softmax(x.astype(np.float32)).dtype == np.float64
    assert standard_softmax(x.astype(np.longdouble)).dtype == np.longdouble
    assert standard_softmax([1, 3, 2, 5]).dtype == np.float64
    assert standard_softmax(x, dtype=np.float32).dtype == np.float32
    with pytest.raises(TypeError, match="complex128"):
        standard_softmax(x + 1j)
    with pytest.raises(TypeError, match="dtype=int64"):
        standard_softmax(x, dtype=np.int64)
    assert np.isnan(standard_softmax(np.array([1.0, np.nan]))).all()  # IEEE: a nan row, not an error
    with pytest.raises(ValueError, match="at least one entry"):
        standard_softmax(np.zeros((3, 0)))


# --- online softmax ------------------------------------------------------------------------------


@SETTINGS
@given(problem=score_problems())
def test_online_equals_standard_for_any_split_and_order(problem):
    scores, values, blocks, order = problem
    O, L = online_softmax_attention(scores, values, blocks=blocks, order=order)
    assert O.shape == (scores.shape[0], values.shape[1]) and L.shape == (scores.shape[0],)
    assert_close_to_standard(O, L, scores, values, len(blocks))


@SETTINGS
@given(problem=score_problems(), seed=st.integers(0, 2**63 - 1))
def test_merge_of_disjoint_key_sets_equals_standard(problem, seed):
    scores, values, _, _ = problem
    rng = np.random.default_rng(seed)
    n, rows, d = scores.shape[1], scores.shape[0], values.shape[1]
    part = rng.integers(0, 3, size=n)  # each key goes to one of three states, any of them may get none
    states = []
    for which in range(3):
        keys = np.flatnonzero(part == which)
        state = OnlineSoftmaxState(rows, d)
        for chunk in np.array_split(keys, max(1, len(keys) // 3)):
            if len(chunk):
                state.update(scores[:, chunk], values[chunk])
        states.append(state)
    a, b, c = states
    ab, ba = a.merge(b), b.merge(a)
    for name in ("m", "l", "acc"):  # commutative: bitwise (x + y == y + x in floating point)
        assert np.array_equal(getattr(ab, name), getattr(ba, name)), name
    left, right = ab.merge(c), a.merge(b.merge(c))  # associative: up to rounding
    assert np.array_equal(left.m, right.m)  # a max is exact
    for state in (left, right):
        O, L = state.finalize()
        assert_close_to_standard(O, L, scores, values, n)
    # merging never changes its inputs
    O_a, _ = a.finalize()
    a2 = OnlineSoftmaxState(rows, d)
    keys = np.flatnonzero(part == 0)
    for chunk in np.array_split(keys, max(1, len(keys) // 3)):
        if len(chunk):
            a2.update(scores[:, chunk], values[chunk])
    assert np.array_equal(a2.acc, a.acc) and np.array_equal(a2.l, a.l)


def test_merge_of_two_fully_masked_states_is_masked(rng):
    a, b = OnlineSoftmaxState(2, 3), OnlineSoftmaxState(2, 3)
    a.update(np.full((2, 4), -np.inf), rng.standard_normal((4, 3)))
    merged = a.merge(b)
    O, L = merged.finalize()
    assert (O == 0).all() and np.isneginf(L).all() and not np.isnan(merged.acc).any()


def test_step_on_fully_masked_block_keeps_state_and_makes_no_nan(rng):
    s = rng.standard_normal((3, 4)) * 5
    v = rng.standard_normal((4, 2))
    state = OnlineSoftmaxState(3, 2)
    state.update(np.full((3, 4), -np.inf), v)  # m_new = -inf: the guard keeps α = 0, p = 0
    assert np.isneginf(state.m).all() and (state.l == 0).all() and (state.acc == 0).all()
    state.update(s, v)
    before = (state.m.copy(), state.l.copy(), state.acc.copy())
    step = state.update(np.full((3, 4), -np.inf), v)
    assert (step.alpha == 1).all() and (step.p == 0).all()
    for x, y in zip(before, (state.m, state.l, state.acc)):
        assert np.array_equal(x, y)


def test_step_is_the_recurrence_of_3_6_4(rng):
    m_i = rng.standard_normal(4)
    l_i = rng.uniform(1, 3, 4)
    acc = rng.standard_normal((4, 3))
    s_ij = rng.standard_normal((4, 5)) * 3
    v_j = rng.standard_normal((5, 3))
    step = online_softmax_step(m_i, l_i, acc, s_ij, v_j)
    m_new = np.maximum(m_i, s_ij.max(axis=1))
    alpha = np.exp(m_i - m_new)
    p = np.exp(s_ij - m_new[:, None])
    np.testing.assert_allclose(step.l_i, alpha * l_i + p.sum(axis=1), rtol=1e-15)
    np.testing.assert_allclose(step.acc, alpha[:, None] * acc + p @ v_j, rtol=1e-14, atol=1e-15)
    assert (step.alpha <= 1).all() and np.array_equal(step.m_new, m_new)


def test_rescale_threshold_moves_the_max_only_past_it(rng):
    """rescale_threshold (the kernels' LAZY_RESCALE): rows whose block max beats m by more than the
    threshold take the new max (alpha < 1), the others keep m (alpha exactly 1, p up to e^threshold);
    the state then finalises to the same O and L as the textbook step's."""
    thr = 8 * math.log(2)
    m_i = np.array([0.0, 0.0, 0.0, -np.inf, 5.0])
    l_i = np.array([1.0, 2.0, 1.5, 0.0, 1.0])
    acc = rng.standard_normal((5, 3))
    acc[3] = 0.0
    s_ij = np.array([[1.0, 2.0], [5.0, -1.0], [9.0, 0.0], [-3.0, -4.0], [-np.inf, -np.inf]])
    v_j = rng.standard_normal((2, 3))
    lazy = online_softmax_step(m_i, l_i, acc, s_ij, v_j, rescale_threshold=thr)
    exact = online_softmax_step(m_i, l_i, acc, s_ij, v_j)
    np.testing.assert_array_equal(lazy.m_new, [0.0, 0.0, 9.0, -3.0, 5.0])  # 9 > 0 + 5.55; first keys set m
    assert (lazy.alpha[[0, 1, 4]] == 1).all() and lazy.alpha[2] < 1
    assert lazy.p.max() <= math.exp(thr) and lazy.p.max() > 1  # e^5 under a stale max
    from reference.softmax import _finalize

    for got, want in zip(_finalize(lazy.m_new, lazy.l_i, lazy.acc), _finalize(exact.m_new, exact.l_i, exact.acc)):
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)


def test_chapter_example_through_the_state():
    state = OnlineSoftmaxState(1, 1)
    first = state.update([[1.0, 3.0]], [[10.0], [20.0]])
    assert first.alpha[0] == 0 and first.m_new[0] == 3
    assert round(float(state.l[0]), 4) == 1.1353 and round(float(state.acc[0, 0]), 3) == 21.353
    second = state.update([[2.0, 5.0]], [[30.0], [40.0]])
    assert round(float(second.alpha[0]), 4) == 0.1353
    assert round(float(state.acc[0, 0]), 3) == 44.383
    O, L = state.finalize()
    assert round(float(state.l[0]), 4) == 1.2034 and round(float(O[0, 0]), 2) == 36.88
    assert L[0] == pytest.approx(5 + math.log(float(state.l[0])), rel=1e-15)


def test_one_dimensional_inputs_drop_axes(rng):
    O, L = online_softmax_attention([1, 3, 2, 5], [10, 20, 30, 40], blocks=[2, 2], order=[1, 0])
    assert np.ndim(O) == 0 and np.ndim(L) == 0 and round(float(O), 2) == 36.88
    s, v = rng.standard_normal((2, 4)), rng.standard_normal(4)
    O, L = online_softmax_attention(s, v, blocks=3)  # one int: blocks of 3 then 1
    assert O.shape == (2,) and L.shape == (2,)
    O_std, L_std = standard_result(s, v[:, None])
    np.testing.assert_allclose(O, O_std[:, 0], rtol=0, atol=1e-14 * np.abs(v).max())


def test_block_and_order_validation_names_what_was_given():
    x, v = np.zeros((1, 5)), np.zeros((5, 2))
    with pytest.raises(ValueError, match=r"blocks \(2, 2\) sum to 4.*5"):
        online_softmax_attention(x, v, blocks=[2, 2])
    with pytest.raises(ValueError, match=r"\[0, 0\] is not a permutation of range\(2\)"):
        online_softmax_attention(x, v, blocks=[2, 3], order=[0, 0])
    with pytest.raises(ValueError, match="'sideways' is not understood"):
        online_softmax_attention(x, v, blocks=[2, 3], order="sideways")
    with pytest.raises(ValueError, match="block size must be an int >= 1, got 0"):
        online_softmax_attention(x, v, blocks=[5, 0])
    with pytest.raises(TypeError, match="bool"):
        online_softmax_attention(x, v, blocks=True)
    with pytest.raises(ValueError, match="5 keys.*4 rows"):
        online_softmax_attention(x, np.zeros((4, 2)), blocks=5)
    o, lse = online_softmax_attention(np.array([[0, np.inf, 0, 0, 0]]), v, blocks=5)  # IEEE: a nan row
    assert np.isnan(o).all() and np.isnan(lse).all()



def test_callable_order(rng):
    s, v = rng.standard_normal((3, 7)), rng.standard_normal((7, 2))
    seen = []
    O, L = online_softmax_attention(s, v, blocks=[1, 4, 2], order=lambda n: seen.append(n) or [2, 0, 1])
    assert seen == [3]
    assert_close_to_standard(O, L, s, v, 3)


def test_state_refuses_silent_truncation_and_bad_shapes(rng):
    state = OnlineSoftmaxState(2, 3, dtype=np.float32)
    with pytest.raises(TypeError, match="float64.*truncate"):
        state.update(rng.standard_normal((2, 4)), rng.standard_normal((4, 3)).astype(np.float32))
    state.update(rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32))
    assert state.acc.dtype == np.float32
    with pytest.raises(ValueError, match=r"values_block has shape \(4, 2\); this state needs \(4, 3\)"):
        OnlineSoftmaxState(2, 3).update(rng.standard_normal((2, 4)), rng.standard_normal((4, 2)))
    with pytest.raises(ValueError, match="must match"):
        OnlineSoftmaxState(2, 3).merge(OnlineSoftmaxState(3, 3))
    with pytest.raises(ValueError, match="rows must be an int >= 1, got 0"):
        OnlineSoftmaxState(0, 3)


def test_fresh_state_finalizes_to_masked(rng):
    O, L = OnlineSoftmaxState(int(rng.integers(1, 9)), 4).finalize()
    assert (O == 0).all() and np.isneginf(L).all()
