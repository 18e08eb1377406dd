"""flash-attn's variants in the reference: sliding window, softcap and ALiBi, forward, backward and decode.

The rule under test (``reference.attention``'s module docstring), with shift = Nk − Nq: query i sees key
j iff 0 ≤ j < Nk, (left = −1 or j ≥ i + shift − left) and (right = −1 or j ≤ i + shift + right), causal
being right = 0; the logits are s = scale·q·k, then softcap·tanh(s/softcap), then − slope·|i + shift − j|.

Tolerances, float64. Tiled vs materialised: as in test_reference_attention.py (the online bound
4·(Nk + 2·n_blocks + 50)·eps and a score error δS from the two BLAS paths), where δS also covers the
variants' elementwise steps: tanh is 1-Lipschitz and each path rounds tanh and the bias subtraction once
more, so δS = δS(q·k) + 8·eps·(max|logit| + softcap). Brute force: an fsum loop in extended precision
against BLAS, unit-size logits and biases of at most ~10: 1e−12. Finite differences: as in
test_reference_backward.py (h = 1e−5, rtol 1e−6, atol 1e−7). Hidden keys: their scores become −inf, so
their weights are exactly 0: what they hold moves no result beyond a few eps (``assert_unchanged``).
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import (
    attention_backward,
    causal_mask,
    decode_attention,
    decode_partials,
    first_q_block_to_visit,
    flash_attention,
    flash_attention_backward,
    kv_block_range,
    kv_blocks_to_visit,
    q_block_range,
    standard_attention,
    tile_needs_mask,
    visible_mask,
)

from test_reference_backward import numeric_gradients  # noqa: E402  (the finite differences, written once)

EPS = np.finfo(np.float64).eps
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sees(i, j, n_q, n_k, causal, window):
    """The rule, one (query, key) pair at a time: written out apart from the code under test."""
    left, right = window
    if causal:
        right = 0
    left = -1 if left >= n_k else left  # flash-attn's API: a side >= Nk is unbounded
    right = -1 if right >= n_k else right
    shift = n_k - n_q
    return 0 <= j < n_k and (left == -1 or j >= i + shift - left) and (right == -1 or j <= i + shift + right)


def variant_kwargs(draw, n_q, n_k, lead):
    """Random causal / window / softcap / ALiBi arguments for q's leading shape ``lead``."""
    causal = draw(st.booleans())
    left = draw(st.one_of(st.just(-1), st.integers(0, n_k + 1)))
    right = draw(st.sampled_from([-1, 0])) if causal else draw(st.one_of(st.just(-1), st.integers(0, n_q + 1)))
    kwargs = dict(causal=causal, window_size=(left, right), softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 5.0, 50.0])))
    shapes = [None] + ([lead[-1:]] if len(lead) >= 1 else []) + ([lead[-2:]] if len(lead) >= 2 else [])
    shape = draw(st.sampled_from(shapes))
    if shape is not None:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        kind = draw(st.sampled_from(["geometric", "signed"]))
        if kind == "geometric":  # 2^(-8 (h + 1) / H), the ALiBi paper's slopes
            slopes = 2.0 ** (-8 * (np.arange(shape[-1]) + 1) / shape[-1]) * np.ones(shape)
        else:
            slopes = rng.uniform(-1, 1, shape)
        kwargs["alibi_slopes"] = slopes
    return kwargs


@st.composite
def variant_problems(draw, max_n=24):
    """q, k, v in the layouts of test_reference_attention (GQA, broadcasting), plus random variants."""
    layout = draw(st.sampled_from(["2d", "hnd", "bhnd", "gqa", "broadcast"]))
    n_q, n_k = draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    d = draw(st.sampled_from([1, 2, 3, 8]))
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    q_lead, kv_lead = {
        "2d": ((), ()), "hnd": ((3,), (3,)), "bhnd": ((2, 2), (2, 2)), "gqa": ((1, 4), (1, 2)),
        "broadcast": ((2, 1, 3), (4, 1)),  # lead (2, 4, 3): the slopes follow q's (B, H) = (1, 3)
    }[layout]
    sigma = math.sqrt(draw(st.sampled_from([1e-2, 1.0, 10.0, 1e3])))
    q = rng.standard_normal(q_lead + (n_q, d)) * sigma
    k = rng.standard_normal(kv_lead + (n_k, d)) * sigma
    v = rng.standard_normal(kv_lead + (n_k, d))
    kwargs = variant_kwargs(draw, n_q, n_k, q_lead)
    kwargs["softmax_scale"] = draw(st.sampled_from([None, 0.3]))
    return q, k, v, kwargs


def logit_error(q, k, kwargs, S_final):
    """δS of the module docstring: the two paths' distance on one final logit."""
    scale = kwargs.get("softmax_scale") or 1 / math.sqrt(q.shape[-1])
    qk = 2 * (q.shape[-1] + 2) * EPS * scale * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
    finite = S_final[np.isfinite(S_final)]
    return qk + 8 * EPS * (np.abs(finite).max(initial=0) + kwargs.get("softcap", 0.0))


