"""A/B timing of two versions of numba_flash.backward in one process, on a GPU: interleaved rounds, so
slow drift (clocks, temperature) falls on both alike.

    git archive <commit> numba_flash | (mkdir -p /tmp/old && tar x -C /tmp/old)   # the "before" tree
    python3 scripts/ab_backward.py --old /tmp/old --rounds 5

--old names a directory holding a ``numba_flash`` package; it is imported under the name
``numba_flash_old`` (the package's imports are relative, so it loads its own kernels). Per shape and
mode (deterministic, deterministic=False), each round times one direct ``backward`` call of each
version (CUDA events, median of --iters calls; the versions alternate which goes first from round to
round, since 2026-12-01's runs, which timed "before" first every round) and SDPA's flash backward (memory-efficient
for fp32; torch.autograd.grad of a retained graph, as a yardstick); the figure is the median over rounds with the min-max spread. Both
versions' gradients are compared: equal bits are expected where only instruction scheduling changed
(deterministic mode), and every version is checked against SDPA once. Writes $OUT/ab_backward.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numba_flash  # noqa: E402
import numba_flash.configs  # noqa: E402
from numba_flash.bench import time_call  # noqa: E402

SHAPES = {  # label: (dtype, B, H, N, d, causal)
    "f16 N4096 d128": (torch.float16, 4, 16, 4096, 128, False),
    "f16 N4096 d128 causal": (torch.float16, 4, 16, 4096, 128, True),
    "f16 N4096 d64": (torch.float16, 4, 16, 4096, 64, False),
    "bf16 N4096 d128": (torch.bfloat16, 4, 16, 4096, 128, False),
    "f16 N4096 d64 causal": (torch.float16, 4, 16, 4096, 64, True),
    "f32 N4096 d128": (torch.float32, 4, 16, 4096, 128, False),
    "f32 N4096 d128 causal": (torch.float32, 4, 16, 4096, 128, True),
    "f32 N4096 d64": (torch.float32, 4, 16, 4096, 64, False),
    "f32 N4096 d64 causal": (torch.float32, 4, 16, 4096, 64, True),
    "f32 N4096 d32": (torch.float32, 4, 16, 4096, 32, False),
    "f32 N4096 d32 causal": (torch.float32, 4, 16, 4096, 32, True),
}


def load_old(root):
    """The package numba_flash under root, imported as numba_flash_old."""
    spec = importlib.util.spec_from_file_location("numba_flash_old", os.path.join(root, "numba_flash", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(root, "numba_flash")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["numba_flash_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def time_ms(fn, iters):
    """Median of single-call CUDA-event timings (numba_flash.bench.time_call, two warm-up calls)."""
    return time_call(fn, reps=iters)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="directory holding the 'before' numba_flash package")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--modes", nargs="+", default=["deterministic", "atomic"], choices=["deterministic", "atomic"],
                    help="deterministic: backward(deterministic=True); atomic: deterministic=False")
    ap.add_argument("--after-dq", choices=["splits", "kernel"],
                    help="set or clear the deterministic_splits flag of every dkdv_atomic tile in the 'after' "
                         "package's backward tables: how its deterministic mode forms dQ (splits, or the dq kernel)")
    ap.add_argument("--after-mma-sync", action="store_true",
                    help="the 'after' package runs the mma.sync kernels on sm_90 too (configs.MMA_BWD_WGMMA's "
                         "overrides emptied: what sm_80-89 run)")
    args = ap.parse_args(argv)
    tables = numba_flash.configs
    if args.after_mma_sync:
        tables.MMA_BWD_WGMMA.clear()
    if args.after_dq:  # the tables backward reads, edited in place (on sm_90 fp16 / bf16 read MMA_BWD_WGMMA's
        # tiles over MMA_BWD_TABLE's, so both)
        for table in (tables.MMA_BWD_TABLE, tables.MMA_BWD_WGMMA, tables.TF32_BWD_TABLE):
            for key, tile in table.items():
                if key[0] == "dkdv_atomic":
                    flags = tile.flags - {"deterministic_splits"} | ({"deterministic_splits"} if args.after_dq == "splits"
                                                                       else set())
                    table[key] = tile.with_(flags=flags)
    old = load_old(args.old)
    versions = {"before": old.backward, "after": numba_flash.backward}
    torch.manual_seed(0)
    results = []
    for label in args.shapes:
        dtype, B, H, N, d, causal = SHAPES[label]
        q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(4))
        out, lse = numba_flash.forward(q, k, v, causal=causal)
        flops = 2.5 * 4.0 * B * H * N * N * d * (0.5 if causal else 1.0)
        # SDPA flash backward (fp32: memory-efficient, which flash does not take): the yardstick and the reference
        qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        backend = torch.nn.attention.SDPBackend
        with torch.nn.attention.sdpa_kernel(backend.EFFICIENT_ATTENTION if dtype == torch.float32
                                            else backend.FLASH_ATTENTION):
            o_ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        ref = torch.autograd.grad(o_ref, (qr, kr, vr), dout, retain_graph=True)

        def sdpa():
            torch.autograd.grad(o_ref, (qr, kr, vr), dout, retain_graph=True)

        calls, check = {}, {}
        for det in [m == "deterministic" for m in args.modes]:
            grads = {}
            for name, fn in versions.items():
                def call(fn=fn, det=det):
                    return fn(q, k, v, out, lse, dout, causal=causal, deterministic=det)
                grads[name] = [g.float() for g in call()]
                err = max(float((g - r.float()).abs().max()) for g, r in zip(grads[name], ref))
                calls[(name, det)] = call
                check[f"{name} det={det}"] = dict(max_abs_err_vs_sdpa=err)
            same = all(torch.equal(a, b) for a, b in zip(grads["before"], grads["after"]))
            # expected True only for deterministic=True (atomic adds land in any order)
            check[f"det={det} before==after bitwise"] = same
        times = {key: [] for key in list(calls) + ["sdpa"]}
        for rnd in range(args.rounds):  # the versions alternate which goes first
            order = list(calls.items())
            for key, call in (order if rnd % 2 == 0 else order[::-1]):
                times[key].append(time_ms(call, args.iters))
            times["sdpa"].append(time_ms(sdpa, args.iters))
        row = dict(shape=label, check=check, rounds=args.rounds, iters=args.iters, ms={})
        for key, ts in times.items():
            yardstick = "sdpa efficient" if dtype == torch.float32 else "sdpa flash"
            name = yardstick if key == "sdpa" else f"{key[0]} {'deterministic' if key[1] else 'deterministic=False'}"
            ts = sorted(ts)
            med = ts[len(ts) // 2]
            row["ms"][name] = dict(median=med, min=ts[0], max=ts[-1], tflops=flops / med / 1e9)
        results.append(row)
        print(f"== {label}  checks: {check}")
        for name, r in row["ms"].items():
            print(f"   {name:34s} {r['median']:7.3f} ms ({r['min']:.3f}-{r['max']:.3f})  {r['tflops']:6.1f} TFLOP/s")
        sys.stdout.flush()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ab_backward.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("NUMBA_FLASH_COMMIT"),
                           old=os.path.abspath(args.old), command=" ".join(sys.argv), results=results), f, indent=1)


if __name__ == "__main__":
    main()
