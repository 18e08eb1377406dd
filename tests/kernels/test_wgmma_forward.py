"""The forward on warpgroup MMA (numba_flash.kernels.wgmma_forward): in the CUDA simulator through the wgmma
twins (ptx/warpgroup.py), and its sm_90a build (ptxas: wgmma in the SASS, no spills)."""
import sys
from pathlib import Path

import pytest

from numba_flash.kernels import wgmma_forward
from numba_flash.tiles import Tile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_mma_forward import assert_close, run_forward  # noqa: E402
from gpu_helpers import needs_gpu  # noqa: E402
from test_ptx import NO_GPU_PATCH, in_simulator, run_compile_child  # noqa: E402


def run_wgmma(B, H, Hkv, n_q, n_k, d, causal, dtype, tile, seed=0, pad_to=None):
    """wgmma_forward.launch through test_mma_forward.run_forward (GPU or simulator): (O, L, O_ref, L_ref)."""
    return run_forward(B, H, Hkv, n_q, n_k, d, causal, dtype, seed=seed, pad_to=pad_to, tile=tile,
                       launch=wgmma_forward.launch)


@in_simulator
@pytest.mark.parametrize("d,dtype,causal,tile", [
    (64, "float16", False, Tile(64, 32, 64, warps=4, stages=2)),  # one warpgroup, a tail K/V tile
    (40, "bfloat16", True, Tile(128, 32, 64, warps=8, stages=2, flags={"grid_bh_x"})),  # two, padded d, causal
    (128, "float16", True, Tile(64, 32, 128, warps=4, stages=2)),  # two column atoms
    (100, "float16", False, Tile(64, 96, 128, warps=4, stages=2)),  # d % 8 != 0: a part-data chunk; 96-key tiles
])
def test_wgmma_forward_sim(d, dtype, causal, tile):
    r = run_wgmma(1, 2, 1, 70, 45, d, causal, dtype, tile, seed=d, pad_to=-(-d // 8) * 8 if d % 8 else None)
    assert_close(*r, dtype)


@in_simulator
def test_sm90_forward_takes_the_wgmma_tiles(rng):
    """Where wgmma exists (sm_90, and the simulator's twins), forward's fp16 / bf16 tiles are MMA_WGMMA's, explain
    says so, and every one of them can be built; mma.sync's stay for the head dims MMA_WGMMA lacks."""
    import numpy as np

    from numba_flash import api
    from numba_flash.configs import MMA_TABLE, MMA_WGMMA

    assert set(MMA_WGMMA) == set(MMA_TABLE)
    for (hd, causal), tile in MMA_WGMMA.items():
        assert api.mma_config(hd, causal) == tile and wgmma_forward.problems(tile, "bfloat16") == []
    q = rng.standard_normal((1, 2, 64, 128)).astype(np.float16)
    text = api.explain(q, q, q)
    assert "wgmma.mma_async m64n128k16" in text and "2 warpgroups x 64 rows" in text, text


WGMMA_FORWARD_COMPILE = NO_GPU_PATCH + """
import json, re, subprocess, sys, tempfile
from numba import cuda
from numba_flash.configs import MMA_WGMMA
from numba_flash.kernels import wgmma_forward
out = {}
for (hd, causal), tile in sorted(MMA_WGMMA.items()):
    for dtype in ("float16", "bfloat16"):
        ptx, _ = cuda.compile_ptx(wgmma_forward.kernel_source(tile, causal, dtype), wgmma_forward.kernel_signature(),
                                  cc=(9, 0, "a"))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        r = subprocess.run([sys.argv[-1], "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                           text=True)
        rep = r.stderr + r.stdout
        m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
        regs = re.search(r"Used (\\d+) registers", rep)
        out[f"{hd}-{causal}-{dtype}"] = dict(rc=r.returncode, stack=int(m.group(1)) if m else -1,
                                             spills=int(m.group(2)) + int(m.group(3)) if m else -1,
                                             registers=int(regs.group(1)) if regs else -1,
                                             mma=len(re.findall(r"wgmma.mma_async", ptx)),
                                             want=hd // 16 + tile.block_k // 16, serialized="serialized" in rep,
                                             f64=".f64" in ptx, log=rep[-600:])
print(json.dumps(out))
"""


@pytest.mark.heavy  # ptxas over every shipped build; CI keeps the shipped-PTX hash check of the same kernels
def test_shipped_tiles_build_for_sm90a(tmp_path):
    """ptxas -arch=sm_90a takes every MMA_WGMMA tile (both dtypes) with no spills or stack, within 255 registers,
    every product of a tile in the PTX (d/16 for Q·Kᵀ, block_k/16 for P·V), none serialized by ptxas, no fp64."""
    got = run_compile_child(WGMMA_FORWARD_COMPILE, [], tmp_path)
    assert len(got) == 16
    for key, r in got.items():
        assert r["rc"] == 0, (key, r["log"])
        assert (r["stack"], r["spills"]) == (0, 0) and 0 < r["registers"] <= 255, (key, r)
        assert r["mma"] == r["want"] and not r["serialized"] and not r["f64"], (key, r)


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
    r = run_wgmma(B, H, Hkv, n_q, n_k, d, causal, dtype, tile, seed=n_q + d, pad_to=-(-d // 8) * 8 if d % 8 else None)
    assert_close(*r, dtype)
