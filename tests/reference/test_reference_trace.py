"""The trace of the online softmax: each recorded step is the 3.6.4 recurrence, and the end is the standard."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import format_trace, online_softmax_attention, online_softmax_trace

SETTINGS = settings(max_examples=80, deadline=None)


def test_chapter_trace_fields():
    t = online_softmax_trace([1, 3, 2, 5], [10, 20, 30, 40], blocks=[2, 2])
    s1, s2 = t.steps
    assert (s1.block, s1.keys, s1.x, s1.v) == (0, (0, 2), (1.0, 3.0), (10.0, 20.0))
    assert s1.m_old == -math.inf and s1.m_new == 3 and s1.alpha == 0
    assert s2.m_old == 3 and s2.m_tilde == 5 and s2.alpha == pytest.approx(math.exp(-2), rel=1e-15)
    assert t.standard_m == 5 and t.m == 5
    assert t.standard_p == pytest.approx([math.exp(-4), math.exp(-2), math.exp(-3), 1.0], rel=1e-15)
    assert t.O == pytest.approx(t.O_acc / t.l, rel=1e-15)
    assert t.L == pytest.approx(5 + math.log(t.l), rel=1e-15)
    text = format_trace(t)
    for number in ("1.1353", "21.3534", "0.1353", "1.2034", "44.3835", "36.8806", "-inf"):
        assert number in text


def test_to_dict_is_strict_json():
    t = online_softmax_trace([-np.inf, 2.0, 1.0], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], blocks=[1, 2])
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["steps"][0]["m_tilde"] == "-inf" and d["steps"][0]["l"] == 0
    assert len(d["O"]) == 2 and d["d"] == 2


@st.composite
def rows(draw):
    n = draw(st.integers(1, 12))
    d = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    x = rng.standard_normal(n) * draw(st.sampled_from([1.0, 100.0, 1e4]))
    x[rng.random(n) < draw(st.sampled_from([0.0, 0.5]))] = -np.inf
    v = rng.standard_normal((n, d)) if d > 1 else rng.standard_normal(n)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    sizes = [int(b - a) for a, b in zip([0, *cuts], [*cuts, n])]  # uneven blocks summing to n
    order = draw(st.permutations(range(len(sizes))))
    return x, v, sizes, order


@SETTINGS
@given(rows())
def test_every_step_is_the_recurrence(problem):
    x, v, blocks, order = problem
    t = online_softmax_trace(x, v, blocks=blocks, order=order)
    assert [s.block for s in t.steps] == list(order)
    l_old, O_old = 0.0, np.zeros(np.shape(v)[1:])
    for s in t.steps:
        v_blk = np.asarray(s.v)
        assert s.m_new == max(s.m_old, s.m_tilde) and s.m_tilde == max(s.x)
        if s.m_new != -math.inf:
            assert s.alpha == pytest.approx(math.exp(s.m_old - s.m_new), rel=4e-16, abs=0)
            assert s.p == pytest.approx([math.exp(a - s.m_new) for a in s.x], rel=1e-15, abs=0)
        np.testing.assert_allclose(s.l, s.alpha * l_old + sum(s.p), rtol=1e-14, atol=0)
        np.testing.assert_allclose(s.O, s.alpha * O_old + np.asarray(s.p) @ v_blk, rtol=1e-12, atol=1e-300 + 1e-14 * np.abs(v).max())
        l_old, O_old = s.l, np.asarray(s.O)
    O, L = online_softmax_attention(x, v, blocks=blocks, order=order)
    np.testing.assert_array_equal(np.asarray(t.O), O)  # the trace drives the same state: same bits
    assert t.L == L or (math.isinf(t.L) and math.isinf(L))
    np.testing.assert_allclose(t.O, t.standard_O, rtol=0, atol=1e-12 * np.abs(v).max())
    assert (t.L == t.standard_L) or abs(t.L - t.standard_L) <= 1e-12 * max(1.0, abs(t.standard_L))


def test_trace_validation():
    with pytest.raises(ValueError, match=r"need x of shape \(n,\)"):
        online_softmax_trace(np.zeros((2, 2)), np.zeros(2), blocks=1)
    with pytest.raises(ValueError, match="sum to 3"):
        online_softmax_trace([1, 2, 3, 4], [1, 2, 3, 4], blocks=[1, 2])
    with pytest.raises(ValueError, match="not a permutation"):
        online_softmax_trace([1, 2], [1, 2], blocks=[1, 1], order=[1, 1])
