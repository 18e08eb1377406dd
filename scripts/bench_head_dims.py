"""Forward benchmark across head dims on the GPU, in one run: numba_flash beside every PyTorch SDPA backend
(cuDNN, the default on an H100 / H200; FlashAttention-2; memory-efficient; math where it fits).

    python scripts/bench_head_dims.py               # the rows of the Hopper-forward issue's table (B4 H16 N4096 ...)
    python scripts/bench_head_dims.py --quick       # N 1024: a smoke run
    python scripts/bench_head_dims.py --out DIR     # results: DIR/head-dims-<date>.{json,md} (default benchmarks/results)

Each row: TFLOP/s = 4·B·H·Nq·Nk·d / time (half for causal), time the median of CUDA-event timings of single calls
(numba_flash.bench.time_call); the kernel numba_flash ran (explain's first words); and the error of O against
float64 attention on the first two heads of batch 0 (materialised on the GPU), beside the error of naive attention
in the same dtype (the flash-attention rule: ours <= 2x naive + small). A backend that cannot run a case is
recorded with its error message. --with-mma-sync adds, on an sm_90 GPU, each case on the mma.sync kernel
(kernels/mma_forward.py, what sm_80-89 run) in the same process.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from numba_flash import bench  # noqa: E402

# (label, dtype, B, H, Hkv, N, d, causal)
FULL = [
    ("fp16 d64", "float16", 4, 16, 16, 4096, 64, False),
    ("fp16 d96", "float16", 4, 16, 16, 4096, 96, False),
    ("fp16 d128", "float16", 4, 16, 16, 4096, 128, False),
    ("fp16 d128 causal", "float16", 4, 16, 16, 4096, 128, True),
    ("fp16 d192", "float16", 4, 16, 16, 4096, 192, False),
    ("fp16 d192 causal", "float16", 4, 16, 16, 4096, 192, True),
    ("fp16 d256", "float16", 4, 16, 16, 4096, 256, False),
    ("fp16 d256 causal", "float16", 4, 16, 16, 4096, 256, True),
    ("bf16 d256", "bfloat16", 4, 16, 16, 4096, 256, False),
    ("bf16 d256 causal GQA 16/8", "bfloat16", 4, 16, 8, 4096, 256, True),
    ("bf16 B1 N16384 d128", "bfloat16", 1, 16, 16, 16384, 128, False),
    ("bf16 GQA 32/8 causal d128", "bfloat16", 4, 32, 8, 4096, 128, True),
    ("Llama B4 H16/4 N2048 d128 causal bf16", "bfloat16", 4, 16, 4, 2048, 128, True),
]


def quick_cases():
    return [(label, dt_, B, H, Hkv, 1024, d, c) for label, dt_, B, H, Hkv, _, d, c in FULL[:9]]


def reference_error(q, k, v, out, causal, scale):
    """max |O - O_fp64| on batch 0, heads 0 and 1 (with GQA, their kv heads), and the same for naive attention in
    the inputs' dtype (S, softmax and P·V materialised in that dtype)."""
    import torch

    group = q.shape[1] // k.shape[1]
    heads = slice(0, 2)
    kv = [h // group for h in range(2)]
    q0, k0, v0 = q[0, heads], k[0, kv], v[0, kv]

    def attn(qq, kk, vv):
        s = (qq @ kk.transpose(-1, -2)) * scale
        if causal:
            n_q, n_k = s.shape[-2:]
            hide = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(n_k - n_q + 1)
            s = s.masked_fill(hide, float("-inf"))
        return torch.softmax(s, dim=-1) @ vv

    exact = attn(q0.double(), k0.double(), v0.double())
    naive = attn(q0, k0, v0).double()
    return (float((out[0, heads].double() - exact).abs().max()), float((naive - exact).abs().max()))


def run_case(label, dtype, B, H, Hkv, N, d, causal, include_math, with_mma_sync=False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import numba_flash

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H * N * d + Hkv)
    q = torch.randn(B, H, N, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(B, Hkv, N, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    flops = bench.flops(B, H, N, N, d, causal)
    base = dict(case=label, dtype=dtype, B=B, H=H, Hkv=Hkv, N=N, d=d, causal=causal)
    rows = []

    def record(impl, fn, **extra):
        row = dict(base, impl=impl, **extra)
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            torch.cuda.synchronize()
            row["max_err"], row["naive_err"] = reference_error(q, k, v, out, causal, scale)
            del out
            ms, reps = bench.time_call(fn)
            row.update(ms=ms, tflops=flops / ms / 1e9, reps=reps)
        except Exception as e:  # an unsupported backend or an OOM is a result
            row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:160]
        rows.append(row)
        torch.cuda.empty_cache()

    from numba_flash import api, plans
    from numba_flash.tiles import Tile

    _, cfg, _ = api.choose_kernel(api.validate(q, k, v, causal=causal))
    record("numba_flash", lambda: numba_flash.forward(q, k, v, causal=causal), kernel=str(cfg))
    if with_mma_sync and isinstance(cfg, Tile) and cfg.has("wgmma"):  # the same call on sm_80-89's mma.sync kernel
        wgmma_here, plans_on = api._wgmma_here, plans.cache_info()["enabled"]
        plans.set_enabled(False)  # (a plan of the wgmma call would replay it)
        api._wgmma_here = lambda: False
        try:
            _, cfg_sync, _ = api.choose_kernel(api.validate(q, k, v, causal=causal))
            record("numba_flash mma.sync", lambda: numba_flash.forward(q, k, v, causal=causal), kernel=str(cfg_sync))
        finally:
            api._wgmma_here = wgmma_here
            plans.set_enabled(plans_on)
    for impl, backend in bench.sdpa_backends().items():
        if impl == "sdpa-math" and not include_math:
            continue
        enable_gqa = H != Hkv

        def sdpa(backend=backend, enable_gqa=enable_gqa):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)

        record(impl, sdpa)

    def default():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=H != Hkv)

    record("sdpa-default", default)
    return rows


