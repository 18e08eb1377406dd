"""Tensor-core backward (kernels.mma_dkdv, mma_dq, bwd_prep through backward_plan.launch_mma): simulator,
sm_90 build, and the real GPU.

The simulator runs the kernels' fragment indexing through numba_flash.ptx's twins (mma, ldmatrix,
cp.async with poisoned in-flight bytes), so a wrong lane mapping, a read before a copy lands or a
buffer overwritten while another warp reads it fails here without a GPU. Each simulated block is
128 Python threads: the shapes stay small and few.

Error rule (fp16 / bf16), flash-attention's: err(ours vs float64) <= 2 · err(naive same-dtype vs
float64) + one unit of rounding of max |ref|. The naive same-dtype backward is
reference.attention_backward evaluated in float16; NumPy has no bfloat16, so bf16 is held to
the fp16 rule widened by the ratio of the two unit roundoffs (2^-8 / 2^-11 = 8).
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import cuda

import reference
from numba_flash.configs import MMA_BWD_SPILL_OK, MMA_BWD_TABLE
from numba_flash import backward_plan
from numba_flash.backward_plan import config_from_tiles, table_tiles
from numba_flash.blocks import entry, schedule
from numba_flash.kernels import mma_dkdv, mma_dq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_backward_sim import gradient_bounds  # noqa: E402
from test_ptx import compile_in_subprocess, in_simulator, ptxas_report  # noqa: E402


def _bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def problem(seed, B, H, Hkv, n_q, n_k, d, causal, dtype, big=1.0):
    """(q, k, v, out, lse, dout) as the values the kernels see (float64) and as their 16-bit storage."""
    rng = np.random.default_rng(seed)
    x32 = [rng.standard_normal((B, h, n, d)).astype(np.float32) * s
           for h, n, s in ((H, n_q, big), (Hkv, n_k, big), (Hkv, n_k, 1.0), (H, n_q, 1.0))]
    if dtype == "float16":
        store = [x.astype(np.float16) for x in x32]
        vals = [x.astype(np.float64) for x in store]
    else:
        store = [_bf16_bits(x) for x in x32]
        vals = [_bf16_value(x).astype(np.float64) for x in store]
    q, k, v, do = vals
    o, lse = reference.standard_attention(q, k, v, causal=causal)
    if dtype == "float16":
        o_store = o.astype(np.float16)
        o = o_store.astype(np.float64)
    else:
        o_store = _bf16_bits(o)
        o = _bf16_value(o_store).astype(np.float64)
    lse = lse.astype(np.float32)
    return (q, k, v, o, lse, do), (store[0], store[1], store[2], o_store, lse, store[3])


def padded_view(x, pad_to):
    """x on the device as a view of rows of pad_to elements whose padding holds NaN bits (f16 and bf16):
    a copy that reads past column d - 1 puts NaN into a tile."""
    padded = np.full(x.shape[:-1] + (pad_to,), 0xFFFF, np.uint16).view(x.dtype)
    padded[..., : x.shape[-1]] = x
    return cuda.to_device(padded)[:, :, :, : x.shape[-1]]  # Numba device arrays reject `...`


def run_backward(stored, d, causal, dtype, config, scale=None, atomic=False, pad_to=None, splits=None, planes=None):
    """backward_plan.launch_mma on device arrays (simulator or GPU); returns (dq, dk, dv) as float64.
    atomic: dQ added up by the dkdv kernel with atomic adds (deterministic=False). splits: the deterministic
    splits instead (dq_acc with that many planes; ``planes``, a list, receives them). pad_to: q, k, v, out
    and dout are padded_view's of rows of pad_to elements."""
    q, k, v, o, lse, do = (padded_view(x, pad_to) if pad_to and x.ndim == 4 else cuda.to_device(x) for x in stored)
    B, H, n_q, _ = stored[0].shape
    rows = (B * H, schedule.padded_rows(n_q))
    l2, dd = cuda.device_array(rows, np.float32), cuda.device_array(rows, np.float32)
    grads = [cuda.to_device(np.full(x.shape, 0x7E00 if dtype == "float16" else 0x7FC0, np.uint16)
                            .view(x.dtype)) for x in (stored[0], stored[1], stored[2])]  # NaN: unwritten shows
    scale = 1 / math.sqrt(d) if scale is None else scale
    n_planes = splits or (1 if atomic else 0)
    # the splits' planes are not zeroed (their first launch stores): NaN shows a row read before it was written
    dq_acc = cuda.to_device(np.full((n_planes * rows[0], rows[1], config["head_dim"]), np.nan if splits else 0.0,
                                    np.float32)) if n_planes else None
    backward_plan.launch_mma(q, k, v, o, do, lse, l2, dd, *grads, causal=causal, softmax_scale=scale, dtype=dtype,
                             d=d, config=config, dq_acc=dq_acc, dq_splits=splits)
    if planes is not None:
        planes.append(dq_acc.copy_to_host().reshape(n_planes, B, H, rows[1], config["head_dim"]))
    out = [g.copy_to_host() for g in grads]
    if dtype == "float16":
        return [g.astype(np.float64) for g in out]
    return [_bf16_value(g).astype(np.float64) for g in out]


