"""fp32 backward on tensor cores (numba_flash.kernels.tf32_backward, 3xTF32): kernels, API, sm_90 build.

The simulator runs the fragment indexing of both patterns through the twins of mma.m16n8k8.tf32
and cvt.rn / cvt.rna.tf32 on small tiles; the tensor core's truncating accumulation is covered on the GPU
(tests/kernels/test_gpu_backward.py::test_tf32x3_backward_as_accurate_as_simt).
"""
from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
from numba import config, cuda

import numba_flash
import reference
from numba_flash.configs import SMEM_PER_BLOCK_MAX, TF32_BWD_SPILL_OK, TF32_BWD_TABLE
from numba_flash import backward_plan
from numba_flash.blocks import schedule
from numba_flash.blocks.tf32 import head_dim_for
from numba_flash.kernels import tf32_backward as tb
from test_mma_forward import attention_f64
from gpu_helpers import needs_gpu
from test_backward_sim import EPS32, gradient_bounds
from test_ptx import NO_GPU_PATCH, in_simulator, run_compile_child


def problem(B, H, Hkv, n_q, n_k, d, causal, seed=0, scale=None):
    """fp32 q, k, v, dO and the forward's O, L (from float64), and the float64 reference gradients."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, n_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, n_k, d)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, H, n_q, d)).astype(np.float32)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o, lse = (x.astype(np.float32) for x in attention_f64(q, k, v, causal, scale))
    refs = reference.attention_backward(q, k, v, o, lse, do, causal=causal, softmax_scale=scale)
    return (q, k, v, o, lse, do), refs, scale


def run_launcher(vals, d, causal, scale, config):
    """backward_plan.launch_tf32 on the problem; a "split_round" key of config goes to launch's argument of that name."""
    config = dict(config)
    kw = {"split_round": config.pop("split_round")} if "split_round" in config else {}
    q, k, v, o, lse, do = (cuda.to_device(x) for x in vals)
    B, H, n_q, _ = vals[0].shape
    rows = (B * H, schedule.padded_rows(n_q))
    l2, dd = cuda.device_array(rows, np.float32), cuda.device_array(rows, np.float32)
    grads = [cuda.to_device(np.full(x.shape, np.nan, np.float32)) for x in vals[:3]]  # unwritten shows as NaN
    backward_plan.launch_tf32(q, k, v, o, do, lse, l2, dd, *grads, causal=causal, softmax_scale=scale, d=d, config=config, **kw)
    return [g.copy_to_host() for g in grads]


def check(grads, refs, tol=2e-6):
    """fp32-level: max error below tol relative to the gradient's scale (at least 1)."""
    for name, ours, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert np.all(np.isfinite(ours)), f"{name}: non-finite (unwritten or nan) entries"
        err = np.abs(ours - ref).max()
        assert err <= tol * max(1.0, np.abs(ref).max()), f"{name}: {err:.3e} (max |ref| {np.abs(ref).max():.3e})"


SMALL = dict(dkdv=(32, 16), dq=(32, 16), head_dim=32)
# (head dim, causal): the launches' plan of each configs.TF32_BWD_TABLE entry (backward_plan.config_from_tiles)
TF32_PLANS = {(hd, causal): backward_plan.tf32_config(hd, causal) for _, hd, causal in TF32_BWD_TABLE}


# --------------------------------------------------------------------------------------------
# The kernels on small tiles (2 warps)
# --------------------------------------------------------------------------------------------
@in_simulator
@pytest.mark.parametrize("B,H,Hkv,n_q,n_k,d,causal,config", [
    (1, 2, 1, 37, 45, 24, False, {}),   # GQA, d 24 -> 32, ragged tiles
    (1, 1, 1, 40, 29, 32, True, {}),    # Nq > Nk causal: 11 rows see nothing (dq = 0)
    (1, 2, 2, 21, 50, 16, True, {}),    # Nq < Nk causal
    pytest.param(2, 2, 1, 9, 20, 8, False, {}, marks=pytest.mark.slow),  # B 2 x GQA: 125 s under pytest -n 2
    (1, 1, 1, 20, 36, 52, False, dict(dkdv=(16, 8), dq=(16, 8), head_dim=64)),  # 1 warp, d 52 -> 64
    (1, 1, 1, 23, 30, 32, True, dict(split_round="rna")),  # the split below sm_90 (cvt.rna)
    pytest.param(1, 1, 1, 18, 25, 28, False, dict(split_round="rn_raw"), marks=pytest.mark.variant),  # lo unrounded
])
def test_tf32x3_backward_kernels_sim(B, H, Hkv, n_q, n_k, d, causal, config):
    vals, refs, scale = problem(B, H, Hkv, n_q, n_k, d, causal)
    grads = run_launcher(vals, d, causal, scale, {**SMALL, **config})
    check(grads, refs)
    if causal and n_q > n_k:
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)


