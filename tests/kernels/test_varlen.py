"""Varlen (packed sequences): numba_flash.varlen_forward / varlen_backward against reference.varlen_attention.

Each sequence of a pack is checked against the float64 reference by flash-attention's rule (at most twice a
naive float16 implementation's error, plus a small floor). The packs hold the awkward sequences: no queries,
no keys (rows that see nothing: O = 0, L = -inf), more queries than keys (bottom-right causal per sequence),
lengths that cut tiles anywhere, GQA. Keys of other sequences must have no effect: poisoning them with NaN
would show any read across a boundary. The dQ schemes (deterministic splits, atomic, dq kernel) each run.

On the simulator (CI) and on the GPU alike (``anywhere``).
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import numba_flash
import reference
from gpu_helpers import needs_gpu
from numba_flash import varlen as nf_varlen

pytestmark = pytest.mark.anywhere

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def _pack(seed, lens_q, lens_k, H, Hkv, d, dtype=np.float16):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], H, d)) * 1.5).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hkv, d)).astype(dtype)
    do = rng.standard_normal((cu_q[-1], H, d)).astype(dtype)
    return cu_q, cu_k, q, k, v, do


def _bound(ours, exact, naive, floor):
    """flash-attention's rule: |ours - exact| <= 2 |naive - exact| + floor, over the finite entries."""
    fin = np.isfinite(exact)
    err = np.abs(np.where(fin, ours - exact, 0)).max(initial=0)
    ref_err = np.abs(np.where(fin, naive - exact, 0)).max(initial=0)
    assert err <= 2 * ref_err + floor, f"error {err:.3e} > 2 x naive {ref_err:.3e} + {floor:g}"


def _check(pack, mods, det=True, backward=True):
    cu_q, cu_k, q, k, v, do = pack
    args = (cu_q, cu_k, int(np.diff(cu_q).max()), int(np.diff(cu_k).max()))
    out, lse = numba_flash.varlen_forward(q, k, v, *args, **mods)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == np.float32
    o64, l64 = reference.varlen_attention(q, k, v, cu_q, cu_k, **mods)
    o16, l16 = reference.varlen_attention(q, k, v, cu_q, cu_k, **mods, dtype=np.float16)
    _bound(out.astype(np.float64), o64, o16.astype(np.float64), 1e-3)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(l64))  # rows that see no key: L = -inf
    fin = np.isfinite(l64)
    np.testing.assert_allclose(lse[fin], l64[fin], atol=1e-4 * max(1.0, np.abs(l64[fin]).max(initial=0)), rtol=0)
    assert (out.transpose(1, 0, 2)[~fin] == 0).all(), "a row that sees no key must have O = 0"
    if not backward:
        return out, lse
    grads = numba_flash.varlen_backward(q, k, v, out, lse, do, *args, deterministic=det, **mods)
    exact = reference.varlen_attention_backward(q, k, v, o64, l64, do, cu_q, cu_k, **mods)
    naive = reference.varlen_attention_backward(q, k, v, o16, l16, do, cu_q, cu_k, **mods, dtype=np.float16)
    for ours, x, nv in zip(grads, exact, naive):
        assert ours.shape == x.shape and ours.dtype == q.dtype
        _bound(ours.astype(np.float64), x, nv.astype(np.float64), 2e-3 * max(1.0, np.abs(x).max()))
    return out, lse


