"""Tensor-core forward (numba_flash.kernels.mma_forward) in the CUDA simulator, and its sm_90 build.

The simulator runs the kernel's fragment indexing through numba_flash.ptx's twins (mma, ldmatrix,
cp.async, shuffles), so a wrong lane mapping fails here without a GPU. Shapes stay small: each
simulated thread is a Python thread (128 per block). Simulator tests re-run themselves in a child
process with NUMBA_ENABLE_CUDASIM=1 when this process does not have it; compile tests always run
in a child without it (see tests/kernels/test_ptx.py).
"""
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from numba_flash.kernels import mma_forward
from numba_flash.tiles import Tile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ptx import compile_in_subprocess, in_simulator, ptxas_report  # noqa: E402


# --------------------------------------------------------------------------------------------
# NumPy float64 attention (bottom-right causal alignment; fully masked rows: O = 0, L = -inf)
# --------------------------------------------------------------------------------------------
def attention_f64(q, k, v, causal, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    H, Hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, H // Hkv, axis=1)
    v = np.repeat(v, H // Hkv, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    n_q, n_k = s.shape[-2:]
    if causal:
        i = np.arange(n_q)[:, None]
        j = np.arange(n_k)[None, :]
        s = np.where(j > i + n_k - n_q, -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    o = np.where(l > 0, (p @ v) / np.where(l > 0, l, 1.0), 0.0)
    lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
    return o, lse


def to_bits(x, dtype):
    """float32 array -> (16-bit words for the kernel, the values they hold as float64)."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    bits = (x.view(np.uint32) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16  # round to nearest even
    bits = bits.astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def from_bits(o, dtype):
    if dtype == "float16":
        return o.astype(np.float64)
    return (o.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def tile_of(d, HEAD_DIM=None, BLOCK_Q=64, BLOCK_K=64, M_TILES=1, flags=()):
    """The mma Tile of these sizes (HEAD_DIM: the forward's compiled head dim for d) and flags."""
    from numba_flash.configs import MMA_HEAD_DIMS

    return Tile(BLOCK_Q, BLOCK_K, HEAD_DIM or next(h for h in MMA_HEAD_DIMS if h >= d), warps=BLOCK_Q // (16 * M_TILES),
                stages=mma_forward.STAGES, flags=flags)


def run_forward(B, H, Hkv, n_q, n_k, d, causal, dtype, seed=0, HEAD_DIM=None, scale=None, pad_to=None, big=1.0,
                k_ramp=None, tile=None, launch=None, **config):
    """mma_forward.launch (or ``launch``, a kernel module's launch of the same arguments) on device arrays; returns
    (O, L) as float64 and the float64 reference.

    tile: the Tile to launch (default: tile_of(d, HEAD_DIM, **config)).

    pad_to: q, k, v are views of rows of pad_to elements (strided, only d used), the padding NaN bits, so a
    kernel that copies a byte past column d - 1 into its tiles gets NaNs in S. k_ramp: key j is
    multiplied by 1 + k_ramp·j / n_k (scores that grow along the keys). Works on a GPU
    and in the simulator (where device arrays wrap NumPy arrays).
    """
    rng = np.random.default_rng(seed)
    q32 = rng.standard_normal((B, H, n_q, d)).astype(np.float32) * big
    k32 = rng.standard_normal((B, Hkv, n_k, d)).astype(np.float32)
    if k_ramp:
        k32 *= (1 + k_ramp * np.arange(n_k, dtype=np.float32) / n_k)[:, None]
    v32 = rng.standard_normal((B, Hkv, n_k, d)).astype(np.float32)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    device, values = [], []
    for x in (q32, k32, v32):
        words, vals = to_bits(x, dtype)
        if pad_to:
            padded = np.full(x.shape[:-1] + (pad_to,), 0xFFFF, words.dtype)  # NaN in f16 and bf16
            padded[..., :d] = words
            device.append(cuda.to_device(padded)[:, :, :, :d])  # Numba device arrays reject `...`
        else:
            device.append(cuda.to_device(words))
        values.append(vals)
    out = cuda.to_device(np.zeros((B, H, n_q, d), device[0].dtype))
    lse = cuda.to_device(np.zeros((B, H, n_q), np.float32))
    tile = tile or tile_of(d, HEAD_DIM, **config)
    (launch or mma_forward.launch)(*device, out, lse, tile, causal=causal, softmax_scale=scale)
    o_ref, lse_ref = attention_f64(*values, causal, scale)
    return from_bits(out.copy_to_host(), dtype), lse.copy_to_host().astype(np.float64), o_ref, lse_ref


def assert_close(o, lse, o_ref, lse_ref, dtype):
    # O is rounded once to the output dtype and P once to 16 bits before P·V: a few ulps of 16-bit.
    ulp = 2.0**-10 if dtype == "float16" else 2.0**-7
    o_err = np.abs(o - o_ref).max()
    assert o_err <= 4 * ulp * max(1.0, np.abs(o_ref).max()), f"max |O - O_ref| = {o_err}"
    finite = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert (lse[~finite] == -np.inf).all()
    lse_err = np.abs(lse[finite] - lse_ref[finite]).max(initial=0.0)
    assert lse_err <= 1e-4 * max(1.0, np.abs(lse_ref[finite]).max(initial=0.0)), f"max |L - L_ref| = {lse_err}"


# --------------------------------------------------------------------------------------------
# Simulator tests
# --------------------------------------------------------------------------------------------
@in_simulator
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_square_sim(causal, dtype):
    """Nq = Nk = 70: a full and a ragged K/V tile, two Q tiles (the second mostly padding)."""
    r = run_forward(1, 2, 2, 70, 70, 64, causal, dtype)
    assert_close(*r, dtype)


@in_simulator
@pytest.mark.parametrize("causal", [False, True])
def test_more_keys_than_queries_gqa_sim(causal):
    """Nq < Nk with bottom-right alignment, GQA (H = 2, Hkv = 1), one Q tile per head."""
    r = run_forward(1, 2, 1, 20, 90, 64, causal, "float16", seed=1)
    assert_close(*r, "float16")


@in_simulator
def test_fewer_keys_than_queries_causal_masks_whole_rows_sim():
    """Nq > Nk, causal: the first Nq - Nk rows see no key (O = 0, L = -inf), some whole warps too."""
    r = run_forward(1, 1, 1, 64, 24, 64, True, "bfloat16", seed=2)
    o, lse = r[0], r[1]
    assert (lse[0, 0, :40] == -np.inf).all() and (o[0, 0, :40] == 0).all()
    assert_close(*r, "bfloat16")


@in_simulator
def test_head_dim_padding_and_strides_sim():
    """d = 40 zero-padded to HEAD_DIM = 64 inside the loads; rows of a padded (strided) buffer."""
    r = run_forward(1, 1, 1, 33, 65, 40, False, "bfloat16", seed=3, pad_to=48)
    assert_close(*r, "bfloat16")


@in_simulator
def test_head_dim_128_sim():
    """d = 128 (Q re-read from shared memory every tile, the d = 128 default), causal, Nq < Nk."""
    r = run_forward(1, 1, 1, 17, 80, 128, True, "bfloat16", seed=4)
    assert_close(*r, "bfloat16")


@in_simulator
@pytest.mark.parametrize("d,dtype", [(256, "float16"), (160, "bfloat16")])
def test_large_head_dims_sim(d, dtype):
    """d = 256 (16 k-steps of Q·Kᵀ, 32 O n-tiles: acc alone 128 fp32 per lane) and 160 padded to 192 (24 chunks
    a row: three 8-chunk swizzle groups), causal with Nq < Nk, GQA, a tail tile of each."""
    r = run_forward(1, 2, 1, 21, 45, d, True, dtype, seed=d, BLOCK_Q=32, BLOCK_K=32)
    assert_close(*r, dtype)


@in_simulator
def test_head_dim_192_threads_not_a_multiple_of_the_chunks_sim():
    """d = 192 with 8 warps: 256 threads over rows of 24 chunks, so 192 threads copy (8 rows a pass) and the
    other 64 issue none (blocks.copies.copy_threads); 4 warps (96 copy) too, a tail K/V tile each."""
    from numba_flash.blocks.copies import copy_threads

    assert copy_threads(192, 256) == 192 and copy_threads(192, 128) == 96 and copy_threads(256, 256) == 256
    for bq in (128, 64):
        r = run_forward(1, 1, 1, 30, 50, 192, False, "float16", seed=bq, BLOCK_Q=bq, BLOCK_K=32)
        assert_close(*r, "float16")


@in_simulator
def test_small_tiles_sim():
    """BLOCK_Q = 32 (2 warps), BLOCK_K = 32 (4 K/V tiles: both buffers of the pair used twice), causal."""
    r = run_forward(1, 1, 1, 40, 100, 64, True, "float16", seed=6, BLOCK_Q=32, BLOCK_K=32)
    assert_close(*r, "float16")


@in_simulator
def test_two_warps_head_dim_128_unfixed_swizzle_sim():
    """d = 128 with 2 warps: 64 threads copy rows 4 apart, so each copy computes its own swizzle
    (the fast load path's other branch); a tail K/V tile and a tail Q tile."""
    r = run_forward(1, 1, 1, 37, 75, 128, False, "float16", seed=12, BLOCK_Q=32, BLOCK_K=32)
    assert_close(*r, "float16")


@in_simulator
def test_eight_warps_head_dim_128_sim():
    """128 x 32 x 128 (8 warps, 256 threads, rows 16 apart per copy), strided rows, causal."""
    r = run_forward(1, 1, 1, 100, 40, 128, True, "float16", seed=14, BLOCK_Q=128, BLOCK_K=32, pad_to=136)
    assert_close(*r, "float16")


@in_simulator
@pytest.mark.parametrize("causal", [False, True])
def test_two_m_tiles_per_warp_sim(causal):
    """M_TILES = 2 (32 rows per warp, each K/V fragment feeds two m-tiles): 2 warps x 32 rows,
    Nq > one tile with a ragged tail, Nq > Nk so the causal diagonal crosses both m-tiles of a warp
    (kept small: each simulated warp exchange is slow; GQA is covered by the other tests)."""
    r = run_forward(1, 1, 1, 70, 40, 64, causal, "float16", seed=15, BLOCK_Q=64, BLOCK_K=32, M_TILES=2)
    assert_close(*r, "float16")


@in_simulator
def test_two_m_tiles_head_dim_128_sim():
    """M_TILES = 2 at d = 128 (Q re-read per k-step for both m-tiles), bf16, causal with Nq < Nk."""
    r = run_forward(1, 1, 1, 45, 77, 128, True, "bfloat16", seed=16, BLOCK_Q=64, BLOCK_K=32, M_TILES=2)
    assert_close(*r, "bfloat16")


@in_simulator
def test_large_logits_sim():
    """Scores around 100 in base 2: the running max must be subtracted (no inf / nan)."""
    r = run_forward(1, 1, 1, 16, 70, 64, False, "float16", seed=5, big=12.0)
    assert np.isfinite(r[0]).all()
    assert_close(*r, "float16")


def test_shipped_configs_are_valid():
    from numba_flash.configs import MMA_TABLE

    for tile in MMA_TABLE.values():
        assert mma_forward.problems(tile, "float16") == [], tile  # 128 x 64 at d = 128: 96 KiB, dynamic smem
    for head_dim in (64, 128, 192, 256):
        assert mma_forward.problems(tile_of(head_dim), "bfloat16") == []
    assert "shared memory" in " ".join(mma_forward.problems(tile_of(128, BLOCK_Q=256, BLOCK_K=256), "float16"))
    assert "stages" in " ".join(mma_forward.problems(tile_of(64).with_(stages=1), "float16"))
    assert "flags" in " ".join(mma_forward.problems(tile_of(64, flags={"split_tail"}), "float16"))
    with pytest.raises(ValueError, match="head_dim=96"):
        mma_forward.build(tile_of(64, HEAD_DIM=96), False, "float16")


# --------------------------------------------------------------------------------------------
# sm_90 build: every shipped config compiles, uses tensor cores, and ptxas reports no spills
# --------------------------------------------------------------------------------------------
COMPILE_SOURCE_MT = """
from numba_flash.kernels import mma_forward
from numba_flash.tiles import Tile
mma_forward_kernel = mma_forward.kernel_source(Tile({BQ}, {BK}, {D}, warps={BQ} // (16 * {MT}), stages=2,
                                                    flags={FLAGS!r}), {CAUSAL}, {DTYPE!r})
SIG = mma_forward.kernel_signature()
"""


def compile_source(BQ, BK, D, CAUSAL, DTYPE, MT=1, FLAGS=()):
    return COMPILE_SOURCE_MT.format(BQ=BQ, BK=BK, D=D, CAUSAL=CAUSAL, DTYPE=DTYPE, MT=MT, FLAGS=sorted(FLAGS))


SWEEP_CONFIGS = [(64, 32, 128, 1), (128, 32, 128, 1), (128, 64, 64, 1), (128, 128, 64, 1), (64, 128, 64, 1),
                 (128, 32, 128, 2), (128, 64, 64, 2), (64, 64, 64, 2)]


@pytest.mark.parametrize("BQ,BK,D,MT", SWEEP_CONFIGS)
def test_sweep_configs_compile_without_spills(BQ, BK, D, MT, tmp_path):
    """The configs scripts/sweep_mma.py times (uncapped registers): no spills, fragments in registers."""
    source = compile_source(BQ, BK, D, True, "float16", MT)
    text = compile_in_subprocess(source, "SIG", "mma_forward_kernel", tmp_path)
    assert "ld.local" not in text and "st.local" not in text
    report = ptxas_report(text, tmp_path)
    allowed = SWEEP_SPILL_OK.get((BQ, BK, D, MT), 0)
    assert report["spill_stores"] <= allowed and report["spill_loads"] <= allowed, report["text"]


# Sweep configs that spill a few bytes at 255 registers since the softmax keeps row maxima scaled
# (alpha = 2^(M_old - M_new)): ptxas sm_90 13.0 gave 8/12 B; they were 0 before.
SWEEP_SPILL_OK = {(128, 64, 64, 2): 16, (64, 64, 64, 2): 16}


def test_head_dim_128_register_budget(tmp_path):
    """v4's copy plans and unrolled k-steps: 64x64x128 took 240 registers in v3, 174 in v4, 209 with
    one dynamic shared buffer (v6; ptxas's choice, no spills)."""
    source = compile_source(64, 64, 128, False, "float16")
    text = compile_in_subprocess(source, "SIG", "mma_forward_kernel", tmp_path)
    assert text.count("mma.sync.aligned") == 2 * 64  # both GEMMs fully unrolled (8x8 + 4x16)
    report = ptxas_report(text, tmp_path)
    assert report["registers"] <= 224, report["text"]  # 2 blocks (8 warps) per SM need <= 256 at 128 threads


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_shipped_configs_compile_for_sm90(head_dim, causal, dtype, tmp_path):
    """Each config forward ships (configs.MMA_TABLE): tensor cores, fragments in registers, and no
    spills beyond the few bytes MMA_SPILL_OK records for a config the sweep measured faster."""
    from numba_flash.configs import MMA_SPILL_OK, MMA_TABLE

    tile = MMA_TABLE[head_dim, causal]
    bq, bk, mt = tile.block_q, tile.block_k, mma_forward.m_tiles(tile)
    source = compile_source(bq, bk, head_dim, causal, dtype, mt, tile.flags)
    text = compile_in_subprocess(source, "SIG", "mma_forward_kernel", tmp_path)
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.{0}.{0}.f32".format("f16" if dtype == "float16" else "bf16")
    assert mma in text and "ldmatrix.sync.aligned.m8n8.x4.trans" in text and "cp.async.cg" in text
    assert "ld.local" not in text and "st.local" not in text  # NVVM keeps every fragment in registers
    # no fp64 anywhere (a Python-float constant in the lazy-rescale comparison once made it cvt/add/setp.f64)
    assert ".f64" not in text
    report = ptxas_report(text, tmp_path)
    allowed = MMA_SPILL_OK.get((bq, bk, head_dim, mt), 0)
    assert report["spill_stores"] <= allowed and report["spill_loads"] <= allowed, report["text"]


@pytest.mark.parametrize("causal", [False, True])
def test_small_smem_tiles_compile_for_sm90_without_spills(causal, tmp_path):
    """MMA_SMALL_SMEM's d = 256 tiles (GPUs with < 192 KiB of shared memory per block): no spills, no local arrays."""
    from numba_flash.configs import MMA_SMALL_SMEM

    tile = MMA_SMALL_SMEM[256, causal]
    source = compile_source(tile.block_q, tile.block_k, 256, causal, "bfloat16", mma_forward.m_tiles(tile), tile.flags)
    text = compile_in_subprocess(source, "SIG", "mma_forward_kernel", tmp_path)
    assert "ld.local" not in text and "st.local" not in text
    report = ptxas_report(text, tmp_path)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report["text"]


def test_warp_skip_keeps_one_barrier_per_tile(tmp_path):
    """warp_skip must not add a barrier instruction: a warp past its rows' tiles takes the same
    bar.sync as the others (one loop, the maths skipped by a warp-uniform branch). A second loop of
    barriers for the skipped tiles is undefined for an aligned barrier (compute-sanitizer synccheck:
    divergent bar.sync), whatever results a GPU happens to give."""
    from numba_flash.configs import MMA_TABLE

    tile = MMA_TABLE[64, True]
    assert tile.has("warp_skip")  # the build this guards
    counts = {}
    for flags in (tile.flags, tile.flags - {"warp_skip"}):
        source = compile_source(tile.block_q, tile.block_k, 64, True, "float16", mma_forward.m_tiles(tile), flags)
        text = compile_in_subprocess(source, "SIG", "mma_forward_kernel", tmp_path)
        counts["warp_skip" in flags] = len(re.findall(r"\bbar(?:rier)?\.sync", text))
    assert counts[True] == counts[False] > 0, counts


# --------------------------------------------------------------------------------------------
# Real GPU (marked gpu; skipped without one): python -m pytest -m gpu tests/kernels/test_mma_forward.py
# --------------------------------------------------------------------------------------------
from gpu_helpers import needs_gpu  # noqa: E402

gpu = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 40, 96, 160, 192, 200, 256])
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300), (1, 2, 1, 129, 517), (1, 3, 3, 517, 129), (1, 2, 2, 1, 77)])
@pytest.mark.gpu
@needs_gpu
def test_gpu_matches_float64(shape, d, causal, dtype):
    B, H, Hkv, n_q, n_k = shape
    r = run_forward(B, H, Hkv, n_q, n_k, d, causal, dtype, seed=n_q + d)
    assert_close(*r, dtype)