# --------------------------------------------------------------------------------------------
# dQ formed in the dK/dV kernel: the atomic grid and the deterministic splits, plane by plane
# --------------------------------------------------------------------------------------------
def run_dq_in_dkdv(vals, d, causal, scale, config, splits):
    """backward_plan.launch_tf32 with dq_acc: splits None = one zeroed plane (deterministic=False), else that many planes
    filled with NaN (the first launch must store; the convert must read a plane only from its first row).
    Returns (grads, planes as (S, B, H, NQ_PAD, HEAD_DIM))."""
    q, k, v, o, lse, do = (cuda.to_device(x) for x in vals)
    B, H, n_q, _ = vals[0].shape
    rows = (B * H, schedule.padded_rows(n_q))
    l2, dd = cuda.device_array(rows, np.float32), cuda.device_array(rows, np.float32)
    grads = [cuda.to_device(np.full(x.shape, np.nan, np.float32)) for x in vals[:3]]
    planes = splits or 1
    acc = cuda.to_device(np.full((planes * B * H, rows[1], config["head_dim"]), np.nan if splits else 0.0,
                                 np.float32))
    backward_plan.launch_tf32(q, k, v, o, do, lse, l2, dd, *grads, causal=causal, softmax_scale=scale, d=d, config=config,
              dq_acc=acc, dq_splits=splits)
    return [g.copy_to_host() for g in grads], acc.copy_to_host().reshape(planes, B, H, rows[1], -1)


@in_simulator
@pytest.mark.parametrize("B,H,Hkv,n_q,n_k,d,causal,tile,splits", [
    # dS over the step's Q / dO buffers (32 keys <= 40 words a row), 2 n-tiles a warp (red.v4 of 4 columns),
    # GQA 2, Nq > Nk: 2 splits over 3 key blocks, plane 1 starts at a later row, 11 rows see no key
    (1, 2, 1, 40, 70, 32, True, (32, 16), 2),
    # dS in a region of its own (64 keys > 40), 2 query groups x 2 column slices, Nq < Nk, 3 splits of 3
    pytest.param(1, 1, 1, 30, 150, 20, True, (64, 32), 3, marks=pytest.mark.slow),
    # deterministic=False: one zeroed plane, 4 warps each one n-tile wide (scalar-pair adds), d 28 -> 32
    (1, 1, 1, 23, 70, 28, False, (64, 16), None),
    # the shipped tiles' dQ phase: 4 n-tiles a warp (K by 16-byte loads, two red.v4 a row), 2 query groups x
    # 2 column slices, dS over the stage (64 keys <= 72 words), head dim 64
    pytest.param(1, 1, 1, 33, 100, 60, False, (64, 32), 2, marks=pytest.mark.slow),
])
def test_tf32x3_dq_in_dkdv_sim(B, H, Hkv, n_q, n_k, d, causal, tile, splits):
    """Every gradient at fp32 level, and each fp32 plane exactly its own key blocks' dS·K (unscaled) from a
    float64 reference: a block adding into another's plane, or a key block run twice or never, fails here
    even where the sum would not."""
    vals, refs, scale = problem(B, H, Hkv, n_q, n_k, d, causal, seed=n_k)
    config = {**SMALL, "dkdv_atomic": tile, "head_dim": head_dim_for(d)}
    dq_plane_check(vals, refs, scale, d, causal, config, splits)