def check_error_rule(grads, vals, causal, dtype, scale=None):
    q, k, v, o, lse, do = vals
    refs = reference.attention_backward(q, k, v, o, lse, do, causal=causal, softmax_scale=scale)
    naive = reference.attention_backward(*(x.astype(np.float16) for x in (q, k, v, o)), lse,
                                         do.astype(np.float16), causal=causal, softmax_scale=scale, dtype=np.float16)
    widen = 1.0 if dtype == "float16" else 8.0
    for name, ours, ref, nv in zip(("dq", "dk", "dv"), grads, refs, naive):
        assert np.all(np.isfinite(ours)), f"{name}: non-finite (unwritten or nan) entries"
        err = np.abs(ours - ref).max()
        naive_err = np.abs(nv.astype(np.float64) - ref).max()
        bound = widen * (2 * naive_err + 2.0**-11 * np.abs(ref).max())
        assert err <= bound, f"{name}: ours {err:.3e} > {bound:.3e} (naive fp16 {naive_err:.3e})"


def shipped(head_dim):
    """The mma.sync plan at a compiled head dim (configs.MMA_BWD_TABLE, without sm_90's wgmma overrides)."""
    return config_from_tiles(table_tiles(MMA_BWD_TABLE, head_dim), head_dim)


MMA_BWD_HEAD_DIMS = sorted({hd for _, hd in MMA_BWD_TABLE})


# --------------------------------------------------------------------------------------------
# Simulator
# --------------------------------------------------------------------------------------------
@in_simulator
@pytest.mark.parametrize(
    "B,H,Hkv,n_q,n_k,d,causal,dtype",
    [
        (1, 2, 1, 40, 72, 64, True, "float16"),   # GQA 2, Nq < Nk, 2 K/V tiles, the second partial
        (1, 1, 1, 70, 30, 24, True, "bfloat16"),  # Nq > Nk: rows 0..39 see no key; d 24 padded to 64
        (1, 1, 1, 33, 70, 128, False, "float16"),  # d = 128; a whole 64-key tile (copies 8 rows apart)
        (1, 1, 1, 72, 66, 64, False, "float16"),  # a whole 64-row Q tile (dkdv) and K/V tile (dq): the
                                                   # copies' whole-tile path, then the clamped one
    ],
)
def test_shipped_configs_sim(B, H, Hkv, n_q, n_k, d, causal, dtype):
    vals, stored = problem(B * n_q + n_k + d, B, H, Hkv, n_q, n_k, d, causal, dtype)
    grads = run_backward(stored, d, causal, dtype, shipped(64 if d <= 64 else 128))
    check_error_rule(grads, vals, causal, dtype)
    if n_q > n_k and causal:  # rows that see no key: dQ exactly zero
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)


@in_simulator
@pytest.mark.parametrize(
    "d,pad_to,atomic",
    [
        (20, 24, False),  # d % 8 != 0: the chunk of columns 16..23 is part data (the kernels' PARTIAL_CHUNK)
        (24, 32, False),  # d % 8 == 0: the chunk of columns 24..31 is all zeros (ignore-src), never read
        (36, 40, True),   # the atomic dkdv (64 keys, 128 threads) with a part-data chunk
    ],
)
def test_padded_rows_sim(d, pad_to, atomic):
    """q, k, v, dout as strided views whose row padding is NaN: the copies read only columns < d."""
    causal, dtype = True, "float16"
    config = shipped(64) if atomic else {"dkdv": (16, 16), "dq": (32, 16), "head_dim": 64}
    vals, stored = problem(d, 1, 2, 1, 37, 29, d, causal, dtype)
    grads = run_backward(stored, d, causal, dtype, config, atomic=atomic, pad_to=pad_to)
    check_error_rule(grads, vals, causal, dtype)


@in_simulator
def test_other_tiles_and_large_logits_sim():
    """16-key dkdv tiles (1 warp) streaming 16-query tiles over 3 query heads, 32-row dq tiles with
    16-key tiles: many pipeline steps and buffer flips; logits ~ 1e2 (P = exp(S - L) stays finite)."""
    config = {"dkdv": (16, 16), "dq": (32, 16), "head_dim": 64}
    vals, stored = problem(5, 1, 3, 1, 37, 29, 64, True, "float16", big=3.0)
    assert np.abs(vals[4]).max() > 50
    grads = run_backward(stored, 64, True, "float16", config)
    check_error_rule(grads, vals, True, "float16")


@in_simulator
@pytest.mark.parametrize(
    "B,H,Hkv,n_q,n_k,d,causal,dtype",
    [
        (1, 2, 1, 70, 50, 40, True, "float16"),    # GQA 2: two query heads add into one block's dQ rows; Nq > Nk
        (1, 1, 1, 20, 130, 128, False, "bfloat16"),  # d = 128: the shipped 128-key blocks (8 warps: 4 down
                                                      # dQ_i's rows x 2 across its columns), 2 add into each row
    ],
)
def test_atomic_dq_sim(B, H, Hkv, n_q, n_k, d, causal, dtype):
    """deterministic=False: dkdv adds dS K into fp32 scratch atomically, a last kernel scales and rounds."""
    vals, stored = problem(7 + n_q, B, H, Hkv, n_q, n_k, d, causal, dtype)
    head_dim = 64 if d <= 64 else 128
    grads = run_backward(stored, d, causal, dtype, shipped(head_dim), atomic=True)
    check_error_rule(grads, vals, causal, dtype)
    if n_q > n_k and causal:
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)