@pytest.mark.parametrize("config", [dict(BLOCK_K=32), dict(BLOCK_Q=128), dict(BLOCK_Q=32, BLOCK_K=128)])
@pytest.mark.gpu
@needs_gpu
def test_gpu_other_configs(config):
    r = run_forward(1, 2, 1, 333, 444, 64, True, "float16", seed=7, **config)
    assert_close(*r, "float16")


SWEEP_GPU_CONFIGS = [
    (128, dict(BLOCK_Q=128, BLOCK_K=32, M_TILES=2)), (128, dict(BLOCK_Q=64, BLOCK_K=32, M_TILES=2)),
    (64, dict(BLOCK_Q=128, BLOCK_K=64, M_TILES=2)), (64, dict(BLOCK_Q=64, BLOCK_K=64, M_TILES=2)),
    (64, dict(BLOCK_Q=128, BLOCK_K=128, M_TILES=2)),
    # the flags (grid order, shared-memory epilogue, warp skip), alone and as shipped
    (128, dict(BLOCK_Q=128, BLOCK_K=64, M_TILES=2, flags={"grid_bh_x", "smem_epilogue"})),
    (64, dict(BLOCK_Q=128, BLOCK_K=64, M_TILES=2, flags={"smem_epilogue"})),
    (64, dict(BLOCK_Q=64, BLOCK_K=64, flags={"grid_bh_x"})),
    (128, dict(BLOCK_Q=128, BLOCK_K=64, M_TILES=2, flags={"warp_skip"})),
    (64, dict(BLOCK_Q=128, BLOCK_K=64, M_TILES=2, flags={"warp_skip", "grid_bh_x"})),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,config", SWEEP_GPU_CONFIGS)
@pytest.mark.gpu
@needs_gpu
def test_gpu_sweep_configs(head_dim, config, causal):
    """Variants scripts/sweep_mma.py times (shipped and earlier candidates), on ragged GQA shapes (d = head_dim - 8
    padded)."""
    for d in (head_dim, head_dim - 8):
        r = run_forward(1, 4, 2, 333, 517, d, causal, "bfloat16", seed=d + 18, HEAD_DIM=head_dim, **config)
        assert_close(*r, "bfloat16")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.gpu
@needs_gpu
def test_gpu_lazy_rescale_moving_max(dtype, causal):
    """The shipped d = 128 tiles (lazy rescaling) where row maxima keep climbing: keys grow along the sequence
    and q is 4x, so M moves past 2^8 on many tiles (and stays behind on others) over 33 K/V tiles."""
    from numba_flash.configs import MMA_TABLE

    r = run_forward(1, 2, 1, 300, 2100, 128, causal, dtype, seed=31, big=4.0, k_ramp=3.0, tile=MMA_TABLE[128, causal])
    assert np.isfinite(r[0]).all()
    assert_close(*r, dtype)


@pytest.mark.gpu
@needs_gpu
def test_gpu_strided_and_large_logits():
    assert_close(*run_forward(2, 2, 1, 200, 260, 40, True, "bfloat16", seed=8, pad_to=64), "bfloat16")
    r = run_forward(1, 2, 2, 100, 300, 64, False, "float16", seed=9, big=12.0)
    assert np.isfinite(r[0]).all()
    assert_close(*r, "float16")


@pytest.mark.gpu
@needs_gpu
def test_gpu_deterministic():
    """Same inputs, same bits, many runs (no atomics; a race would show up here)."""
    first = run_forward(1, 4, 4, 513, 700, 128, True, "bfloat16", seed=10)
    for _ in range(5):
        again = run_forward(1, 4, 4, 513, 700, 128, True, "bfloat16", seed=10)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])


