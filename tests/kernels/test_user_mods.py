"""User mods (numba_flash.mods) compiled into the tensor-core forwards: mask_mod, score_mod, document_mask.

Each kernel case runs ``numba_flash.forward`` with a Python mod and checks it against the float64 reference
running the same function (reference.standard_attention's mask_mod / score_mod) by flash-attention's rule.
The aux arrays are exactly the problem's lengths, so a mod called past Nq or Nk would index out of range
(the simulator raises). Shapes are not tile multiples. Also: the build key follows the mod's code, closure,
globals and aux types; bad mods and kernels without user mods are refused.

On the simulator (CI) and on the GPU alike (``anywhere``).
"""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import numba_flash
import reference
from numba_flash.blocks.mods import UserMod
from numba_flash.mods import MaskMod, ScoreMod, document_mask
from test_mods import _bound, _inputs

pytestmark = pytest.mark.anywhere

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def checkerboard(b, h, q_idx, kv_idx):
    return (q_idx // 8 + kv_idx // 8 + h) % 3 != 0


def rel_bias(score, b, h, q_idx, kv_idx, table, n_k):
    return score + table[h, q_idx - kv_idx + n_k[0]]


def tanh_cap(score, b, h, q_idx, kv_idx):
    return 3.0 * math.tanh(score / 3.0) - 0.01 * abs(q_idx - kv_idx)


def _check(out, lse, o64, l64, o16):
    _bound(out.astype(np.float64), o64, o16.astype(np.float64), 1e-3)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(l64))
    fin = np.isfinite(l64)
    np.testing.assert_allclose(lse[fin], l64[fin], atol=1e-4 * max(1.0, np.abs(l64[fin]).max(initial=0)), rtol=0)
    assert (out[~fin] == 0).all(), "a row that sees no key must have O = 0"


def _run(case, rng):
    B, H, n_q, n_k, d, causal, which = case
    q, k, v, _ = _inputs(int(rng.integers(2**31)), B, H, H, n_q, n_k, d)
    table = rng.standard_normal((H, n_q + n_k + 1)).astype(np.float32)
    n_k_arr = np.array([n_k], np.int32)
    if which == "mask+score":
        kw = dict(mask_mod=checkerboard, score_mod=ScoreMod(rel_bias, aux=(table, n_k_arr)))
        ref = dict(mask_mod=checkerboard, score_mod=rel_bias, score_aux=(table, n_k_arr))
    elif which == "score":
        kw = dict(score_mod=tanh_cap, softcap=5.0)
        ref = dict(score_mod=tanh_cap, softcap=5.0)
    else:  # document mask: 3 documents of random lengths per batch row
        seg = np.sort(rng.integers(0, 3, (B, n_q)).astype(np.int32), axis=1)
        kw = dict(mask_mod=document_mask(seg))
        ref = dict(mask_mod=lambda b, h, i, j, s: s[b, i] == s[b, j], mask_aux=(seg,))
    out, lse = numba_flash.forward(q, k, v, causal=causal, **kw)
    o64, l64 = reference.standard_attention(q, k, v, causal=causal, **ref)
    o16, _ = reference.standard_attention(q, k, v, causal=causal, dtype=np.float16, **ref)
    _check(out, lse, o64, l64, o16)


