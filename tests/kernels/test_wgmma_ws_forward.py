"""The warp-specialised TMA forward (numba_flash.kernels.wgmma_ws_forward) and its intrinsics (ptx/tma.py): the twins
in the CUDA simulator, the sm_90a build through ptxas, GPU runs of tiles beyond the shipped ones (marked variant),
and the dispatch of sm_90's plain forward to configs.MMA_WGMMA_WS's tiles."""
import functools
import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from numba_flash import ptx
from numba_flash.kernels import wgmma_ws_forward as ws
from numba_flash.tiles import Tile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_mma_forward import assert_close, run_forward  # noqa: E402
from gpu_helpers import needs_gpu  # noqa: E402
from test_ptx import NO_GPU_PATCH, in_simulator, run_compile_child  # noqa: E402


def run_ws(B, H, Hkv, n_q, n_k, d, causal, dtype, tile, seed=0, pad_to=None, n_sm=None):
    """wgmma_ws_forward.launch through test_mma_forward.run_forward (GPU or simulator): (O, L, O_ref, L_ref);
    n_sm: the SM count a persistent tile's grid takes."""
    launch = functools.partial(ws.launch, n_sm=n_sm) if n_sm else ws.launch
    return run_forward(B, H, Hkv, n_q, n_k, d, causal, dtype, seed=seed, pad_to=pad_to, tile=tile, launch=launch)


def swizzled(tile_words):
    """The 128-byte-swizzled image (uint16 words) of a (rows, 64) tile of 16-bit words: chunk j of row r at
    chunk j ^ (r % 8)."""
    rows = tile_words.shape[0]
    out = np.empty_like(tile_words)
    for r in range(rows):
        for j in range(8):
            out[r, 8 * (j ^ (r % 8)):8 * (j ^ (r % 8)) + 8] = tile_words[r, 8 * j:8 * j + 8]
    return out