def final_logits(q, k, kwargs):
    """The materialised final logits, for the tolerances (from the reference's own tile code)."""
    from reference.attention import _prepare

    pr = _prepare(q, k, k, dtype=None, **(dict(causal=False, softmax_scale=None) | kwargs))
    return pr.logits(0, pr.n_q, 0, pr.n_k, mask=True)[0]


def assert_close(O, L, O_ref, L_ref, tol_O, tol_L, what=""):
    masked = np.isneginf(L_ref)
    assert np.array_equal(np.isneginf(L), masked), f"{what}: L must be -inf exactly on the rows that see no key"
    assert (O[masked] == 0).all(), f"{what}: a row that sees no key must give O = 0"
    err_O = np.abs(O - O_ref).max(initial=0)
    assert err_O <= tol_O, f"{what}: max |O - O_ref| = {err_O:.3e} > {tol_O:.3e}"
    if (~masked).any():
        err_L = np.abs(L[~masked] - L_ref[~masked]).max()
        tol = tol_L + 2 * EPS * np.abs(L_ref[~masked]).max()
        assert err_L <= tol, f"{what}: max |L - L_ref| = {err_L:.3e} > {tol:.3e}"


# --- forward: tile loop against the materialised version, in any K/V block order -------------------


@SETTINGS
@given(problem=variant_problems(), block_q=st.integers(1, 30), block_k=st.integers(1, 30),
       order_seed=st.integers(0, 2**32 - 1))
