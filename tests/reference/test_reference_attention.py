"""Attention forward references: the FA2 tile loop against the materialising version.

Tolerance (``attention_tolerance``), float64. Beyond the online-vs-standard bound of
test_reference_softmax.py (4·(Nk + 2·n_blocks + 50)·eps per unit of max|v|), the two paths may
compute the same score S_ij = scale·Σ_k q_ik k_jk with different BLAS kernels (a tile vs the whole
matrix): each S_ij may differ by δS ≤ 2·(d + 2)·eps·scale·Σ_k|q_ik||k_jk| ≤ 2·(d + 2)·eps·scale·‖q_i‖‖k_j‖. Softmax is shift
invariant, so a logit error δS changes each weight by a relative ≤ 2·δS and O by ≤ 2·δS·max|v|
per path. With logits up to 1e4 that term dominates (≈ 1e−10); for unit logits it is ≈ 1e−14.
"""

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import (
    causal_mask,
    first_q_block_to_visit,
    flash_attention,
    kv_blocks_to_visit,
    logsumexp,
    online_softmax_attention,
    standard_attention,
    standard_softmax,
    tile_needs_mask,
)

EPS = np.finfo(np.float64).eps
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def score_error(q, k, scale):
    """δS: how far two correct float64 computations of one score may be apart (module docstring)."""
    d = q.shape[-1]
    # Σ_k |q_ik||k_jk| ≤ ‖q_i‖·‖k_j‖ (Cauchy-Schwarz), bounded over all rows
    return 2 * (d + 2) * EPS * scale * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()


def attention_tolerance(q, k, v, scale, n_k, n_blocks):
    """(tol_O, tol_L): bounds on |flash − standard| for O (absolute) and for finite L."""
    dS = score_error(q, k, scale)
    online = 4 * (n_k + 2 * n_blocks + 50) * EPS
    vmax = np.abs(v).max()
    return vmax * (online + 4 * dS), online + 2 * dS


def assert_attention_close(O, L, O_ref, L_ref, tol_O, tol_L):
    masked = np.isneginf(L_ref)
    assert np.array_equal(np.isneginf(L), masked), "L must be -inf exactly on the fully masked rows"
    assert (O[masked] == 0).all(), "a fully masked row must give O = 0"
    err_O = np.abs(O - O_ref).max()
    assert err_O <= tol_O, f"max |O - O_ref| = {err_O:.3e} > tolerance {tol_O:.3e}"
    if (~masked).any():
        err_L = np.abs(L[~masked] - L_ref[~masked]).max()
        tol = tol_L + 2 * EPS * np.abs(L_ref[~masked]).max()
        assert err_L <= tol, f"max |L - L_ref| = {err_L:.3e} > tolerance {tol:.3e}"


@st.composite
def attention_problems(draw, max_n=40):
    """Random q, k, v: batch/head layouts with GQA and broadcasting, Nq ≠ Nk, logits up to ~1e4."""
    layout = draw(st.sampled_from(["2d", "bhnd", "gqa", "broadcast"]))
    n_q, n_k = draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    d = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 24]))
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    if layout == "2d":
        q_lead, kv_lead = (), ()
    elif layout == "bhnd":
        q_lead = kv_lead = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    elif layout == "gqa":
        h_kv, g = draw(st.integers(2, 3)), draw(st.integers(2, 3))
        q_lead, kv_lead = (1, h_kv * g), (1, h_kv)
    else:
        q_lead, kv_lead = (2, 1, 3), (4, 1)  # broadcast both ways: lead (2, 4, 3)
    logit = draw(st.sampled_from([1e-2, 1.0, 10.0, 1e3, 1e4]))
    sigma = math.sqrt(logit)  # q·k/sqrt(d) with unit-variance-ish entries of size sigma: logits ~ logit
    q = rng.standard_normal(q_lead + (n_q, d)) * sigma
    k = rng.standard_normal(kv_lead + (n_k, d)) * sigma
    v = rng.standard_normal(kv_lead + (n_k, d))
    softmax_scale = draw(st.sampled_from([None, None, 0.3, 2.0]))
    return q, k, v, softmax_scale