@pytest.mark.gpu
@needs_gpu
def test_gpu_long_sequence_spot_check():
    """B=1, H=2, N=2048, d=128, causal and not: 32 K/V tiles per row block."""
    for causal in (False, True):
        r = run_forward(1, 2, 2, 2048, 2048, 128, causal, "float16", seed=11)
        assert np.isfinite(r[0]).all()
        assert_close(*r, "float16")


# --------------------------------------------------------------------------------------------
# The flags (grid order, epilogue through shared memory, warp skip): simulator correctness
# --------------------------------------------------------------------------------------------
VARIANT_FLAGS = [{"grid_bh_x"}, {"smem_epilogue"}, {"warp_skip"}, {"grid_bh_x", "smem_epilogue", "warp_skip"}]


# Each flag where it acts (the grid order and the warp skip only change causal runs) and the
# combination both ways: the simulator runs a 64-thread block in ~10 s per K/V tile, so CI keeps
# these few and small.
VARIANT_CASES = [(flags, causal) for flags in VARIANT_FLAGS[:-1]
                 for causal in ((True,) if flags & {"grid_bh_x", "warp_skip"} else (False,))]
VARIANT_CASES += [(VARIANT_FLAGS[-1], False), (VARIANT_FLAGS[-1], True)]


@in_simulator
@pytest.mark.parametrize("flags,causal", VARIANT_CASES,
                         ids=lambda x: "+".join(sorted(x)) if isinstance(x, set) else str(x))
