"""Sliding window, softcap and ALiBi (flash-attn 2.x's variants) in the tensor-core kernels, forward and backward.

Each case runs ``numba_flash.forward`` / ``backward`` and checks them against the float64 reference
(reference.standard_attention / attention_backward with the same window_size, softcap, alibi_slopes) by
flash-attention's rule: the error is at most twice a naive same-dtype implementation's (the reference in
float16) plus a small floor. Shapes cut tiles at odd places (Nq != Nk, not tile multiples, GQA, odd d), so
the window's tile range, its edge tests and the per-score rules all run. Tile skipping is shown by
poisoning with NaN every key that no query sees: a kernel that loaded such a tile would get 0 · NaN = NaN.

On the simulator (CI) and on the GPU alike (``anywhere``).
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
import reference

pytestmark = pytest.mark.anywhere

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

# (B, H, Hkv, Nq, Nk, d, causal, window_size, softcap, alibi)
FORWARD = [
    (1, 2, 1, 70, 133, 64, False, (20, 5), 0.0, None),
    (1, 2, 2, 40, 150, 64, True, (10, -1), 0.0, None),
    (1, 1, 1, 33, 50, 32, False, (-1, -1), 5.0, None),
    (2, 2, 1, 33, 50, 64, True, (-1, -1), 0.0, "BH"),
    (1, 2, 1, 65, 47, 40, False, (7, 3), 2.0, "H"),  # d = 40: a part-data copy per row
    (1, 2, 2, 150, 90, 128, False, (0, 0), 0.0, None),  # Nq > Nk: rows before the shift see nothing
    (1, 2, 1, 40, 70, 200, True, (25, 0), 3.0, "H"),  # d = 200 -> 256: the 8-warp 128-row tile
]


def _inputs(seed, B, H, Hkv, n_q, n_k, d, dtype=np.float16, q_scale=1.5):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, H, n_q, d)) * q_scale).astype(dtype)
    k = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
    do = rng.standard_normal((B, H, n_q, d)).astype(dtype)
    return q, k, v, do


def _slopes(kind, B, H, seed=7):
    if kind is None:
        return None
    rng = np.random.default_rng(seed)
    return (rng.random((H,) if kind == "H" else (B, H)) * 0.5 + 0.05).astype(np.float32)


def _bound(ours, exact, naive, floor):
    """flash-attention's rule: |ours - exact| <= 2 |naive - exact| + floor, over the finite entries."""
    fin = np.isfinite(exact)
    err = np.abs(np.where(fin, ours - exact, 0)).max(initial=0)
    ref_err = np.abs(np.where(fin, naive - exact, 0)).max(initial=0)
    assert err <= 2 * ref_err + floor, f"error {err:.3e} > 2 x naive {ref_err:.3e} + {floor:g}"


@pytest.mark.parametrize("case", FORWARD, ids=lambda c: f"Nq{c[3]}-Nk{c[4]}-d{c[5]}-w{c[7]}-cap{c[8]}-{c[9]}"
                         f"{'-causal' if c[6] else ''}")
def test_forward_variants(case):
    B, H, Hkv, n_q, n_k, d, causal, window, cap, alibi = case
    q, k, v, _ = _inputs(0, B, H, Hkv, n_q, n_k, d)
    slopes = _slopes(alibi, B, H)
    mods = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
    out, lse = numba_flash.forward(q, k, v, **mods)
    o64, l64 = reference.standard_attention(q, k, v, **mods)
    o16, _ = reference.standard_attention(q, k, v, **mods, dtype=np.float16)
    _bound(out.astype(np.float64), o64, o16.astype(np.float64), 1e-3)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(l64))  # rows that see no key: L = -inf
    fin = np.isfinite(l64)
    np.testing.assert_allclose(lse[fin], l64[fin], atol=1e-4 * max(1.0, np.abs(l64[fin]).max(initial=0)), rtol=0)
    assert (out[~fin] == 0).all(), "a row that sees no key must have O = 0"


@pytest.mark.parametrize("case", [FORWARD[1], FORWARD[3], FORWARD[4]], ids=["window-left", "alibi-BH", "d40"])
def test_forward_variants_on_mma_sync(case, monkeypatch):
    """The mma.sync forward's mod builds (what sm_80-89 run; sm_90 and the simulator take the wgmma forward)."""
    monkeypatch.setattr(numba_flash.api, "_wgmma_here", lambda: False)
    assert not numba_flash.api.mma_config(case[5], case[6]).has("wgmma")
    test_forward_variants(case)