@in_simulator
@pytest.mark.slow
@pytest.mark.parametrize("B,H,Hkv,n_q,n_k,d,causal,dtype,scheme", [
    pytest.param(1, 2, 1, 20, 30, 256, True, "float16", "kernel", marks=pytest.mark.heavy),  # d 256: the split-layout dkdv (8 warps), the d256 dq kernel;
                                                          # GQA 2 (two query heads' Pᵀ / dSᵀ through shared memory)
    (1, 1, 1, 20, 40, 160, True, "bfloat16", "atomic"),  # d 160 -> 192: rows of 24 chunks (192 of 256 threads copy),
                                                          # the atomic dQ phase's 3 passes a warp
    pytest.param(1, 1, 1, 16, 70, 196, False, "float16", "splits", marks=pytest.mark.heavy),  # d 196 -> 256: a part-data chunk (rows padded to 200 with
                                                          # NaN); 2 key blocks, 2 splits
])
def test_head_dims_above_128_sim(B, H, Hkv, n_q, n_k, d, causal, dtype, scheme):
    """Head dims 129..256 (padded to 192 or 256): dkdv in the split layout (two warps per 16 keys, Pᵀ and dSᵀ
    through shared memory, dK / dV of half the columns a warp) with every dQ scheme."""
    vals, stored = problem(d + n_k, B, H, Hkv, n_q, n_k, d, causal, dtype)
    head_dim = 192 if d <= 192 else 256
    assert mma_dkdv.col_split(head_dim) == 2 and d != head_dim or d == 256
    grads = run_backward(stored, d, causal, dtype, shipped(head_dim), atomic=scheme == "atomic",
                         splits=2 if scheme == "splits" else None, pad_to=-(-d // 8) * 8 if d % 8 else None)
    check_error_rule(grads, vals, causal, dtype)


@in_simulator
@pytest.mark.parametrize("n_q,n_k,splits", [(30, 200, 3), pytest.param(200, 150, 2, marks=pytest.mark.heavy)])
def test_dq_splits_sim(n_q, n_k, splits):
    """backward(deterministic=True)'s splits, GQA 2, causal, key blocks of 64: Nq < Nk with 3 splits over 4
    key blocks (two launches: key blocks 0, 1, 2 into planes 0, 1, 2, then key block 3 into plane 0), and
    Nq > Nk with 2 over 3, where plane 1 starts at row 64 and rows 0-49 see no key (the planes are NaN
    until written: the convert must not read before a plane's first row). Each fp32 plane must hold exactly
    its own key blocks' dS·K (unscaled), from a float64 reference: a block adding into another's plane, or a
    key block run twice or never, fails here even where the sum would not."""
    B, H, Hkv, d, causal, dtype = 1, 2, 1, 40, True, "float16"
    vals, stored = problem(21, B, H, Hkv, n_q, n_k, d, causal, dtype)
    planes = []
    grads = run_backward(stored, d, causal, dtype, shipped(64), splits=splits, planes=planes)
    check_error_rule(grads, vals, causal, dtype)
    if n_q > n_k:  # rows that see no key: dQ exactly zero
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)
    want_planes = []  # the NumPy mirror of the scheme: key block j into plane j mod S, unscaled
    reference.flash_attention_backward(*vals, block_q=64, block_k=64, causal=causal, dq_splits=splits,
                                       planes=want_planes)
    for plane in range(splits):
        want = want_planes[plane]
        first = schedule.plane_first_row(plane, n_q, n_k, 64, 64, 1)  # rows before it: never written (NaN)
        got = planes[0][plane][:, :, first:n_q, :d]
        np.testing.assert_allclose(got, want[:, :, first:], atol=2e-2 * np.abs(want).max() + 1e-3,
                                   err_msg=f"plane {plane}")
        assert np.all(want[:, :, :first] == 0)  # ... and nothing was to be added there
        assert np.all(planes[0][plane][:, :, first:n_q, d:] == 0)  # padded head-dim columns: zeros stored


@in_simulator
@pytest.mark.parametrize("d,n,dtype,big,scheme", [
    (16, 1, "float16", (5.0, 3.0), "atomic"),   # flash-attention's test_flash_attn_bwd_overflow: q·5, k·3
    (128, 5, "float16", (5.0, 3.0), "atomic"),  # 128-key blocks (8 warps), 123 of them past n_k
    (128, 5, "float16", (5.0, 3.0), "splits"),  # the deterministic splits' build (its first launch stores)
    (64, 2, "bfloat16", (20.0, 20.0), "atomic"),  # |S| ~ 400: exp2 overflows fp32 itself where L < -89
])
def test_keys_past_the_end_with_large_logits_sim(d, n, dtype, big, scheme):
    """The dK/dV block that also forms dQ (dQ += dS K) holds keys past n_k: K rows there are zero-filled, so
    their scores are 0 and P = exp(0 - L) overflows (to inf in fp16 where L < -11, in fp32 where L < -89);
    inf · 0 in dS K made dQ NaN. Those keys must be masked like every other hidden score."""
    qk, v_big = big
    to16 = (lambda x: x.astype(np.float16)) if dtype == "float16" else _bf16_bits
    value = (lambda x: x.astype(np.float64)) if dtype == "float16" else (lambda b: _bf16_value(b).astype(np.float64))
    overflow = -12 if dtype == "float16" else -90  # L below it: exp(0 - L) past fp16's (fp32's) largest value
    rng = np.random.default_rng(d + n)
    x32 = [rng.standard_normal((1, 2, n, d)).astype(np.float32) * s for s in (qk, qk, v_big, 1.0)]
    k_mean = x32[1][0, 0].mean(0)
    x32[0][0, 0, 0] = -qk * math.sqrt(d) * k_mean / np.linalg.norm(k_mean)  # a row whose every score is very negative
    store = [to16(x) for x in x32]
    q, k, v, do = (value(x) for x in store)
    o, lse = reference.standard_attention(q, k, v)
    assert lse.min() < overflow, lse.min()
    o_store = to16(o.astype(np.float32))
    vals = (q, k, v, value(o_store), lse.astype(np.float32), do)
    stored = (store[0], store[1], store[2], o_store, lse.astype(np.float32), store[3])
    head_dim = 64 if d <= 64 else 128
    grads = run_backward(stored, d, False, dtype, shipped(head_dim), atomic=scheme == "atomic",
                         splits=1 if scheme == "splits" else None)  # one key block: one plane
    refs = reference.attention_backward(*vals)
    # per entry: 16-bit rounding of P and dS (4 units of the dtype) times the sum of the terms' magnitudes;
    # an unmasked or misplaced term is of the order of that sum
    unit = 2.0**-11 if dtype == "float16" else 2.0**-8
    bounds = gradient_bounds(*vals, False, 1 / math.sqrt(d))
    for name, ours, ref, m in zip(("dq", "dk", "dv"), grads, refs, bounds):
        assert np.all(np.isfinite(ours)), f"{name}: {np.count_nonzero(~np.isfinite(ours))} non-finite entries"
        excess = np.abs(ours - ref) - (4 * unit * m + 1e-30)
        assert excess.max() <= 0, f"{name}: error above the bound by {excess.max():.3e}"


@pytest.mark.parametrize("n_kv_heads,slots,group,want_splits,fallback", [
    (64, 132, 1, 2, False),   # B4 H16: 16 launches of 128 blocks (one wave each), like the atomic grid's 16 waves
    (16, 132, 1, 8, False),   # B1 H16: the cap (8 planes), 4 launches of 128 blocks
    (4, 132, 8, 8, True),     # GQA 8 on 4 kv heads: 32 blocks cannot fill 132 slots, the dq kernel runs
])
def test_dq_splits_choice(n_kv_heads, slots, group, want_splits, fallback):
    splits, ratio = schedule.dq_splits(4096, 4096, 128, 64, False, group, n_kv_heads, slots)
    assert splits == want_splits
    assert (ratio > schedule.SPLITS_SLOWER_OK) == fallback, ratio
    # causal: a launch holds neighbouring key blocks, alike in work
    splits, ratio = schedule.dq_splits(4096, 4096, 128, 64, True, 1, 64, 132)
    assert ratio <= 1.01


def test_makespan_is_a_greedy_schedule():
    assert schedule._makespan([5, 1, 1, 1], 2) == 5  # three short blocks beside the long one
    assert schedule._makespan([1, 1, 1, 5], 2) == 6  # the long one starts last
    assert schedule._makespan([3, 3], 4) == 3


def test_public_api_deterministic_flag():
    from numba_flash import backward

    vals, stored = problem(3, 1, 2, 2, 17, 23, 32, True, "float16")
    q, k, v, o, lse, do = stored
    with pytest.raises(TypeError, match="deterministic must be a bool; got 'no'"):
        backward(q, k, v, o, lse, do, causal=True, deterministic="no")
    grads = backward(q, k, v, o, lse, do, causal=True, deterministic=False)
    check_error_rule([g.astype(np.float64) for g in grads], vals, True, "float16")
    with pytest.raises(ValueError, match=r"atomic dQ is built into the dkdv kernel with 4 or 8 warps \(64 or 128 keys, "
                                         r"32 or 64 above d = 128\) and 64-query tiles only, not dkdv 64x32"):
        mma_dkdv.build(64, 32, 128, False, "float16", atomic_dq=True)
    for bad in ({"atomic_dq": False, "dq_splits": 1}, {"atomic_dq": True, "dq_splits": 3}):
        with pytest.raises(ValueError, match="dq_splits="):
            mma_dkdv.build(64, 64, 64, False, "float16", **bad)


@in_simulator
@settings(max_examples=2, deadline=None)
@given(
    dkdv=st.sampled_from([(16, 16), (32, 16), (16, 32), (32, 32)]),
    dq=st.sampled_from([(16, 16), (32, 16), (16, 32), (32, 32)]),
    n_q=st.integers(1, 24),
    n_k=st.integers(1, 24),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@example(dkdv=(16, 16), dq=(16, 16), n_q=5, n_k=23, causal=True, seed=1)  # many one-warp blocks and steps
def test_tile_sizes_property_sim(dkdv, dq, n_q, n_k, causal, seed):
    """Any tiling (hence any order in which the kernels visit key and query blocks) gives gradients
    within the error rule of the float64 reference: the block-order independence of 3.6.7.
    d = 24: rows of 48 bytes, the smallest padded head dim that cp.async takes (16-byte rows)."""
    vals, stored = problem(seed, 1, 2, 1, n_q, n_k, 24, causal, "float16")
    grads = run_backward(stored, 24, causal, "float16", {"dkdv": dkdv, "dq": dq, "head_dim": 64})
    check_error_rule(grads, vals, causal, "float16")


def test_problems_and_configs():
    for head_dim in MMA_BWD_HEAD_DIMS:
        cfg = shipped(head_dim)
        assert mma_dkdv.problems(*cfg["dkdv"], head_dim, "float16") == []
        assert mma_dq.problems(*cfg["dq"], head_dim, "bfloat16") == []
        assert mma_dkdv.problems(*cfg["dkdv_atomic"], head_dim, "float16") == []
    assert "HEAD_DIM=96" in " ".join(mma_dq.problems(64, 64, 96, "float16"))
    assert "shared memory" in " ".join(mma_dkdv.problems(256, 128, 128, "float16"))
    assert "the scratch rows' padding" in " ".join(mma_dq.problems(256, 64, 64, "float16"))
    assert "copying threads" in " ".join(mma_dkdv.problems(16, 128, 64, "float16"))
    assert "take 64 queries" in " ".join(mma_dkdv.problems(64, 32, 256, "float16"))  # the split layout's Pᵀ, dSᵀ
    # above d = 128: 8 warps for 64 keys; sm_80's 163 KiB a block holds the d192 tiles, not d256's dkdv
    assert mma_dkdv.threads(64, 256) == 256 and mma_dkdv.threads(64, 128) == 128
    assert mma_dkdv.smem_bytes(64, 64, 192) <= 163 * 1024 < mma_dkdv.smem_bytes(64, 64, 256) <= 227 * 1024
    assert mma_dkdv.smem_bytes(64, 64, 256, True) == mma_dkdv.smem_bytes(64, 64, 256)  # dSᵀ's tile is there anyway
    with pytest.raises(ValueError, match="cannot be built"):
        mma_dq.build(64, 24, 64, False, "float16")
    assert schedule.padded_rows(1) == 128 and schedule.padded_rows(256) == 256


# --------------------------------------------------------------------------------------------
# sm_90 build of the shipped configs
# --------------------------------------------------------------------------------------------
COMPILE_SOURCE = """
from numba_flash.blocks.entry import kernel_signature
from numba_flash.kernels import mma_dkdv, mma_dq
def source(kernel, own, streamed, d, causal, dtype, atomic_dq=False, vector_red=True, dq_splits=0):
    if kernel == "dq":
        return mma_dq.source(own, streamed, d, causal, dtype)
    return mma_dkdv.source(own, streamed, d, causal, dtype, atomic_dq, vector_red, DQ_SPLITS=dq_splits)
kern = source({K!r}, {O}, {S}, {D}, {C}, {DT!r}, atomic_dq={A})
SIG = kernel_signature({K!r}, {A})
"""


def expected_mma(kernel, own, streamed, head_dim):
    """mma.sync counts of one step: two head-dim GEMMs, then one (dq) or two (dkdv) GEMMs over the streamed rows,
    fully unrolled; the dkdv split layout (d > 128: a warp's Sᵀ / dPᵀ of half the queries, dV / dK of half the
    columns) may keep the loop over the dV / dK k-steps rolled (its A fragments come by ldmatrix, the k-steps
    differ in addresses only): then one k-step's products are in the PTX."""
    split = mma_dkdv.col_split(head_dim) if kernel == "dkdv" else 1
    first = 2 * (head_dim // 16) * (streamed // split // 8)
    second = (2 if kernel == "dkdv" else 1) * (streamed // 16) * (head_dim // split // 8)
    return {first + second} | ({first + second // (streamed // 16)} if split > 1 else set())


# every head dim's shipped tiles, causal and not up to d = 128; one build each above (each compiles for a minute)
COMPILED = [(hd, causal) for hd in MMA_BWD_HEAD_DIMS if hd <= 128 for causal in (False, True)] + \
    [pytest.param(hd, hd == 256, marks=pytest.mark.heavy if hd == 192 else ()) for hd in MMA_BWD_HEAD_DIMS if hd > 128]


@pytest.mark.parametrize("head_dim,causal", COMPILED)
@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_shipped_configs_compile_for_sm90(head_dim, kernel, causal, tmp_path):
    """Tensor cores, every GEMM unrolled, fragments in registers, and no spills beyond the bytes
    MMA_BWD_SPILL_OK records for a config the sweep measured fastest anyway."""
    own, streamed = shipped(head_dim)[kernel]
    source = COMPILE_SOURCE.format(K=kernel, O=own, S=streamed, D=head_dim, C=causal, DT="float16", A=False)
    text = compile_in_subprocess(source, "SIG", "kern", tmp_path)
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in text and "cp.async.cg" in text
    assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") in expected_mma(
        kernel, own, streamed, head_dim)
    assert "ld.local" not in text and "st.local" not in text
    report = ptxas_report(text, tmp_path)
    allowed = MMA_BWD_SPILL_OK.get((kernel, own, streamed, head_dim), 0)
    assert report["spill_stores"] <= allowed and report["spill_loads"] <= allowed, report["text"]


@pytest.mark.parametrize("head_dim,causal,build", [  # above d = 128 two of the builds (a minute each)
    (hd, causal, build) for hd in MMA_BWD_HEAD_DIMS if hd <= 128 and shipped(hd).get("deterministic_dq") == "splits"
    for causal in (False, True) for build in (1, 2)] + [pytest.param(192, False, 1, marks=pytest.mark.heavy), (256, True, 2)])
def test_dq_splits_builds_compile(head_dim, causal, build, tmp_path):
    """The deterministic splits' dkdv builds (1: adds, 2: the first launch's stores): the dQ leaves by
    red.global.add.v2 or by st.global.v2 (never both: each build's other branch is pruned at compile time),
    and spills stay within MMA_BWD_SPILL_OK's entry."""
    keys, queries = shipped(head_dim)["dkdv_atomic"]
    source = COMPILE_SOURCE.format(K="dkdv", O=keys, S=queries, D=head_dim, C=causal, DT="float16", A=True).replace(
        "atomic_dq=True)", f"atomic_dq=True, dq_splits={build})").replace(
        "kernel_signature('dkdv', True)", "kernel_signature('dkdv', True, True)")
    assert f"dq_splits={build}" in source and "True, True)" in source
    text = compile_in_subprocess(source, "SIG", "kern", tmp_path)
    red, st = text.count("red.global.add.v2.f32"), text.count("st.global.v2.f32")
    assert (red == 0 and st > 0) if build == 2 else (red > 0 and st == 0), (red, st)
    report = ptxas_report(text, tmp_path)
    allowed = MMA_BWD_SPILL_OK.get(("dkdv-splits", keys, queries, head_dim), 0)
    assert report["spill_stores"] <= allowed and report["spill_loads"] <= allowed, report["text"]


@pytest.mark.parametrize("head_dim,keys,vector_red", [(64, 64, False), (64, 128, True), (128, 64, True),
                                                      (128, 128, True), (192, 64, False)])
def test_atomic_dq_compiles_to_red(head_dim, keys, vector_red, tmp_path):
    """deterministic=False: dQ leaves dkdv as red.global.add.v2.f32, one per pair of a fragment's
    adjacent columns (no returned value, no generic atom), or below sm_90, where ptxas has no vector
    red, as scalar red.global.add.f32 (vector_red=False, the launcher's choice there)."""
    source = COMPILE_SOURCE.format(K="dkdv", O=keys, S=64, D=head_dim, C=True, DT="bfloat16", A=True).replace(
        "atomic_dq=True)", f"atomic_dq=True, vector_red={vector_red})")
    assert f"vector_red={vector_red}" in source
    text = compile_in_subprocess(source, "SIG", "kern", tmp_path)
    assert "atom." not in text
    vec, scalar = text.count("red.global.add.v2.f32"), text.count("red.global.add.f32")
    # at least one pass's 2 x DQ_TILES adds (a pair loop may stay rolled), two scalar adds each without vectors
    assert (vec >= 8 and scalar == 0) if vector_red else (vec == 0 and scalar >= 16)
    assert "ld.local" not in text and "st.local" not in text
    report = ptxas_report(text, tmp_path)
    allowed = MMA_BWD_SPILL_OK.get(("dkdv-atomic", keys, 64, head_dim), 0)
    assert report["spill_stores"] <= allowed and report["spill_loads"] <= allowed, report["text"]


# --------------------------------------------------------------------------------------------
# Real GPU (marked gpu; skipped without one): python -m pytest -m gpu tests/kernels/test_mma_backward.py
# --------------------------------------------------------------------------------------------
from gpu_helpers import needs_gpu  # noqa: E402

gpu = [pytest.mark.gpu, needs_gpu]
SWEEP = [  # non-shipped configs scripts/bench_backward.py --sweep-mma times: each must be right too
    {"dkdv": (128, 32), "dq": (128, 64), "head_dim": 128},
    {"dkdv": (64, 32), "dq": (64, 32), "head_dim": 128},
    {"dkdv": (128, 64), "dq": (128, 64), "head_dim": 64},
    {"dkdv": (64, 32), "dq": (64, 128), "head_dim": 64},
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 40, 96])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300), (1, 2, 1, 129, 517), (1, 4, 1, 517, 129)])
def test_gpu_grid(shape, d, causal, dtype):
    B, H, Hkv, n_q, n_k = shape
    vals, stored = problem(n_q * 7 + d, B, H, Hkv, n_q, n_k, d, causal, dtype)
    grads = run_backward(stored, d, causal, dtype, shipped(64 if d <= 64 else 128))
    check_error_rule(grads, vals, causal, dtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", SWEEP)
def test_gpu_sweep_configs(config):
    d = config["head_dim"]
    vals, stored = problem(d, 1, 4, 2, 300, 333, d, True, "float16")
    check_error_rule(run_backward(stored, d, True, "float16", config), vals, True, "float16")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d,causal,dtype,keys", [(64, False, "float16", 64), (128, True, "bfloat16", 64),
                                                 (96, True, "float16", 64), (128, True, "float16", 128),
                                                 (64, False, "bfloat16", 128)])