def test_variants_sim(flags, causal):
    """2 warps x 32 rows (M_TILES = 2) over Nq = 40 (a ragged Q tile), Nk = 70 (three K/V tiles, the
    last ragged: two-stage buffers alternate and wrap), GQA 2 (the grid order's b·h over 2 heads)."""
    r = run_forward(1, 2, 1, 40, 70, 64, causal, "float16", seed=21, BLOCK_Q=64, BLOCK_K=32, M_TILES=2, flags=flags)
    assert_close(*r, "float16")


@in_simulator
@pytest.mark.parametrize("flags", [(), ("smem_epilogue",)])
def test_variants_head_dim_128_and_odd_d_sim(flags):
    """d = 120 in HEAD_DIM = 128 (Q re-read from shared memory; the epilogue's last 16-byte chunk is
    dropped, a padded column), Nq > Nk causal (whole rows masked), bf16, 4 warps x 16 rows."""
    r = run_forward(1, 1, 1, 40, 23, 120, True, "bfloat16", seed=22, HEAD_DIM=128, BLOCK_Q=64, BLOCK_K=16, flags=flags)
    assert_close(*r, "bfloat16")


@in_simulator
@pytest.mark.parametrize("big,k_ramp,causal", [(4.0, 3.0, False), (4.0, 3.0, True), (1.0, 0.0, False)])
def test_lazy_rescale_sim(big, k_ramp, causal):
    """Lazy rescaling: with keys that grow along the sequence and large scores (4x q), row maxima climb
    by more than 2^8 from tile to tile for some rows (M moves: acc, l_i rescaled) and by less for
    others (M stays behind, p up to 2^8); with plain N(0, 1) data M settles after the first tile.
    2 warps x 32 rows, 16-key tiles (5 of them, the last ragged), GQA 2, bf16 too (P packed at up to 256)."""
    r = run_forward(1, 2, 1, 40, 70, 64, causal, "float16", seed=26, big=big, k_ramp=k_ramp, BLOCK_Q=64,
                    BLOCK_K=16, M_TILES=2)
    assert np.isfinite(r[0]).all()
    assert_close(*r, "float16")
    if causal:
        r = run_forward(1, 1, 1, 40, 23, 120, True, "bfloat16", seed=27, big=big, k_ramp=k_ramp, HEAD_DIM=128,
                        BLOCK_Q=64, BLOCK_K=16, flags={"smem_epilogue"})
        assert_close(*r, "bfloat16")


