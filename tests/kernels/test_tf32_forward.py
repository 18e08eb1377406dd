"""fp32 on tensor cores (numba_flash.kernels.tf32_forward, 3xTF32): intrinsics, kernel, API, sm_90 build.

The simulator runs the kernel's fragment indexing through the twins of mma.m16n8k8.tf32 and
cvt.rn / cvt.rna.tf32 (numba_flash.ptx), so a wrong lane mapping or k-order fails here without a GPU; small
tiles (2 warps) keep each case to seconds. What the twins cannot show, the tensor core's truncating
accumulation, is covered on the GPU (tests/kernels/test_gpu_forward.py::test_tf32x3_as_accurate_as_simt).
"""
from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
from numba import cuda

import numba_flash
from numba_flash import ptx
from numba_flash.configs import TF32_TABLE
from numba_flash.kernels import tf32_forward as tf
from numba_flash.tiles import Tile
from test_mma_forward import attention_f64
from test_ptx import NO_GPU_PATCH, in_simulator, run_compile_child


# --------------------------------------------------------------------------------------------
# Intrinsics (check_* run in the simulator here and on a GPU in tests/kernels/test_gpu_ptx.py)
# --------------------------------------------------------------------------------------------
def tf32_rna_numpy(x):
    """Round float32 to tf32 (10 mantissa bits), ties away from zero; inf/nan unchanged."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return np.where(finite, rounded, bits.astype(np.uint32)).view(np.float32)


def tf32_rn_numpy(x):
    """Round float32 to tf32, ties to even (cvt.rn.tf32.f32); inf/nan unchanged. By arithmetic, not bits (the
    twin, ptx.mma._tf32_round_rn_twin, works on bits): a multiple of tf32's ulp at x's binade (denormals: the
    smallest binade's) by np.rint, which rounds half to even; past the largest float32, inf."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and nan are replaced below
        _, e = np.frexp(x.astype(np.float64))  # |x| = m 2^e, 0.5 <= m < 1: the leading bit is 2^(e-1)
        ulp = np.ldexp(1.0, np.maximum(e - 1, -126) - 10)
        rounded = (np.rint(x.astype(np.float64) / ulp) * ulp).astype(np.float32)  # overflow -> inf
    return np.where(np.isfinite(x), rounded, x)


def check_tf32_round(seed=0, rn=False):
    """ptx.tf32_round (cvt.rna) or, rn, ptx.tf32_round_rn (cvt.rn, sm_90+) bit for bit against NumPy, ties of
    both parities included (1 + 2^-11 is a tie with an even last bit: rna rounds it up, rn down)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal(200).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 200),
                        np.float32([1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, -(1 + 3 * 2**-11), np.inf, -np.inf,
                                    np.finfo(np.float32).max, 0.0, -0.0, 1e-40, -3e-41])]).astype(np.float32)
    round_ = ptx.tf32_round_rn if rn else ptx.tf32_round

    @cuda.jit
    def kernel(a, out):
        i = cuda.grid(1)
        if i < a.size:
            out[i] = round_(a[i])

    out = np.zeros_like(x)
    kernel[(x.size + 63) // 64, 64](x, out)
    expect = tf32_rn_numpy(x) if rn else tf32_rna_numpy(x)
    np.testing.assert_array_equal(out.view(np.uint32), expect.view(np.uint32))
    nan = np.float32([np.nan])
    kernel[1, 32](nan, out[:1])
    assert np.isnan(out[0])  # the GPU's canonical NaN may differ in bits: only NaN-ness is checked


def check_mma_tf32(seed=0):
    """m16n8k8 tf32 with fragments built from global memory by the documented (g, t) layout."""
    rng = np.random.default_rng(seed)
    A = tf32_rna_numpy(rng.standard_normal((16, 8)).astype(np.float32))
    B = tf32_rna_numpy(rng.standard_normal((8, 8)).astype(np.float32))
    C = rng.standard_normal((16, 8)).astype(np.float32)

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane & 3
        d0, d1, d2, d3 = ptx.mma_m16n8k8_tf32(a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[t, g], b[t + 4, g],
                                              c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t] = d0
        d[g, 2 * t + 1] = d1
        d[g + 8, 2 * t] = d2
        d[g + 8, 2 * t + 1] = d3

    D = np.zeros((16, 8), np.float32)
    kernel[1, 32](A, B, C, D)
    expect = A.astype(np.float64) @ B + C
    np.testing.assert_allclose(D, expect, rtol=0, atol=1e-5 * (1 + np.abs(expect).max()))


@in_simulator
@pytest.mark.parametrize("rn", [False, True])
def test_tf32_round_sim(rn):
    check_tf32_round(rn=rn)


@in_simulator
@pytest.mark.parametrize("seed", [0, 1])
def test_mma_tf32_sim(seed):
    check_mma_tf32(seed)


def test_fragment_coords_cover_the_tiles():
    a = {xy for lane in range(32) for xy in ptx.tf32_a_coords(lane)}
    b = {xy for lane in range(32) for xy in ptx.tf32_b_coords(lane)}
    assert a == {(r, c) for r in range(16) for c in range(8)} and b == {(k, n) for k in range(8) for n in range(8)}


# --------------------------------------------------------------------------------------------
# The kernel on small tiles (2 warps), every option
# --------------------------------------------------------------------------------------------
def tile_of(d, BLOCK_Q=64, BLOCK_K=64, HEAD_DIM=None, PRESPLIT=False, GRID_BH_X=False):
    """The tf32 Tile of these sizes (HEAD_DIM: head_dim_for(d)) and flags."""
    flags = {"presplit"} if PRESPLIT else set()
    return Tile(BLOCK_Q, BLOCK_K, HEAD_DIM or tf.head_dim_for(d), flags=flags | ({"grid_bh_x"} if GRID_BH_X else set()))


def launch_tf32(q, k, v, out, lse, causal, softmax_scale, PASSES_=3, SPLIT_ROUND=None, **config):
    """tf32_forward.launch with the tile of tile_of(d, **config)."""
    tf.launch(q, k, v, out, lse, tile_of(q.shape[3], **config), causal=causal, softmax_scale=softmax_scale,
              passes=PASSES_, split_round=SPLIT_ROUND)


def run_tf32(B, H, Hkv, n_q, n_k, d, causal, seed=0, scale=None, **config):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, n_q, d)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, n_k, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, n_k, d)).astype(np.float32)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    lse = cuda.to_device(np.full(q.shape[:-1], np.nan, np.float32))
    launch_tf32(*(cuda.to_device(x) for x in (q, k, v)), out, lse, causal, scale, **config)
    ref_o, ref_l = attention_f64(q, k, v, causal, scale)
    return out.copy_to_host(), lse.copy_to_host(), ref_o, ref_l


SMALL = dict(BLOCK_Q=32, BLOCK_K=16, HEAD_DIM=32)


@in_simulator
@pytest.mark.parametrize("B,H,Hkv,n_q,n_k,d,causal,options", [
    (1, 2, 1, 37, 45, 24, False, {}),                                      # GQA, d 24 -> 32, ragged tiles
    (1, 1, 1, 40, 29, 32, True, dict(PRESPLIT=True)),                      # Nq > Nk causal: 11 rows see nothing
    (2, 2, 2, 1, 70, 20, False, dict(PRESPLIT=True, GRID_BH_X=True)),      # one query, 5 K/V tiles
    (1, 1, 1, 33, 40, 32, True, dict(GRID_BH_X=True)),                    # the grid order, splitting per warp
    (1, 1, 1, 20, 36, 52, False, dict(BLOCK_Q=16, BLOCK_K=8, HEAD_DIM=64, PRESPLIT=True)),  # 1 warp, d 52 -> 64
    (1, 1, 1, 25, 33, 32, True, dict(SPLIT_ROUND="rna", PRESPLIT=True)),   # the split below sm_90 (cvt.rna)
    (1, 1, 1, 21, 27, 28, False, dict(SPLIT_ROUND="rn_raw")),             # lo left to the tensor core
])
def test_tf32x3_kernel_sim(B, H, Hkv, n_q, n_k, d, causal, options):
    o, l, ref_o, ref_l = run_tf32(B, H, Hkv, n_q, n_k, d, causal, **{**SMALL, **options})
    fin = np.isfinite(ref_l)
    np.testing.assert_array_equal(np.isfinite(l), fin)
    assert np.all(o[~fin] == 0)
    assert np.abs(o - ref_o).max() < 2e-6, np.abs(o - ref_o).max()  # 3xTF32: fp32-level
    assert np.abs(l[fin] - ref_l[fin]).max() < 2e-6


SPLIT_PTX_CHILD = NO_GPU_PATCH + textwrap.dedent(
    """
    import json
    from numba import cuda
    from numba_flash.kernels import tf32_backward as tb, tf32_forward as tf
    from numba_flash.tiles import Tile

    out = {}
    for mode in tf.SPLIT_ROUNDS:
        fwd = cuda.compile_ptx(tf.kernel_source(Tile(32, 16, 32), False, 3, mode), tf.kernel_signature(),
                               cc=(9, 0))[0]
        bwd = cuda.compile_ptx(tb.source("dq", 32, 16, 32, False, split_round=mode), tb.kernel_signature("dq"),
                               cc=(9, 0))[0]
        out[mode] = [[p.count("cvt.rn.tf32.f32"), p.count("cvt.rna.tf32.f32")] for p in (fwd, bwd)]
    print(json.dumps(out))
    """
)


@pytest.mark.heavy
def test_split_round_builds(tmp_path):
    """Each SPLIT_ROUND builds what it says (small tiles, forward and the backward's dq kernel, sm_90 PTX): "rn"
    cvt.rn only, "rna" cvt.rna only, "rn_raw" cvt.rn for hi alone (half of rn's, which rounds lo too)."""
    got = run_compile_child(SPLIT_PTX_CHILD, [], tmp_path)
    for rn, rna, raw in zip(got["rn"], got["rna"], got["rn_raw"]):
        assert rn[0] > 0 and rn[1] == 0, got
        assert rna == [0, rn[0]], got
        assert raw == [rn[0] // 2, 0] and rn[0] % 2 == 0, got


class Built(Exception):
    """Raised by spy_factories' stand-ins: the launch reached the factory, nothing compiled."""


def spy_factories(monkeypatch, module, *names):
    """Replace module's factories with stand-ins that record their (args, kwargs) and raise Built; the records."""
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        raise Built

    for name in names:
        monkeypatch.setattr(module, name, spy)
    return seen


@in_simulator
def test_launchers_pick_rna_below_sm90(monkeypatch):
    """On a GPU older than sm_90 (cvt.rn.tf32 needs it) both launchers build the cvt.rna kernels: the split round
    reaches the factories (spied: they raise before compiling)."""
    from numba_flash import backward_plan
    from numba_flash.blocks import schedule
    from numba_flash.kernels import tf32_backward as tb

    monkeypatch.setattr(ptx, "current_sm90", lambda: False)
    seen = spy_factories(monkeypatch, tf, "build")
    seen_bwd = spy_factories(monkeypatch, tb, "build")
    x = cuda.to_device(np.ones((1, 1, 16, 32), np.float32))
    lse = cuda.to_device(np.ones((1, 1, 16), np.float32))
    with pytest.raises(Built):
        launch_tf32(x, x, x, cuda.device_array_like(x), lse, False, 0.1)
    assert seen[-1][0][-1] == "rna", seen[-1]  # build's last positional argument
    rows = cuda.device_array((1, schedule.padded_rows(16)), np.float32)
    for kernels in (("dkdv",), ("dq",)):
        with pytest.raises(Built):
            backward_plan.launch_tf32(x, x, x, x, x, lse, rows, rows, *(cuda.device_array_like(x) for _ in range(3)),
                                      causal=False, softmax_scale=0.1, d=32, kernels=kernels)
        assert seen_bwd[-1][1].get("split_round") == "rna", seen_bwd[-1]
    monkeypatch.setattr(ptx, "current_sm90", lambda: True)
    with pytest.raises(Built):
        launch_tf32(x, x, x, cuda.device_array_like(x), lse, False, 0.1)
    assert seen[-1][0][-1] == "rn"


@in_simulator
@pytest.mark.parametrize("sm90", [True, False])
def test_explain_builds_the_launched_forward(monkeypatch, sm90):
    """`numba_flash explain`'s kernel facts compile the kernel the forward launches (same cache key, split
    rounding included), on sm_90 and below it."""
    from numba_flash import api, cli

    monkeypatch.setattr(ptx, "current_sm90", lambda: sm90)
    seen = spy_factories(monkeypatch, tf, "build")
    cfg = api.tf32_config(128, True)
    with pytest.raises(Built):
        cli.kernel_facts("tf32x3", cfg, True, "float32").jit()
    x = cuda.to_device(np.ones((1, 1, 16, 128), np.float32))
    with pytest.raises(Built):
        tf.launch(x, x, x, cuda.device_array_like(x), cuda.device_array((1, 1, 16), np.float32), cfg, causal=True,
                  softmax_scale=0.1)
    assert seen[0] == seen[1] and seen[0][0][-1] == ("rn" if sm90 else "rna"), seen


def test_split_round_by_device(monkeypatch):
    """cvt.rn.tf32 exists from sm_90 on: the launchers' default split is "rn" there and "rna" below it; an unknown
    rounding is refused by name, by the launchers' helper and by the factories."""
    monkeypatch.setattr(ptx, "current_sm90", lambda: True)
    assert tf.split_round_for_device() == "rn"
    monkeypatch.setattr(ptx, "current_sm90", lambda: False)
    assert tf.split_round_for_device() == "rna" and tf.split_round_for_device("rn_raw") == "rn_raw"
    with pytest.raises(ValueError, match="'rz'.*one of"):
        tf.split_round_for_device("rz")
    with pytest.raises(ValueError, match="SPLIT_ROUND='rz'"):
        tf.products(3, "rz")
    from numba_flash.kernels import tf32_backward as tb

    with pytest.raises(ValueError, match="split_round='rz'"):
        tb.build("dq", 32, 16, 32, False, split_round="rz")


@in_simulator
def test_tf32_one_pass_sim():
    """PASSES_=1 rounds the operands to tf32 once: errors of tf32 size, far above 3xTF32's."""
    o, l, ref_o, ref_l = run_tf32(1, 1, 1, 30, 40, 32, False, PASSES_=1, **SMALL)
    err = np.abs(o - ref_o).max()
    assert 1e-5 < err < 3e-3, err
    assert np.abs(l - ref_l).max() < 3e-3


@in_simulator
def test_forward_tf32x3_shipped_config_sim():
    """The public path with kernel='tf32x3': shipped tiles (128x64, 8 warps), NumPy in and out."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 1, 12, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 20, 8)).astype(np.float32) for _ in range(2))
    out, lse = numba_flash.forward(q, k, v, causal=True, kernel="tf32x3")
    ref_o, ref_l = attention_f64(q, k, v, True, 1 / math.sqrt(8))
    assert out.dtype == np.float32 and np.abs(out - ref_o).max() < 2e-6 and np.abs(lse - ref_l).max() < 2e-6


# --------------------------------------------------------------------------------------------
# Kernel choice (no kernel runs)
# --------------------------------------------------------------------------------------------
def test_explain_tf32_choices(rng):
    q = rng.standard_normal((1, 2, 64, 64)).astype(np.float32)
    assert numba_flash.explain(q, q, q, kernel="tf32x3").startswith("tf32x3: fp32 on tensor cores")
    text = numba_flash.explain(q, q, q, causal=True, kernel="tf32")
    assert text.startswith("tf32: ") and "1e-3" in text and "K/V split" not in text
    odd = q[..., :30].copy()
    with pytest.raises(ValueError, match="kernel='tf32x3' cannot run.*d % 4 == 0"):
        numba_flash.explain(odd, odd, odd, kernel="tf32x3")
    h = q.astype(np.float16)
    with pytest.raises(ValueError, match="kernel='tf32' cannot run.*float16"):
        numba_flash.forward(h, h, h, kernel="tf32")
    big = rng.standard_normal((1, 1, 8, 160)).astype(np.float32)
    with pytest.raises(ValueError, match="head dim 160 > 128"):
        numba_flash.explain(big, big, big, kernel="tf32x3")


def test_explain_auto_fp32_in_simulator_says_why(rng):
    from numba import config

    q = rng.standard_normal((1, 1, 16, 32)).astype(np.float32)
    text = numba_flash.explain(q, q, q)
    if config.ENABLE_CUDASIM:
        assert text.startswith("simt:") and "simulator" in text
    elif ptx.compute_capability() >= (8, 0):  # a GPU with tf32 tensor cores
        assert text.startswith("tf32x3:"), text


def test_table_entries_can_be_built():
    for (hd, causal), tile in TF32_TABLE.items():
        assert tile.head_dim == hd and not tf.problems(tile, 3) and not tf.problems(tile, 1), (hd, causal)
    assert "flags" in " ".join(tf.problems(Tile(128, 64, 64, flags={"acc_per_tile"})))


# --------------------------------------------------------------------------------------------
# sm_90 build of the shipped configs: no spills, no local memory, the instructions we meant
# --------------------------------------------------------------------------------------------
CHILD = NO_GPU_PATCH + textwrap.dedent(
    """
    import json, re, subprocess, sys, tempfile
    from numba import cuda
    from numba_flash.configs import TF32_TABLE
    from numba_flash.kernels import tf32_forward as tf

    ptxas = sys.argv[-1]
    out = []
    for (hd, causal), tile in sorted(TF32_TABLE.items()):
        bq = tile.block_q
        for passes in (3, 1):
            src = tf.kernel_source(tile, causal, passes)
            ptx, _ = cuda.compile_ptx(src, tf.kernel_signature(), cc=(9, 0))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
            rep = r.stderr + r.stdout
            m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
            out.append(dict(hd=hd, causal=causal, passes=passes, bq=bq, rc=r.returncode, stack=int(m.group(1)),
                            spills=int(m.group(2)) + int(m.group(3)),
                            registers=int(re.search(r"Used (\\d+) registers", rep).group(1)),
                            mma=ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
                            cvt=ptx.count("cvt.rn.tf32.f32"), cvt_rna=ptx.count("cvt.rna.tf32.f32"),
                            local=ptx.count("ld.local") + ptx.count("st.local")))
    print(json.dumps(out))
    """
)


@pytest.mark.heavy  # ptxas over every shipped build; CI keeps the shipped-PTX hash check of the same kernels
def test_shipped_tf32_configs_fit_sm90(tmp_path):
    reports = run_compile_child(CHILD, [], tmp_path)
    assert len(reports) == 2 * len(TF32_TABLE)
    for rep in reports:
        where = json.dumps(rep)
        assert rep["rc"] == 0 and rep["stack"] == 0 and rep["spills"] == 0 and rep["local"] == 0, where
        assert rep["registers"] * 32 * (rep["bq"] // 16) <= 65536, where  # one block per SM at least
        hd, bk = rep["hd"], TF32_TABLE[rep["hd"], rep["causal"]].block_k
        # P·V (bk/8 x hd/8 mma, 3 tf32 products each, 1 for plain TF32) is unrolled; S's loop over pairs
        # of k-steps may stay rolled (one pair's bk/8 x 2 in the PTX)
        assert rep["passes"] * (hd // 8) * (bk // 8) < rep["mma"] <= rep["passes"] * 2 * (hd // 8) * (bk // 8), where
        assert rep["cvt"] > 0 and rep["cvt_rna"] == 0, where  # sm_90 builds split by cvt.rn (one F2FP each)
