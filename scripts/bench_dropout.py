"""Benchmark of attention dropout on the GPU, in one run: numba_flash (the mma.sync kernels, which carry dropout)
beside its own dropout-free call (on sm_90 the warp-specialised forward) and PyTorch SDPA with the same
dropout_p on each backend (its default, cuDNN on an H100 / H200; FlashAttention-2; memory-efficient; math).

    python scripts/bench_dropout.py               # bf16 B4 H16 N4096, d 64 / 128, causal and not, p 0.1
    python scripts/bench_dropout.py --quick       # N 1024
    python scripts/bench_dropout.py --out DIR     # results: DIR/dropout-<date>.{json,md} (default benchmarks/results)

Each row: forward ("fwd") and forward + backward through autograd ("fwd+bwd") in training mode, median of
CUDA-event timings (numba_flash.bench.time_call), TFLOP/s as 4·B·H·N²·d (half for causal; fwd+bwd 3.5x), counted
with the dropped scores (as every implementation computes them). The error is numba_flash's O against float64
attention with the same keep mask (numba_flash.dropout_mask) on head 0 of batch 0, beside the same formulas in
bf16 (flash-attention's rule); SDPA's rows draw their own masks, so theirs is not comparable and not given.
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


def cases(quick):
    n = 1024 if quick else 4096
    return [(4, 16, n, d, causal) for d in (64, 128) for causal in (False, True)]


def run(quick):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash.torch import attention

    p = 0.1
    backends = {"sdpa default": None, "sdpa cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa flash": SDPBackend.FLASH_ATTENTION,
                "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa math": SDPBackend.MATH}
    rows = []
    for B, H, N, d, causal in cases(quick):
        g = torch.Generator(device="cuda").manual_seed(N + d)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)
        flop = 4 * B * H * N * N * d / (2 if causal else 1)
        label = f"bf16 B{B} H{H} N{N} d{d}{' causal' if causal else ''}"
        impls = {"numba_flash p=0 (the default kernel)": lambda: attention(q, k, v, causal=causal),
                 f"numba_flash p={p}": lambda: attention(q, k, v, causal=causal, dropout_p=p)}
        for name, backend in backends.items():
            def sdpa(backend=backend):
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
            impls[f"{name} p={p}"] = sdpa
        for name, fn in impls.items():
            row = {"case": label, "impl": name}
            try:
                with torch.no_grad():
                    row["fwd_ms"] = bench.time_call(fn)[0]
                row["fwd_bwd_ms"] = bench.time_call(lambda: fn().backward(dout))[0]
                row["fwd_tflops"] = flop / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops"] = 3.5 * flop / row["fwd_bwd_ms"] / 1e9
            except Exception as e:  # a backend that refuses the case: recorded, not dropped
                row["error_message"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        # the error of ours against float64 with the same mask, head 0 of batch 0
        seed = 12345
        out, _ = numba_flash.forward(q.detach(), k.detach(), v.detach(), causal=causal, dropout_p=p, dropout_seed=seed)
        z = torch.as_tensor(numba_flash.dropout_mask(1, 1, N, N, p, seed), device="cuda").bool()[0, 0]
        scale = 65536 / round((1 - p) * 65536)

        def materialised(dtype):
            q0, k0, v0 = (x.detach()[0, 0].to(dtype) for x in (q, k, v))
            s = (q0 @ k0.T) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
            pr = torch.softmax(s.float(), -1).to(dtype)
            return (pr * z.to(dtype) * scale) @ v0

        exact = materialised(torch.float64)
        rows[-len(impls) + 1]["error_vs_fp64"] = (out[0, 0].double() - exact).abs().max().item()
        rows[-len(impls) + 1]["naive_bf16_error_vs_fp64"] = (materialised(torch.bfloat16).double() - exact).abs().max().item()
    return rows


def markdown(meta, rows):
    lines = ["# Attention dropout (p = 0.1), forward and forward + backward", "",
             f"GPU: {meta['gpu']}; date: {meta['date']}; command: `{meta['command']}`; commit {meta['commit']}; "
             f"torch {meta.get('torch')}.", "",
             "TFLOP/s count every score (dropped ones too); err: ours vs float64 with the same mask (head 0), "
             "naive: the same formulas in bf16.", "",
             "| case | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | err | naive err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error_message" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['error_message']} | | | | | |")
            continue
        err = f"{r['error_vs_fp64']:.1e}" if "error_vs_fp64" in r else ""
        naive = f"{r['naive_bf16_error_vs_fp64']:.1e}" if "naive_bf16_error_vs_fp64" in r else ""
        lines.append(f"| {r['case']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | "
                     f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | {err} | {naive} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)
    command = "python scripts/bench_dropout.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run(args.quick)
    meta = bench.metadata(command.strip(), simulator=False)
    stem = os.path.join(args.out, f"dropout-{dt.date.today().isoformat()}{'-quick' if args.quick else ''}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
