"""Forward benchmark on the GPU: numba_flash beside PyTorch SDPA (each backend) and naive attention.

    python scripts/bench_forward.py                 # full suite, writes benchmarks/results/forward-<date>.{json,md}
    python scripts/bench_forward.py --quick         # two shapes, for a smoke run
    python scripts/bench_forward.py --sweep-simt    # also time every candidate SIMT config at the target shape

TFLOP/s = 4·B·H·Nq·Nk·d / time (half for causal). Time = median of CUDA-event timings of single
calls after warm-up. Every input tensor is larger than the 60 MB L2 at the suite's sizes except
N=1024 d=64 fp16 (8 MiB per tensor), where the figures include some L2 reuse.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numba_flash  # noqa: E402
from numba_flash.configs import SimtConfig, keep  # noqa: E402

FULL = [  # (B, H, N, d)
    (4, 16, 1024, 64), (4, 16, 4096, 64), (4, 16, 16384, 64),
    (4, 16, 1024, 128), (4, 16, 4096, 128), (4, 16, 16384, 128),
]
QUICK = [(4, 16, 1024, 64), (4, 16, 4096, 128)]


def flops(B, H, n_q, n_k, d, causal):
    f = 4.0 * B * H * n_q * n_k * d
    return f / 2 if causal else f


def time_call(fn, *, warmup=2, reps=None, budget_s=1.5):
    """Median of per-call CUDA-event timings (ms); reps adapt so one case takes ~budget_s."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = reps or int(min(50, max(3, budget_s / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times)), reps


def naive_cupy(q, k, v, causal, scale):
    """Standard attention, materialising S and P in HBM (3.6.2), in CuPy."""
    import cupy as cp

    s = cp.matmul(q, k.swapaxes(-1, -2)) * q.dtype.type(scale)
    if causal:
        n_q, n_k = s.shape[-2:]
        mask = cp.arange(n_k)[None, :] > cp.arange(n_q)[:, None] + (n_k - n_q)
        s = cp.where(mask, s.dtype.type(-cp.inf), s)
    s = s - s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.matmul(p, v)


def sdpa_backends():
    import torch
    from torch.nn.attention import SDPBackend

    return {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }


def run_case(B, H, N, d, dtype, causal, include_naive=True, include_math=False):
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H * N * d)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g).to(tdt) for _ in range(3))
    fl = flops(B, H, N, N, d, causal)
    rows = []

    def record(name, fn):
        try:
            ms, reps = time_call(fn)
            rows.append({"impl": name, "ms": ms, "tflops": fl / ms / 1e9, "reps": reps})
        except Exception as e:  # an unsupported backend or an OOM is a result, not a crash
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            rows.append({"impl": name, "ms": None, "tflops": None, "error": msg})
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()

    record("numba_flash", lambda: numba_flash.forward(q, k, v, causal=causal))
    for name, backend in sdpa_backends().items():
        if name == "sdpa-math" and not include_math:
            continue
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        record(name, sdpa)
    if include_naive and dtype != "bfloat16":
        qc, kc, vc = (cp.asarray(t) for t in (q, k, v))
        record("naive-cupy", lambda: naive_cupy(qc, kc, vc, causal, 1 / math.sqrt(d)))
    for r in rows:
        r.update(B=B, H=H, N=N, d=d, dtype=dtype, causal=causal)
    return rows


def peak_memory(d=128, dtype="float16", B=1, H=16):
    """Peak extra device memory (beyond q, k, v) of ours vs naive as N grows, until naive OOMs."""
    import torch

    out = []
    tdt = getattr(torch, dtype)
    for N in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
        row = {"N": N, "B": B, "H": H, "d": d, "dtype": dtype}
        q, k, v = (torch.randn(B, H, N, d, device="cuda").to(tdt) for _ in range(3))
        for name, fn in (
            ("numba_flash", lambda: numba_flash.forward(q, k, v)),
            ("naive-torch", lambda: torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(d), -1) @ v),
        ):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                res = fn()
                torch.cuda.synchronize()
                row[name] = torch.cuda.max_memory_allocated() - base
                del res
            except torch.OutOfMemoryError:
                row[name] = None
        row["ours_expected"] = B * H * N * d * torch.finfo(tdt).bits // 8 + B * H * N * 4
        out.append(row)
        del q, k, v
        torch.cuda.empty_cache()
        if row["naive-torch"] is None and N >= 32768:
            break
    return out