# (B, H, Nq, Nk, d, causal, mods)
CASES = [
    (1, 2, 70, 91, 64, True, "mask+score"),
    (2, 1, 45, 45, 64, True, "document"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Nq{c[2]}-Nk{c[3]}-{c[6]}{'-causal' if c[5] else ''}")
def test_user_mods_in_the_wgmma_forward(case, rng):
    assert numba_flash.api.mma_config(case[4], case[5]).has("wgmma")
    _run(case, rng)


@pytest.mark.slow
def test_user_mods_in_the_mma_sync_forward(rng, monkeypatch):
    """The mma.sync forward (sm_80-89; sm_90 and the simulator take the wgmma forward), two m-tiles a warp."""
    monkeypatch.setattr(numba_flash.api, "_wgmma_here", lambda: False)
    assert not numba_flash.api.mma_config(64, False).has("wgmma")
    _run((1, 1, 40, 57, 64, False, "mask+score"), rng)


@pytest.mark.slow
@pytest.mark.skipif(ml_dtypes is None, reason="NumPy bfloat16 needs ml_dtypes")
def test_score_mod_bf16_with_softcap(rng):
    q, k, v, _ = _inputs(int(rng.integers(2**31)), 1, 2, 2, 33, 60, 64, dtype=ml_dtypes.bfloat16)
    out, lse = numba_flash.forward(q, k, v, score_mod=tanh_cap, softcap=5.0, causal=True)
    o64, _ = reference.standard_attention(*(x.astype(np.float32) for x in (q, k, v)), score_mod=tanh_cap,
                                          softcap=5.0, causal=True)
    err = np.abs(out.astype(np.float64) - o64).max()
    assert err <= 2 * 2.0**-8 * np.abs(o64).max() + 1e-3, err


def test_explain_names_the_user_mods():
    q = np.zeros((1, 1, 8, 64), np.float16)
    text = numba_flash.explain(q, q, q, mask_mod=checkerboard, score_mod=tanh_cap)
    assert "mask_mod" in text and "checkerboard" in text and "score_mod" in text and "tanh_cap" in text


# ---------------------------------------------------------------------------------------------------------
# The build key: what makes a mod's kernel the same or another
# ---------------------------------------------------------------------------------------------------------
def _key(fn, leading=4, aux=()):
    return UserMod(fn, leading, aux).cache_key


def test_the_key_follows_code_closure_globals_and_aux_types():
    def make(width):
        def near(b, h, q_idx, kv_idx):
            return abs(q_idx - kv_idx) <= width
        return near

    assert _key(make(4)) == _key(make(4)), "a redefinition with the same code and closure reuses the kernel"
    assert _key(make(4)) != _key(make(5)), "a closure value is compiled in: another value, another kernel"

    def other(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= 3

    assert _key(other) != _key(make(3))
    assert _key(checkerboard, aux=(("int32", 1),)) != _key(checkerboard, aux=(("int64", 1),))
    assert _key(checkerboard, aux=(("int32", 1),)) != _key(checkerboard, aux=(("int32", 2),))
    g = {"LIMIT": 3, "abs": abs}
    src = "def lim(b, h, q_idx, kv_idx):\n    return q_idx - kv_idx < LIMIT\n"
    exec(src, g)
    k3 = _key(g["lim"])
    g["LIMIT"] = 4
    assert _key(g["lim"]) != k3, "a global the code names is frozen into the kernel: part of the key"
    import types

    settings = types.ModuleType("user_settings")  # a user module whose attribute the mod reads
    settings.WIDTH = 3
    g2 = {"settings": settings, "abs": abs}
    exec("def by_module(b, h, q_idx, kv_idx):\n    return abs(q_idx - kv_idx) <= settings.WIDTH\n", g2)
    k_mod = _key(g2["by_module"])
    settings.WIDTH = 4
    assert _key(g2["by_module"]) != k_mod, "a user module's attribute is frozen into the kernel: part of the key"
    from numba_flash import jit_cache

    jit_cache.canonical(("mma_forward", numba_flash.api.Mods(mask_mod=UserMod(make(4), 4, ()))))  # renders


def test_a_device_array_in_the_closure_is_refused():
    from numba import cuda

    arr = cuda.to_device(np.zeros(4, np.int32))

    def reads(b, h, q_idx, kv_idx):
        return arr[q_idx] == 0

    with pytest.raises(TypeError, match="pass device arrays as aux"):
        _key(reads)


# ---------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------
def test_kernels_without_user_mods_refuse_them():
    q16 = np.zeros((1, 1, 8, 64), np.float16)
    q32 = np.zeros((1, 1, 8, 64), np.float32)
    with pytest.raises(NotImplementedError, match="kernel 'simt'"):
        numba_flash.forward(q16, q16, q16, mask_mod=checkerboard, kernel="simt")
    with pytest.raises(NotImplementedError, match="float16 / bfloat16"):
        numba_flash.forward(q32, q32, q32, mask_mod=checkerboard)
    with pytest.raises(NotImplementedError, match="tf32x3"):
        numba_flash.forward(q32, q32, q32, score_mod=tanh_cap, kernel="tf32x3")


@pytest.mark.parametrize("kw, err, match", [
    (lambda: dict(mask_mod=3), TypeError, "mask_mod must be a function"),
    (lambda: dict(mask_mod=ScoreMod(tanh_cap)), TypeError, "got a ScoreMod"),
    (lambda: dict(score_mod=MaskMod(checkerboard)), TypeError, "got a MaskMod"),
    (lambda: dict(mask_mod=MaskMod(checkerboard, aux=np.zeros(3))), TypeError, "aux must be a tuple"),
    (lambda: dict(mask_mod=MaskMod(checkerboard, aux=(np.zeros(3, np.float16),))), TypeError, "aux\\[0\\] has dtype float16"),
    (lambda: dict(mask_mod=MaskMod(checkerboard, aux=(np.int32(3),))), TypeError, "aux\\[0\\]"),
    (lambda: dict(mask_mod=document_mask(np.zeros((1, 7), np.int32))), ValueError, "has shape \\(1, 7\\); accepted: \\(1, 8\\)"),
    (lambda: dict(score_mod=ScoreMod(tanh_cap, grad=2.0)), TypeError, "grad must be a function"),
])
def test_bad_user_mods_are_refused(kw, err, match):
    q = np.zeros((1, 1, 8, 64), np.float16)
    with pytest.raises(err, match=match):
        numba_flash.forward(q, q, q, **kw())


# ---------------------------------------------------------------------------------------------------------
# The sm_90a build of user mods (ptxas -v): the wgmma forward, the sm_90 default, spills nothing
# ---------------------------------------------------------------------------------------------------------
def _user_mod_compile_source():
    from test_ptx import NO_GPU_PATCH

    return NO_GPU_PATCH + """
import json, re, subprocess, sys, tempfile
from numba import cuda
from numba_flash.blocks.mods import Mods, UserMod
from numba_flash.configs import MMA_WGMMA
from numba_flash.kernels import wgmma_forward
from numba_flash.mods import same_document

def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + table.shape[1] // 2]

builds = {"document-causal": (True, Mods(mask_mod=UserMod(same_document, 4, (("int32", 2), ("int32", 2))))),
          "relbias-full": (False, Mods(score_mod=UserMod(rel_bias, 5, (("float32", 2),))))}
out = {}
for name, (causal, mods) in builds.items():
    ptx, _ = cuda.compile_ptx(wgmma_forward.kernel_source(MMA_WGMMA[128, causal], causal, "bfloat16", False, mods),
                              wgmma_forward.kernel_signature(mods), cc=(9, 0, "a"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([sys.argv[-1], "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    rep = r.stderr + r.stdout
    m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
    out[name] = dict(rc=r.returncode, stack=int(m.group(1)) if m else -1,
                     spills=int(m.group(2)) + int(m.group(3)) if m else -1, log=rep[-600:])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_user_mod_builds_for_sm90a_spill_nothing(tmp_path):
    from test_ptx import run_compile_child

    got = run_compile_child(_user_mod_compile_source(), [], tmp_path)
    for name, r in got.items():
        assert r["rc"] == 0, (name, r["log"])
        assert (r["stack"], r["spills"]) == (0, 0), (name, r)


# ---------------------------------------------------------------------------------------------------------
# The backward: the same mods in the dkdv / dq kernels, a score mod with its grad (ScoreMod(fn, grad=...))
# ---------------------------------------------------------------------------------------------------------
bwd_module = importlib.import_module("numba_flash.backward")  # (numba_flash.backward is the function)


def rel_bias_grad(score, b, h, q_idx, kv_idx, table, n_k):
    return 1.0


def tanh_cap_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / 3.0)
    return 1.0 - t * t


def _run_backward(case, rng, deterministic=True, d=64):
    """numba_flash.backward with the mods against reference.attention_backward (float64) by flash-attention's rule;
    out and lse from the float64 reference (the forward's kernels are the forward tests')."""
    B, H, n_q, n_k, causal, which = case
    q, k, v, do = _inputs(int(rng.integers(2**31)), B, H, H, n_q, n_k, d)
    table = rng.standard_normal((H, n_q + n_k + 1)).astype(np.float32)
    n_k_arr = np.array([n_k], np.int32)
    if which == "mask+score":
        kw = dict(mask_mod=checkerboard, score_mod=ScoreMod(rel_bias, grad=rel_bias_grad, aux=(table, n_k_arr)))
        ref = dict(mask_mod=checkerboard, score_mod=rel_bias, score_mod_grad=rel_bias_grad, score_aux=(table, n_k_arr))
    elif which == "score":
        kw = dict(score_mod=ScoreMod(tanh_cap, grad=tanh_cap_grad), softcap=5.0)
        ref = dict(score_mod=tanh_cap, score_mod_grad=tanh_cap_grad, softcap=5.0)
    else:  # document mask: 3 documents of random lengths per batch row
        seg_q = np.sort(rng.integers(0, 3, (B, n_q)).astype(np.int32), axis=1)
        seg_k = np.sort(rng.integers(0, 3, (B, n_k)).astype(np.int32), axis=1)
        kw = dict(mask_mod=document_mask(seg_q, seg_k))
        ref = dict(mask_mod=lambda b, h, i, j, sq, sk: sq[b, i] == sk[b, j], mask_aux=(seg_q, seg_k))
    fwd = {n: x for n, x in ref.items() if n != "score_mod_grad"}
    o64, l64 = reference.standard_attention(q, k, v, causal=causal, **fwd)
    grads = numba_flash.backward(q, k, v, o64.astype(q.dtype), l64.astype(np.float32), do, causal=causal,
                                 deterministic=deterministic, **kw)
    exact = reference.attention_backward(q, k, v, o64, l64, do, causal=causal, **ref)
    o16, l16 = reference.standard_attention(q, k, v, causal=causal, dtype=np.float16, **fwd)
    naive = reference.attention_backward(q, k, v, o16, l16, do, causal=causal, dtype=np.float16, **ref)
    for name, ours, x, nv in zip(("dq", "dk", "dv"), grads, exact, naive):
        assert np.isfinite(ours.astype(np.float64)).all(), name
        _bound(ours.astype(np.float64), x, nv.astype(np.float64), 2e-3 * max(1.0, np.abs(x).max()))


def test_user_mods_in_the_wgmma_backward(rng):
    """deterministic=False on sm_90 (and the simulator): the wgmma dkdv forms dQ with atomic adds."""
    if not bwd_module.mma_config(64).get("dkdv_wgmma"):
        pytest.skip("no wgmma dkdv on this GPU (sm_90 only)")
    _run_backward((1, 1, 40, 53, True, "mask+score"), rng, deterministic=False)


def test_user_mods_in_the_mma_sync_dkdv_and_dq_kernels(rng):
    """deterministic=True at this size: the mma.sync dkdv without dQ and the dq kernel; a score mod through the
    softcap (the chain rule through both)."""
    q = np.zeros((1, 1, 20, 64), np.float16)
    assert "separate dq kernel" in numba_flash.explain_backward(q, q, q, score_mod=ScoreMod(tanh_cap,
                                                                                            grad=tanh_cap_grad))
    _run_backward((1, 1, 20, 37, False, "score"), rng)


@pytest.mark.heavy
def test_user_mods_in_the_mma_sync_atomic_dkdv(rng, monkeypatch):
    """The mma.sync dkdv with atomic dQ (sm_80-89's, with 8 warps at d = 128)."""
    monkeypatch.setattr(bwd_module, "current_wgmma", lambda: False)
    assert not bwd_module.mma_config(64).get("dkdv_wgmma")
    _run_backward((1, 2, 40, 53, True, "mask+score"), rng, deterministic=False)


@pytest.mark.heavy
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma_sync"])
def test_user_mods_through_the_deterministic_splits(rng, monkeypatch, wgmma):
    """The splits with user mods add into zeroed planes (forced: the cost model takes the dq kernel this small)."""
    from numba_flash.blocks import schedule

    monkeypatch.setattr(schedule, "SPLITS_SLOWER_OK", 1e9)
    if not wgmma:
        monkeypatch.setattr(bwd_module, "current_wgmma", lambda: False)
    d = 64 if wgmma else 128  # (the mma.sync table has no splits at d = 64)
    q, kv = np.zeros((1, 1, 45, d), np.float16), np.zeros((1, 1, 300, d), np.float16)
    if "deterministic splits" not in numba_flash.explain_backward(q, kv, kv):
        pytest.skip(f"no dQ splits at head dim {d} here")
    _run_backward((1, 1, 45, 300, False, "document" if wgmma else "mask+score"), rng, d=d)


@pytest.mark.heavy
def test_user_mods_in_the_split_layout_dkdv(rng):
    """d = 200 -> 256: the split-layout mma.sync dkdv (two warps per 16 keys) and the dq kernel."""
    _run_backward((1, 1, 16, 20, True, "mask+score"), rng, d=200)


def test_backward_refuses_a_score_mod_without_grad_and_other_kernels():
    q = np.zeros((1, 1, 8, 64), np.float16)
    lse = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="has no grad.*ScoreMod\\(fn, grad=fn_grad\\)"):
        numba_flash.backward(q, q, q, q, lse, q, score_mod=tanh_cap)
    with pytest.raises(ValueError, match="has no grad"):
        numba_flash.explain_backward(q, q, q, score_mod=ScoreMod(tanh_cap))
    with pytest.raises(NotImplementedError, match="mask_mod.*'mma' kernels only.*kernel='simt'"):
        numba_flash.backward(q, q, q, q, lse, q, mask_mod=checkerboard, kernel="simt")
    q32 = np.zeros((1, 1, 8, 64), np.float32)
    for kernel in ("auto", "tf32x3"):
        with pytest.raises(NotImplementedError, match="score_mod.*'mma' kernels only"):
            numba_flash.backward(q32, q32, q32, q32, lse, q32, score_mod=ScoreMod(tanh_cap, grad=tanh_cap_grad),
                                 kernel=kernel)
    with pytest.raises(TypeError, match="grad must be a function"):
        numba_flash.backward(q, q, q, q, lse, q, score_mod=ScoreMod(tanh_cap, grad=1.0))
    with pytest.raises(ValueError, match="has shape \\(1, 7\\); accepted: \\(1, 8\\)"):
        numba_flash.backward(q, q, q, q, lse, q, mask_mod=document_mask(np.zeros((1, 7), np.int32)))


def test_the_grad_is_part_of_the_backward_build_key_only():
    spec = UserMod(tanh_cap, 5, ())
    assert UserMod(tanh_cap, 5, (), grad=tanh_cap_grad).cache_key != spec.cache_key
    assert UserMod(tanh_cap, 5, (), grad=tanh_cap_grad) == UserMod(tanh_cap, 5, (), grad=tanh_cap_grad)
    assert spec.cache_key == ("user_mod", 5, spec.cache_key[2], ()), "the forward's key has no grad entry"