def test_flash_equals_standard_under_every_variant(problem, block_q, block_k, order_seed):
    """Windows, softcaps, ALiBi slopes, causal, in any combination: the tile loop (which skips the K/V blocks
    outside a Q block's window and masks only edge tiles) gives standard attention, whatever the order of the
    K/V blocks: natural, reversed or shuffled, the results agree to the online bound."""
    q, k, v, kwargs = problem
    n_k = k.shape[-2]
    n_blocks = -(-n_k // block_k)
    O_ref, L_ref = standard_attention(q, k, v, **kwargs)
    dS = logit_error(q, k, kwargs, final_logits(q, k, kwargs))
    online = 4 * (n_k + 2 * n_blocks + 50) * EPS
    tol_O, tol_L = np.abs(v).max() * (online + 4 * dS), online + 2 * dS
    results = {}
    for order in ("natural", "reverse", lambda n: np.random.default_rng(order_seed).permutation(n)):
        name = order if isinstance(order, str) else "shuffled"
        results[name] = flash_attention(q, k, v, block_q=block_q, block_k=block_k, kv_order=order, **kwargs)
        assert_close(*results[name], O_ref, L_ref, tol_O, tol_L, f"flash ({name} order) vs standard")
    for name in ("reverse", "shuffled"):  # orders against each other: only the online rounding differs
        assert_close(*results[name], *results["natural"], np.abs(v).max() * 2 * online, 2 * online,
                     f"{name} vs natural order")


# --- forward: a per-element loop --------------------------------------------------------------------


def brute_force(q, k, v, scale, causal, window, softcap, slopes):
    """O and L of (B, H, Nq, d) q and (B, H, Nk, d) k, v, one logit at a time in extended precision.

    ``slopes``: (B, H) or None. Uses only the rule of the module docstring, written out.
    """
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    shift = n_k - n_q
    O, L = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    for b, h, i in np.ndindex(B, H, n_q):
        keys = [j for j in range(n_k) if sees(i, j, n_q, n_k, causal, window)]
        if not keys:
            continue
        s = []
        for j in keys:
            x = float(np.dot(q[b, h, i].astype(np.longdouble), k[b, h, j].astype(np.longdouble))) * scale
            if softcap > 0:
                x = softcap * math.tanh(x / softcap)
            if slopes is not None:
                x = x - slopes[b, h] * abs(i + shift - j)
            s.append(x)
        m = max(s)
        w = [math.exp(x - m) for x in s]
        l = math.fsum(w)
        L[b, h, i] = m + math.log(l)
        O[b, h, i] = [math.fsum(wj * v[b, h, j, c] for wj, j in zip(w, keys)) / l for c in range(d)]
    return O, L


BRUTE_CASES = [  # (n_q, n_k, causal, window_size, softcap, alibi)
    (6, 6, False, (2, 1), 0.0, None),
    (4, 9, False, (1, 2), 0.0, None),  # Nq < Nk: shifted window
    (9, 4, False, (0, 1), 0.0, None),  # Nq > Nk: early rows see nothing
    (5, 8, True, (2, -1), 0.0, None),  # causal with a left bound (flash-attn's local causal)
    (7, 7, True, (3, 0), 0.0, None),
    (6, 6, False, (-1, 0), 0.0, None),  # a window that is causal
    (6, 6, False, (0, -1), 0.0, None),  # only keys at or after the diagonal
    (5, 7, False, (-1, -1), 0.7, None),  # softcap below the logits' size: it bites
    (5, 7, False, (-1, -1), 0.0, "BH"),
    (7, 5, True, (-1, -1), 0.0, "H"),  # causal ALiBi: the exact bias, not flash-attn's slope·j
    (6, 9, False, (2, 3), 1.5, "BH"),  # everything at once
    (8, 5, True, (1, 0), 2.0, "BH"),
    (3, 3, False, (10, 10), 0.0, None),  # bounds wider than the problem: plain attention
]


@pytest.mark.parametrize("n_q,n_k,causal,window,softcap,alibi", BRUTE_CASES)
def test_standard_matches_a_per_element_loop(rng, n_q, n_k, causal, window, softcap, alibi):
    B, H, d = 2, 2, 3
    q, k, v = (rng.standard_normal((B, H, n, d)) * 1.5 for n in (n_q, n_k, n_k))
    slopes = None if alibi is None else rng.uniform(0.1, 1.0, (B, H) if alibi == "BH" else (H,))
    slopes_bh = None if slopes is None else np.broadcast_to(slopes, (B, H))
    scale = 1 / math.sqrt(d)
    O_ref, L_ref = brute_force(q, k, v, scale, causal, window, softcap, slopes_bh)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    O, L = standard_attention(q, k, v, **kwargs)
    assert_close(O, L, O_ref, L_ref, 1e-12, 1e-12, "standard vs per-element loop")
    O_f, L_f = flash_attention(q, k, v, block_q=2, block_k=3, **kwargs)
    assert_close(O_f, L_f, O_ref, L_ref, 1e-12, 1e-12, "flash vs per-element loop")
    if window == (10, 10):
        O_plain, _ = standard_attention(q, k, v)
        np.testing.assert_array_equal(O, O_plain)


def test_alibi_lse_differs_from_flash_attn_causal_by_the_row_constant(rng):
    """flash-attn's causal kernels add slope·j; the exact bias − slope·(i + shift − j) differs by a constant per
    row, slope·(i + shift): O is the same and L moves by exactly that (the docstring's note)."""
    n_q, n_k, d, H = 4, 7, 3, 2
    q, k, v = rng.standard_normal((H, n_q, d)), rng.standard_normal((H, n_k, d)), rng.standard_normal((H, n_k, d))
    slopes = np.array([0.5, 0.25])
    O, L = standard_attention(q, k, v, causal=True, alibi_slopes=slopes)
    S = np.einsum("hid,hjd->hij", q, k) / math.sqrt(d) + slopes[:, None, None] * np.arange(n_k)  # flash-attn's bias
    S = np.where(causal_mask(0, n_q, 0, n_k, n_q, n_k), -np.inf, S)
    m = S.max(-1, keepdims=True)
    P = np.exp(S - m)
    np.testing.assert_allclose(O, (P @ v) / P.sum(-1, keepdims=True), atol=1e-14, rtol=0)
    L_flash_attn = (m[..., 0] + np.log(P.sum(-1)))
    shift = n_k - n_q
    np.testing.assert_allclose(L_flash_attn - L, slopes[:, None] * (np.arange(n_q) + shift), atol=1e-13, rtol=0)


# --- keys no query sees ------------------------------------------------------------------------------


@st.composite
def problems_with_unseen_keys(draw):
    """Nk > Nq + left, so with a left bound the first Nk − Nq − left keys are outside every row's window."""
    n_q, left = draw(st.integers(1, 8)), draw(st.integers(0, 4))
    n_unseen = draw(st.integers(1, 6))
    n_k = n_q + left + n_unseen
    causal = draw(st.booleans())
    right = draw(st.sampled_from([-1, 0])) if causal else draw(st.one_of(st.just(-1), st.integers(0, 3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    H, d = 2, draw(st.sampled_from([1, 4]))
    q, k, v = rng.standard_normal((H, n_q, d)), rng.standard_normal((H, n_k, d)), rng.standard_normal((H, n_k, d))
    kwargs = dict(causal=causal, window_size=(left, right), softcap=draw(st.sampled_from([0.0, 3.0])))
    if draw(st.booleans()):
        kwargs["alibi_slopes"] = rng.uniform(-1, 1, H)
    return q, k, v, kwargs, n_unseen, rng


def assert_unchanged(changed, original, what):
    """Equal up to a few eps of the largest entry: the hidden keys' weights are exactly 0, so only a BLAS that
    sums differently for differently placed inputs could move a bit; a key that leaked would move O(1)."""
    tol = 8 * EPS * max(1.0, np.abs(original).max(initial=0))
    err = np.abs(changed - original).max(initial=0)
    assert err <= tol, f"{what}: changing keys no query sees moved it by {err:.3e} (> {tol:.3e})"


@SETTINGS
@given(problems_with_unseen_keys(), st.integers(1, 6), st.integers(1, 6))
def test_keys_outside_every_window_change_nothing(problem, block_q, block_k):
    """Other k and v (up to 100 times larger) at the keys no query sees leave O, L, dq and the other keys' dk, dv
    as they were, in both paths, and those keys' own dk, dv are exactly 0."""
    q, k, v, kwargs, n_unseen, rng = problem
    assert not any(sees(i, j, q.shape[-2], k.shape[-2], kwargs["causal"], kwargs["window_size"])
                   for i in range(q.shape[-2]) for j in range(n_unseen)), "the test's own premise"
    k2, v2 = k.copy(), v.copy()
    k2[:, :n_unseen] = rng.standard_normal(k2[:, :n_unseen].shape) * 100
    v2[:, :n_unseen] = rng.standard_normal(v2[:, :n_unseen].shape) * 100
    do = rng.standard_normal(q.shape)
    tiles = dict(block_q=block_q, block_k=block_k)
    for forward, backward, extra in ((standard_attention, attention_backward, {}),
                                     (flash_attention, flash_attention_backward, tiles)):
        O, L = forward(q, k, v, **extra, **kwargs)
        O2, L2 = forward(q, k2, v2, **extra, **kwargs)
        assert_unchanged(O2, O, f"{forward.__name__}: O")
        assert_unchanged(L2, L, f"{forward.__name__}: L")
        dq, dk, dv = backward(q, k, v, O, L, do, **extra, **kwargs)
        dq2, dk2, dv2 = backward(q, k2, v2, O2, L2, do, **extra, **kwargs)
        assert_unchanged(dq2, dq, f"{backward.__name__}: dq")
        assert_unchanged(dk2[:, n_unseen:], dk[:, n_unseen:], f"{backward.__name__}: dk of the seen keys")
        assert_unchanged(dv2[:, n_unseen:], dv[:, n_unseen:], f"{backward.__name__}: dv of the seen keys")
        for g in (dk, dv, dk2, dv2):
            assert (g[:, :n_unseen] == 0).all(), f"{backward.__name__}: a key no query sees must get dk = dv = 0"


# --- backward: finite differences, and tiled against materialised -----------------------------------


FD_CASES = {
    "softcap": ((1, 2, 4, 3), (1, 2, 5, 3), dict(softcap=0.8)),  # logits ~ 1: tanh well off linear
    "alibi (H,)": ((1, 2, 4, 3), (1, 2, 5, 3), dict(alibi_slopes=np.array([0.5, -0.3]))),
    "alibi (B, H)": ((2, 2, 3, 2), (2, 1, 4, 2), dict(alibi_slopes=np.array([[0.5, 0.2], [1.0, -0.4]]))),
    "window": ((1, 2, 5, 3), (1, 2, 5, 3), dict(window_size=(1, 1))),
    "window, Nq > Nk": ((1, 1, 6, 2), (1, 1, 4, 2), dict(window_size=(1, 0))),
    "causal window, GQA": ((1, 4, 4, 2), (1, 2, 6, 2), dict(causal=True, window_size=(2, -1))),
    "combined": ((2, 2, 4, 3), (2, 2, 6, 3),
                 dict(window_size=(2, 1), softcap=1.2, alibi_slopes=np.array([[0.3, 0.6], [0.1, 0.9]]))),
    "combined causal": ((1, 2, 5, 2), (1, 2, 5, 2), dict(causal=True, window_size=(3, 0), softcap=0.6,
                                                        alibi_slopes=np.array([0.7, 0.2]))),
}


@pytest.mark.parametrize("case", list(FD_CASES))
def test_backward_matches_finite_differences(rng, case):
    q_shape, kv_shape, kwargs = FD_CASES[case]
    q = rng.standard_normal(q_shape)
    k, v = rng.standard_normal((2, *kv_shape))
    O, L = standard_attention(q, k, v, **kwargs)
    do = rng.standard_normal(O.shape)
    numeric = numeric_gradients(q, k, v, do, kwargs)
    analytic = attention_backward(q, k, v, O, L, do, **kwargs)
    tiled = flash_attention_backward(q, k, v, O, L, do, block_q=2, block_k=3, **kwargs)
    for name, a, n, t in zip(("dq", "dk", "dv"), analytic, numeric, tiled):
        assert a.shape == n.shape == t.shape, name
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-7, err_msg=f"{case}: {name}")
        np.testing.assert_allclose(t, n, rtol=1e-6, atol=1e-7, err_msg=f"{case}: {name} (tiled)")
    assert max(np.abs(g).max() for g in numeric) > 1e-2, "the case must have gradients to check"


def backward_bounds(q, k, v, o, lse, do, kwargs):
    """Per-entry bounds on |tiled − materialised| for (dq, dk, dv), as test_reference_backward.py's, on the
    final logits: the softcap's factor 1 − tanh² ≤ 1 only shrinks the terms, and its rounding (absolute,
    ≤ 2·eps + 2·δS/softcap) is covered by the eps and δS terms of ``factor`` on the unshrunk terms."""
    from reference.attention import _prepare

    pr = _prepare(q, k, v, dtype=None, **(dict(causal=False, softmax_scale=None) | kwargs))
    S = pr.logits(0, pr.n_q, 0, pr.n_k, mask=True)[0]
    P = np.exp(S - np.where(np.isneginf(lse), np.inf, lse)[..., None])
    A = P * (np.abs(do) @ np.swapaxes(np.abs(pr.v), -1, -2) + np.sum(np.abs(do * o), axis=-1)[..., None])
    factor = 4 * (pr.n_q + pr.n_k + pr.d + 2) * EPS + 4 * logit_error(q, k, kwargs, S)
    return (
        factor * pr.reduce_dq(pr.scale * A @ np.abs(pr.k)),
        factor * pr.reduce_dkv(pr.scale * np.swapaxes(A, -1, -2) @ np.abs(pr.q)),
        factor * pr.reduce_dkv(np.swapaxes(P, -1, -2) @ np.abs(do)),
    )


@SETTINGS
@given(problem=variant_problems(max_n=16), block_q=st.integers(1, 20), block_k=st.integers(1, 20),
       dq_splits=st.one_of(st.none(), st.integers(1, 3)))
def test_tiled_backward_equals_materialised_under_every_variant(problem, block_q, block_k, dq_splits):
    """The tiled backward, which visits only the Q blocks of q_block_range and masks only edge tiles, against
    the materialised one, with dQ added straight or through planes."""
    q, k, v, kwargs = problem
    O, L = standard_attention(q, k, v, **kwargs)
    do = np.random.default_rng(0).standard_normal(O.shape)
    ref = attention_backward(q, k, v, O, L, do, **kwargs)
    tiled = flash_attention_backward(q, k, v, O, L, do, block_q=block_q, block_k=block_k, dq_splits=dq_splits,
                                     **kwargs)
    for name, r, t, tol, x in zip(("dq", "dk", "dv"), ref, tiled, backward_bounds(q, k, v, O, L, do, kwargs),
                                  (q, k, v)):
        assert t.shape == r.shape == x.shape, name
        err = np.abs(t - r)
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert (err <= tol + 1e-300).all(), f"{name}: |tiled - ref| = {err[worst]:.3e} > {tol[worst]:.3e} at {worst}"


# --- rows that see no key ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_q,n_k,kwargs,empty_rows", [
    (6, 3, dict(window_size=(0, 0)), 3),  # query i sees only key i - 3: rows 0..2 see nothing
    (6, 3, dict(causal=True, softcap=2.0), 3),  # Nq > Nk causal
    (7, 4, dict(window_size=(1, 0), alibi_slopes=np.array([0.5])), 3),
    (5, 5, dict(window_size=(0, 0), softcap=1.0, alibi_slopes=np.array([2.0])), 0),  # the diagonal only
])
def test_rows_that_see_no_key(rng, n_q, n_k, kwargs, empty_rows):
    """O = 0, L = −inf and dq = 0 on those rows, and finite gradients elsewhere; a row that sees one key has
    O = v of that key and dq = 0 (its softmax is constant)."""
    d = 3
    q, k, v = rng.standard_normal((1, n_q, d)), rng.standard_normal((1, n_k, d)), rng.standard_normal((1, n_k, d))
    shift = n_k - n_q
    for O, L in (standard_attention(q, k, v, **kwargs), flash_attention(q, k, v, block_q=2, block_k=2, **kwargs)):
        assert np.isneginf(L[0, :empty_rows]).all() and np.isfinite(L[0, empty_rows:]).all()
        assert (O[0, :empty_rows] == 0).all()
        do = rng.standard_normal(O.shape)
        for dq, dk, dv in (attention_backward(q, k, v, O, L, do, **kwargs),
                           flash_attention_backward(q, k, v, O, L, do, block_q=4, block_k=2, **kwargs)):
            assert (dq[0, :empty_rows] == 0).all()
            assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
            if kwargs.get("window_size") == (0, 0):  # every other row sees exactly key i + shift
                rows = np.arange(empty_rows, n_q)
                np.testing.assert_allclose(O[0, rows], v[0, rows + shift], atol=1e-15, rtol=0)
                assert np.abs(dq[0, empty_rows:]).max() < 1e-14
                np.testing.assert_allclose(dv[0, rows + shift], do[0, rows], atol=1e-15, rtol=0)


# --- the tile plan -----------------------------------------------------------------------------------


@st.composite
def tile_plans(draw):
    n_q, n_k = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.booleans())
    left = draw(st.one_of(st.just(-1), st.integers(0, n_k + 2)))
    right = draw(st.sampled_from([-1, 0])) if causal else draw(st.one_of(st.just(-1), st.integers(0, n_q + 2)))
    return n_q, n_k, draw(st.integers(1, 12)), draw(st.integers(1, 12)), causal, (left, right)