@in_simulator
@pytest.mark.parametrize("n_q,n_k", [(128, 128), (100, 60), (50, 130)])
def test_warp_skip_sim(n_q, n_k):
    """warp_skip, causal, 2 warps x 32 rows, 16-key tiles: each Q tile's last tiles lie wholly above the
    diagonal for warp 0 (and, with Nq > Nk, whole warps see nothing at all)."""
    r = run_forward(1, 1, 1, n_q, n_k, 64, True, "float16", seed=24, BLOCK_Q=64, BLOCK_K=16, M_TILES=2,
                    flags={"warp_skip"})
    assert_close(*r, "float16")


@in_simulator
def test_smem_epilogue_block_without_key_tiles_sim():
    """Nq = 80 > Nk = 10, causal, 32-row Q tiles at d = 128 (Q in shared memory, no prologue
    barrier): the first Q tiles see no key at all, so O = 0 goes into Q's rows after the block's
    only barrier (the one EPI_SYNC adds)."""
    r = run_forward(1, 1, 1, 80, 10, 128, True, "float16", seed=25, BLOCK_Q=32, BLOCK_K=16,
                    flags={"smem_epilogue"})
    assert (r[1][0, 0, :70] == -np.inf).all() and (r[0][0, 0, :70] == 0).all()
    assert_close(*r, "float16")