def test_gpu_atomic_dq(d, causal, dtype, keys):
    """deterministic=False at real sizes: GQA 2, ragged lengths; the error rule as for the default.
    keys: the dkdv block's keys (128: 8 warps, dQ_i split across columns too)."""
    vals, stored = problem(d + 1, 2, 4, 2, 700, 900, d, causal, dtype)
    config = dict(shipped(64 if d <= 64 else 128), dkdv_atomic=(keys, 64))
    grads = run_backward(stored, d, causal, dtype, config, atomic=True)
    check_error_rule(grads, vals, causal, dtype)


@pytest.mark.gpu
@needs_gpu
def test_gpu_deterministic():
    """The dq-kernel scheme (no atomics; run_backward without splits): 20 runs, bitwise the same gradients."""
    vals, stored = problem(1, 2, 4, 2, 700, 900, 128, True, "bfloat16")
    first = run_backward(stored, 128, True, "bfloat16", shipped(128))
    for _ in range(20):
        for a, b in zip(first, run_backward(stored, 128, True, "bfloat16", shipped(128))):
            np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d,causal,dtype,splits,n_q,n_k", [(128, True, "bfloat16", 3, 700, 1000),
                                                           (128, False, "float16", 8, 700, 1000),
                                                           (128, True, "float16", 2, 1000, 700),
                                                           (64, True, "float16", 5, 700, 1000)])