@settings(max_examples=300, deadline=None)
@given(tile_plans())
def test_tile_plan_matches_the_brute_force_mask(plan):
    """visible_mask is the rule; a K/V block is in kv_block_range iff some entry of its tile is visible (the
    same for q_block_range over Q blocks); tile_needs_mask iff a visited tile has a hidden entry."""
    n_q, n_k, block_q, block_k, causal, window = plan
    full = visible_mask(0, n_q, 0, n_k, n_q, n_k, causal, window)
    expected = np.array([[sees(i, j, n_q, n_k, causal, window) for j in range(n_k)] for i in range(n_q)])
    np.testing.assert_array_equal(full, expected)
    q_blocks = [(s, min(s + block_q, n_q)) for s in range(0, n_q, block_q)]
    k_blocks = [(s, min(s + block_k, n_k)) for s in range(0, n_k, block_k)]
    for a, (q0, q1) in enumerate(q_blocks):
        needed = [full[q0:q1, k0:k1].any() for k0, k1 in k_blocks]
        first, stop = kv_block_range(q0, q1, n_q, n_k, block_k, causal, window)
        assert needed == [first <= j < stop for j in range(len(k_blocks))], (q0, q1, first, stop)
        if not any(needed):
            assert (first, stop) == (0, 0)
        for j, (k0, k1) in enumerate(k_blocks):
            tile = visible_mask(q0, q1, k0, k1, n_q, n_k, causal, window)
            np.testing.assert_array_equal(tile, full[q0:q1, k0:k1])
            if needed[j]:
                assert tile_needs_mask(q0, k1, n_q, n_k, causal, window, q_stop=q1, k_start=k0) == (not tile.all())
    for j, (k0, k1) in enumerate(k_blocks):
        needed = [full[q0:q1, k0:k1].any() for q0, q1 in q_blocks]
        first, stop = q_block_range(k0, k1, n_q, n_k, block_q, causal, window)
        assert needed == [first <= a < stop for a in range(len(q_blocks))], (k0, k1, first, stop)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.integers(1, 12), st.booleans())