# lens_q, lens_k: sequence 1 has no queries, sequence 3 fewer keys than queries (rows before its shift see
# nothing under causal), sequence 4 no keys at all
LENS_Q, LENS_K = [5, 0, 70, 33, 9], [9, 4, 70, 20, 0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_the_reference_per_sequence(causal):
    _check(_pack(0, LENS_Q, LENS_K, 2, 1, 64), dict(causal=causal))


@pytest.mark.parametrize("slopes, Hkv, d, window, causal", [
    pytest.param("BH", 2, 40, (12, 0), True, marks=pytest.mark.heavy),  # per-sequence slopes, d = 40: part-data copies
    ("H", 1, 64, (8, 4), False),   # GQA, a window on both sides
], ids=["causal-window-BH-slopes-d40", "window-both-sides-H-slopes-gqa"])
def test_varlen_mods_align_per_sequence(slopes, Hkv, d, window, causal):
    """A window, softcap and ALiBi ((B, H) or (H,) slopes) per sequence."""
    B, H = len(LENS_Q), 2
    alibi = (np.random.default_rng(5).random((B, H) if slopes == "BH" else (H,)) * 0.5 + 0.05).astype(np.float32)
    _check(_pack(1, LENS_Q, LENS_K, H, Hkv, d), dict(causal=causal, window_size=window, softcap=3.0,
                                                     alibi_slopes=alibi))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_on_mma_sync(causal, monkeypatch):
    """The varlen entry of the mma.sync forward (what sm_80-89 run; sm_90 and the simulator take the wgmma one), with
    a window, softcap and ALiBi, d = 40 (part-data copies)."""
    api = importlib.import_module("numba_flash.api")
    monkeypatch.setattr(api, "_wgmma_here", lambda: False)
    H = 2
    alibi = (np.random.default_rng(6).random((H,)) * 0.5 + 0.05).astype(np.float32)
    pack = _pack(2, LENS_Q, LENS_K, H, 1, 40)
    assert not api.mma_config(40, causal).has("wgmma")
    _check(pack, dict(causal=causal, window_size=(10, 3) if not causal else (15, 0), softcap=3.0, alibi_slopes=alibi),
           backward=False)


@pytest.mark.parametrize("scheme", ["atomic", "kernel", "splits1"])
def test_varlen_backward_dq_schemes(scheme, monkeypatch):
    """deterministic=False's atomic plane, the separate dq kernel, and one deterministic split with 150 keys in a
    sequence (two launches of the 128-key wgmma dkdv, the second from kb0 = 1, where the first sequence has no
    key block: it returns), each forced here."""
    forced = {"kernel": ("kernel", None, "forced"), "splits1": ("splits", 1, "forced")}.get(scheme)
    if forced:
        monkeypatch.setattr(nf_varlen, "dq_for_pack", lambda p, cfg, det: forced)
    lens_k = [30, 150] if scheme == "splits1" else [30, 70]
    _check(_pack(2, [20, 70], lens_k, 2, 1, 64), dict(causal=True), det=scheme != "atomic")


def test_long_packs_keep_the_deterministic_splits_and_lopsided_ones_take_no_planes():
    """64 sequences of up to 8192 rows, H = 16, d = 128: a dQ plane (4.3 GB) is past the dense splits' 1 GiB, which
    would take the dq kernel; a pack may take one plane past it. One long sequence among many short ones (a plane
    mostly padding, 69 GB) takes the dq kernel in both modes. (No kernel runs here: the choice only.)"""
    import importlib

    backward = importlib.import_module("numba_flash.backward")  # the module (the package exports the function)
    cfg = backward.mma_config(128)

    def problem(n_seq, total, max_len):
        q = np.zeros((total, 16, 128), np.float16)  # only the shapes and the longest length matter here
        cu = np.linspace(0, total, n_seq + 1).astype(np.int32)
        return nf_varlen._problem(q, q, q, cu, cu, max_len, max_len, True, None, (-1, -1), 0.0, None, False)

    long_pack = problem(64, 64 * 4096, 8192)
    assert backward.dq_scheme(long_pack, cfg, True)[0] == "kernel"
    scheme, splits, why = nf_varlen.dq_for_pack(long_pack, cfg, True)
    assert scheme == "splits" and splits == 1, why
    assert nf_varlen.dq_for_pack(long_pack, cfg, False)[0] == "atomic"
    lopsided = problem(256, 65536, 32768)
    for det in (True, False):
        scheme, _, why = nf_varlen.dq_for_pack(lopsided, cfg, det)
        assert scheme == "kernel" and "past 4 x the packed dQ" in why, why


@pytest.mark.heavy
def test_other_sequences_have_no_effect():
    """The second sequence sees only its own rows: NaN in every other sequence's q, k, v and dout leaves its out,
    lse and gradients bitwise what they are without the NaN."""
    cu_q, cu_k, q, k, v, do = _pack(3, [20, 50, 10], [30, 45, 20], 2, 1, 64)
    rows, keys = slice(cu_q[1], cu_q[2]), slice(cu_k[1], cu_k[2])

    def poisoned(x, s):
        y = np.full_like(x, np.nan)
        y[s] = x[s]
        return y

    args = (cu_q, cu_k, 50, 45)
    q_p, do_p, k_p, v_p = poisoned(q, rows), poisoned(do, rows), poisoned(k, keys), poisoned(v, keys)
    out, lse = numba_flash.varlen_forward(q_p, k_p, v_p, *args, causal=True)
    clean, clean_lse = numba_flash.varlen_forward(q, k, v, *args, causal=True)
    np.testing.assert_array_equal(out[rows], clean[rows])
    np.testing.assert_array_equal(lse[:, rows], clean_lse[:, rows])
    grads = numba_flash.varlen_backward(q_p, k_p, v_p, out, lse, do_p, *args, causal=True)
    clean_grads = numba_flash.varlen_backward(q, k, v, clean, clean_lse, do, *args, causal=True)
    for g, c, s in zip(grads, clean_grads, (rows, keys, keys)):
        np.testing.assert_array_equal(g[s], c[s])


@pytest.mark.skipif(ml_dtypes is None, reason="NumPy bfloat16 needs ml_dtypes")
def test_varlen_bf16_forward():
    cu_q, cu_k, q, k, v, _ = _pack(4, [30, 70], [50, 70], 2, 1, 64, dtype=ml_dtypes.bfloat16)
    out, _ = numba_flash.varlen_forward(q, k, v, cu_q, cu_k, 70, 70, causal=True)
    o64, _ = reference.varlen_attention(*(x.astype(np.float32) for x in (q, k, v)), cu_q, cu_k, causal=True)
    assert np.abs(out.astype(np.float64) - o64).max() <= 2 * 2.0**-8 * np.abs(o64).max() + 1e-3


def test_varlen_of_one_sequence_is_the_dense_call():
    """B = 1: the same kernels as numba_flash.forward / backward on (1, H, N, d), the same bits."""
    cu_q, cu_k, q, k, v, do = _pack(6, [70], [90], 2, 1, 64)
    out, lse = numba_flash.varlen_forward(q, k, v, cu_q, cu_k, 70, 90, causal=True)
    dense = lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)[None])  # noqa: E731
    o_d, l_d = numba_flash.forward(dense(q), dense(k), dense(v), causal=True)
    np.testing.assert_array_equal(out, o_d[0].transpose(1, 0, 2))
    np.testing.assert_array_equal(lse, l_d[0])
    g = numba_flash.varlen_backward(q, k, v, out, lse, do, cu_q, cu_k, 70, 90, causal=True)
    g_d = numba_flash.backward(dense(q), dense(k), dense(v), o_d, l_d, dense(do), causal=True)
    for x, y in zip(g, g_d):
        np.testing.assert_array_equal(x, y[0].transpose(1, 0, 2))