def test_gpu_dq_splits(d, causal, dtype, splits, n_q, n_k):
    """Deterministic splits at real sizes (GQA 2, ragged lengths; 8 splits over 8 key blocks of 128 is one
    each; Nq > Nk: planes that start below row 0 and rows that see no key): the error rule, and 20 runs
    bitwise equal although every add is a red.global.add."""
    vals, stored = problem(d + 5, 2, 4, 2, n_q, n_k, d, causal, dtype)
    config = shipped(64 if d <= 64 else 128)
    first = run_backward(stored, d, causal, dtype, config, splits=splits)
    check_error_rule(first, vals, causal, dtype)
    for _ in range(20):
        for a, b in zip(first, run_backward(stored, d, causal, dtype, config, splits=splits)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("scheme", ["kernel", "atomic", "splits"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d,causal", [(256, True), (256, False), (192, True), (160, False), (200, True),
                                      (196, False)])
def test_gpu_head_dims_above_128(d, causal, dtype, scheme):
    """d 129..256 (192, 256 and padded: 160 -> 192, 200 and 196 -> 256, 196 with a part-data chunk): the
    split-layout dkdv with each dQ scheme, GQA 2, ragged lengths (Nq > Nk: rows that see no key); the splits'
    20 runs bitwise equal."""
    head_dim = 192 if d <= 192 else 256
    vals, stored = problem(d + causal, 2, 4, 2, 700, 450, d, causal, dtype)
    splits = 3 if scheme == "splits" else None
    pad = -(-d // 8) * 8 if d % 8 else None  # (d 196: rows of 200, their padding NaN)
    first = run_backward(stored, d, causal, dtype, shipped(head_dim), atomic=scheme == "atomic", splits=splits,
                         pad_to=pad)
    check_error_rule(first, vals, causal, dtype)
    assert np.all(first[0][:, :, : 700 - 450] == 0) or not causal
    for _ in range(20 if scheme == "splits" and d == 256 else 0):
        for a, b in zip(first, run_backward(stored, d, causal, dtype, shipped(head_dim), splits=splits)):
            np.testing.assert_array_equal(a, b)


# scripts/bench_backward.py's MMA_SWEEP candidates at d 192 / 256 (dkdv, with atomic dQ too; dq), paired up
SWEEP_ABOVE_128 = [(d, {"dkdv": dkdv, "dq": dq, "dkdv_atomic": dkdv})
                   for d, dqs in ((192, [(64, 32), (64, 16), (128, 32), (64, 64)]),
                                  (256, [(64, 32), (64, 16), (128, 32), (128, 16)]))
                   for dkdv, dq in zip([(64, 64), (32, 64)] * 2, dqs)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,config", SWEEP_ABOVE_128)
def test_gpu_head_dims_above_128_sweep_tiles(d, config, causal):
    """The d 192 / 256 candidates scripts/bench_backward.py --sweep-mma times are right too (and, run first with
    pytest -n, put their builds in the disk cache for the sweep)."""
    config = dict(config, head_dim=d)
    vals, stored = problem(d + 3, 1, 4, 2, 333, 300, d, causal, "float16")
    check_error_rule(run_backward(stored, d, causal, "float16", config), vals, causal, "float16")
    check_error_rule(run_backward(stored, d, causal, "float16", config, atomic=True), vals, causal, "float16")


def test_backward_above_128_dispatch(monkeypatch):
    """fp16 / bf16 at d 129..256 run the tensor-core backward (explain says the split layout and the padding) where
    the GPU's blocks have the tiles' shared memory; elsewhere auto runs SIMT with the reason (backward's
    PerformanceWarning quotes it) and kernel='mma' raises it."""
    import importlib

    from numba_flash.api import validate

    bwd = importlib.import_module("numba_flash.backward")
    q = np.broadcast_to(np.float16(1), (1, 2, 8, 200))
    family, cfg, reasons = bwd.choose_backward(validate(q, q, q, causal=True))
    assert family == "mma" and cfg["head_dim"] == 256 and cfg["dkdv"] == (64, 64), reasons
    assert any("two warps per 16 keys" in r for r in reasons) and "zero-padded to 256" in " ".join(reasons)
    assert not any("widened to fp32" in r for r in reasons)
    monkeypatch.setattr(bwd, "_device_smem", lambda: (163 * 1024, 164 * 1024))  # sm_80
    family, _, reasons = bwd.choose_backward(validate(q, q, q))
    assert family == "simt" and "dkdv tile at head dim 256 needs 214016 B of shared memory" in reasons[-1], reasons
    with pytest.raises(ValueError, match="kernel='mma' cannot run this backward.*needs 214016 B"):
        bwd.choose_backward(validate(q, q, q), "mma")
    family, cfg, _ = bwd.choose_backward(validate(q[..., :160], q[..., :160], q[..., :160]))
    assert family == "mma" and cfg["head_dim"] == 192  # d 192's tiles fit 163 KiB
    monkeypatch.setattr(bwd, "_device_smem", lambda: (99 * 1024, 100 * 1024))  # sm_86 / sm_89
    assert bwd.choose_backward(validate(q[..., :160], q[..., :160], q[..., :160]))[0] == "simt"
    assert bwd.choose_backward(validate(q[..., :128], q[..., :128], q[..., :128]))[0] == "mma"


def test_check_dq_acc_names_the_layout_it_needs():
    """launch()'s check of the dQ-in-dkdv scratch (both families): planes x heads, padded rows, HEAD_DIM,
    C-contiguous fp32, and 1 <= dq_splits <= key blocks."""
    ok = np.zeros((3 * 8, 128, 64), np.float32)
    entry.check_dq_acc(ok, 3, 8, 128, 64, n_kb=5)
    entry.check_dq_acc(ok[:8], None, 8, 128, 64, n_kb=5)
    with pytest.raises(ValueError, match=r"needs a C-contiguous fp32 array of shape \(16, 128, 64\)"):
        entry.check_dq_acc(ok, 2, 8, 128, 64, n_kb=5)
    with pytest.raises(ValueError, match="strides"):
        entry.check_dq_acc(np.zeros((24, 128, 128), np.float32)[:, :, ::2], 3, 8, 128, 64, n_kb=5)
    with pytest.raises(ValueError, match=r"1 <= dq_splits <= 2 key blocks"):
        entry.check_dq_acc(ok, 3, 8, 128, 64, n_kb=2)


def test_dq_scheme_falls_back_to_the_dq_kernel(monkeypatch):
    """backward.dq_scheme keeps the dq kernel where the splits cannot or should not run: a GPU whose blocks
    get less shared memory than the 128-key dkdv needs (sm_86/89: 99 KiB), one fp32 plane of dQ above the
    scratch budget (a long context), an empty problem (explain_backward must not fail on it); and takes the
    splits at the benchmark shape."""
    import importlib

    from numba_flash.api import validate

    bwd = importlib.import_module("numba_flash.backward")  # the module (the package exports the function)

    def scheme(shape_q, shape_kv, causal=False):
        q = np.broadcast_to(np.float16(1), shape_q)  # no memory: only shapes and dtype are read
        kv = np.broadcast_to(np.float16(1), shape_kv)
        p = validate(q, kv, kv, causal=causal)
        return bwd.dq_scheme(p, shipped(128), True)

    how, splits, why = scheme((4, 16, 4096, 128), (4, 16, 4096, 128))
    assert (how, splits) == ("splits", 2), why
    monkeypatch.setattr(bwd, "_device_smem", lambda: (99 * 1024, 100 * 1024))
    how, _, why = scheme((4, 16, 4096, 128), (4, 16, 4096, 128))
    assert how == "kernel" and "shared memory" in why, why
    p = validate(*(np.broadcast_to(np.float16(1), (1, 2, 64, 128)),) * 3)  # deterministic=False as well
    assert bwd.dq_scheme(p, shipped(128), False)[0] == "kernel"
    monkeypatch.undo()
    how, _, why = scheme((1, 32, 131072, 128), (1, 8, 131072, 128), causal=True)  # 2 GiB per plane
    assert how == "kernel" and "scratch budget" in why, why
    how, _, why = scheme((2, 4, 0, 128), (2, 4, 10, 128))
    assert how == "kernel" and "empty" in why, why
    q = np.zeros((1, 2, 5, 128), np.float16)
    assert "empty problem" in numba_flash_explain(q, q[:, :, :0]), "explain_backward on Nk = 0"


def numba_flash_explain(q, kv):
    from numba_flash import explain_backward

    return explain_backward(q, kv, kv)