def test_causal_helpers_are_the_window_helpers_without_a_window(n_q, n_k, block_q, block_k, causal):
    """causal_mask, kv_blocks_to_visit, first_q_block_to_visit and tile_needs_mask's causal form (no q_stop,
    k_start) are the window_size=(-1, -1) cases of the general helpers."""
    if causal:
        hidden = ~visible_mask(0, n_q, 0, n_k, n_q, n_k, True)
        np.testing.assert_array_equal(causal_mask(0, n_q, 0, n_k, n_q, n_k), hidden)
    for q0 in range(0, n_q, block_q):
        q1 = min(q0 + block_q, n_q)
        first, stop = kv_block_range(q0, q1, n_q, n_k, block_k, causal)
        assert first == 0 and kv_blocks_to_visit(q0, q1, n_q, n_k, block_k, causal) == stop
        for k0 in range(0, n_k, block_k):
            k1 = min(k0 + block_k, n_k)
            assert tile_needs_mask(q0, k1, n_q, n_k, causal) == tile_needs_mask(
                q0, k1, n_q, n_k, causal, (-1, -1), q_stop=q1, k_start=k0)
    for k0 in range(0, n_k, block_k):
        first, stop = q_block_range(k0, min(k0 + block_k, n_k), n_q, n_k, block_q, causal)
        assert first_q_block_to_visit(k0, n_q, n_k, block_q, causal) == first and stop == -(-n_q // block_q)


def test_flash_never_loads_a_block_outside_the_window(rng):
    """With a narrow window each Q block touches only the K/V blocks of kv_block_range: blocks outside hold
    nan, which any load would spread (0·nan = nan), and O stays finite and equal to the standard one."""
    n, d, block = 64, 4, 8
    q, k, v = rng.standard_normal((3, n, d))
    window = (3, 2)
    O_ref, L_ref = standard_attention(q, k, v, window_size=window)
    for q0 in range(0, n, block):
        first, stop = kv_block_range(q0, q0 + block, n, n, block, False, window)
        assert stop - first <= 3  # 8 rows see 8 + 3 + 2 keys: at most three blocks of 8
        k_bad, v_bad = k.copy(), v.copy()
        outside = np.ones(n, bool)
        outside[first * block : stop * block] = False
        k_bad[outside], v_bad[outside] = np.nan, np.nan
        O, L = flash_attention(q, k_bad, v_bad, block_q=block, block_k=block, q_rows=slice(q0, q0 + block),
                               window_size=window)
        np.testing.assert_allclose(O, O_ref[q0 : q0 + block], atol=1e-12, rtol=0)
        np.testing.assert_allclose(L, L_ref[q0 : q0 + block], atol=1e-12, rtol=0)


# --- decode ------------------------------------------------------------------------------------------


@st.composite
def decode_problems(draw):
    """Ragged caches (lengths 0 and Nmax included), GQA, Nq up to 5, and any window / softcap / ALiBi."""
    B, Hkv, G = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    n_q, n_max, d = draw(st.integers(1, 5)), draw(st.integers(0, 24)), draw(st.sampled_from([1, 4]))
    lens = np.array(draw(st.lists(st.integers(0, n_max), min_size=B, max_size=B)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, Hkv * G, n_q, d)) * draw(st.sampled_from([1.0, 5.0]))
    k, v = rng.standard_normal((2, B, Hkv, n_max, d))
    left = draw(st.one_of(st.just(-1), st.integers(0, n_max + 1)))
    kwargs = dict(window_size=(left, draw(st.sampled_from([-1, 0]))), softcap=draw(st.sampled_from([0.0, 0.0, 1.0])))
    alibi = draw(st.sampled_from([None, "H", "BH"]))
    if alibi:
        kwargs["alibi_slopes"] = rng.uniform(-1, 1, (Hkv * G,) if alibi == "H" else (B, Hkv * G))
    return q, k, v, lens, kwargs


@SETTINGS
@given(decode_problems(), st.integers(1, 6), st.sampled_from([1, 4]))
def test_decode_equals_standard_per_sequence(problem, n_splits, block_n):
    """Each sequence b is standard causal attention on its cache [0, len_b) with the same variants, i.e. the
    shift len_b − Nq; the split states hold the final logits (softcap and bias included) for the merge."""
    q, k, v, lens, kwargs = problem
    O, L = decode_attention(q, k, v, cache_seqlens=lens, splits=n_splits, block_n=block_n, **kwargs)
    slopes = kwargs.get("alibi_slopes")
    for b, n in enumerate(lens):
        if n == 0:
            assert (O[b] == 0).all() and np.isneginf(L[b]).all()
            continue
        per_b = dict(kwargs, alibi_slopes=None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b]))
        O_ref, L_ref = standard_attention(q[b], k[b, :, :n], v[b, :, :n], causal=True, **per_b)
        online = 4 * (k.shape[2] + 2 * n_splits + 50) * EPS
        dS = logit_error(q[b], k[b, :, :n], per_b, final_logits(q[b], k[b, :, :n], dict(per_b, causal=True)))
        assert_close(O[b], L[b], O_ref, L_ref, np.abs(v).max() * (online + 4 * dS), online + 2 * dS, f"sequence {b}")


