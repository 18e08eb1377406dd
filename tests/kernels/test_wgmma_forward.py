"""The forward on warpgroup MMA (numba_flash.kernels.wgmma_forward): in the CUDA simulator through the wgmma
twins (ptx/warpgroup.py), and its sm_90a build (ptxas: wgmma in the SASS, no spills)."""
import sys
from pathlib import Path

import pytest
from numba import cuda

from numba_flash.kernels import wgmma_forward
from numba_flash.tiles import Tile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_mma_forward import assert_close, attention_f64, from_bits, to_bits  # noqa: E402
from gpu_helpers import needs_gpu  # noqa: E402
from test_ptx import in_simulator  # noqa: E402


def run_wgmma(B, H, Hkv, n_q, n_k, d, causal, dtype, tile, seed=0):
    """wgmma_forward.launch on device arrays (GPU or simulator); (O, L, O_ref, L_ref) in float64."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((B, h, n, d)).astype(np.float32) for h, n in ((H, n_q), (Hkv, n_k), (Hkv, n_k))]
    device, values = [], []
    for x in xs:
        words, vals = to_bits(x, dtype)
        device.append(cuda.to_device(words))
        values.append(vals)
    out = cuda.to_device(np.zeros((B, H, n_q, d), device[0].dtype))
    lse = cuda.to_device(np.zeros((B, H, n_q), np.float32))
    scale = 1.0 / np.sqrt(d)
    wgmma_forward.launch(*device, out, lse, tile, causal=causal, softmax_scale=scale)
    o_ref, lse_ref = attention_f64(*values, causal, scale)
    return from_bits(out.copy_to_host(), dtype), lse.copy_to_host().astype(np.float64), o_ref, lse_ref


@in_simulator
@pytest.mark.parametrize("d,dtype,causal,tile", [
    (64, "float16", False, Tile(64, 32, 64, warps=4, stages=2)),  # one warpgroup, a tail K/V tile
    (40, "bfloat16", True, Tile(128, 32, 64, warps=8, stages=2, flags={"grid_bh_x"})),  # two, padded d, causal
    (128, "float16", True, Tile(64, 32, 128, warps=4, stages=2)),  # two column atoms
])
def test_wgmma_forward_sim(d, dtype, causal, tile):
    r = run_wgmma(1, 2, 1, 70, 45, d, causal, dtype, tile, seed=d)
    assert_close(*r, dtype)


def test_problems():
    assert wgmma_forward.problems(Tile(128, 128, 128, warps=8, stages=2), "float16") == []
    assert "warpgroups" in " ".join(wgmma_forward.problems(Tile(96, 64, 128, warps=6, stages=2), "float16"))
    assert "head_dim" in " ".join(wgmma_forward.problems(Tile(64, 64, 96, warps=4, stages=2), "float16"))
    assert "block_k" in " ".join(wgmma_forward.problems(Tile(64, 40, 64, warps=4, stages=2), "float16"))


GPU_TILES = [  # (d, tile): one warpgroup and two, key tiles of 64 to 176, every head dim the kernel builds
    (64, Tile(128, 128, 64, warps=8, stages=2)), (128, Tile(128, 128, 128, warps=8, stages=2)),
    (128, Tile(64, 176, 128, warps=4, stages=2)), (100, Tile(128, 96, 128, warps=8, stages=2, flags={"grid_bh_x"})),
    (192, Tile(128, 96, 192, warps=8, stages=2)), (256, Tile(128, 64, 256, warps=8, stages=2)),
    (200, Tile(128, 80, 256, warps=8, stages=2, flags={"grid_bh_x"})),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,tile", GPU_TILES, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300), (1, 2, 1, 129, 517), (1, 3, 3, 517, 129), (1, 2, 2, 1, 77)])
def test_gpu_wgmma_forward_matches_float64(shape, d, tile, causal, dtype):
    from numba_flash import ptx

    if not ptx.current_wgmma():
        pytest.skip("wgmma needs an sm_90 GPU")
    B, H, Hkv, n_q, n_k = shape
    r = run_wgmma(B, H, Hkv, n_q, n_k, d, causal, dtype, tile, seed=n_q + d)
    assert_close(*r, dtype)