@in_simulator
@pytest.mark.parametrize("n,splits", [(1, None), (3, 1)])
def test_tf32x3_keys_past_the_end_with_large_logits_sim(n, splits):
    """The dK/dV block that forms dQ holds keys past n_k, whose scores (Q against zero-filled K rows) are 0: where
    a row's L < -89, P = exp2(0 - L·log2 e) overflows fp32 and inf · 0 in dS K made dQ NaN (deterministic=False
    and the splits). Those keys are masked like every other hidden score."""
    rng = np.random.default_rng(n)
    d = 32
    q, k, v, do = (rng.standard_normal((1, 2, n, d)).astype(np.float32) * s for s in (8, 8, 1, 1))
    k_mean = k[0, 0].mean(0)
    q[0, 0, 0] = -8 * math.sqrt(d) * k_mean / np.linalg.norm(k_mean)  # every score of this row is very negative
    scale = 1 / math.sqrt(d)
    o, lse = (x.astype(np.float32) for x in attention_f64(q, k, v, False, scale))
    assert lse.min() < -89, lse.min()
    vals = (q, k, v, o, lse, do)
    refs = reference.attention_backward(*vals, softmax_scale=scale)
    grads, _ = run_dq_in_dkdv(vals, d, False, scale, {**SMALL, "dkdv_atomic": (32, 16)}, splits)
    # |S| ~ 1e2 here: fp32 rounding of the exponent and of dP - D (P one-hot: dS ~ 0) dwarfs max |ref|, so the
    # bound is per entry, the fp32 worst case of test_backward_sim (tf32x3 splits its operands to fp32 level)
    bounds = gradient_bounds(*vals, False, scale)
    for name, ours, ref, m in zip(("dq", "dk", "dv"), grads, refs, bounds):
        assert np.all(np.isfinite(ours)), f"{name}: {np.count_nonzero(~np.isfinite(ours))} non-finite entries"
        excess = np.abs(ours - ref) - (4 * (2 * n + d) * EPS32 * m + 1e-30)
        assert excess.max() <= 0, f"{name}: error above the bound by {excess.max():.3e}"


def dq_plane_check(vals, refs, scale, d, causal, config, splits, tol=2e-6):
    """run_dq_in_dkdv, then the gradients and each plane against float64 (relative to max(1, max |ref|);
    an indexing bug is O(1)); returns the gradients."""
    n_q, n_k = vals[0].shape[2], vals[1].shape[2]
    grads, planes = run_dq_in_dkdv(vals, d, causal, scale, config, splits)
    check(grads, refs, tol)
    bn, bm = config["dkdv_atomic"]
    if causal and n_q > n_k:  # rows that see no key: dQ exactly zero
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)
    want_planes = []  # the NumPy mirror of the scheme: K/V block j into plane j mod S, unscaled
    reference.flash_attention_backward(*(x.astype(np.float64) for x in vals), block_q=bm, block_k=bn, causal=causal,
                                       softmax_scale=scale, dq_splits=splits or 1, planes=want_planes)
    for plane in range(splits or 1):
        want = want_planes[plane]
        first = schedule.plane_first_row(plane, n_q, n_k, bn, bm, int(causal)) if splits else 0
        got = planes[plane][:, :, first:n_q]
        np.testing.assert_allclose(got[..., :d], want[:, :, first:], atol=tol * max(1.0, np.abs(want).max()),
                                   err_msg=f"plane {plane}")
        assert np.all(want[:, :, :first] == 0)  # ... and nothing was to be added before its first row
        assert np.all(got[..., d:] == 0)  # padded head-dim columns: zeros added (or stored)
    return grads


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d,causal,splits,n_q,n_k", [(128, False, 3, 300, 700), (128, True, 2, 700, 300),
                                                    (64, True, 4, 300, 700), (64, False, 2, 500, 500),
                                                    (32, True, 3, 700, 300), (32, False, 2, 300, 700)])
def test_gpu_tf32x3_dq_splits(d, causal, splits, n_q, n_k):
    """The shipped dQ-in-dkdv tiles on the GPU with the splits forced (the default picks them by the SM
    count: at test sizes some head dims take the dq kernel): fp32-level gradients, every plane against
    float64 (planes NaN until written), and 3 runs bitwise equal."""
    vals, refs, scale = problem(1, 4, 2, n_q, n_k, d, causal, seed=d + n_q)
    config = backward_plan.tf32_config(d, causal)
    first = dq_plane_check(vals, refs, scale, d, causal, config, splits, tol=1e-5)  # the tensor core truncates
    for _ in range(3):
        again, _ = run_dq_in_dkdv(vals, d, causal, scale, config, splits)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


