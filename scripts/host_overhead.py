"""Host (Python) time per call of forward / decode / backward, and where it goes (GPU + PyTorch).

Two measurements per entry point, on PyTorch CUDA tensors:
- issue time: tiny problems (the GPU finishes each launch faster than Python issues the next),
  N back-to-back calls without synchronising, wall time / N = host microseconds per call;
- single-call time at a real shape with CUDA events around one call after a synchronize, as the
  benchmarks time it: host time the GPU sits idle for is inside that figure.
Beside ours: the bare compiled kernel (numba_flash.launch.launch with ready views) and PyTorch
SDPA. ``--old PATH`` also runs a copy of an older numba_flash package (a folder holding
``numba_flash/``) in a subprocess, for a before/after. ``--profile`` prints cProfile's top
functions of forward. Writes JSON to ``--json``.

``--no-gpu`` measures the Python path alone on any machine: numba_flash in GPU mode with the
driver stubbed out (cuCtxGetDevice, cuLaunchKernel, module loading: no-ops) and a stand-in for
PyTorch CUDA tensors (shape, strides, pointer; ``torch.empty`` allocates nothing), so per-call
microseconds are numba_flash's own work. Real allocations and driver calls cost extra on a GPU
host; the table counts them per call. With ``--profile``, cProfile of decode.

    python scripts/host_overhead.py [--old .old_pkg] [--profile] [--json PATH] [--no-gpu]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

if "--child" not in sys.argv:  # the child imports the old package from its PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def issue_us(fn, n=400):
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * t / n


def event_ms(fn, n=30):
    """Median ms of single calls between CUDA events, the GPU idle before each (as the benchmarks)."""
    from numba_flash import bench

    return bench.time_call(fn, warmup=5, reps=n)[0]


def measure(label: str) -> dict:
    import torch
    import torch.nn.functional as F

    import numba_flash

    res = {"label": label, "numba_flash": numba_flash.__file__, "issue_us": {}, "single_call_ms": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s, dt=torch.float16: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    for dt in ("float16", "float32", "bfloat16"):
        tdt = getattr(torch, dt)
        q, k, v = (rnd(1, 1, 64, 64, dt=tdt) for _ in range(3))
        res["issue_us"][f"forward {dt} B1H1 N64 d64"] = issue_us(lambda: numba_flash.forward(q, k, v))
    q, k, v = (rnd(1, 1, 64, 64) for _ in range(3))
    res["issue_us"]["torch sdpa float16 B1H1 N64 d64"] = issue_us(lambda: F.scaled_dot_product_attention(q, k, v))
    qd, kc, vc = rnd(1, 8, 1, 64), rnd(1, 8, 256, 64), rnd(1, 8, 256, 64)
    lens = torch.tensor([200], dtype=torch.int32, device="cuda")
    res["issue_us"]["decode float16 B1H8 Nk256 d64 (lens)"] = issue_us(
        lambda: numba_flash.decode(qd, kc, vc, cache_seqlens=lens))
    q, k, v, do = (rnd(1, 1, 64, 64, dt=torch.float32) for _ in range(4))
    o, lse = numba_flash.forward(q, k, v)
    if hasattr(numba_flash, "backward"):
        res["issue_us"]["backward float32 B1H1 N64 d64"] = issue_us(
            lambda: numba_flash.backward(q, k, v, o, lse, do), n=200)

    # Single calls at the shapes the benchmarks time (CUDA events around one call).
    for B, H, N, d in ((4, 16, 1024, 64), (4, 16, 4096, 128)):
        q, k, v = (rnd(B, H, N, d) for _ in range(3))
        key = f"float16 B{B}H{H} N{N} d{d}"
        res["single_call_ms"][f"forward {key}"] = event_ms(lambda: numba_flash.forward(q, k, v))
        res["single_call_ms"][f"sdpa flash {key}"] = event_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        if label == "new":  # the compiled kernel alone, views made once
            from numba_flash import api, arrays
            from numba_flash.launch import launch
            from numba_flash.kernels import mma_forward, wgmma_forward

            p = api.validate(q, k, v)
            views = [arrays.to_device_view(x, 0).view("uint16") for x in (q, k, v)]
            out = torch.empty_like(q)
            lse = torch.empty(B, H, N, device="cuda")
            ov, lv = arrays.to_device_view(out, 0).view("uint16"), arrays.to_device_view(lse, 0, ndim=3)
            cfg = api.mma_config(d, False)
            family = wgmma_forward if cfg.has("wgmma") else mma_forward  # as api.launch_mma_forward picks
            kern = family.build(cfg, False, "float16", d % 8 != 0)
            q_tiles = (N + cfg.block_q - 1) // cfg.block_q
            grid = (B * H, q_tiles) if cfg.has("grid_bh_x") else (q_tiles, B * H)
            threads = family.threads(cfg)
            smem = family.smem_bytes(cfg)
            sl2 = p.softmax_scale * mma_forward.LOG2E
            res["single_call_ms"][f"kernel only {key}"] = event_ms(
                lambda: launch(kern, grid, threads, 0, smem, *views, ov, lv, N, N, d, 1, sl2))
            res["issue_us"][f"kernel only (launch) {key}"] = issue_us(
                lambda: launch(kern, grid, threads, 0, smem, *views, ov, lv, N, N, d, 1, sl2), n=50)
    return res


def profile_forward(dtype: str, n=300) -> str:
    import cProfile
    import io
    import pstats

    import torch

    import numba_flash

    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda").to(getattr(torch, dtype)) for _ in range(3))
    numba_flash.forward(q, k, v)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        numba_flash.forward(q, k, v)
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


# --- --no-gpu: the Python path with the driver and PyTorch stood in for -------------------------
STUB_COUNTS = {"driver": 0, "alloc": 0, "launch": 0}


class _StubDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name


class _StubDevice:
    type, index = "cuda", 0


class StubTensor:
    """What numba_flash reads of a PyTorch CUDA tensor: shape, dtype, device, stride(), data_ptr()."""

    is_cuda, device, _next = True, _StubDevice(), [1 << 20]

    def __init__(self, shape, dtype):
        self.shape, self.dtype, strides, step = tuple(shape), dtype, [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        self._strides, self._ptr = tuple(reversed(strides)), self._next[0]
        StubTensor._next[0] += 1 << 20

    def stride(self, i=None):
        return self._strides if i is None else self._strides[i]

    def data_ptr(self):
        return self._ptr


StubTensor.__module__ = "torch"  # arrays.kind_of goes by the module


_FAKE_MAPS: dict = {}  # install_stubs' stand-in for blocks.tensor_maps.device_maps: key -> fake pointer
MAPS_OF: dict = {}  # fake maps pointer -> the addresses of the arrays it maps (q, k, v, out)
_FAKE_LOCK = threading.Lock()


def install_stubs():
    """Stand-ins for torch, the driver calls and kernel compilation; returns the torch stand-in."""
    import types as pytypes

    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # numba_flash's GPU path (before numba is imported)
    torch = pytypes.ModuleType("torch")
    for name in ("float16", "bfloat16", "float32", "int32", "int64"):
        setattr(torch, name, _StubDtype(name))

    def empty(shape, dtype=None, device=None):
        STUB_COUNTS["alloc"] += 1
        return StubTensor(shape, dtype)

    default_stream = pytypes.SimpleNamespace(cuda_stream=0)
    torch.empty, torch.Tensor = empty, StubTensor
    torch.cuda = pytypes.SimpleNamespace(current_stream=lambda device=None: default_stream)
    sys.modules["torch"] = torch

    from cuda.bindings import driver as cu
    from numba import cuda
    from numba.core.typing.templates import Signature
    from numba.cuda.cudadrv import driver as nb_driver

    def ctx_get_device():
        STUB_COUNTS["driver"] += 1
        return cu.CUresult.CUDA_SUCCESS, 0

    def launch_kernel(*args):
        STUB_COUNTS["launch"] += 1
        return (cu.CUresult.CUDA_SUCCESS,)

    cu.cuCtxGetDevice, cu.cuLaunchKernel = ctx_get_device, launch_kernel
    nb_driver.driver = pytypes.SimpleNamespace(cuKernelSetAttribute=lambda *a: None)
    device = pytypes.SimpleNamespace(MULTIPROCESSOR_COUNT=132, compute_capability=(9, 0), id=0)
    cuda.get_current_device, cuda.is_available, cuda.gpus = (lambda: device), (lambda: True), [device]
    os.environ["NUMBA_FLASH_CACHE"] = "0"  # stub kernels: nothing may be loaded from or stored to the disk cache
    real_jit = cuda.jit

    class Dispatcher:  # what launch._Launcher reads of a compiled kernel
        def __init__(self, sig):
            self.overloads = {sig.args: pytypes.SimpleNamespace(argument_types=sig.args)}

    def jit(sig=None, **kw):  # kernels: the signature, nothing compiled; device functions as usual
        if isinstance(sig, Signature) and not kw.get("device"):
            return lambda fn: Dispatcher(sig)
        return real_jit(sig, **kw)

    cuda.jit = jit
    from numba_flash import launch

    from numba_flash.blocks import tensor_maps

    def device_maps(specs, stream=0):  # the TMA maps need the driver: one fake pointer per set of arrays
        key = tuple((launch.address(x), tuple(x.shape), tuple(x.strides), int(r)) for x, r in specs)
        with _FAKE_LOCK:
            ptr = _FAKE_MAPS.setdefault(key, (1 << 45) + 4096 * len(_FAKE_MAPS))
            MAPS_OF[ptr] = tuple(address for address, *_ in key)
        return launch.DeviceView(ptr, (128 * len(specs),), (1,), "uint8")

    tensor_maps.device_maps = device_maps
    cufunc = pytypes.SimpleNamespace(handle=0, device=pytypes.SimpleNamespace(id=0), name="stub")
    launch._Launcher.cufunc = lambda self, device_id: cufunc
    return torch


def python_us(fn, n=2000, reps=7, clock=time.perf_counter):
    """Best of reps: mean microseconds per call over n calls, after a warm-up (clock: wall time by default)."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n * 1e6)
    return best