def test_decode_partials_hold_the_final_logits(rng):
    """One split of one row by hand: m, ℓ and acc are built from the final logits
    softcap · tanh(s/softcap) − slope·|i + shift − j| over the keys of the window (shift = len_b − Nq)."""
    q = rng.standard_normal((1, 2, 2, 4))
    k, v = rng.standard_normal((2, 1, 1, 10, 4))
    slopes = np.array([[0.4, 0.9]])
    m, l, acc = decode_partials(q, k, v, cache_seqlens=[8], splits=[4], window_size=(3, 0), softcap=2.0,
                                alibi_slopes=slopes)
    i, h, shift = 1, 1, 8 - 2  # query 1 sits at key 7: it sees keys 4..7, all in split 1, [4, 8)
    keys = np.arange(4, 8)
    s = 2.0 * np.tanh((q[0, h, i] @ k[0, 0, keys].T) / 2.0 / 2.0) - 0.9 * np.abs(i + shift - keys)
    # the logit is a difference of terms up to ~5 (cap 2, bias 0.9·3): cancellation leaves an absolute error
    np.testing.assert_allclose(m[0, h, i, 1], s.max(), rtol=1e-14, atol=1e-14 * 5)
    np.testing.assert_allclose(l[0, h, i, 1], np.exp(s - s.max()).sum(), rtol=1e-14)
    np.testing.assert_allclose(acc[0, h, i, 1], np.exp(s - s.max()) @ v[0, 0, keys], rtol=1e-13,
                               atol=1e-14 * np.abs(v).max() * len(keys))  # a sum of signed terms may cancel
    assert np.isneginf(m[0, :, 1, 0]).all()  # keys 0..3 are left of query 1's window
    assert np.isfinite(m[0, :, 0, 0]).all()  # query 0 (at key 6) sees key 3


