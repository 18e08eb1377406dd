"""numba_flash.backward against reference.attention_backward / flash_attention_backward (float64).

Runs on the CUDA simulator where there is no GPU (CI), and on the GPU where there is one. Two ways
in, as in test_forward_sim.py: the public ``backward`` with the shipped configs (few, small cases:
256 simulated threads per block are slow) and ``simt_backward.launch`` with tiny tile configs
(8 threads), which covers many tiles, GQA, causal offsets and ragged edges quickly.

Tolerance for float32 inputs (``gradient_bounds``). The reference evaluates the same formulas in
float64 on the same float32 inputs (q, k, v, out, lse, dout), so the difference is the kernels'
fp32 rounding. Every gradient entry is a sum of products, and each product's factors carry a
relative error of at most a few units of eps32 per operation along its chain:
    S = Q Kᵀ (d terms)                     error ≤ d·eps·scale·|Q||K|ᵀ in the exponent
    P = exp2(S·c − L·log2 e)               relative error ≤ eps·(1 + |S·scale| + |L| + that)
    dP − D (d terms each)                  error ≤ d·eps·(|dO||V|ᵀ + rowsum|dO∘O|)
    dV = Pᵀ dO, dK = dSᵀ Q, dQ = dS K      Nq or Nk more terms.
Summing the absolute values of every term gives a per-entry magnitude M; the kernels' error is at
most (Nq + Nk + d)·eps32·M, a worst-case bound (rounding errors add, never cancel), plus
ATOL = 1e-30 for fp32 underflow: a P below 2^-126 ≈ 1.2e-38 loses its relative accuracy, which
costs at most ~1e-38 times the other factors (≤ 1e4 here) times the number of terms (≤ 100).
An indexing, masking or scaling bug gives errors of the order of M itself, far above the bound.
"""
from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import cuda

import reference
from numba_flash.backward import backward, explain_backward
from numba_flash.configs import HEAD_DIMS, SMEM_PER_BLOCK_MAX, head_dim_bucket
from numba_flash.kernels import simt_backward
from numba_flash.kernels.simt_backward import BACKWARD_CONFIGS, BackwardConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ptx import NO_GPU_PATCH, run_compile_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EPS32 = float(np.finfo(np.float32).eps)
ATOL = 1e-30  # fp32 underflow of tiny P (module docstring)


# --------------------------------------------------------------------------------------------
# Problems, bounds, checks
# --------------------------------------------------------------------------------------------
def problem(rng, B, H, Hkv, n_q, n_k, d, causal, dtype=np.float32, scale=None, big=1.0):
    """(q, k, v, out, lse, dout) in dtype, with out and lse from the float64 reference forward."""
    q = (rng.standard_normal((B, H, n_q, d)) * big).astype(dtype)
    k = (rng.standard_normal((B, Hkv, n_k, d)) * big).astype(dtype)
    v = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
    do = rng.standard_normal((B, H, n_q, d)).astype(dtype)
    o, lse = reference.standard_attention(q, k, v, causal=causal, softmax_scale=scale)
    return q, k, v, o.astype(dtype), lse.astype(np.float32), do