DECODE_CASES = {  # B, H, Hkv, Nk, d, with device lengths
    "decode float16 B1 H8 Hkv8 Nk256 d64 (lens)": (1, 8, 8, 256, 64, True),
    "decode float16 B8 H32 Hkv8 Nk32768 d128 (4 splits)": (8, 32, 8, 32768, 128, False),
    "decode float16 B8 H32 Hkv8 Nk32768 d128 (lens)": (8, 32, 8, 32768, 128, True),
    "decode float16 B8 H32 Hkv32 Nk32768 d128 (1 split)": (8, 32, 32, 32768, 128, False),
}


def measure_no_gpu(label: str, profile: bool = False) -> dict:
    torch = install_stubs()
    import numba_flash

    res = {"label": label, "numba_flash": numba_flash.__file__, "python_us": {}, "per_call": {}}

    def run(key, fn):
        fn()
        for name in STUB_COUNTS:
            STUB_COUNTS[name] = 0
        fn()
        res["per_call"][key] = dict(STUB_COUNTS)
        res["python_us"][key] = python_us(fn)

    for key, (B, H, Hkv, N, d, with_lens) in DECODE_CASES.items():
        q = StubTensor((B, H, 1, d), torch.float16)
        k, v = (StubTensor((B, Hkv, N, d), torch.float16) for _ in range(2))
        lens = StubTensor((B,), torch.int32) if with_lens else None
        run(key, lambda: numba_flash.decode(q, k, v, cache_seqlens=lens))
    for dt in ("float16", "float32"):
        q, k, v = (StubTensor((1, 1, 64, 64), getattr(torch, dt)) for _ in range(3))
        run(f"forward {dt} B1 H1 N64 d64", lambda: numba_flash.forward(q, k, v))
    for dt in ("float32", "float16"):
        q, k, v, o, do = (StubTensor((1, 1, 64, 64), getattr(torch, dt)) for _ in range(5))
        lse = StubTensor((1, 1, 64), torch.float32)
        run(f"backward {dt} B1 H1 N64 d64", lambda: numba_flash.backward(q, k, v, o, lse, do))
    plans = getattr(numba_flash, "plans", None)
    if plans is not None and hasattr(plans, "set_enabled"):  # this package has plans: the ordinary path too
        plans.set_enabled(False)
        q, k, v = (StubTensor((1, 1, 64, 64), torch.float16) for _ in range(3))
        run("forward float16 B1 H1 N64 d64, plans off", lambda: numba_flash.forward(q, k, v))
        q = StubTensor((8, 32, 1, 128), torch.float16)
        k, v = (StubTensor((8, 8, 32768, 128), torch.float16) for _ in range(2))
        run("decode float16 B8 H32 Hkv8 Nk32768 d128 (4 splits), plans off", lambda: numba_flash.decode(q, k, v))
        plans.set_enabled(True)
    if profile:
        import cProfile
        import io
        import pstats

        q = StubTensor((8, 32, 1, 128), torch.float16)
        k, v = (StubTensor((8, 8, 32768, 128), torch.float16) for _ in range(2))
        lens = StubTensor((8,), torch.int32)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(1000):
            numba_flash.decode(q, k, v, cache_seqlens=lens)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
        res["profile_decode"] = buf.getvalue()
    return res