# --- argument checks ---------------------------------------------------------------------------------


def _call(fn, **kwargs):
    """One entry point on a small valid problem, with ``kwargs`` on top (q has B = 2, H = 2)."""
    q, k, v = np.ones((2, 2, 4, 3)), np.ones((2, 2, 5, 3)), np.ones((2, 2, 5, 3))
    if fn == "decode":
        return decode_attention(q, k, v, **kwargs)
    if fn in ("attention_backward", "flash_attention_backward"):
        o, lse = np.ones((2, 2, 4, 3)), np.zeros((2, 2, 4))
        tiles = dict(block_q=2, block_k=2) if fn == "flash_attention_backward" else {}
        backward = attention_backward if fn == "attention_backward" else flash_attention_backward
        return backward(q, k, v, o, lse, o, **tiles, **kwargs)
    if fn == "flash_attention":
        return flash_attention(q, k, v, block_q=2, block_k=2, **kwargs)
    return standard_attention(q, k, v, **kwargs)


ENTRY_POINTS = ["standard_attention", "flash_attention", "attention_backward", "flash_attention_backward", "decode"]
BAD_ARGUMENTS = [
    (dict(window_size=(-2, 0)), ValueError, r"window_size left = -2 .*-1 \(no bound on that side\) or >= 0"),
    (dict(window_size=(0, -5)), ValueError, r"window_size right = -5"),
    (dict(window_size=(1.5, 0)), TypeError, r"window_size left must be an int, got 1.5 of type float"),
    (dict(window_size=(0, np.float64(2.0))), TypeError, r"window_size right must be an int, got .*2.0"),
    (dict(window_size=(True, 0)), TypeError, r"window_size left must be an int, got the bool True"),
    (dict(window_size=(1, 2, 3)), ValueError, r"window_size must have 2 entries \(left, right\), got 3: \(1, 2, 3\)"),
    (dict(window_size=(1,)), ValueError, r"window_size must have 2 entries \(left, right\), got 1: \(1,\)"),
    (dict(window_size=4), TypeError, r"window_size must be a pair \(left, right\), got 4 of type int"),
    (dict(window_size="ab"), TypeError, r"window_size must be a pair .*'ab' of type str"),
    (dict(window_size=None), TypeError, r"window_size must be a pair .*None"),
    (dict(softcap=-1), ValueError, r"softcap must be a finite number >= 0 \(0.0: no capping\), got -1"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number >= 0.*nan"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0.*inf"),
    (dict(softcap=10**400), ValueError, r"softcap must be a finite number >= 0"),
    (dict(softcap="1"), TypeError, r"softcap must be a real number.*'1' of type str"),
    (dict(softcap=True), TypeError, r"softcap must be a real number.*bool"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes has shape \(3,\); accepted for q of shape "
                                                r"\(2, 2, 4, 3\): \(H,\) = \(2,\) or \(B, H\) = \(2, 2\)"),
    (dict(alibi_slopes=np.ones((2, 3))), ValueError, r"alibi_slopes has shape \(2, 3\)"),
    (dict(alibi_slopes=np.ones((1, 2, 2))), ValueError, r"alibi_slopes has shape \(1, 2, 2\)"),
    (dict(alibi_slopes=np.float64(0.5)), ValueError, r"alibi_slopes has shape \(\)"),
    (dict(alibi_slopes=np.array([0.5, np.nan])), ValueError, r"alibi_slopes contains non-finite values"),
    (dict(alibi_slopes=np.array([0.5, np.inf])), ValueError, r"alibi_slopes contains non-finite values"),
    (dict(alibi_slopes=np.array([True, False])), TypeError, r"alibi_slopes has dtype bool"),
    (dict(alibi_slopes=np.array([1j, 1])), TypeError, r"alibi_slopes has dtype complex128"),
]


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("kwargs,error,match", BAD_ARGUMENTS)
def test_bad_variant_arguments_are_refused_by_every_entry_point(fn, kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(fn, **kwargs)


@pytest.mark.parametrize("fn", ENTRY_POINTS[:-1])
def test_causal_fixes_the_window_right(fn):
    with pytest.raises(ValueError, match=r"window_size=\(2, 3\) with causal=True: causal masking fixes the "
                                         r"window's right = 0; accepted with it: right = -1 or 0"):
        _call(fn, causal=True, window_size=(2, 3))
    for right in (-1, 0):  # both mean right = 0
        a = _call(fn, causal=True, window_size=(2, right))
        b = _call(fn, causal=True, window_size=(2, 0))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_decode_is_causal_so_it_fixes_the_window_right():
    with pytest.raises(ValueError, match=r"window_size=\(0, 1\) with decoding \(causal to the end of each cache\): "
                                         r"causal masking fixes the window's right = 0"):
        _call("decode", window_size=(0, 1))


def test_window_sides_may_be_numpy_ints_or_an_array(rng):
    q, k, v = rng.standard_normal((3, 5, 4))
    O, L = standard_attention(q, k, v, window_size=(2, 1))
    for window in ((np.int64(2), np.int32(1)), [2, 1], np.array([2, 1])):
        O2, L2 = standard_attention(q, k, v, window_size=window)
        np.testing.assert_array_equal(O2, O)
    with pytest.raises(TypeError, match=r"window_size right must be an int, got the bool .*True"):
        standard_attention(q, k, v, window_size=(2, np.True_))


def test_alibi_needs_a_heads_axis():
    q = np.ones((4, 3))  # (Nq, d): no heads axis
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \(1,\), but q of shape \(4, 3\) has no heads axis; "
                                         r"accepted: q \(H, Nq, d\) with slopes \(H,\)"):
        standard_attention(q, q, q, alibi_slopes=np.ones(1))
    q3 = np.ones((2, 4, 3))  # (H, Nq, d): (H,) only
    standard_attention(q3, q3, q3, alibi_slopes=np.ones(2))
    with pytest.raises(ValueError, match=r"accepted for q of shape \(2, 4, 3\): \(H,\) = \(2,\) \(H = q.shape"):
        standard_attention(q3, q3, q3, alibi_slopes=np.ones((1, 2)))


def test_helpers_check_their_window_too():
    with pytest.raises(ValueError, match=r"window_size left = -3"):
        visible_mask(0, 2, 0, 2, 2, 2, False, (-3, 0))
    with pytest.raises(ValueError, match=r"causal masking fixes the window's right = 0"):
        kv_block_range(0, 2, 4, 4, 2, True, (1, 1))
    with pytest.raises(TypeError, match=r"window_size must be a pair"):
        q_block_range(0, 2, 4, 4, 2, False, 3)
    with pytest.raises(TypeError, match=r"tile_needs_mask with a left window bound \(window_size=\(1, -1\)\) needs "
                                        r"q_stop= and k_start=; got q_stop=None, k_start=None"):
        tile_needs_mask(0, 2, 4, 4, False, (1, -1))