def test_tf32_dq_scheme(monkeypatch):
    """backward.dq_scheme for the tf32x3 family: the splits (default) and the atomic grid at the benchmark
    shape; the dq kernel in both modes on a GPU whose blocks get less shared memory than the dQ-in-dkdv
    tile needs (A100: 163 KiB) and for a table entry without one."""
    import importlib

    from numba_flash.api import validate

    bwd = importlib.import_module("numba_flash.backward")  # the module (the package exports the function)
    x = np.broadcast_to(np.float32(1), (4, 16, 4096, 128))  # no memory: only shapes and dtype are read
    p = validate(x, x, x)
    cfg = backward_plan.tf32_config(128, False)
    how, splits, why = bwd.dq_scheme(p, cfg, True, "tf32x3")
    assert how == "splits" and 1 <= splits <= 8 and "5 tile products" in why, why
    assert bwd.dq_scheme(p, cfg, False, "tf32x3")[0] == "atomic"
    no_tile = {key: val for key, val in cfg.items() if key != "dkdv_atomic"}
    assert bwd.dq_scheme(p, no_tile, True, "tf32x3")[0] == bwd.dq_scheme(p, no_tile, False, "tf32x3")[0] == "kernel"
    monkeypatch.setattr(bwd, "_device_smem", lambda: (163 * 1024, 164 * 1024))
    for d in (64, 128):
        y = np.broadcast_to(np.float32(1), (1, 4, 1024, d))
        for det in (True, False):
            how, _, why = bwd.dq_scheme(validate(y, y, y), backward_plan.tf32_config(d, True), det, "tf32x3")
            assert how == "kernel" and "shared memory" in why, (d, det, why)


def test_dq_in_dkdv_layouts():
    """atomic_dq_phase's warp split and where dS goes, for every shipped tile; and what cannot be built."""
    for (hd, causal), cfg in TF32_PLANS.items():
        if "dkdv_atomic" not in cfg:
            continue
        bn, bm = cfg["dkdv_atomic"]
        qg, slices, dq_tiles = tb.dq_warps(bn, bm, hd)
        assert qg * slices == bn // 16 and dq_tiles * 8 * slices == hd, (hd, causal)
        assert not tb.atomic_problems(bn, bm, hd), (hd, causal)
        # d128's 128 x 32 tile has no room for a dS region (2 x 16 KiB): it goes over the step's Q / dO
        # buffers; the smaller head dims' tiles (64 or 128 keys, more than a 40- or 72-word row) get their own
        assert tb.ds_in_stage(bn, hd) == (hd == 128), (hd, causal)
        if hd == 128:
            assert tb.smem_bytes("dkdv", bn, bm, hd) + 2 * 4 * bn * bm > SMEM_PER_BLOCK_MAX
    assert tb.smem_bytes("dkdv", 128, 32, 128, atomic_dq=True) == tb.smem_bytes("dkdv", 128, 32, 128) == 217600
    assert tb.smem_bytes("dkdv", 128, 64, 64, atomic_dq=True) == 156672 + 65536 <= SMEM_PER_BLOCK_MAX
    assert tb.atomic_problems(128, 64, 128)  # 64-query tiles at d128: 288 KB of shared memory even without dS
    assert "groups of 16 queries" in tb.atomic_problems(32, 8, 32)[0]  # add_dq reads 16-row fragments of dS
    with pytest.raises(ValueError, match="atomic dQ is built into the dkdv kernel only"):
        tb.build("dq", 128, 32, 128, False, atomic_dq=True)
    with pytest.raises(ValueError, match="dq_splits=1"):
        tb.build("dq", 128, 32, 128, False, dq_splits=1)


