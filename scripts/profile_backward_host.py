"""Host time of one backward through torch autograd, piece by piece (GPU).

    python3 scripts/profile_backward_host.py [float16] [--d 128]

bench_backward's "bwd" (torch.autograd.grad of a retained graph) reads ~0.47 ms more than
numba_flash.backward called directly, with launch plans hitting in both. This times, per call
(median of 30, after warm-up): the GPU events around autograd.grad; the host wall time of that
call; the time inside the numba_flash::bwd op's call of backward (autograd's device thread); inside the
plan's replay (Plan.run) and, of that, the replay proper (Plan._run: allocations and launches; the
rest is the context push/pop of a thread with no current context); and the same for the direct call.
"""
import argparse
import statistics
import time

import torch

import numba_flash
from numba_flash import plans
import numba_flash.torch as nft
from numba_flash.torch import attention

ap = argparse.ArgumentParser()
ap.add_argument("dtype", nargs="?", default="float16")
ap.add_argument("--d", type=int, default=128)
args = ap.parse_args()
dt = getattr(torch, args.dtype)
q, k, v, dout = (torch.randn(4, 16, 4096, args.d, device="cuda").to(dt) for _ in range(4))
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
spans: dict = {"bwd op": [], "Plan.run": [], "Plan._run": []}


def timed(name, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spans[name].append((time.perf_counter() - t0) * 1e3)
    return wrapper


nft.backward = timed("bwd op", nft.backward)  # the name the numba_flash::bwd op calls
plans.Plan.run = timed("Plan.run", plans.Plan.run)
plans.Plan._run = timed("Plan._run", plans.Plan._run)
out = attention(*leaves)
o, lse = numba_flash.forward(q, k, v)
for label, call in (("autograd.grad", lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)),
                    ("backward() direct", lambda: numba_flash.backward(q, k, v, o, lse, dout))):
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    for s in spans.values():
        s.clear()
    gpu, wall = [], []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        call()
        wall.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    med = {name: statistics.median(s) if s else float("nan") for name, s in spans.items()}
    print(f"{args.dtype} d{args.d} {label}: GPU events {statistics.median(gpu):.3f} ms, host wall "
          f"{statistics.median(wall):.3f} ms; inside the bwd op {med['bwd op']:.3f}, "
          f"Plan.run {med['Plan.run']:.3f}, Plan._run {med['Plan._run']:.3f} ms; plan hits so far "
          f"{plans.cache_info()['hits']}", flush=True)