def markdown(result):
    meta = result["meta"]
    impls = ["numba_flash", "numba_flash mma.sync", "sdpa-default", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math"]
    lines = [f"# Forward across head dims\n\nGPU: {meta['gpu']}; date: {meta['date']}; command: `{meta['command']}`; "
             f"commit {meta['commit']}; torch {meta['torch']}.\n",
             "TFLOP/s (max |O - O_fp64| on two heads; naive same-dtype attention's error in the last column). "
             "ours/cuDNN: numba_flash's TFLOP/s over SDPA cuDNN's.\n",
             "| case | " + " | ".join(impls) + " | ours/cuDNN | naive err | numba_flash kernel |",
             "|---" * (len(impls) + 4) + "|"]
    by_case = {}
    for r in result["rows"]:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, rs in by_case.items():
        cells = []
        for impl in impls:
            r = rs.get(impl)
            if r is None:
                cells.append("")
            elif r.get("tflops"):
                cells.append(f"{r['tflops']:.1f} ({r['max_err']:.1e})")
            else:
                cells.append("— " + r.get("error", "")[:40])
        ours, cudnn = rs.get("numba_flash", {}), rs.get("sdpa-cudnn", {})
        ratio = f"{ours['tflops'] / cudnn['tflops']:.2f}" if ours.get("tflops") and cudnn.get("tflops") else "—"
        naive = ours.get("naive_err")
        naive = "—" if naive is None else f"{naive:.1e}"
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {ratio} | {naive} | {ours.get('kernel', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default=None, help="regex: only cases whose label matches (re.search)")
    ap.add_argument("--with-mma-sync", action="store_true",
                    help="on sm_90, also time each case on the mma.sync kernel (what sm_80-89 GPUs run)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)
    if not bench.gpu_available():
        sys.exit("bench_head_dims.py needs a CUDA GPU with torch (the simulator cannot time kernels)")
    import re

    command = "python scripts/bench_head_dims.py" + (" --quick" if args.quick else "") + \
        (f" --cases '{args.cases}'" if args.cases else "") + (" --with-mma-sync" if args.with_mma_sync else "")
    result = {"meta": bench.metadata(command, simulator=False), "rows": []}
    for case in quick_cases() if args.quick else FULL:
        if args.cases and not re.search(args.cases, case[0]):
            continue
        rows = run_case(*case, include_math=case[5] <= 2048 or args.quick, with_mma_sync=args.with_mma_sync)
        result["rows"] += rows
        print(" | ".join(f"{r['impl']} {r['tflops']:.1f}" if r.get("tflops") else f"{r['impl']} —" for r in rows),
              f"<- {case[0]}", flush=True)
    stem = os.path.join(args.out, f"head-dims-{dt.date.today().isoformat()}" + ("-mma-sync" if args.with_mma_sync else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