# --------------------------------------------------------------------------------------------
# sm_90 build of the shipped tiles: no spills, no local memory
# --------------------------------------------------------------------------------------------
CHILD = NO_GPU_PATCH + textwrap.dedent(
    """
    import json, re, subprocess, sys, tempfile
    from numba import cuda
    from numba_flash.backward_plan import tf32_config
    from numba_flash.configs import TF32_BWD_TABLE
    from numba_flash.kernels import tf32_backward as tb

    ptxas = sys.argv[-1]
    out = []
    builds = {"dkdv-atomic": 0, "dkdv-splits": 1, "dkdv-splits-first": 2}  # the dQ-in-dkdv builds: dq_splits
    for (hd, causal), cfg in sorted({(hd, c): tf32_config(hd, c) for _, hd, c in TF32_BWD_TABLE}.items()):
        runs = ["dkdv", "dq"] + [name for name in builds if "dkdv_atomic" in cfg]
        for kernel in runs:
            if kernel in builds:
                own, streamed = cfg["dkdv_atomic"]
                src = tb.source("dkdv", own, streamed, hd, causal, atomic_dq=True, dq_splits=builds[kernel])
                sig = tb.kernel_signature("dkdv", True, builds[kernel] > 0)
            else:
                own, streamed = cfg[kernel]
                src = tb.source(kernel, own, streamed, hd, causal)
                sig = tb.kernel_signature(kernel)
            ptx, _ = cuda.compile_ptx(src, sig, cc=(9, 0))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                               text=True)
            rep = r.stderr + r.stdout
            m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
            out.append(dict(hd=hd, kernel=kernel, causal=causal, own=own, streamed=streamed,
                            rc=r.returncode,
                            stack=int(m.group(1)), spills=int(m.group(2)) + int(m.group(3)),
                            registers=int(re.search(r"Used (\\d+) registers", rep).group(1)),
                            mma=ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
                            red=ptx.count("red.global.add"), st=ptx.count("st.global.v4.b32"),
                            cvt=ptx.count("cvt.rn.tf32.f32"), cvt_rna=ptx.count("cvt.rna.tf32.f32"),
                            local=ptx.count("ld.local") + ptx.count("st.local")))
    print(json.dumps(out))
    """
)