SIMT_CANDIDATES = [  # (block_q, block_k, row_threads, col_threads, share_kv) for head_dim 128
    (64, 64, 8, 16, False), (64, 64, 8, 16, True), (64, 32, 8, 16, False), (64, 32, 8, 16, True),
    (128, 64, 16, 16, False), (128, 64, 16, 16, True), (128, 32, 16, 16, True),
    (64, 64, 16, 16, True), (32, 64, 4, 16, True), (64, 64, 8, 8, True),
]


def sweep_simt(B=4, H=16, N=4096, d=128, causal=False):
    """Time each candidate SIMT config at the fp32 target shape (tuning results are recorded)."""
    import torch
    from numba import cuda

    from numba_flash.kernels import simt_forward

    q, k, v = (torch.randn(B, H, N, d, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda")
    qd, kd, vd, od, ld = (cuda.as_cuda_array(t, sync=False) for t in (q, k, v, out, lse))
    rows = []
    for bq, bk, rt, ct, share in SIMT_CANDIDATES:
        cfg = SimtConfig(bq, bk, rt, ct, d, share_kv=share)
        if not keep([cfg]):
            rows.append({"config": [bq, bk, rt, ct, share], "error": "; ".join(cfg.problems())})
            continue
        run = lambda: simt_forward.launch(cfg, qd, kd, vd, od, ld, causal=causal,
                                          softmax_scale=d ** -0.5, dtype="float32", d=d)
        ms, _ = time_call(run)
        kern = simt_forward.make_forward_kernel(cfg, causal, "float32")
        regs = next(iter(kern.overloads.values()))._codelibrary.get_cufunc().attrs.regs
        rows.append({"config": [bq, bk, rt, ct, share], "ms": ms, "tflops": flops(B, H, N, N, d, causal) / ms / 1e9,
                     "regs": regs, "smem": cfg.smem_bytes})
        print(f"  simt {bq}x{bk} {rt}x{ct} share_kv={share}: {rows[-1]['tflops']:.1f} TFLOP/s, {regs} regs, {cfg.smem_bytes} B smem",
              flush=True)
    return rows


def table(rows):
    lines = ["| dtype | causal | B | H | N | d | impl | ms | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = f"{r['tflops']:.1f}" if r.get("tflops") else f"— ({r.get('error', '')[:60]})"
        ms = f"{r['ms']:.3f}" if r.get("ms") else "—"
        lines.append(f"| {r['dtype']} | {r['causal']} | {r['B']} | {r['H']} | {r['N']} | {r['d']} | {r['impl']} | {ms} | {val} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep-simt", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)

    import torch

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/bench_forward.py", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__, "python": platform.python_version(),
        "numba_flash": numba_flash.__version__,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    }
    result = {"meta": meta, "forward": [], "sweep_simt": None, "memory": None}
    if args.sweep_simt:
        print("SIMT config sweep (fp32, B4 H16 N4096 d128):", flush=True)
        result["sweep_simt"] = sweep_simt()
    shapes = QUICK if args.quick else FULL
    for (B, H, N, d) in shapes:
        for dtype in args.dtypes:
            for causal in (False, True):
                rows = run_case(B, H, N, d, dtype, causal, include_math=N <= 4096 and not args.quick)
                result["forward"].extend(rows)
                ours = rows[0]
                print(f"{dtype:8s} causal={causal!s:5s} B{B} H{H} N{N} d{d}: " + ", ".join(
                    f"{r['impl']} {r['tflops']:.1f}" if r.get("tflops") else f"{r['impl']} —" for r in rows), flush=True)
    if not args.no_memory:
        result["memory"] = peak_memory()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"forward-{meta['date'][:10]}" + ("-quick" if args.quick else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = [f"# Forward benchmark\n\nGPU: {meta['gpu']}; date: {meta['date']}; command: `{meta['command']}`; "
          f"commit {meta['commit']}; torch {meta['torch']}.\n", table(result["forward"])]
    if result["memory"]:
        md.append("\n## Peak extra device memory (bytes beyond q, k, v), fp16 B1 H16 d128\n")
        md.append("| N | numba_flash | out+lse | naive (torch) |\n|---|---|---|---|")
        for r in result["memory"]:
            md.append(f"| {r['N']} | {r['numba_flash']} | {r['ours_expected']} | {r['naive-torch'] if r['naive-torch'] is not None else 'OOM'} |")
    if result["sweep_simt"]:
        md.append("\n## SIMT config sweep, fp32 B4 H16 N4096 d128\n\n| block_q, block_k, row_threads, col_threads, share_kv | TFLOP/s | regs | smem B |\n|---|---|---|---|")
        for r in result["sweep_simt"]:
            md.append(f"| {r['config']} | {r.get('tflops', 0):.1f} | {r.get('regs', '')} | {r.get('smem', r.get('error', ''))} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