@SETTINGS
@given(
    problem=attention_problems(),
    block_q=st.integers(1, 48),
    block_k=st.integers(1, 48),
    causal=st.booleans(),
    order_seed=st.integers(0, 2**63 - 1),
    order_kind=st.sampled_from(["natural", "reverse", "random"]),
    rescale_threshold=st.sampled_from([0.0, 0.0, 8 * math.log(2), 30.0]),
)
def test_flash_equals_standard(problem, block_q, block_k, causal, order_seed, order_kind, rescale_threshold):
    """Any block sizes, any K/V block order, any rescale threshold (the kernels' LAZY_RESCALE: a stale
    running max is still the same softmax): the same O and L as the standard attention."""
    q, k, v, softmax_scale = problem
    n_k = k.shape[-2]
    kv_order = (lambda n: np.random.default_rng(order_seed).permutation(n)) if order_kind == "random" else order_kind
    O_ref, L_ref = standard_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    O, L = flash_attention(
        q, k, v, block_q=block_q, block_k=block_k, causal=causal, softmax_scale=softmax_scale, kv_order=kv_order,
        rescale_threshold=rescale_threshold,
    )
    assert O.shape == O_ref.shape and L.shape == L_ref.shape and O.dtype == np.float64
    scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
    assert_attention_close(O, L, O_ref, L_ref, *attention_tolerance(q, k, v, scale, n_k, -(-n_k // block_k)))


def naive_per_row(q, k, v, causal, scale):
    """An independent 2-D reference: one query at a time, in extended precision, with fsum."""
    n_q, n_k = q.shape[0], k.shape[0]
    O, L = np.zeros(q.shape), np.full(n_q, -np.inf)
    for i in range(n_q):
        keys = [j for j in range(n_k) if not causal or j <= i + n_k - n_q]
        if not keys:
            continue
        s = [float(np.dot(q[i].astype(np.longdouble), k[j].astype(np.longdouble)) * scale) for j in keys]
        m = max(s)
        w = [math.exp(x - m) for x in s]
        l = math.fsum(w)
        L[i] = m + math.log(l)
        O[i] = [math.fsum(wj * v[j, c] for wj, j in zip(w, keys)) / l for c in range(q.shape[1])]
    return O, L


@pytest.mark.parametrize("n_q,n_k", [(5, 5), (3, 8), (8, 3), (1, 6), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_standard_matches_an_independent_per_row_loop(rng, n_q, n_k, causal):
    d = int(rng.integers(1, 9))
    q, k, v = (rng.standard_normal((n, d)) * 2 for n in (n_q, n_k, n_k))
    O_ref, L_ref = naive_per_row(q, k, v, causal, 1 / math.sqrt(d))
    O, L = standard_attention(q, k, v, causal=causal)
    assert_attention_close(O, L, O_ref, L_ref, 1e-13 * np.abs(v).max(), 1e-13)
    # bottom-right alignment: with Nq > Nk the first Nq - Nk queries see nothing
    if causal:
        assert np.isneginf(L[: max(0, n_q - n_k)]).all() and np.isfinite(L[max(0, n_q - n_k) :]).all()


def test_gqa_equals_repeating_heads(rng):
    b, h_kv, g, n_q, n_k, d = 2, 3, 2, 7, 9, 4
    q = rng.standard_normal((b, h_kv * g, n_q, d))
    k, v = rng.standard_normal((2, b, h_kv, n_k, d))
    for causal in (False, True):
        O, L = standard_attention(q, k, v, causal=causal)
        O_f, L_f = flash_attention(q, k, v, block_q=3, block_k=4, causal=causal)
        for bi in range(b):
            for h in range(h_kv * g):  # query head h uses K/V head h // g
                O_h, L_h = standard_attention(q[bi, h], k[bi, h // g], v[bi, h // g], causal=causal)
                np.testing.assert_allclose(O[bi, h], O_h, rtol=0, atol=1e-14)
                np.testing.assert_allclose(O_f[bi, h], O_h, rtol=0, atol=1e-14)
                np.testing.assert_allclose(L_f[bi, h], L_h, rtol=1e-14)


def test_leading_dims_broadcast(rng):
    q = rng.standard_normal((2, 1, 5, 3))
    k, v = rng.standard_normal((2, 4, 6, 3))  # (4, 6, 3): broadcast to (2, 4, ...)
    O, L = standard_attention(q, k, v)
    assert O.shape == (2, 4, 5, 3) and L.shape == (2, 4, 5)
    for bi in range(2):
        for h in range(4):
            np.testing.assert_allclose(O[bi, h], standard_attention(q[bi, 0], k[h], v[h])[0], atol=1e-14, rtol=0)


@SETTINGS
@given(
    n_q=st.integers(1, 60),
    n_k=st.integers(1, 60),
    block_q=st.integers(1, 20),
    block_k=st.integers(1, 20),
    causal=st.booleans(),
)
def test_tile_plan_matches_brute_force(n_q, n_k, block_q, block_k, causal):
    n_kv_blocks = -(-n_k // block_k)
    for q_start in range(0, n_q, block_q):
        q_stop = min(q_start + block_q, n_q)
        needed = []
        for j in range(n_kv_blocks):
            k_start, k_stop = j * block_k, min((j + 1) * block_k, n_k)
            hidden = causal_mask(q_start, q_stop, k_start, k_stop, n_q, n_k) if causal else np.zeros((1, 1), bool)
            needed.append(not hidden.all())
            if needed[-1]:
                assert tile_needs_mask(q_start, k_stop, n_q, n_k, causal) == bool(hidden.any())
        n_visit = kv_blocks_to_visit(q_start, q_stop, n_q, n_k, block_k, causal)
        assert needed == [j < n_visit for j in range(n_kv_blocks)], "visited blocks must be exactly the needed ones"
    for k_start in range(0, n_k, block_k):
        k_stop = min(k_start + block_k, n_k)
        needed = [
            not (causal and causal_mask(qs, min(qs + block_q, n_q), k_start, k_stop, n_q, n_k).all())
            for qs in range(0, n_q, block_q)
        ]
        first = first_q_block_to_visit(k_start, n_q, n_k, block_q, causal)
        assert needed == [i >= first for i in range(len(needed))]


def test_causal_alignment_is_bottom_right(rng):
    # query i sees keys 0 .. i + Nk - Nq: the same as non-causal attention over that prefix
    n_q, n_k, d = 4, 9, 3
    q, k, v = rng.standard_normal((n_q, d)), rng.standard_normal((n_k, d)), rng.standard_normal((n_k, d))
    O, L = flash_attention(q, k, v, block_q=3, block_k=2, causal=True)
    for i in range(n_q):
        last = i + n_k - n_q
        O_i, L_i = standard_attention(q[i : i + 1], k[: last + 1], v[: last + 1])
        np.testing.assert_allclose(O[i], O_i[0], atol=1e-14, rtol=0)
        np.testing.assert_allclose(L[i], L_i[0], rtol=1e-14)


def test_q_rows_computes_that_part_of_the_grid(rng):
    q = rng.standard_normal((2, 13, 4))
    k, v = rng.standard_normal((2, 2, 10, 4))
    for causal in (False, True):
        O, L = standard_attention(q, k, v, causal=causal)
        O_part, L_part = flash_attention(q, k, v, block_q=4, block_k=3, causal=causal, q_rows=slice(5, 12))
        np.testing.assert_allclose(O_part, O[:, 5:12], atol=1e-14, rtol=0)
        assert np.array_equal(np.isneginf(L_part), np.isneginf(L[:, 5:12]))


def test_flash_never_builds_an_nq_by_nk_array(rng):
    # Nq = Nk = 200 000: one float64 S would be 320 GB. Compute a slice of the grid (two Q blocks
    # of the non-causal problem, two near the end of the causal one) and check the peak memory
    # stays at a few tiles (block_q·block_k·8 bytes = 8 MiB each), far below even one row-slice of S.
    n, d, block_q, block_k = 200_000, 8, 256, 4096
    q, k, v = rng.standard_normal((3, n, d))
    tile_bytes = block_q * block_k * 8
    for causal, rows in ((False, slice(0, 2 * block_q)), (True, slice(n - 2 * block_q, n))):
        tracemalloc.start()
        try:
            O, L = flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal, q_rows=rows)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        print(f"causal={causal}: peak {peak / 2**20:.1f} MiB with {tile_bytes / 2**20:.0f} MiB tiles")
        s_rows_bytes = (rows.stop - rows.start) * n * 8  # what S would take for just these rows
        assert peak < 8 * tile_bytes + 4 * q.nbytes, f"peak {peak / 2**20:.0f} MiB for {tile_bytes / 2**20:.0f} MiB tiles"
        assert peak < s_rows_bytes / 4
        # check a few of those rows against the materialising version on just those rows; with the
        # causal mask the rows r of an N×N problem see keys 0..r, i.e. bottom-right aligned
        # attention of q[r0:r1] over k[:r1]
        r0 = rows.start + 100
        keys = slice(0, r0 + 8) if causal else slice(None)
        O_ref, L_ref = standard_attention(q[r0 : r0 + 8], k[keys], v[keys], causal=causal)
        np.testing.assert_allclose(O[100:108], O_ref, rtol=0, atol=1e-11)
        np.testing.assert_allclose(L[100:108], L_ref, rtol=1e-13)


def test_softmax_scale_and_lse_conventions(rng):
    q, k, v = rng.standard_normal((3, 2, 6, 5))
    O_default, L_default = standard_attention(q, k, v)
    O_scaled, L_scaled = standard_attention(q / math.sqrt(5), k, v, softmax_scale=1.0)
    np.testing.assert_allclose(O_default, O_scaled, atol=1e-14, rtol=0)
    S = np.einsum("hid,hjd->hij", q, k) / math.sqrt(5)
    lse = np.log(np.exp(S).sum(-1))  # natural log, unmasked, small logits: the definition is safe
    np.testing.assert_allclose(L_default, lse, rtol=1e-14)


def test_dtypes(rng):
    q, k, v = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3))
    O, L = flash_attention(q, k, v, block_q=2, block_k=3)
    assert O.dtype == L.dtype == np.float64
    O32, L32 = flash_attention(q, k, v, block_q=2, block_k=3, dtype=np.float32)
    assert O32.dtype == np.float32
    np.testing.assert_allclose(O32, O, atol=1e-5)
    O_ld, _ = standard_attention(q.astype(np.longdouble), k, v)
    assert O_ld.dtype == np.longdouble
    O_int, _ = standard_attention(np.ones((2, 2), dtype=np.int32), np.eye(2), np.eye(2))
    assert O_int.dtype == np.float64


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(softmax_scale=0.0), ValueError, "finite and > 0.*0.0"),
        (dict(softmax_scale=-1), ValueError, "finite and > 0.*-1"),
        (dict(softmax_scale=float("nan")), ValueError, "finite and > 0"),
        (dict(softmax_scale=float("inf")), ValueError, "finite and > 0"),
        (dict(softmax_scale="0.1"), TypeError, "real number or None.*str"),
        (dict(softmax_scale=True), TypeError, "real number"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(block_q=0), ValueError, "block_q must be an int >= 1, got 0"),
        (dict(block_k=2.5), TypeError, "block_k must be an int >= 1, got 2.5"),
        (dict(kv_order=[0, 0, 1]), ValueError, r"kv_order=\[0, 0, 1\] is not a permutation of range\(3\)"),
        (dict(kv_order="random"), ValueError, "'random' is not understood"),
        (dict(q_rows=slice(0, 4, 2)), TypeError, "q_rows must be a slice with step 1"),
        (dict(dtype=np.int16), TypeError, "dtype=int16 is not a real floating dtype"),
        (dict(rescale_threshold=-1.0), ValueError, "rescale_threshold must be a finite number >= 0.*-1.0"),
        (dict(rescale_threshold=float("inf")), ValueError, "rescale_threshold must be a finite number >= 0"),
        (dict(rescale_threshold="8"), TypeError, "rescale_threshold must be a real number.*'8'"),
        (dict(rescale_threshold=float("nan")), ValueError, "rescale_threshold must be a finite number >= 0"),
        (dict(rescale_threshold=np.True_), TypeError, "rescale_threshold must be a real number.*bool"),
    ],
)
def test_flash_validation_messages(kwargs, error, match):
    q, k, v = np.ones((4, 2)), np.ones((5, 2)), np.ones((5, 2))
    args = dict(block_q=2, block_k=2) | kwargs
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **args)


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((4, 3), (5, 2), (5, 2)), "share the head dim d.*q \\(4, 3\\), k \\(5, 2\\)"),
        (((4, 2), (5, 2), (5, 3)), "share the head dim d"),
        (((4, 2), (5, 2), (6, 2)), "k and v must have the same shape"),
        (((4, 0), (5, 0), (5, 0)), "d = q.shape\\[-1\\] must be >= 1"),
        (((4,), (5, 2), (5, 2)), "q must have shape \\(..., N, d\\)"),
        (((0, 2), (5, 2), (5, 2)), "Nq >= 1 and Nk >= 1"),
        (((1, 6, 4, 2), (1, 4, 5, 2), (1, 4, 5, 2)), "4 must divide|K/V heads must divide"),
        (((2, 3, 4, 2), (3, 3, 5, 2), (3, 3, 5, 2)), "do not broadcast"),
    ],
)
def test_shape_validation_messages(shapes, match):
    q, k, v = (np.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        standard_attention(q, k, v)


def test_nan_propagates_and_complex_inputs_are_refused():
    """A nan in q's row 1 makes that row's O and L nan (IEEE, the kernels' policy); row 0 stays what it was.
    The online softmax agrees row by row."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    clean_o, clean_l = standard_attention(q, k, v)
    q[1, 2] = np.nan
    o, l = standard_attention(q, k, v)
    assert np.isnan(o[1]).all() and np.isnan(l[1])
    np.testing.assert_array_equal(o[0], clean_o[0])
    np.testing.assert_array_equal(l[0], clean_l[0])
    s = (q @ k.T) / 2.0
    o2, l2 = online_softmax_attention(s, v, blocks=[2, 1])
    assert np.isnan(o2[1]).all() and np.isnan(l2[1]) and np.allclose(o2[0], clean_o[0]) and np.isclose(l2[0], clean_l[0])
    s[0, 1] = np.inf  # +inf has no softmax either
    assert np.isnan(standard_softmax(s)[0]).all() and np.isnan(logsumexp(s)[0])
    with pytest.raises(TypeError, match="v has dtype complex128"):
        standard_attention(np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)) * 1j)