@in_simulator
def test_smem_epilogue_unaligned_out_falls_back_sim():
    """d = 44: out's rows (88 bytes) are not 16-byte aligned, so launch quietly uses the fragment
    stores (q, k, v are rows of a 48-element buffer, as cp.async needs)."""
    r = run_forward(1, 1, 1, 20, 33, 44, False, "float16", seed=23, pad_to=48, flags={"smem_epilogue"})
    assert_close(*r, "float16")


def test_explain_names_the_shipped_variants(rng):
    """explain lists each flag configs.MMA_TABLE ships for the shape (and none it does not), and what every
    mma tile does."""
    import numba_flash
    from numba_flash.api import _MMA_ALWAYS, _VARIANT_WORDS, mma_config
    from numba_flash.configs import MMA_TABLE

    for d, causal in MMA_TABLE:
        tile = mma_config(d, causal)  # MMA_TABLE's, or on sm_90 MMA_WGMMA's
        q = rng.standard_normal((1, 2, 64, d)).astype(np.float16)
        text = numba_flash.explain(q, q, q, causal=causal)
        assert text.startswith("mma:"), text
        for key, words in _VARIANT_WORDS.items():
            on = key in _MMA_ALWAYS or tile.has(key)
            assert (words in text) == on, (d, causal, key, text)