def gradient_bounds(q, k, v, o, lse, do, causal, scale):
    """Per-entry magnitudes (M_dq, M_dk, M_dv) of the module docstring, in float64."""
    q, k, v, o, do = (np.asarray(x, np.float64) for x in (q, k, v, o, do))
    lse = np.asarray(lse, np.float64)
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    n_q, n_k, d = q.shape[2], k.shape[2], q.shape[3]
    s = q @ np.swapaxes(kk, -1, -2) * scale
    visible = np.ones((n_q, n_k), bool)
    if causal:
        visible = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + n_k - n_q
    lse_sub = np.where(np.isneginf(lse), np.inf, lse)[..., None]
    p = np.where(visible, np.exp(np.where(visible, s, 0.0) - lse_sub), 0.0)
    lse_abs = np.where(np.isfinite(lse), np.abs(lse), 0.0)[..., None]
    p_mag = p * (1 + np.abs(s) + lse_abs + d * scale * (np.abs(q) @ np.swapaxes(np.abs(kk), -1, -2)))
    dp_minus_d = do @ np.swapaxes(vv, -1, -2) - np.sum(do * o, -1, keepdims=True)
    dp_mag = np.abs(do) @ np.swapaxes(np.abs(vv), -1, -2) + np.sum(np.abs(do * o), -1, keepdims=True)
    ds_mag = p_mag * np.abs(dp_minus_d) + p * d * dp_mag
    m_dv = np.swapaxes(p_mag, -1, -2) @ np.abs(do)
    m_dk = scale * np.swapaxes(ds_mag, -1, -2) @ np.abs(q)
    m_dq = scale * ds_mag @ np.abs(kk)
    group_sum = lambda x: x.reshape(x.shape[0], -1, g, *x.shape[2:]).sum(axis=2)  # noqa: E731
    return m_dq, group_sum(m_dk), group_sum(m_dv)


