"""User mods (numba_flash.mods) compiled into the tensor-core forwards: mask_mod, score_mod, document_mask.

Each kernel case runs ``numba_flash.forward`` with a Python mod and checks it against the float64 reference
running the same function (reference.standard_attention's mask_mod / score_mod) by flash-attention's rule.
The aux arrays are exactly the problem's lengths, so a mod called past Nq or Nk would index out of range
(the simulator raises). Shapes are not tile multiples. Also: the build key follows the mod's code, closure,
globals and aux types; bad mods and kernels without user mods are refused.

On the simulator (CI) and on the GPU alike (``anywhere``).
"""
from __future__ import annotations

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
