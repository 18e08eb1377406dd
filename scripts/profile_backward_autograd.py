"""Where the time of one backward goes, through torch autograd and without it (GPU).

    python3 scripts/profile_backward_autograd.py [float16|float32] [--d 128] [--causal]

Times (median CUDA-event ms, bench.time_call): numba_flash.backward called directly, the same
through torch.autograd.grad of a retained graph (bench_backward's "bwd"), forward + grad (its
"fwd+bwd") and the forward alone, each for deterministic=True and False; then lists every GPU
kernel torch.profiler (CUPTI) sees in three autograd calls, with its total and mean time.
"""
import argparse

import torch

import numba_flash
from numba_flash import bench
from numba_flash.torch import attention

ap = argparse.ArgumentParser()
ap.add_argument("dtype", nargs="?", default="float16")
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--causal", action="store_true")
args = ap.parse_args()
dt = getattr(torch, args.dtype)
B, H, N, d, causal = 4, 16, 4096, args.d, args.causal
q, k, v, dout = (torch.randn(B, H, N, d, device="cuda").to(dt) for _ in range(4))
leaves = [x.detach().requires_grad_() for x in (q, k, v)]
f = bench.flops(B, H, N, N, d, causal)
for det in (True, False):
    out = attention(*leaves, causal=causal, deterministic=det)
    o, lse = numba_flash.forward(q, k, v, causal=causal)
    cases = {
        "backward() direct": lambda: numba_flash.backward(q, k, v, o, lse, dout, causal=causal, deterministic=det),
        "autograd.grad (retained graph)": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
        "forward + grad": lambda: torch.autograd.grad(attention(*leaves, causal=causal, deterministic=det),
                                                      leaves, dout),
        "forward alone": lambda: numba_flash.forward(q, k, v, causal=causal),
    }
    from numba_flash import plans

    for name, fn in cases.items():
        before = dict(plans._state)
        ms, reps = bench.time_call(fn, budget_s=0.5)
        hits, misses = plans._state["hits"] - before["hits"], plans._state["misses"] - before["misses"]
        credit = {"forward alone": 1.0, "forward + grad": 3.5}.get(name, 2.5)
        print(f"{args.dtype} d{d} causal={causal} deterministic={det} {name}: {ms:.3f} ms "
              f"({credit * f / ms / 1e9:.1f} TFLOP/s credited {credit}x, {reps} reps; launch plans: {hits} hits, "
              f"{misses} misses)", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
        torch.cuda.synchronize()
    try:
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
    except (KeyError, AttributeError, ValueError):  # older torch names the column cuda_time_total
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    print(table, flush=True)