def check_gradients(grads, q, k, v, o, lse, do, causal, scale=None, block=None):
    """Our (dq, dk, dv) against both float64 references, within the docstring's bound."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    refs = [reference.attention_backward(q, k, v, o, lse, do, causal=causal, softmax_scale=scale)]
    if block is not None:  # the tile loop the kernels follow, with their tile sizes
        refs.append(reference.flash_attention_backward(q, k, v, o, lse, do, block_q=block[0], block_k=block[1],
                                                       causal=causal, softmax_scale=scale))
    bounds = gradient_bounds(q, k, v, o, lse, do, causal, scale)
    factor = (q.shape[2] + k.shape[2] + q.shape[3]) * EPS32
    for name, ours, like, bound, *ref in zip(("dq", "dk", "dv"), grads, (q, k, v), bounds, *refs):
        assert ours.shape == like.shape and ours.dtype == like.dtype, (name, ours.shape, ours.dtype)
        assert np.all(np.isfinite(ours)), name
        for r in ref:
            err = np.abs(ours.astype(np.float64) - r)
            tol = factor * bound + ATOL
            worst = np.unravel_index(np.argmax(err - tol), err.shape)
            assert np.all(err <= tol), (
                f"{name}: error {err[worst]:.3e} > bound {tol[worst]:.3e} at {worst} "
                f"(max error {err.max():.3e}, max |ref| {np.abs(r).max():.3e})")


SMALL_CONFIGS = [  # (block_q, block_k, row_threads, col_threads): 8-16 threads, several tiles
    (8, 8, 2, 4),
    (16, 8, 4, 2),
    (8, 16, 4, 4),
]


def launch_small(cfg_tuple, q, k, v, o, lse, do, causal, scale=None, dtype=None):
    """simt_backward.launch with a tiny config for both kernels; host arrays in, host arrays out."""
    bq, bk, rt, ct = cfg_tuple
    d = q.shape[-1]
    dtype = dtype or str(q.dtype)
    scale = 1 / math.sqrt(d) if scale is None else scale
    cfgs = tuple(BackwardConfig(kern, bq, bk, rt, ct, head_dim_bucket(d)) for kern in ("dkdv", "dq"))
    dq = cuda.device_array(q.shape, q.dtype)
    dk = cuda.device_array(k.shape, k.dtype)
    dv = cuda.device_array(v.shape, v.dtype)
    delta = cuda.device_array(lse.shape, np.float32)
    simt_backward.launch(cfgs, *(cuda.to_device(x) for x in (q, k, v, o, do, lse)), delta, dq, dk, dv,
                         causal=causal, softmax_scale=scale, dtype=dtype, d=d)
    return dq.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()


# --------------------------------------------------------------------------------------------
# The public API, shipped configs (few cases: 256 simulated threads per block)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "B,H,Hkv,n_q,n_k,d,causal",
    [
        (1, 2, 1, 20, 30, 24, True),    # GQA group 2, d = 24 padded to 32, Nq < Nk causal
        (1, 1, 1, 70, 30, 16, True),    # Nq > Nk causal: the first 40 rows see no key; 2 Q tiles
        (1, 1, 1, 9, 65, 64, False),    # two K/V tiles, one Q tile
    ],
)
def test_backward_shipped_configs(rng, B, H, Hkv, n_q, n_k, d, causal):
    args = problem(rng, B, H, Hkv, n_q, n_k, d, causal)
    grads = backward(*args, causal=causal)
    cfg = simt_backward.backward_configs(d)[0]
    check_gradients(grads, *args, causal, block=(cfg.block_q, cfg.block_k))
    if n_q > n_k and causal:  # fully masked rows: exactly zero, not merely small
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_backward_fp16(rng, kernel):
    """fp16 in, fp16 out: error within 2x that of the same formulas evaluated in fp16, + fp16 rounding."""
    args = problem(rng, 1, 2, 2, 24, 40, 32, True, dtype=np.float16)
    grads = backward(*args, causal=True, kernel=kernel)
    refs = reference.attention_backward(*args, causal=True)
    naive = reference.attention_backward(*args, causal=True, dtype=np.float16)
    for name, ours, ref, nv in zip(("dq", "dk", "dv"), grads, refs, naive):
        assert ours.dtype == np.float16
        err = np.abs(ours.astype(np.float64) - ref).max()
        naive_err = np.abs(nv.astype(np.float64) - ref).max()
        assert err <= 2 * naive_err + 2**-11 * np.abs(ref).max(), f"{name}: ours {err:.3e} vs naive fp16 {naive_err:.3e}"


def test_backward_batchless_and_explain(rng):
    q, k, v, o, lse, do = problem(rng, 1, 1, 1, 12, 10, 8, False)
    grads3 = backward(q[0], k[0], v[0], o[0], lse[0], do[0])
    grads2 = backward(q[0, 0], k[0, 0], v[0, 0], o[0, 0], lse[0, 0], do[0, 0])
    assert [g.shape for g in grads3] == [(1, 12, 8), (1, 10, 8), (1, 10, 8)]
    assert [g.shape for g in grads2] == [(12, 8), (10, 8), (10, 8)]
    for g3, g2 in zip(grads3, grads2):
        np.testing.assert_array_equal(g3[0], g2)
    check_gradients(tuple(g[None] for g in grads3), q, k, v, o, lse, do, False)
    text = explain_backward(q, k, v)
    assert "padded to 16" in text and "no atomics" in text
    half = [x.astype(np.float16) for x in (q, k, v)]
    assert text.startswith("simt backward") and explain_backward(*half).startswith("mma backward")
    forced = explain_backward(*half, kernel="simt")
    assert forced.startswith("simt backward") and "kernel='simt' was asked for" in forced
    with pytest.raises(ValueError, match="kernel='mma' cannot run this backward: dtype float32"):
        backward(q, k, v, o, lse, do, kernel="mma")
    with pytest.raises(ValueError, match="kernel='fast'; accepted: auto, simt, mma"):
        backward(q, k, v, o, lse, do, kernel="fast")


@pytest.mark.parametrize("n_q,n_k", [(0, 10), (10, 0), (1, 1)])
def test_backward_kernel_check_before_empty_shortcut(rng, n_q, n_k):
    """kernel='mma' on float32: refused whether or not the problem is empty (it was accepted when empty)."""
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (n_q, n_k, n_k))
    lse = np.zeros(q.shape[:-1], np.float32)
    with pytest.raises(ValueError, match="kernel='mma' cannot run this backward: dtype float32"):
        backward(q, k, v, q, lse, q, kernel="mma")


@pytest.mark.parametrize("kernel,dtype,d", [("auto", np.float32, 8), ("simt", np.float32, 8),
                                            ("mma", np.float16, 32), ("tf32x3", np.float32, 32)])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("n_q,n_k", [(0, 10), (10, 0)])
def test_backward_empty_sequences(rng, n_q, n_k, kernel, dtype, d, deterministic):
    """Nq = 0 or Nk = 0 with every kernel and either dQ scheme: zero (or empty) gradients, no kernel runs."""
    q, k, v = (rng.standard_normal((1, 2, n, d)).astype(dtype) for n in (n_q, n_k, n_k))
    o = np.zeros_like(q)
    lse = np.full(q.shape[:-1], -np.inf, np.float32)
    dq, dk, dv = backward(q, k, v, o, lse, np.ones_like(q), kernel=kernel, deterministic=deterministic)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not dq.any() and not dk.any() and not dv.any()


def test_backward_numba_device_arrays(rng):
    """The simulator's Numba device arrays are accepted (they have no __cuda_array_interface__ there)."""
    args = _ok(rng)
    ref = backward(*args)
    got = backward(*(cuda.to_device(x) for x in args))
    for r, g in zip(ref, got):
        np.testing.assert_array_equal(g.copy_to_host(), r)