@pytest.mark.skipif(ml_dtypes is None, reason="NumPy bfloat16 needs ml_dtypes")
def test_forward_variants_bf16():
    q, k, v, _ = _inputs(1, 1, 2, 1, 77, 120, 64, dtype=ml_dtypes.bfloat16)
    mods = dict(causal=True, window_size=(30, 0), softcap=4.0, alibi_slopes=_slopes("H", 1, 2))
    out, lse = numba_flash.forward(q, k, v, **mods)
    o64, _ = reference.standard_attention(*(x.astype(np.float32) for x in (q, k, v)), **mods)  # exact widening
    err = np.abs(out.astype(np.float64) - o64).max()
    assert err <= 2 * 2.0**-8 * np.abs(o64).max() + 1e-3, err  # bf16's rounding of O and P, twice


def test_tiles_outside_every_window_are_never_loaded():
    """Nq = 64 against Nk = 512 with a window of 32: the rows see keys 416 .. 511 only. Every other key is
    NaN in k and v; a tile of them that the kernel loaded would put 0 · NaN into P · V."""
    q, k, v, do = _inputs(2, 1, 2, 1, 64, 512, 64)
    window = (32, 0)
    first = (512 - 64 - 32) // 64 * 64  # the first key of the first 64-key tile a row sees (416 -> 384)
    k_poisoned, v_poisoned = k.copy(), v.copy()
    k_poisoned[:, :, :first] = np.nan
    v_poisoned[:, :, :first] = np.nan
    out, lse = numba_flash.forward(q, k_poisoned, v_poisoned, causal=True, window_size=window)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    o64, _ = reference.standard_attention(q, k, v, causal=True, window_size=window)
    np.testing.assert_allclose(out.astype(np.float64), o64, atol=4e-3, rtol=0)
    dq, dk, dv = numba_flash.backward(q, k_poisoned, v_poisoned, out, lse, do, causal=True, window_size=window)
    assert np.isfinite(dq).all(), "the dq kernel loaded a K/V tile outside every row's window"
    assert (dk[:, :, :first] == 0).all() and (dv[:, :, :first] == 0).all()


@pytest.mark.parametrize("dtype", ["float16", pytest.param("float32", marks=pytest.mark.heavy)])  # fp32: the slow SIMT sim
@pytest.mark.parametrize("left,right", [(-1, 0), (-1, -1)])
def test_trivial_windows_run_the_plain_kernels(left, right, dtype):
    """(-1, 0) is causal and (-1, -1) no window: the same kernels (every family), the same bits, forward and
    backward."""
    q, k, v, do = _inputs(3, 1, 2, 2, 40, 70, 64, dtype=np.dtype(dtype))
    causal = right == 0
    a = numba_flash.forward(q, k, v, window_size=(left, right))
    b = numba_flash.forward(q, k, v, causal=causal)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert "mods" not in numba_flash.explain(q, k, v, window_size=(left, right))
    ga = numba_flash.backward(q, k, v, *a, do, window_size=(left, right))
    gb = numba_flash.backward(q, k, v, *b, do, causal=causal)
    for x, y in zip(ga, gb):
        np.testing.assert_array_equal(x, y)


BACKWARD = [  # (B, H, Hkv, Nq, Nk, d, causal, window_size, softcap, alibi, deterministic)
    (1, 2, 1, 70, 133, 64, False, (20, 5), 0.0, None, True),
    (1, 2, 2, 40, 40, 64, True, (10, -1), 0.0, None, False),
    (1, 1, 1, 33, 50, 32, False, (-1, -1), 3.0, None, True),
    (2, 2, 1, 33, 50, 64, True, (-1, -1), 0.0, "BH", False),
    (1, 2, 1, 65, 47, 64, False, (7, 3), 2.0, "H", True),
    (1, 2, 1, 65, 47, 64, False, (7, 3), 2.0, "H", False),
    (1, 2, 1, 16, 20, 200, False, (7, 3), 2.0, "H", True),  # d 200 -> 256: the split-layout dkdv with every mod
]


@pytest.mark.parametrize("case", BACKWARD, ids=lambda c: f"Nq{c[3]}-Nk{c[4]}-w{c[7]}-cap{c[8]}-{c[9]}"
                         f"{'-causal' if c[6] else ''}-det{int(c[10])}")
