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

    python scripts/host_overhead.py [--old .old_pkg] [--profile] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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
            from numba_flash.kernels import mma_forward

            p = api.validate(q, k, v)
            views = [arrays.to_device_view(x, 0).view("uint16") for x in (q, k, v)]
            out = torch.empty_like(q)
            lse = torch.empty(B, H, N, device="cuda")
            ov, lv = arrays.to_device_view(out, 0).view("uint16"), arrays.to_device_view(lse, 0, ndim=3)
            cfg = api.mma_config(d, False)
            kern = mma_forward.make_forward_kernel(cfg["BLOCK_Q"], cfg["BLOCK_K"], cfg["HEAD_DIM"], False, "float16",
                                                   None, True, True, None, cfg.get("M_TILES", 1), True)
            grid = ((N + cfg["BLOCK_Q"] - 1) // cfg["BLOCK_Q"], B * H)
            threads = mma_forward.threads_per_block(cfg["BLOCK_Q"], cfg.get("M_TILES", 1))
            smem = mma_forward.smem_bytes(cfg["BLOCK_Q"], cfg["BLOCK_K"], cfg["HEAD_DIM"])
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="folder holding an older numba_flash package, measured in a subprocess")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
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