@pytest.mark.heavy  # ptxas over every shipped build; CI keeps the shipped-PTX hash check of the same kernels
def test_shipped_tf32_backward_configs_fit_sm90(tmp_path):
    """Every shipped tf32x3 backward kernel builds for sm_90: no local memory, no spills beyond
    configs.TF32_BWD_SPILL_OK, a block's registers within the 64K file, shared memory within 227 KiB."""
    reports = run_compile_child(CHILD, [], tmp_path)
    print(json.dumps(reports, indent=0))
    assert len(reports) == sum(2 + 3 * ("dkdv_atomic" in c) for c in TF32_PLANS.values())
    for rep in reports:
        where = json.dumps(rep)
        allowed = TF32_BWD_SPILL_OK.get((rep["kernel"], rep["own"], rep["streamed"], rep["hd"], rep["causal"]), 0)
        assert rep["rc"] == 0 and rep["spills"] <= allowed and rep["local"] == 0, where
        assert rep["stack"] == 0 or allowed, where
        assert rep["registers"] * 32 * (rep["own"] // 16) <= 65536, where
        assert rep["cvt"] > 0 and rep["cvt_rna"] == 0, where  # sm_90 builds split by cvt.rn (one F2FP each)
        atomic = rep["kernel"].startswith("dkdv-")
        smem = tb.smem_bytes("dkdv" if atomic else rep["kernel"], rep["own"], rep["streamed"], rep["hd"],
                             atomic_dq=atomic)
        assert smem <= 227 * 1024, where
        # dQ: added by red.global (atomic grid, later splits), stored by the splits' first launch, else neither
        assert (rep["red"] > 0, rep["st"] > 0) == (rep["kernel"] in ("dkdv-atomic", "dkdv-splits"),
                                                   rep["kernel"] == "dkdv-splits-first"), where


# --------------------------------------------------------------------------------------------
# The public path and the kernel choice
# --------------------------------------------------------------------------------------------
@in_simulator
def test_backward_tf32x3_public_sim(monkeypatch):
    """numba_flash.backward(kernel='tf32x3'): NumPy in and out, GQA causal. One-warp tiles: the shipped
    64-row ones take minutes in the simulator (the compile test covers those)."""
    monkeypatch.setattr(backward_plan, "tf32_config", lambda d, causal: dict(dkdv=(16, 8), dq=(16, 8), head_dim=32))
    vals, refs, scale = problem(1, 2, 1, 11, 19, 8, True, seed=3)
    grads = numba_flash.backward(*vals, causal=True, kernel="tf32x3")
    assert all(g.dtype == np.float32 for g in grads)
    check(grads, refs)


def test_explain_backward_tf32x3(rng):
    q = rng.standard_normal((1, 4, 64, 128)).astype(np.float32)
    k = q[:, :2].copy()
    text = numba_flash.explain_backward(q, k, k, causal=True, kernel="tf32x3")
    assert text.startswith("tf32x3 backward: fp32 on tensor cores"), text
    bn, bm = TF32_PLANS[128, True]["dkdv"]
    assert f"dkdv: {bn}-key tiles x {bm}-query tiles, {tb.threads(bn)} threads" in text, text
    assert "GQA" in text
    auto = numba_flash.explain_backward(q, q, q)
    if config.ENABLE_CUDASIM:  # auto keeps fp32 on SIMT in the simulator and names the option
        assert auto.startswith("simt backward") and "kernel='tf32x3'" in auto, auto


def test_auto_backward_fp32_is_tf32x3_off_the_simulator(rng, monkeypatch):
    """What auto picks for fp32 on an sm_80+ GPU, decided without one: tf32x3 where its conditions hold,
    else SIMT with the blocker named."""
    import sys
    import types

    import numba_flash.api as api

    bw = sys.modules["numba_flash.backward"]  # the attribute numba_flash.backward is the function

    gpu = types.SimpleNamespace(ENABLE_CUDASIM=False)
    monkeypatch.setattr(bw, "nb_config", gpu)
    monkeypatch.setattr(api, "nb_config", gpu)
    monkeypatch.setattr(api.cuda, "is_available", lambda: False)  # skips the cc query (sm_80+ assumed)
    for d in (24, 64, 128):
        q = rng.standard_normal((1, 2, 8, d)).astype(np.float32)
        family, cfg, reasons = bw.choose_backward(api.validate(q, q, q))
        assert family == "tf32x3" and cfg["head_dim"] == head_dim_for(d), (d, reasons)
    q = rng.standard_normal((1, 2, 8, 130)).astype(np.float32)
    family, _, reasons = bw.choose_backward(api.validate(q, q, q))
    assert family == "simt" and "head dim 130 > 128" in reasons[-1], reasons
    q = q[..., :64].copy()
    family, _, reasons = bw.choose_backward(api.validate(q, q, q), "simt")
    assert family == "simt" and "kernel='simt' was asked for" in reasons[-1], reasons


def test_tf32x3_backward_refuses(rng):
    h = rng.standard_normal((1, 1, 16, 32)).astype(np.float16)
    lse = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="kernel='tf32x3' cannot run.*float16"):
        numba_flash.backward(h, h, h, h, lse, h, kernel="tf32x3")
    with pytest.raises(ValueError, match="kernel='tf32x3' cannot run.*float16"):
        numba_flash.explain_backward(h, h, h, kernel="tf32x3")
    odd = rng.standard_normal((1, 1, 16, 30)).astype(np.float32)
    with pytest.raises(ValueError, match="kernel='tf32x3' cannot run.*d % 4 == 0"):
        numba_flash.explain_backward(odd, odd, odd, kernel="tf32x3")
    big = rng.standard_normal((1, 1, 8, 160)).astype(np.float32)
    with pytest.raises(ValueError, match="head dim 160 > 128"):
        numba_flash.explain_backward(big, big, big, kernel="tf32x3")


def test_tf32_backward_table_entries_can_be_built():
    for (hd, causal), cfg in TF32_PLANS.items():
        assert not tb.problems("dkdv", *cfg["dkdv"], hd) and not tb.problems("dq", *cfg["dq"], hd), (hd, causal)
        assert not {"dkdv_passes", "swizzle"} & set(cfg), (hd, causal)  # layouts that did not ship