def test_backward_variants(case):
    B, H, Hkv, n_q, n_k, d, causal, window, cap, alibi, det = case
    q, k, v, do = _inputs(4, B, H, Hkv, n_q, n_k, d)
    slopes = _slopes(alibi, B, H)
    mods = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
    out, lse = numba_flash.forward(q, k, v, **mods)
    grads = numba_flash.backward(q, k, v, out, lse, do, deterministic=det, **mods)
    o64, l64 = reference.standard_attention(q, k, v, **mods)
    exact = reference.attention_backward(q, k, v, o64, l64, do, **mods)
    o16, l16 = reference.standard_attention(q, k, v, **mods, dtype=np.float16)
    naive = reference.attention_backward(q, k, v, o16, l16, do, **mods, dtype=np.float16)
    for name, ours, x, nv in zip(("dq", "dk", "dv"), grads, exact, naive):
        scale = max(1.0, np.abs(x).max())
        _bound(ours.astype(np.float64), x, nv.astype(np.float64), 2e-3 * scale)


@pytest.mark.parametrize("kw,err,match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size left"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size left"),
    (dict(window_size=(True, 0)), TypeError, "window_size left"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size"),
    (dict(window_size=(5, 3), causal=True), ValueError, "causal=True is window_size right = 0"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes has shape \(3,\)"),
    (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes has dtype float64"),
    (dict(alibi_slopes=[0.5, 0.5]), TypeError, "alibi_slopes must be"),
])
def test_bad_mods_are_refused(kw, err, match):
    q, k, v, do = _inputs(5, 1, 2, 1, 8, 8, 16)
    with pytest.raises(err, match=match):
        numba_flash.forward(q, k, v, **kw)
    out, lse = numba_flash.forward(q, k, v)
    with pytest.raises(err, match=match):
        numba_flash.backward(q, k, v, out, lse, do, **kw)


@pytest.mark.parametrize("kernel", ["tf32x3", "tf32"])
def test_mods_are_not_in_the_tf32_kernels(kernel):
    """The tf32 kernels have no mods: asked for by name they say so (auto runs float32 with mods on SIMT)."""
    q, k, v, do = _inputs(6, 1, 2, 1, 8, 8, 16, dtype=np.float32)
    with pytest.raises(NotImplementedError, match=f"sliding window.*not built into kernel='{kernel}'"):
        numba_flash.forward(q, k, v, window_size=(2, 2), kernel=kernel)
    with pytest.raises(NotImplementedError, match="softcap"):
        numba_flash.explain(q, k, v, softcap=3.0, kernel=kernel)


@pytest.mark.parametrize("dtype,kernel", [("float32", "auto"), ("float16", "simt"), ("float32", "tf32x3")])
def test_backward_mods_outside_the_mma_kernels_raise(dtype, kernel):
    """The backward builds the variants into the mma kernels only: anything else says so, never drops them."""
    q, k, v, do = _inputs(6, 1, 2, 1, 8, 8, 16, dtype=np.dtype(dtype))
    out, lse = numba_flash.forward(q, k, v, kernel="simt")
    with pytest.raises(NotImplementedError, match="ALiBi.*'mma' kernels only"):
        numba_flash.backward(q, k, v, out, lse, do, alibi_slopes=np.ones(2, np.float32), kernel=kernel)


SIMT_FORWARD = [  # (dtype, d, kernel, causal, window_size, softcap, alibi): the SIMT kernel with mods
    ("float32", 64, "auto", True, (12, 0), 4.0, "H"),  # auto: float32 with mods runs on SIMT
    pytest.param(("float32", 200, "auto", False, (30, 9), 0.0, "BH"), marks=pytest.mark.heavy),  # float32, d > 128
    ("float16", 64, "simt", False, (-1, -1), 3.0, None),
]


@pytest.mark.parametrize("case", SIMT_FORWARD, ids=lambda c: f"{c[0]}-d{c[1]}-{c[2]}-w{c[4]}-cap{c[5]}-{c[6]}")
def test_simt_forward_variants(case):
    import warnings

    dtype, d, kernel, causal, window, cap, alibi = case
    q, k, v, _ = _inputs(9, 2, 2, 1, 45, 77, d, dtype=np.dtype(dtype))
    mods = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=_slopes(alibi, 2, 2))
    assert numba_flash.explain(q, k, v, kernel=kernel, **mods).startswith("simt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", numba_flash.PerformanceWarning)
        out, lse = numba_flash.forward(q, k, v, kernel=kernel, **mods)
    o64, l64 = reference.standard_attention(q, k, v, **mods)
    tol = 2e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(out.astype(np.float64), o64, atol=tol, rtol=0)
    fin = np.isfinite(l64)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], l64[fin], atol=1e-4, rtol=0)