def test_backward_no_heads():
    """H = Hkv = 0: empty gradients, as forward's empty outputs."""
    q, k = np.zeros((1, 0, 3, 8), np.float32), np.zeros((1, 0, 5, 8), np.float32)
    dq, dk, dv = backward(q, k, k, q, np.zeros(q.shape[:-1], np.float32), q)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert explain_backward(q, k, k).startswith("simt backward:")


# --------------------------------------------------------------------------------------------
# Many tiles, tiny configs
# --------------------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cfg=st.sampled_from(SMALL_CONFIGS),
    n_q=st.integers(1, 33),
    n_k=st.integers(1, 33),
    d=st.sampled_from([1, 5, 16, 24]),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
    log_scale=st.floats(-1, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_backward_small_tiles_property(cfg, n_q, n_k, d, group, causal, log_scale, seed):
    rng = np.random.default_rng(seed)
    scale = float(10**log_scale) / math.sqrt(d)
    args = problem(rng, 1, 2, 2 // group, n_q, n_k, d, causal, scale=scale)
    grads = launch_small(cfg, *args, causal, scale=scale)
    check_gradients(grads, *args, causal, scale=scale, block=cfg[:2])


@pytest.mark.parametrize("causal", [False, True])
def test_backward_gqa_nq_gt_nk_masked_rows(rng, causal):
    """GQA group 2 with Nq > Nk: causal rows 0..Nq-Nk-1 see nothing (L = -inf) and add nothing."""
    args = problem(rng, 1, 4, 2, 29, 11, 24, causal)
    if causal:
        assert np.all(np.isneginf(args[4][..., :18]))
    grads = launch_small((8, 8, 2, 4), *args, causal)
    check_gradients(grads, *args, causal, block=(8, 8))
    if causal:
        assert np.all(grads[0][:, :, :18] == 0)


def test_backward_huge_logits(rng):
    """Scores ~1e3: P = exp(S - L) stays finite, and the bound scales with |S| and |L|."""
    args = problem(rng, 1, 1, 1, 17, 19, 16, False, scale=1.0, big=8.0)
    assert np.abs(args[4]).max() > 300  # L ~ max score
    grads = launch_small((8, 8, 2, 4), *args, False, scale=1.0)
    check_gradients(grads, *args, False, scale=1.0)


def _bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_backward_bfloat16_bits(rng):
    """bf16 travels as uint16 bits: widened exactly on the way in, rounded to nearest even on the way out."""
    args = problem(rng, 1, 2, 1, 19, 13, 16, True)
    q, k, v, o, lse, do = (_bf16_value(_bf16_bits(x)) if x.dtype == np.float32 and x.ndim == 4 else x
                           for x in args)
    bits = launch_small((8, 8, 2, 4), *(_bf16_bits(x) if x.ndim == 4 else x for x in (q, k, v, o, lse, do)),
                        True, dtype="bfloat16")
    exact = launch_small((8, 8, 2, 4), q, k, v, o, lse, do, True)  # the same maths, kept in fp32
    for b, f in zip(bits, exact):
        assert b.dtype == np.uint16
        np.testing.assert_array_equal(b, _bf16_bits(f))


def test_backward_deterministic(rng):
    """No atomics: two runs give bitwise the same gradients."""
    args = problem(rng, 1, 2, 1, 21, 26, 16, True)
    first = launch_small((8, 8, 2, 4), *args, True)
    again = launch_small((8, 8, 2, 4), *args, True)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# Validation: the forward's checks, plus out / dout / lse
# --------------------------------------------------------------------------------------------
def _ok(rng):
    return list(problem(rng, 1, 2, 1, 4, 6, 8, False))


@pytest.mark.parametrize(
    "index,mutate,exc,words",
    [
        (3, lambda o: o[..., :3, :], ValueError, ["out has shape (1, 2, 3, 8)", "(1, 2, 4, 8)"]),
        (5, lambda do: do.astype(np.float16), TypeError, ["dout has dtype float16", "float32"]),
        (4, lambda lse: lse.astype(np.float64), TypeError, ["lse has dtype float64", "accepted: float32"]),
        (4, lambda lse: lse[..., None], ValueError, ["lse has shape (1, 2, 4, 1)", "(1, 2, 4)", "q.shape[:-1]"]),
        (4, lambda lse: lse.tolist(), TypeError, ["lse must be", "list"]),
        (2, lambda v: v[:, :, :3], ValueError, ["k and v must have the same shape"]),  # the forward's checks
        (0, lambda q: q.astype(np.float64), TypeError, ["float64"]),
        (5, lambda do: np.ma.masked_array(do, mask=do > 0), TypeError, ["dout is a NumPy masked array"]),
        (1, lambda k: np.ma.masked_array(k), TypeError, ["k is a NumPy masked array"]),
    ],
)
def test_validation_errors(rng, index, mutate, exc, words):
    args = _ok(rng)
    args[index] = mutate(args[index])
    with pytest.raises(exc) as e:
        backward(*args)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_validation_scale_and_causal(rng):
    with pytest.raises(ValueError, match="softmax_scale"):
        backward(*_ok(rng), softmax_scale=-1.0)
    with pytest.raises(ValueError, match=r"softmax_scale = 1e\+38 .*at most 2\*\*64"):
        backward(*_ok(rng), softmax_scale=1e38)
    with pytest.raises(TypeError, match="causal must be a bool"):
        backward(*_ok(rng), causal="yes")


# --------------------------------------------------------------------------------------------
# Configs as data, and the sm_90 build of the shipped ones
# --------------------------------------------------------------------------------------------
def test_shipped_configs_and_problems():
    for bq, bk, rt, ct in SMALL_CONFIGS:  # the simulator's tiny configs fit every head dim they meet
        for kern in simt_backward.KERNELS:
            assert BackwardConfig(kern, bq, bk, rt, ct, 32).problems() == []
    for d, cfgs in BACKWARD_CONFIGS.items():
        for cfg in cfgs:
            assert cfg.problems() == [] and cfg.head_dim == d and cfg.smem_bytes <= SMEM_PER_BLOCK_MAX
            assert cfg.accumulators_per_thread <= 128
    bad = BackwardConfig("dkdv", 64, 64, 8, 8, 128)  # 8 K rows x 16 head-dim columns, twice
    assert any("accumulator" in m for m in bad.problems())
    with pytest.raises(ValueError, match="cannot run"):
        simt_backward.make_backward_kernel(bad, False, "float32")
    for d, cfgs in BACKWARD_CONFIGS.items():  # 16-byte loads of 8 rows: 8 disjoint groups of 4 banks
        for cfg in cfgs:
            assert cfg.qk_stride % 8 == 4 and cfg.p_stride % 8 == 4, cfg
    assert any("16-byte" in m for m in BackwardConfig("dq", 64, 64, 16, 16, 96).problems())  # 96 = 6 x 16


# Every shipped head dim (fp32, not causal), then causal and both 16-bit dtypes at d = 128, and
# the D kernel; two groups so that pytest -n 2 runs them side by side.
PTXAS_CASES = {
    "float32": [(kern, d, False, "float32") for d in HEAD_DIMS for kern in ("dkdv", "dq")],
    "causal-16bit": [(kern, 128, True, dt) for kern in ("dkdv", "dq") for dt in ("float32", "float16", "bfloat16")]
    + [("delta", 0, False, dt) for dt in ("float32", "float16", "bfloat16")],
}

CHILD = NO_GPU_PATCH + textwrap.dedent(
    """
    import json, re, subprocess, sys, tempfile
    from numba import cuda
    from numba_flash.kernels import simt_backward as sb

    cases, ptxas = json.loads(sys.argv[1]), sys.argv[2]
    out = []
    for kern, d, causal, dtype in cases:
        if kern == "delta":
            src, sig = sb.delta_source(dtype), sb.delta_signature(dtype)
        else:
            cfg = dict(zip(sb.KERNELS, sb.BACKWARD_CONFIGS[d]))[kern]
            src, sig = sb.kernel_source(cfg, causal, dtype), sb.kernel_signature(cfg, dtype)
        ptx, _ = cuda.compile_ptx(src, sig, cc=(9, 0), fastmath=sb.FASTMATH)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        cap = [] if kern == "delta" or cfg.max_registers is None else [f"-maxrregcount={cfg.max_registers}"]
        r = subprocess.run([ptxas, "-arch=sm_90", "-v", *cap, f.name, "-o", "/dev/null"], capture_output=True, text=True)
        rep = r.stderr + r.stdout
        m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
        regs = re.search(r"Used (\\d+) registers", rep)
        out.append(dict(kernel=kern, d=d, causal=causal, dtype=dtype, rc=r.returncode, stack=int(m.group(1)),
                        spill_stores=int(m.group(2)), spill_loads=int(m.group(3)), registers=int(regs.group(1)),
                        ex2=ptx.count("ex2.approx"), ld_local=ptx.count("ld.local"), atom=ptx.count("atom.")))
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("group", [x if x != "float32" else pytest.param(x, marks=pytest.mark.heavy)
                                   for x in sorted(PTXAS_CASES)])  # float32's ptxas run: heavy (hashes in CI)
def test_shipped_configs_compile_without_spills(group, tmp_path):
    """NVVM keeps the per-thread slices in registers only if it can unroll every loop over them;
    otherwise they land in local memory (a stack frame in ptxas -v), a silent slowdown."""
    import json

    reports = run_compile_child(CHILD, [json.dumps(PTXAS_CASES[group])], tmp_path)
    assert len(reports) == len(PTXAS_CASES[group])
    for rep in reports:
        print(rep)
        where = str(rep)
        assert rep["rc"] == 0, where
        assert rep["stack"] == 0 and rep["spill_stores"] == 0 and rep["spill_loads"] == 0, where
        assert rep["ld_local"] == 0 and rep["atom"] == 0, where  # registers only; no atomics anywhere
        if rep["kernel"] != "delta":
            cfg = dict(zip(simt_backward.KERNELS, BACKWARD_CONFIGS[rep["d"]]))[rep["kernel"]]
            assert rep["ex2"] > 0, where  # P is one ex2 per entry
            assert rep["registers"] * cfg.threads <= 65536, where  # at least one block per SM
            if cfg.max_registers is not None:  # the cap holds, and it buys a second block per SM
                assert rep["registers"] <= cfg.max_registers and 2 * cfg.smem_bytes <= 228 * 1024, where


def test_torch_module_without_torch_says_what_to_install():
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed: tests/kernels/test_gpu_backward.py runs numba_flash.torch")
    with pytest.raises(ImportError, match="numba_flash.torch needs PyTorch"):
        import numba_flash.torch  # noqa: F401
