"""A/B of two versions of numba_flash through the public API, on a GPU: forward, backward and decode.

    git archive <commit> numba_flash | (mkdir -p /tmp/old && tar x -C /tmp/old)   # the "before" tree
    python3 scripts/ab_api.py --old /tmp/old --rounds 5

--old names a directory holding a ``numba_flash`` package, imported as ``numba_flash_old``. Per case, each
round times one call of each version (CUDA events, median of --iters calls; the versions alternate which
goes first), beside SDPA's default backend (cuDNN on an H200) for the forward and backward; the figure is the
median over rounds with the min-max spread. Outputs of the two versions are compared bit for bit (equal
bits are expected where the kernels' instructions did not change; the backward's deterministic=False adds
land in any order, so only deterministic calls are compared). Writes $OUT/ab_api.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numba_flash  # noqa: E402
from ab_backward import load_old  # noqa: E402
from numba_flash.bench import time_call  # noqa: E402

# label: (what, dtype, B, H, Hkv, N, d, causal); decode: N is the cache length, one query per sequence
CASES = {
    "fwd f16 N4096 d128": ("forward", torch.float16, 4, 16, 16, 4096, 128, False),
    "fwd f16 N4096 d128 causal": ("forward", torch.float16, 4, 16, 16, 4096, 128, True),
    "fwd f16 N4096 d64": ("forward", torch.float16, 4, 16, 16, 4096, 64, False),
    "fwd f16 N4096 d64 causal": ("forward", torch.float16, 4, 16, 16, 4096, 64, True),
    "fwd bf16 N16384 d64 causal": ("forward", torch.bfloat16, 1, 16, 16, 16384, 64, True),
    "fwd bf16 N4096 d128 GQA causal": ("forward", torch.bfloat16, 4, 32, 8, 4096, 128, True),
    "fwd f32 N4096 d128": ("forward", torch.float32, 4, 16, 16, 4096, 128, False),
    "fwd f32 N2048 d256 (simt)": ("forward", torch.float32, 1, 16, 16, 2048, 256, False),
    "bwd f16 N4096 d128": ("backward", torch.float16, 4, 16, 16, 4096, 128, False),
    "bwd f16 N4096 d128 causal": ("backward", torch.float16, 4, 16, 16, 4096, 128, True),
    "bwd f16 N4096 d64": ("backward", torch.float16, 4, 16, 16, 4096, 64, False),
    "bwd f32 N4096 d128": ("backward", torch.float32, 4, 16, 16, 4096, 128, False),
    "dec f16 N32768 d128": ("decode", torch.float16, 8, 32, 32, 32768, 128, False),
    "dec f16 N32768 d128 Hkv8": ("decode", torch.float16, 8, 32, 8, 32768, 128, False),
}


def flops(what, B, H, N, d, causal):
    f = 4.0 * B * H * N * N * d * (0.5 if causal else 1.0)
    return 2.5 * f if what == "backward" else f


def case_calls(versions, what, dtype, B, H, Hkv, N, d, causal):
    """{name: call} for the two versions and SDPA, and {name: outputs} of one call each."""
    g = torch.Generator(device="cuda").manual_seed(1234)
    n_q = 1 if what == "decode" else N
    q = torch.randn(B, H, n_q, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    calls = {}
    if what == "forward":
        for name, nf in versions.items():
            calls[name] = lambda nf=nf: nf.forward(q, k, v, causal=causal)
        kr, vr = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
        calls["sdpa default"] = lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
    elif what == "backward":
        out, lse = numba_flash.forward(q, k, v, causal=causal)
        dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=g)
        for name, nf in versions.items():
            calls[name] = lambda nf=nf: nf.backward(q, k, v, out, lse, dout, causal=causal)
        qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        o_ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        calls["sdpa default"] = lambda: torch.autograd.grad(o_ref, (qr, kr, vr), dout, retain_graph=True)
    else:
        lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
        for name, nf in versions.items():
            calls[name] = lambda nf=nf: nf.decode(q, k, v, cache_seqlens=lens)
    outs = {name: call() for name, call in calls.items() if name != "sdpa default"}
    return calls, outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="directory holding the 'before' numba_flash package")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    old = load_old(args.old)
    versions = {"before": old, "after": numba_flash}
    results = []
    for label in args.cases:
        what, dtype, B, H, Hkv, N, d, causal = CASES[label]
        calls, outs = case_calls(versions, what, dtype, B, H, Hkv, N, d, causal)
        same = all(torch.equal(a, b) for a, b in zip(outs["before"], outs["after"]))
        times = {name: [] for name in calls}
        for rnd in range(args.rounds):
            order = [n for n in calls if n != "sdpa default"]
            for name in (order if rnd % 2 == 0 else order[::-1]) + (["sdpa default"] if "sdpa default" in calls else []):
                times[name].append(time_call(calls[name], reps=args.iters)[0])
        row = dict(case=label, bitwise_equal=same, rounds=args.rounds, iters=args.iters, ms={})
        for name, ts in times.items():
            ts = sorted(ts)
            med = ts[len(ts) // 2]
            entry = dict(median=med, min=ts[0], max=ts[-1])
            if what == "decode":
                kv_bytes = 2 * B * Hkv * N * d * torch.finfo(dtype).bits // 8
                entry["gbps"] = kv_bytes / med / 1e6
            else:
                entry["tflops"] = flops(what, B, H, N, d, causal) / med / 1e9
            row["ms"][name] = entry
        b, a = row["ms"]["before"]["median"], row["ms"]["after"]["median"]
        row["after_over_before"] = a / b
        results.append(row)
        rate = "GB/s" if what == "decode" else "TFLOP/s"
        print(f"== {label}: bitwise equal {same}, after/before {a / b:.3f}")
        for name, r in row["ms"].items():
            print(f"   {name:14s} {r['median']:8.3f} ms ({r['min']:.3f}-{r['max']:.3f})  "
                  f"{r.get('gbps', r.get('tflops')):7.1f} {rate}")
        sys.stdout.flush()
    print("\n| case | before ms | after ms | after/before | SDPA default ms | bitwise equal |")
    print("|---|---|---|---|---|---|")
    for r in results:
        s = r["ms"].get("sdpa default", {}).get("median")
        print(f"| {r['case']} | {r['ms']['before']['median']:.3f} | {r['ms']['after']['median']:.3f} | "
              f"{r['after_over_before']:.3f} | {'' if s is None else f'{s:.3f}'} | {r['bitwise_equal']} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ab_api.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), commit=os.environ.get("NUMBA_FLASH_COMMIT"),
                           old=os.path.abspath(args.old), command=" ".join(sys.argv), results=results), f, indent=1)


if __name__ == "__main__":
    main()