# --------------------------------------------------------------------------------------------
# The intrinsics' twins
# --------------------------------------------------------------------------------------------
@in_simulator
def test_tma_load_store_twins(rng):
    """A box half outside the tensor (rows past N read as zeros, columns past d too), landing swizzled on an
    mbarrier with expect_tx; stored back by the TMA store to another tensor (only the part inside is written);
    a plain arrive completing a second barrier; a named barrier between two warps."""
    from numba_flash.blocks.tensor_maps import device_maps
    from numba_flash.ptx import tma

    N, d, ROWS = 12, 56, 16
    x = rng.integers(1, 60000, size=(1, 2, N, d)).astype(np.uint16)
    y = np.full((1, 2, N, d), 7, np.uint16)
    dx, dy = cuda.to_device(x), cuda.to_device(y)
    maps = device_maps([(dx, ROWS), (dy, ROWS)])
    seen = cuda.to_device(np.zeros((ROWS, 64), np.uint16))
    flags = cuda.to_device(np.zeros(2, np.int32))
    load, store = tma.tma_load(4), tma.tma_store(4)
    sync_a = tma.named_barrier_sync(5, 64)
    wait_read = tma.bulk_wait_read(0)

    @cuda.jit
    def kernel(maps, seen, flags):
        smem = cuda.shared.array(ROWS * 64 + 512 + 16, np.uint16)
        tid = cuda.threadIdx.x
        BAR = ROWS * 64 + 512
        if tid == 0:
            ptx.mbarrier_init(smem, BAR, 1)
            ptx.mbarrier_init(smem, BAR + 4, 32)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            ptx.mbarrier_arrive_expect_tx(smem, BAR, ROWS * 128)
            load(smem, 0, maps, 0, smem, BAR, 0, 4, 1, 0)  # rows 4..19 of head 1: 8 past N
        while ptx.mbarrier_try_wait_parity(smem, BAR, 0) == 0:
            pass
        for i in range(tid, ROWS * 64, 64):
            seen[i // 64, i % 64] = smem[i]
        if tid < 32:
            tma.mbarrier_arrive(smem, BAR + 4)
        while ptx.mbarrier_try_wait_parity(smem, BAR + 4, 0) == 0:
            pass
        sync_a()
        if tid == 0:
            flags[0] = 1
            store(maps, 128, smem, 0, 0, 4, 1, 0)
            tma.bulk_commit()
            wait_read()

    kernel[1, 64](maps, seen, flags)
    box = np.zeros((ROWS, 64), np.uint16)
    box[:N - 4, :d] = x[0, 1, 4:]
    np.testing.assert_array_equal(seen.copy_to_host(), swizzled(box))
    want = np.full_like(y, 7)
    want[0, 1, 4:] = x[0, 1, 4:]
    np.testing.assert_array_equal(dy.copy_to_host(), want)
    assert flags.copy_to_host()[0] == 1


def test_driver_encoding_arguments(monkeypatch):
    """What the GPU path hands cuTensorMapEncodeTiled (driver stubbed): 4-D (d, N, H, B) innermost first, the array's
    byte strides (a dim of one element gets a valid stand-in), a 64 x rows box, 128-byte swizzle, zero fill, a
    64-byte aligned output; a failing CUresult raises."""
    import ctypes

    from numba_flash.blocks import tensor_maps

    seen = {}

    def fake(out, dtype, rank, address, dims, strides, box, elem, interleave, swizzle, l2, oob):
        seen.update(out=out, dtype=dtype, rank=rank, dims=[dims[i] for i in range(4)],
                    strides=[strides[i] for i in range(3)], box=[box[i] for i in range(4)],
                    elem=[elem[i] for i in range(4)], swizzle=swizzle, interleave=interleave, oob=oob)
        ctypes.memset(out, 0xAB, 128)
        return seen.get("rc", 0)

    monkeypatch.setattr(tensor_maps, "SIMULATOR", False)
    monkeypatch.setattr(tensor_maps, "_driver", lambda: fake)
    x = cuda.to_device(np.zeros((1, 3, 40, 72), np.uint16))[:, :, :, :64]  # rows of 144 B, 64 used
    got = tensor_maps.encode(x, 128)
    assert (got == 0xAB).all() and seen["out"] % 64 == 0
    assert (seen["dtype"], seen["rank"], seen["swizzle"], seen["interleave"], seen["oob"]) == (1, 4, 3, 0, 0)
    assert seen["dims"] == [64, 40, 3, 1] and seen["box"] == [64, 128, 1, 1] and seen["elem"] == [1] * 4
    assert seen["strides"][:2] == [144, 40 * 144] and seen["strides"][2] % 16 == 0
    seen["rc"] = 1
    with pytest.raises(ValueError, match="CUresult 1"):
        tensor_maps.encode(x, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        tensor_maps.encode(cuda.to_device(np.zeros((1, 1, 4, 20), np.uint16)), 64)


def test_intrinsic_arguments_are_checked():
    from numba_flash.ptx import tma

    with pytest.raises(ValueError, match="rank"):
        tma.tma_load(6)
    with pytest.raises(ValueError, match="id in 1..15"):
        tma.named_barrier_sync(0, 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        tma.named_barrier_arrive(1, 100)
    with pytest.raises(ValueError, match="multiple of 8"):
        tma.setmaxnreg(250, True)


# --------------------------------------------------------------------------------------------
# The kernel in the simulator
# --------------------------------------------------------------------------------------------
@in_simulator
def test_ws_forward_one_consumer_sim():
    """One consumer warpgroup, a ragged last K/V tile, every slot of a 2-slot ring refilled."""
    r = run_ws(1, 1, 1, 70, 100, 64, False, "float16", Tile(64, 32, 64, warps=8, stages=2), seed=1)
    assert_close(*r, "float16")


@in_simulator
def test_ws_forward_two_consumers_every_flag_sim():
    """Two consumers with pingpong, setmaxnreg, overlap and the TMA store; causal, GQA, bf16, d = 40 of a 64 build
    (columns past d zero in the loads and unwritten by the store), 3 slots."""
    tile = Tile(128, 16, 64, warps=12, stages=3, flags={"pingpong", "setmaxnreg", "tma_store", "grid_bh_x",
                                                         "overlap"})
    r = run_ws(1, 2, 1, 100, 56, 40, True, "bfloat16", tile, seed=2)
    assert_close(*r, "bfloat16")


@in_simulator
def test_ws_forward_persistent_sim():
    """persistent: two blocks walk six work items (3 causal Q tiles x 2 heads, GQA), so the ring's steps, its
    parities and the Q tile's full / empty barriers carry across items; every flag, the TMA store of O through
    the Q tile the next item's Q load then overwrites."""
    tile = Tile(128, 16, 64, warps=12, stages=2, flags={"pingpong", "setmaxnreg", "tma_store", "overlap",
                                                         "persistent"})
    r = run_ws(1, 2, 1, 300, 70, 64, True, "float16", tile, seed=3, n_sm=2)
    assert_close(*r, "float16")


@in_simulator
def test_ws_forward_persistent_plain_sim():
    """persistent without overlap or the TMA store (each consumer warp releases the Q tile), 3 slots, five work
    items over four blocks (one walks two), not causal, bf16."""
    tile = Tile(128, 32, 64, warps=12, stages=3, flags={"setmaxnreg", "persistent"})
    r = run_ws(1, 5, 5, 100, 90, 64, False, "bfloat16", tile, seed=4, n_sm=4)
    assert_close(*r, "bfloat16")


def test_persistent_tile_needs_the_sm_count_and_no_grid_order():
    tile = Tile(128, 16, 64, warps=12, stages=2, flags={"persistent", "grid_bh_x"})
    assert any("grid_bh_x" in p for p in ws.problems(tile, "float16"))


@in_simulator
@pytest.mark.heavy
@pytest.mark.parametrize("d,dtype,causal,tile", [
    (128, "bfloat16", True, Tile(128, 32, 128, warps=12, stages=3)),
    (100, "float16", False, Tile(64, 48, 128, warps=8, stages=4)),  # rows padded to 104 (TMA strides: 16 B)
    (256, "float16", True, Tile(64, 16, 256, warps=8, stages=2)),
    (64, "float16", True, Tile(128, 16, 64, warps=12, stages=2, flags={"pingpong", "setmaxnreg", "tma_store"})),
    (64, "bfloat16", False, Tile(64, 32, 64, warps=8, stages=2, flags={"overlap"})),
])
def test_ws_forward_more_sim(d, dtype, causal, tile):
    r = run_ws(1, 2, 2, 70, 150, d, causal, dtype, tile, seed=d, pad_to=-(-d // 8) * 8 if d % 8 else None)
    assert_close(*r, dtype)


def test_signature_is_what_the_launcher_takes():
    """numba_flash.launch flattens arrays of layout 'A' only (a C array would be refused at the first GPU launch)."""
    from numba.cuda import types

    sig = ws.kernel_signature()
    assert all(a.layout == "A" for a in sig.args if isinstance(a, types.Array))
    assert [str(a.dtype) for a in sig.args if isinstance(a, types.Array)] == ["uint8", "uint16", "float32"]


@in_simulator
def test_tma_store_refuses_unaligned_out_rows():
    """d = 100 stored through a map needs O's rows a multiple of 16 bytes: a clear error, not a wrong store."""
    with pytest.raises(ValueError, match="multiples of 16"):
        run_ws(1, 1, 1, 8, 8, 100, False, "float16", Tile(64, 48, 128, warps=8, stages=2, flags={"tma_store"}),
               pad_to=104)


def test_problems():
    assert ws.problems(Tile(128, 128, 128, warps=12, stages=2, flags={"setmaxnreg", "pingpong"}), "float16") == []
    assert "warpgroups" in " ".join(ws.problems(Tile(128, 64, 128, warps=8, stages=2), "float16"))
    assert "stages" in " ".join(ws.problems(Tile(128, 64, 128, warps=12, stages=5), "float16"))
    assert "pingpong" in " ".join(ws.problems(Tile(64, 64, 128, warps=8, stages=2, flags={"pingpong"}), "float16"))
    assert "spill" in " ".join(ws.problems(Tile(128, 64, 256, warps=12, stages=2), "float16"))
    assert "overlap" in " ".join(ws.problems(Tile(128, 64, 128, warps=12, stages=2, flags={"overlap"}), "float16"))
    assert "shared memory" in " ".join(ws.problems(Tile(128, 256, 256, warps=12, stages=4), "float16"))
    with pytest.raises(ValueError, match="cannot be built"):
        ws.build(Tile(128, 40, 128, warps=12, stages=2), False, "float16")


# --------------------------------------------------------------------------------------------
# The sm_90a build
# --------------------------------------------------------------------------------------------
WS_COMPILE = NO_GPU_PATCH + """
import json, re, subprocess, sys, tempfile
from numba import cuda
from numba_flash.kernels import wgmma_ws_forward as ws
from numba_flash.tiles import Tile
cases = json.loads(sys.argv[1])
out = {}
if sys.argv[2] == "intrinsics":  # every ptx/tma intrinsic, each rank, in one kernel
    from numba import types
    from numba_flash import ptx
    from numba_flash.ptx import tma
    L2, L3, L4, L5 = (tma.tma_load(r) for r in (2, 3, 4, 5))
    S2, S3, S4, S5 = (tma.tma_store(r) for r in (2, 3, 4, 5))
    W1 = tma.bulk_wait_read(1)
    NB_S, NB_A = tma.named_barrier_sync(1, 256), tma.named_barrier_arrive(2, 128)
    DEC, INC = tma.setmaxnreg(40, False), tma.setmaxnreg(232, True)

    def every(maps, x):
        smem = cuda.shared.array(0, types.uint16)
        i = cuda.threadIdx.x
        tma.prefetch_tensormap(maps, 0)
        L2(smem, 0, maps, 0, smem, 8192, i, 1)
        L3(smem, 0, maps, 128, smem, 8192, i, 1, 2)
        L4(smem, 0, maps, 256, smem, 8192, i, 1, 2, 3)
        L5(smem, 0, maps, 384, smem, 8192, i, 1, 2, 3, 4)
        tma.mbarrier_arrive(smem, 8196)
        NB_S()
        NB_A()
        if i < 128:
            DEC()
        else:
            INC()
        S2(maps, 0, smem, 0, i, x)
        S3(maps, 128, smem, 0, i, x, 1)
        S4(maps, 256, smem, 0, i, x, 1, 2)
        S5(maps, 384, smem, 0, i, x, 1, 2, 3)
        tma.bulk_commit()
        W1()

    ptx, _ = cuda.compile_ptx(every, (types.Array(types.uint8, 1, "A"), types.int32), cc=(9, 0, "a"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([sys.argv[-1], "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    out["intrinsics"] = dict(rc=r.returncode, log=(r.stderr + r.stdout)[-800:], loads=[
        len(re.findall(rf"cp.async.bulk.tensor.{n}d.shared::cluster.global.mbarrier::complete_tx::bytes", ptx))
        for n in (2, 3, 4, 5)], stores=[len(re.findall(rf"cp.async.bulk.tensor.{n}d.global.shared::cta.bulk_group",
                                                       ptx)) for n in (2, 3, 4, 5)],
        others=[w for w in ("prefetch.tensormap", "mbarrier.arrive.shared::cta.b64", "bar.sync 1, 256",
                            "bar.arrive 2, 128", "setmaxnreg.dec.sync.aligned.u32 40",
                            "setmaxnreg.inc.sync.aligned.u32 232", "cp.async.bulk.commit_group",
                            "cp.async.bulk.wait_group.read 1") if w not in ptx])
for bq, bk, hd, warps, stages, flags, causal, dtype in cases:
    tile = Tile(bq, bk, hd, warps=warps, stages=stages, flags=set(flags))
    ptx, _ = cuda.compile_ptx(ws.kernel_source(tile, causal, dtype), ws.kernel_signature(), cc=(9, 0, "a"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([sys.argv[-1], "-arch=sm_90a", f"-maxrregcount={ws.max_registers(tile)}", "-v", f.name, "-o",
                        "/dev/null"], capture_output=True, text=True)
    rep = r.stderr + r.stdout
    m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
    out[str(tile) + f" {causal} {dtype}"] = dict(
        rc=r.returncode, spills=int(m.group(1)) + int(m.group(2)) + int(m.group(3)) if m else -1,
        tma=len(re.findall(r"cp.async.bulk.tensor.4d.shared::cluster", ptx)), setmaxnreg="setmaxnreg" in ptx,
        mma=len(re.findall(r"wgmma.mma_async", ptx)), want=(hd // 16 + bk // 16) * (2 if "overlap" in flags else 1),
        serialized="serialized" in rep, f64=".f64" in ptx, log=rep[-600:] if "serialized" not in rep else rep[:1500])
print(json.dumps(out))
"""

BUILD_CASES = [  # (block_q, block_k, head_dim, warps, stages, flags, causal, dtype)
    (128, 128, 128, 12, 2, ["setmaxnreg", "pingpong", "tma_store", "overlap"], True, "bfloat16"),
]
MORE_BUILD_CASES = [
    (128, 128, 128, 12, 2, [], False, "float16"), (128, 128, 64, 12, 3, ["setmaxnreg"], False, "float16"),
    (128, 80, 256, 12, 2, ["setmaxnreg", "pingpong"], True, "float16"), (64, 64, 256, 8, 2, [], False, "float16"),
    (128, 64, 256, 12, 2, ["setmaxnreg"], False, "float16"),
    (128, 96, 192, 12, 2, ["setmaxnreg"], False, "bfloat16"), (128, 176, 128, 12, 2, ["setmaxnreg"], False, "float16"),
    (128, 128, 128, 12, 2, ["setmaxnreg", "pingpong", "tma_store"], True, "bfloat16"),
    (128, 80, 256, 12, 2, ["setmaxnreg", "pingpong", "overlap"], False, "float16"),
    (128, 128, 64, 12, 3, ["setmaxnreg", "pingpong", "overlap"], True, "float16"),
    (64, 128, 128, 8, 3, ["overlap"], False, "float16"),
]


def _check_builds(cases, tmp_path, intrinsics=False):
    import json

    got = run_compile_child(WS_COMPILE, [json.dumps(cases), "intrinsics" if intrinsics else "-"], tmp_path)
    if intrinsics:
        r = got.pop("intrinsics")
        assert r["rc"] == 0 and r["loads"] == [1] * 4 and r["stores"] == [1] * 4 and r["others"] == [], r
    assert len(got) == len(cases)
    for key, r in got.items():
        assert r["rc"] == 0, (key, r["log"])
        assert r["spills"] == 0, (key, r)  # no stack, no spills: the consumers' fragments stay in registers
        assert r["tma"] > 0 and r["mma"] == r["want"] and not r["f64"] and not r["serialized"], (key, r)
        assert r["setmaxnreg"] == ("setmaxnreg" in key), (key, r)


def test_builds_for_sm90a(tmp_path):
    """ptxas -arch=sm_90a takes every ptx/tma intrinsic (loads and stores of each rank, prefetch, arrive, named
    barriers, setmaxnreg, bulk groups), and, at the block's register share (168 at 384 threads), the full-flag d128
    build with no spills, every product and the TMA loads in the PTX, no fp64."""
    _check_builds(BUILD_CASES, tmp_path, intrinsics=True)


@pytest.mark.heavy
def test_more_builds_for_sm90a(tmp_path):
    _check_builds(MORE_BUILD_CASES, tmp_path)


# --------------------------------------------------------------------------------------------
# On the GPU (variant until the kernel ships)
# --------------------------------------------------------------------------------------------
GPU_TILES = [  # (d, tile): each flag on and off, one and two consumers, every head dim family
    (64, Tile(128, 128, 64, warps=12, stages=2)),
    (64, Tile(128, 128, 64, warps=12, stages=3, flags={"setmaxnreg", "pingpong", "tma_store"})),
    (128, Tile(128, 128, 128, warps=12, stages=2)),
    (128, Tile(128, 128, 128, warps=12, stages=2, flags={"setmaxnreg", "pingpong", "tma_store", "grid_bh_x"})),
    (128, Tile(128, 128, 128, warps=12, stages=2, flags={"setmaxnreg", "pingpong", "overlap"})),
    (128, Tile(64, 64, 128, warps=8, stages=4, flags={"overlap"})),
    (96, Tile(128, 128, 128, warps=12, stages=2, flags={"setmaxnreg", "tma_store"})),
    (192, Tile(128, 96, 192, warps=12, stages=2, flags={"setmaxnreg"})),
    (256, Tile(128, 64, 256, warps=12, stages=2, flags={"setmaxnreg"})),
    (256, Tile(128, 80, 256, warps=12, stages=2, flags={"setmaxnreg", "pingpong", "overlap", "tma_store"})),
    (128, Tile(128, 128, 128, warps=12, stages=2, flags={"setmaxnreg", "pingpong", "overlap", "tma_store",
                                                          "persistent"})),
    (64, Tile(128, 192, 64, warps=12, stages=2, flags={"setmaxnreg", "pingpong", "overlap", "persistent"})),
]


@pytest.mark.gpu
@pytest.mark.variant
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,tile", GPU_TILES, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 300), (1, 2, 1, 129, 517), (1, 3, 3, 517, 129), (1, 2, 2, 1, 77)])
def test_gpu_ws_forward_matches_float64(shape, d, tile, causal, dtype):
    if not ptx.current_wgmma():
        pytest.skip("TMA + wgmma need an sm_90 GPU")
    B, H, Hkv, n_q, n_k = shape
    r = run_ws(B, H, Hkv, n_q, n_k, d, causal, dtype, tile, seed=n_q + d, pad_to=-(-d // 8) * 8 if d % 8 else None,
               n_sm=3)  # persistent: 3 blocks walk every work item
    assert_close(*r, dtype)


@pytest.mark.gpu
@pytest.mark.variant
@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_ws_forward_fp16_error_rule_and_determinism(causal):
    """fp16 by the flash-attn rule (err vs fp64 <= 2 x a naive fp16 implementation's + small) on a larger problem,
    and two runs give the same bits."""
    import math

    from reference import standard_attention

    if not ptx.current_wgmma():
        pytest.skip("TMA + wgmma need an sm_90 GPU")
    rng = np.random.default_rng(5)
    B, H, Hkv, N, d = 2, 8, 2, 1000, 128
    q, k, v = (rng.standard_normal((B, h, N, d)).astype(np.float16) for h in (H, Hkv, Hkv))
    tile = Tile(128, 128, 128, warps=12, stages=2, flags={"setmaxnreg", "pingpong", "tma_store"})
    outs = []
    for _ in range(2):
        out = cuda.to_device(np.zeros_like(q))
        lse = cuda.to_device(np.zeros((B, H, N), np.float32))
        ws.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, lse, tile, causal=causal,
                  softmax_scale=1 / math.sqrt(d))
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(outs[0], outs[1])
    kr, vr = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    ref, _ = standard_attention(q, kr, vr, causal=causal)
    naive, _ = standard_attention(q, kr, vr, causal=causal, dtype=np.float16)
    err = np.abs(outs[0].astype(np.float64) - ref).max()
    naive_err = np.abs(naive.astype(np.float64) - ref).max()
    assert err <= 2 * naive_err + 1e-4, f"ours {err:.3e} vs naive fp16 {naive_err:.3e}"


# --------------------------------------------------------------------------------------------
# Dispatch: sm_90's plain forward runs configs.MMA_WGMMA_WS's tiles
# --------------------------------------------------------------------------------------------
def test_shipped_ws_tiles_build():
    """Every MMA_WGMMA_WS tile is a ws tile the kernel can build for both dtypes, at a head dim forward pads to."""
    from numba_flash.configs import MMA_HEAD_DIMS, MMA_WGMMA, MMA_WGMMA_WS

    for (hd, causal), tile in MMA_WGMMA_WS.items():
        assert tile.has("ws") and tile.head_dim == hd and hd in MMA_HEAD_DIMS and (hd, causal) in MMA_WGMMA
        assert tile.has("grid_bh_x") == causal
        for dtype in ws.DTYPES:
            assert ws.problems(tile, dtype) == [], (tile, dtype)


def test_ws_tile_refuses_what_it_cannot_run(rng):
    """The ws launch with ALiBi slopes or aux arrays but no mods that read them, or a persistent tile with varlen:
    an error, never a silently dropped argument."""
    from numba_flash.configs import MMA_WGMMA_WS

    tile = MMA_WGMMA_WS[128, False]
    assert any("persistent with varlen" in p for p in ws.problems(tile.with_(flags=tile.flags | {"persistent"}),
                                                                  "float16", varlen=True))
    q = np.zeros((1, 1, 8, 128), np.float16)
    lse = np.zeros((1, 1, 8), np.float32)
    for kw in ({"alibi": np.zeros((1, 1), np.float32)}, {"aux": (np.zeros(3, np.int32),)}):
        with pytest.raises(ValueError, match="without the mods that read them"):
            ws.launch(q, q, q, q.copy(), lse, tile, causal=False, softmax_scale=0.1, **kw)


def test_ws_blockers_name_each_reason(monkeypatch):
    """ws_blockers: a plain call, a call with mods and a varlen one, its views' batch stride 0 aside, have none;
    Nk = 0, O rows that are not 16-byte multiples and a broadcast (zero-stride) view each give their reason, so
    auto keeps such a call on the wgmma forward."""
    from numba_flash.api import Problem, ws_blockers

    def problem(**kw):
        base = dict(kind="numpy", dtype="float16", q_shape=(1, 2, 40, 64), B=1, H=2, Hkv=1, n_q=40, n_k=50, d=64,
                    causal=False, softmax_scale=0.125, device=None)
        base.update(kw)
        if "d" in kw:
            base["q_shape"] = (1, 2, 40, kw["d"])
        return Problem(**base)

    assert ws_blockers(problem()) == []
    assert ws_blockers(problem(softcap=30.0, window_size=(20, 3))) == []
    assert ws_blockers(problem(varlen=True)) == []
    packed = np.lib.stride_tricks.as_strided(np.zeros((1, 2, 90, 64), np.float16), (3, 2, 90, 64), (0, 128, 256, 2))
    assert ws_blockers(problem(varlen=True, B=3), (packed, packed, packed)) == []  # the pack's batch stride 0
    assert "Nk = 0" in " ".join(ws_blockers(problem(n_k=0)))
    assert "O rows of 100 x 2 B" in " ".join(ws_blockers(problem(d=100)))
    broadcast = np.lib.stride_tricks.as_strided(np.zeros((1, 1, 50, 64), np.float16), (1, 2, 50, 64), (0, 0, 128, 2))
    plain = np.zeros((1, 2, 40, 64), np.float16)
    assert "k strides (0, 0, 128, 2)" in " ".join(ws_blockers(problem(), (plain, broadcast, plain)))


@in_simulator
def test_forward_routes_plain_calls_to_ws_sim(monkeypatch, rng):
    """With the ws forward available (patched on in the simulator, where auto leaves it off), forward runs a plain
    call on MMA_WGMMA_WS's tile (here a small one), explain says so, and the result matches float64; a softcap call
    runs there too (explain names the mod)."""
    import numba_flash
    from numba_flash import api
    from reference import standard_attention

    small = Tile(128, 16, 64, warps=12, stages=2, flags={"ws", "setmaxnreg", "pingpong", "overlap", "tma_store"})
    monkeypatch.setattr(api, "_ws_here", lambda: True)
    monkeypatch.setattr(api, "MMA_WGMMA_WS", {(64, False): small})
    B, H, Hkv, n_q, n_k, d = 1, 2, 1, 40, 50, 64
    q, k, v = (rng.standard_normal((B, h, n, d)).astype(np.float16) for h, n in ((H, n_q), (Hkv, n_k), (Hkv, n_k)))
    text = numba_flash.explain(q, k, v)
    assert "warp-specialised" in text and "128x16 tiles" in text, text
    o, lse = numba_flash.forward(q, k, v)
    kr, vr = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    ref, lse_ref = standard_attention(q, kr, vr)
    naive, _ = standard_attention(q, kr, vr, dtype=np.float16)
    err, naive_err = np.abs(o.astype(np.float64) - ref).max(), np.abs(naive.astype(np.float64) - ref).max()
    assert err <= 2 * naive_err + 1e-3, (err, naive_err)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-4)
    capped = numba_flash.explain(q, k, v, softcap=30.0)
    assert "warp-specialised" in capped and "mods: softcap 30" in capped, capped


@in_simulator
@pytest.mark.parametrize("causal, mods", [(True, False), (False, True)])
def test_varlen_forward_on_ws_sim(causal, mods, monkeypatch, rng):
    """varlen_forward on the ws kernel (patched on, small tiles; the overlap one has the TMA store, which varlen drops): three
    sequences of their own lengths (one of a single row, one shorter than a Q tile's box and one over two), their
    boxes running into the next sequence's rows (the last one's into NaN rows past the pack, which must come back
    unwritten); per-sequence causal on the plain schedule, or a window, softcap and (B, H) ALiBi with GQA on the
    overlap one. Against reference.varlen in float64 by the error rule."""
    import numba_flash
    from numba_flash import api
    from reference.varlen import varlen_attention

    if mods:  # the overlap schedule (the shipped tiles'): the last tile's P·V after the loop
        small = Tile(128, 16, 64, warps=12, stages=2, flags={"ws", "setmaxnreg", "pingpong", "overlap", "tma_store",
                                                              "grid_bh_x"})
    else:  # the plain schedule: every step's P·V in the loop
        small = Tile(128, 16, 64, warps=12, stages=3, flags={"ws", "grid_bh_x"})
    monkeypatch.setattr(api, "_ws_here", lambda: True)
    monkeypatch.setattr(api, "MMA_WGMMA_WS", {(64, causal): small})
    alloc = numba_flash.arrays.empty_like_kind

    def sentinel(kind, ref, shape, dtype, stream):  # outputs start as 7s: rows past the pack must stay so
        obj, view = alloc(kind, ref, shape, dtype, stream)
        view.copy_to_device(np.full(shape, 7, view.dtype))
        return obj, view

    monkeypatch.setattr(numba_flash.arrays, "empty_like_kind", sentinel)
    H, Hkv, d = (2, 1, 64) if mods else (1, 1, 64)  # GQA with the mods (simulated blocks are slow: few heads)
    lens_q, lens_k = [1, 50, 140], [30, 45, 150]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], H, d)) * 1.5).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], Hkv, d)).astype(np.float16) for _ in range(2))
    # NaN rows after the pack (no sequence's: the offsets are not checked) that the last sequence's boxes read: its
    # V rows past n_k must be cleared before P·V, its Q rows past n_q never stored
    q_nan, k_nan, v_nan = (np.concatenate([x, np.full((40,) + x.shape[1:], np.nan, x.dtype)]) for x in (q, k, v))
    kw = dict(causal=causal)
    if mods:
        kw.update(window_size=(33, 12), softcap=6.0, alibi_slopes=(rng.random((3, H)) * 0.3).astype(np.float32))
    launched = []
    ws_launch = ws.launch
    monkeypatch.setattr(ws, "launch", lambda *a, **k_: (launched.append(k_.get("varlen")), ws_launch(*a, **k_))[1])
    out, lse = numba_flash.varlen_forward(q_nan, k_nan, v_nan, cu_q, cu_k, max(lens_q), max(lens_k),
                                          check_seqlens=False, **kw)
    assert len(launched) == 1 and launched[0] is not None, "the ws kernel ran the pack"
    assert (out[cu_q[-1]:] == 7).all() and (lse[:, cu_q[-1]:] == 7).all(), "rows past a sequence were stored"
    out, lse = out[:cu_q[-1]], lse[:, :cu_q[-1]]
    ref, lse_ref = varlen_attention(q, k, v, cu_q, cu_k, **kw)
    naive, _ = varlen_attention(q, k, v, cu_q, cu_k, dtype=np.float16, **kw)
    err, naive_err = np.abs(out.astype(np.float64) - ref).max(), np.abs(naive.astype(np.float64) - ref).max()
    assert err <= 2 * naive_err + 1e-3, (err, naive_err)
    fin = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-4)