# --- bad input: refused before any kernel runs, naming what was given and what is accepted --------------
def _small():
    cu = np.array([0, 3, 8], np.int32)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 2, 16)).astype(np.float16) for _ in range(3))
    return cu, q, k, v


@pytest.mark.parametrize("change,err,match", [
    (dict(cu_q=np.array([0, 3, 8], np.int64)), TypeError, "cu_seqlens_q has dtype int64; accepted: int32"),
    (dict(cu_q=np.array([0], np.int32)), ValueError, r"cu_seqlens_q has shape \(1,\)"),
    (dict(cu_k=np.array([0, 8], np.int32)), ValueError, "cu_seqlens_q holds 2 sequences and cu_seqlens_k 1"),
    (dict(cu_q=np.array([1, 3, 8], np.int32)), ValueError, r"cu_seqlens_q\[0\] = 1"),
    (dict(cu_q=np.array([0, 6, 5], np.int32)), ValueError, "cu_seqlens_q decreases at sequence 1"),
    (dict(cu_q=np.array([0, 3, 7], np.int32)), ValueError, r"cu_seqlens_q\[-1\] = 7 but the packed arrays hold 8"),
    (dict(max_q=4), ValueError, "sequence 1 has 5 rows by cu_seqlens_q but max_seqlen_q = 4"),
    (dict(max_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    (dict(max_q=5.0), TypeError, "max_seqlen_q must be an int"),
    (dict(q4=True), ValueError, r"varlen takes packed arrays: \(total_q, H, d\)"),
    (dict(f32=True), NotImplementedError, "varlen forward: built into the 'mma' tensor-core kernels only"),
])
def test_bad_varlen_input_is_refused(change, err, match):
    cu, q, k, v = _small()
    cu_q, cu_k = change.get("cu_q", cu), change.get("cu_k", cu)
    if change.get("q4"):
        q = q[None]
    if change.get("f32"):
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
    with pytest.raises(err, match=match):
        numba_flash.varlen_forward(q, k, v, cu_q, cu_k, change.get("max_q", 5), change.get("max_k", 5))


def test_no_keys_or_no_queries_still_refuse_what_varlen_cannot_run():
    """No kernel runs when the pack has no keys (or no queries), but float32 is refused all the same."""
    cu0 = np.zeros(3, np.int32)
    cu, q, k, v = _small()
    q32, k0 = q.astype(np.float32), np.zeros((0, 2, 16), np.float32)
    with pytest.raises(NotImplementedError, match="varlen forward"):
        numba_flash.varlen_forward(q32, k0, k0, cu, cu0, 5, 0)
    out, lse = numba_flash.varlen_forward(q, k0.astype(np.float16), k0.astype(np.float16), cu, cu0, 5, 0)
    assert (out == 0).all() and np.isneginf(lse).all()
    with pytest.raises(NotImplementedError, match="varlen backward"):
        numba_flash.varlen_backward(q32, k0, k0, q32, lse, q32, cu, cu0, 5, 0)


def test_unchecked_offsets_skip_the_host_read(monkeypatch):
    """check_seqlens=False never reads the offsets back (no host synchronisation): wrong ones are not caught."""
    cu, q, k, v = _small()
    monkeypatch.setattr(nf_varlen, "_host_ints", lambda cu: pytest.fail("the offsets were read back"))
    bad = np.array([0, 3, 7], np.int32)  # ends one row short of the pack: not caught without the check
    out, _ = numba_flash.varlen_forward(q, k, v, bad, bad, 5, 5, check_seqlens=False)
    assert out.shape == q.shape


def test_varlen_backward_checks_lse_layout():
    cu, q, k, v = _small()
    out, lse = numba_flash.varlen_forward(q, k, v, cu, cu, 5, 5)
    with pytest.raises(ValueError, match=r"lse has shape \(8, 2\); accepted: \(2, 8\) \(\(H, total_q\)"):
        numba_flash.varlen_backward(q, k, v, out, lse.T.copy(), out, cu, cu, 5, 5)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d,causal,det", [(160, True, True), (256, False, False), (200, True, True)])
def test_varlen_backward_above_128(d, causal, det):
    """Head dims 129..256 (padded to 192 / 256): the varlen backward on the split-layout dkdv, GQA 2, the
    packs of the dense tests (a sequence without queries, one with fewer keys than queries, one without keys).
    (The simulator ran d 160 causal GQA 2 with lengths [20, 9] x [30, 5]: 8 minutes, too long for CI.)"""
    _check(_pack(3, LENS_Q, LENS_K, 4, 2, d), dict(causal=causal), det=det)