def test_explain_names_the_mods():
    q, k, v, _ = _inputs(7, 1, 2, 1, 8, 8, 16)
    text = numba_flash.explain(q, k, v, causal=True, window_size=(4, -1), softcap=2.0,
                               alibi_slopes=np.ones(2, np.float32))
    assert "sliding window (left 4, right 0, causal)" in text and "softcap 2" in text and "ALiBi" in text
    text = numba_flash.explain_backward(q, k, v, window_size=(4, 1))
    assert "mods: sliding window (left 4, right 1)" in text and "dQ" in text


def test_backward_variants_through_the_deterministic_splits(monkeypatch):
    """The splits with mods add into zeroed planes (a window's key blocks do not cover a plane's rows from its
    first on): forced here, where the cost model would take the dq kernel for so small a problem."""
    from numba_flash.blocks import schedule

    monkeypatch.setattr(schedule, "SPLITS_SLOWER_OK", 1e9)
    q, k, v, do = _inputs(8, 1, 2, 1, 70, 300, 64)
    mods = dict(window_size=(40, 10), softcap=5.0, alibi_slopes=_slopes("H", 1, 2))
    if "deterministic splits" not in numba_flash.explain_backward(q, k, v, **mods):
        pytest.skip("this device's backward has no dQ splits at head dim 64")
    out, lse = numba_flash.forward(q, k, v, **mods)
    grads = numba_flash.backward(q, k, v, out, lse, do, **mods)
    again = numba_flash.backward(q, k, v, out, lse, do, **mods)
    o64, l64 = reference.standard_attention(q, k, v, **mods)
    exact = reference.attention_backward(q, k, v, o64, l64, do, **mods)
    o16, l16 = reference.standard_attention(q, k, v, **mods, dtype=np.float16)
    naive = reference.attention_backward(q, k, v, o16, l16, do, **mods, dtype=np.float16)
    for ours, repeat, x, nv in zip(grads, again, exact, naive):
        np.testing.assert_array_equal(ours, repeat)
        _bound(ours.astype(np.float64), x, nv.astype(np.float64), 2e-3 * max(1.0, np.abs(x).max()))


@pytest.mark.parametrize("kw,err,match", [
    (dict(softcap=1e39), ValueError, "softcap = 1e\\+39 with softmax_scale"),
    (dict(softcap=10**400), ValueError, "softcap must be finite"),
    (dict(softcap=1e-45), ValueError, "softcap = 1e-45 with softmax_scale"),
    (dict(alibi_slopes=np.array([0.5, np.inf], np.float32)), ValueError, "alibi_slopes must be finite"),
    (dict(alibi_slopes=np.ones(2, np.float32), softmax_scale=1e-39), ValueError, "1 / scale in fp32"),
    (dict(window_size={1, 2}), TypeError, "window_size must be a pair"),
    (dict(window_size={1: 0, 2: 0}), TypeError, "window_size must be a pair"),
])
def test_values_the_kernels_cannot_represent_are_refused(kw, err, match):
    """softcap / scale and scale / softcap, and 1 / scale with ALiBi, are fp32 launch arguments: outside fp32's
    range the scores became NaN (softcap=1e39: 144 NaNs in O on the simulator); slopes must be finite."""
    q, k, v, _ = _inputs(10, 1, 2, 1, 5, 5, 16)
    with pytest.raises(err, match=match):
        numba_flash.forward(q, k, v, **kw)


def test_slopes_with_a_batch_axis_need_q_to_have_one():
    q, k, v, _ = _inputs(11, 1, 2, 1, 5, 5, 16)
    with pytest.raises(ValueError, match=r"accepted: \(H,\) = \(2,\) \(q has no batch axis\)"):
        numba_flash.forward(q[0], k[0], v[0], alibi_slopes=np.ones((1, 2), np.float32))
    out, _ = numba_flash.forward(q[0], k[0], v[0], alibi_slopes=np.ones(2, np.float32))  # (H,) is fine
    ref, _ = reference.standard_attention(q[0], k[0], v[0], alibi_slopes=np.ones(2, np.float32))
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=0)


def test_causal_window_with_a_score_mod_takes_the_causal_tiles():
    """window (-1, 0) with softcap is the causal kind: the causal tile config, and explain says what runs."""
    q, k, v, _ = _inputs(12, 1, 2, 1, 40, 40, 64)
    p = numba_flash.api.validate(q, k, v, window_size=(-1, 0), softcap=3.0)
    assert numba_flash.api.choose_kernel(p)[1] == numba_flash.api.mma_config(64, True)