SMALL_WS = {"overlap": Tile(128, 16, 64, warps=12, stages=2, flags={"ws", "setmaxnreg", "pingpong", "overlap",
                                                                        "tma_store"}),
            "plain": Tile(128, 16, 64, warps=12, stages=3, flags={"ws", "grid_bh_x"}),
            "persistent": Tile(128, 16, 64, warps=12, stages=2, flags={"ws", "setmaxnreg", "pingpong", "overlap",
                                                                       "tma_store", "persistent"})}


def _ws_mods_case(which, rng, d=64, n_q=70, n_k=91, H=2, Hkv=1):
    """(q, k, v, forward's keywords, the reference's keywords, causal) of one mods case (fp16; causal-window swaps
    Nq and Nk so that Nq > Nk)."""
    from test_user_mods import checkerboard, rel_bias

    import numba_flash
    from numba_flash.mods import ScoreMod, document_mask
    from numba_flash.sparsity import forward_tile

    if which == "causal-window":
        n_q, n_k = max(n_q, n_k), min(n_q, n_k)
    q, k, v = ((rng.standard_normal((1, h, n, d)) * sc).astype(np.float16)
               for h, n, sc in ((H, n_q, 1.5), (Hkv, n_k, 1.0), (Hkv, n_k, 1.0)))
    if which == "builtins":  # window both sides, softcap, per-batch ALiBi slopes
        slopes = (rng.random((1, H)) * 0.5 + 0.05).astype(np.float32)
        kw = dict(window_size=(20, 7), softcap=5.0, alibi_slopes=slopes)
        return q, k, v, kw, dict(kw), False
    if which == "causal-window":  # Nq > Nk: the first rows see no key (O = 0, L = -inf)
        slopes = (rng.random(H) * 0.5 + 0.05).astype(np.float32)
        kw = dict(window_size=(25, 0), alibi_slopes=slopes)
        return q, k, v, kw, dict(kw), True
    if which == "user":
        table = rng.standard_normal((H, n_q + n_k + 1)).astype(np.float32)
        n_k_arr = np.array([n_k], np.int32)
        kw = dict(mask_mod=checkerboard, score_mod=ScoreMod(rel_bias, aux=(table, n_k_arr)))
        return q, k, v, kw, dict(mask_mod=checkerboard, score_mod=rel_bias, score_aux=(table, n_k_arr)), True
    # three documents, query and key ids of their own (Nq != Nk)
    seg = np.searchsorted([3 * n_q // 7, 16 * n_q // 21], np.arange(n_q), side="right").astype(np.int32)[None]
    k_seg = np.searchsorted([2 * n_k // 9, 6 * n_k // 9], np.arange(n_k), side="right").astype(np.int32)[None]
    bm = numba_flash.block_mask(document_mask(seg, k_seg), 1, H, n_q, n_k, *forward_tile(d, True))
    ref = dict(mask_mod=lambda b, h, i, j, a, c: a[b, i] == c[b, j], mask_aux=(seg, k_seg))
    return q, k, v, dict(block_mask=bm), ref, True


@in_simulator
@pytest.mark.parametrize("which,tile", [("builtins", "overlap"), ("causal-window", "plain"), ("user", "overlap"),
                                        ("block_mask", "plain"), ("causal-window", "persistent"),
                                        pytest.param("block_mask", "persistent", marks=pytest.mark.heavy)])
def test_ws_forward_mods_sim(which, tile, monkeypatch, rng):
    """The masks and mods in the warp-specialised forward (patched on in the simulator, small tiles): a two-sided
    window with softcap and per-batch ALiBi, causal with a window and Nq > Nk (rows that see no key), user
    mask and score mods with an aux table, and a BlockMask's walk (EMPTY, FULL and PARTIAL tiles); each by the
    flash-attn rule against float64, L too, with the overlap schedule and without. explain names the kernel."""
    import numba_flash
    from numba_flash import api

    monkeypatch.setattr(api, "_ws_here", lambda: True)
    monkeypatch.setattr(api, "MMA_WGMMA_WS", {(64, False): SMALL_WS[tile], (64, True): SMALL_WS[tile]})
    decode_module = importlib.import_module("numba_flash.decode")  # (numba_flash.decode is the function)
    monkeypatch.setattr(decode_module, "_sm_count", lambda device=None: 1)  # persistent: one block walks all
    q, k, v, kw, ref_kw, causal = _ws_mods_case(which, rng)
    text = numba_flash.explain(q, k, v, causal=causal, **kw)
    assert "warp-specialised" in text and "128x16 tiles" in text, text
    _check_ws_mods(q, k, v, kw, ref_kw, causal)
    if which == "causal-window":
        assert not np.isfinite(numba_flash.forward(q, k, v, causal=causal, **kw)[1]).all(), "rows that see no key"


def _check_ws_mods(q, k, v, kw, ref_kw, causal):
    """forward against float64 by the flash-attn rule, L too; rows that see no key: O = 0, L = -inf."""
    import numba_flash
    from reference import standard_attention
    from test_mods import _bound

    o, lse = numba_flash.forward(q, k, v, causal=causal, **kw)
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    ref, lse_ref = standard_attention(q, kr, vr, causal=causal, **ref_kw)
    naive, _ = standard_attention(q, kr, vr, causal=causal, dtype=np.float16, **ref_kw)
    _bound(o.astype(np.float64), ref, naive.astype(np.float64), 1e-3)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-4 * max(1.0, np.abs(lse_ref[fin]).max()), rtol=0)
    assert (o[~fin] == 0).all(), "a row that sees no key has O = 0"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("which,d", [("builtins", 64), ("causal-window", 128), ("user", 128), ("block_mask", 128),
                                     ("builtins", 192), ("causal-window", 256), ("block_mask", 256)])
def test_gpu_forward_ws_mods_error_rule(which, d, rng):
    """The masks and mods on sm_90's shipped warp-specialised tiles (explain says so): window, softcap, ALiBi, user
    mods with aux arrays, a BlockMask's walk; GQA 4/2, Nq != Nk, by the flash-attn rule against float64."""
    import numba_flash

    if not ptx.current_wgmma():
        pytest.skip("TMA + wgmma need an sm_90 GPU")
    q, k, v, kw, ref_kw, causal = _ws_mods_case(which, rng, d=d, n_q=300, n_k=517, H=4, Hkv=2)
    text = numba_flash.explain(q, k, v, causal=causal, **kw)
    assert "warp-specialised" in text, text
    _check_ws_mods(q, k, v, kw, ref_kw, causal)


GPU_WS_SHAPES = [(2, 4, 2, 300, 517), (1, 3, 3, 517, 129), (1, 2, 1, 1, 77)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d,causal", [(64, False), (96, False), (128, False), (128, True), (192, False), (192, True), (256, False),
                                      (256, True)])
def test_gpu_forward_ws_error_rule(d, causal, dtype):
    """numba_flash.forward on sm_90 runs the warp-specialised tile for (d, causal) (explain says so) and meets the
    flash-attn rule against float64 (GQA, Nq != Nk both ways, one query row); two calls of one signature on fresh
    data give each its own result (the tensor maps follow the arrays), and a repeat gives the same bits."""
    from gpu_helpers import HAVE_TORCH_CUDA, torch

    import numba_flash

    if not ptx.current_wgmma():
        pytest.skip("TMA + wgmma need an sm_90 GPU")
    if not HAVE_TORCH_CUDA:
        pytest.skip("builds inputs with PyTorch")
    tdt = getattr(torch, dtype)
    for B, H, Hkv, n_q, n_k in GPU_WS_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(n_q * 7 + d)
        for trial in range(2):
            q = torch.randn(B, H, n_q, d, device="cuda", generator=g).to(tdt)
            k, v = (torch.randn(B, Hkv, n_k, d, device="cuda", generator=g).to(tdt) for _ in range(2))
            text = numba_flash.explain(q, k, v, causal=causal)
            assert "warp-specialised" in text, text
            o, lse = numba_flash.forward(q, k, v, causal=causal)
            kr, vr = (x.repeat_interleave(H // Hkv, 1) for x in (k, v))
            scale = 1 / math.sqrt(d)
            s = (q.double() @ kr.double().transpose(-1, -2)) * scale
            if causal:
                s = s.masked_fill(torch.ones(n_q, n_k, device="cuda", dtype=torch.bool).triu(n_k - n_q + 1),
                                  float("-inf"))
            ref = torch.nan_to_num(torch.softmax(s, -1)) @ vr.double()
            lse_ref = torch.logsumexp(s, -1)
            # the naive same-dtype attention: S, P and P·V in the dtype, the same masking
            naive = torch.softmax(torch.where(torch.isinf(s), float("-inf"), (q @ kr.transpose(-1, -2)).float()
                                              * scale).to(tdt).float(), -1).to(tdt) @ vr
            err = (o.double() - ref).abs().max().item()
            naive_err = (torch.nan_to_num(naive.double()) - ref).abs().max().item()
            assert err <= 2 * naive_err + 1e-3, f"{(B, H, Hkv, n_q, n_k)} trial {trial}: {err:.3e} vs {naive_err:.3e}"
            fin = torch.isfinite(lse_ref)
            assert torch.equal(torch.isfinite(lse), fin)
            assert (lse.double()[fin] - lse_ref[fin]).abs().max().item() <= 1e-4 * max(1.0, lse_ref[fin].abs().max())
            o2, _ = numba_flash.forward(q, k, v, causal=causal)
            assert torch.equal(o, o2)