def main_no_gpu(args) -> None:
    runs = [measure_no_gpu("new", args.profile)]
    if args.old:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(args.old)] + sys.path[1:]))
        proc = subprocess.run([sys.executable, __file__, "--child", "--no-gpu"], env=env, capture_output=True,
                              text=True, cwd=os.path.abspath(args.old))
        try:
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            print("old package failed:\n" + (proc.stdout + proc.stderr)[-2000:])
    old = runs[1]["python_us"] if len(runs) > 1 else {}
    print(f"Python time per call, driver and PyTorch stubbed ({len(runs)} package(s)); per call: driver "
          "queries, allocations, kernel launches")
    for key, us in runs[0]["python_us"].items():
        before = f"{old[key]:8.1f} ->" if key in old else ""
        n = runs[0]["per_call"][key]
        was = runs[1]["per_call"].get(key) if old else None
        counts = f"{n['driver']} drv, {n['alloc']} alloc, {n['launch']} launch"
        if was and was != n:
            counts += f" (was {was['driver']}, {was['alloc']}, {was['launch']})"
        print(f"  {key:52s} {before}{us:8.1f} us   {counts}")
    if "profile_decode" in runs[0]:
        print("# cProfile, 1000 decode calls, B8 H32 Hkv8 Nk32768 d128 with lengths\n" + runs[0]["profile_decode"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "runs": runs}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="folder holding an older numba_flash package, measured in a subprocess")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--no-gpu", action="store_true", help="the Python path only, driver and PyTorch stubbed")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child and args.no_gpu:
        print(json.dumps(measure_no_gpu("old")))
        return
    if args.no_gpu:
        main_no_gpu(args)
        return
    if args.child:  # measuring the old package: print its JSON only
        print(json.dumps(measure("old")))
        return
    import torch

    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "runs": [measure("new")]}
    if args.old:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(args.old)] + sys.path[1:]))
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              cwd=os.path.abspath(args.old))
        try:
            results["runs"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            results["old_error"] = (proc.stdout + proc.stderr)[-2000:]
    if args.profile:
        results["profile_forward"] = {dt: profile_forward(dt) for dt in ("float16", "bfloat16")}
    for run in results["runs"]:
        print(f"# {run['label']}: {run['numba_flash']}")
        for key, us in run["issue_us"].items():
            print(f"  issue  {key:45s} {us:8.1f} us/call")
        for key, ms in run["single_call_ms"].items():
            print(f"  single {key:45s} {ms:8.3f} ms")
    if "old_error" in results:
        print("old package failed:\n" + results["old_error"])
    for dt, text in results.get("profile_forward", {}).items():
        print(f"# cProfile, 300 forward calls, {dt}\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