@in_simulator
def test_explain_says_when_a_row_ends_in_a_part_data_copy(rng):
    """d % 8 != 0 (device rows of a padded buffer, as cp.async needs) takes the src-size copies (PARTIAL_CHUNK),
    and the kernel choice says so; d % 8 == 0 does not."""
    from numba_flash import api

    for d, partial in ((44, True), (48, False), (64, False)):
        padded = cuda.to_device(rng.standard_normal((1, 2, 64, 64)).astype(np.float16))[:, :, :, :d]
        p = api.Problem(kind="numba", dtype="float16", q_shape=(1, 2, 64, d), B=1, H=2, Hkv=2, n_q=64, n_k=64, d=d,
                        causal=False, softmax_scale=0.125, device=None)
        family, _, reasons = api.choose_kernel(p, "auto", (padded, padded, padded))
        assert family == "mma" and any("part data" in r for r in reasons) == partial, (d, reasons)


def test_large_head_dims_fit_gpus_with_less_shared_memory(monkeypatch):
    """d = 192 / 256 take the 8-warp 128x64 tile (up to 192 KiB) where the GPU gives a block that much (H200), and
    MMA_SMALL_SMEM's 64x32 tile (96 KiB at most) on an sm_86 / sm_89 (99 KiB); other head dims keep theirs."""
    import importlib

    from numba_flash.configs import MMA_SMALL_SMEM, MMA_TABLE

    api = importlib.import_module("numba_flash.api")
    monkeypatch.setattr(api, "_wgmma_here", lambda: False)  # a GPU without wgmma (sm_80-89)
    assert api.mma_config(200, False) == MMA_TABLE[256, False] and api.mma_config(130, True) == MMA_TABLE[192, True]
    monkeypatch.setattr(api, "_device_smem", lambda: (99 * 1024, 100 * 1024))
    for (hd, causal), tile in MMA_SMALL_SMEM.items():
        assert api.mma_config(hd, causal) == tile and mma_forward.smem_bytes(tile) <= 99 * 1024
        assert mma_forward.problems(tile, "bfloat16") == []
    assert api.mma_config(128, True) == MMA_TABLE[128, True]  # 96 KiB: fits
    q = np.zeros((1, 2, 64, 256), np.float16)
    assert "64x32 tiles" in api.explain(q, q, q)
