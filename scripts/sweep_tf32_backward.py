"""Sweep the fp32 tensor-core backward's tiles (3xTF32, kernels/tf32_backward.py), each kernel alone.

    python3 scripts/sweep_tf32_backward.py            # GPU: B4 H16 N4096 fp32, d 32, 64, 128 (--causal: causal)
    python3 scripts/sweep_tf32_backward.py --ptxas    # no GPU: registers / spills / smem per candidate
    python3 scripts/sweep_tf32_backward.py --front    # the shipped tiles and their nearest rivals

For each head dim: every dkdv candidate (BLOCK_N keys, BLOCK_M queries streamed) and every dq
candidate (BLOCK_M queries, BLOCK_N keys streamed), launched through backward_plan.launch_tf32 with
kernels=("dkdv",) or ("dq",) on the same inputs after one prep. Each result's max |difference| to
the first candidate's is printed beside its time (a wrong tile shows up there, not only in the tests).
Timing: CUDA events around single launches, median (bench.time_call); TFLOP/s credits dkdv with 4
of the backward's five N x N x d products (Sᵀ, dPᵀ, dV, dK) and dq with 3
(S, dP, dQ), so the two add up to the 2.5 x forward FLOPs that bench_backward credits plus the
recomputation. Writes $OUT/sweep_tf32_backward.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# head dim: (dkdv candidates (BLOCK_N, BLOCK_M), dq candidates (BLOCK_M, BLOCK_N)); first = the reference the
# others are diffed against.
CANDIDATES = {
    128: ([(128, 32), (64, 32), (64, 16), (128, 16), (32, 32)],
          [(64, 64), (64, 32), (128, 32), (128, 16), (32, 64), (32, 32)]),
    64: ([(64, 32), (64, 64), (128, 32), (128, 64), (128, 16), (32, 32)],
         [(64, 32), (64, 64), (128, 32), (128, 64), (32, 64)]),
    32: ([(64, 64), (128, 64), (128, 32), (64, 32)],
         [(64, 64), (128, 32), (128, 64), (64, 32)]),
}
# --causal: the non-causal sweep's front runners (ptxas spills 216 B at d128 dkdv 128x32 causal, none
# without the mask), plus d32.
CAUSAL_CANDIDATES = {
    128: ([(128, 32), (128, 16), (64, 16), (64, 32)], [(128, 32), (64, 64)]),
    64: ([(128, 64), (128, 32), (64, 32)], [(64, 32), (128, 32), (128, 64)]),
    32: CANDIDATES[32],
}


# --front: the shipped tiles and their nearest rivals (a short run).
FRONT = {
    128: ([(128, 32), (128, 16)], [(128, 32), (64, 32)]),
    64: ([(128, 64), (128, 32)], [(64, 32), (128, 64)]),
    32: ([(128, 64), (64, 32)], [(128, 32), (64, 64)]),
}


def ptxas_report(causal=False):
    from numba import cuda

    from ptxas_util import blocks_per_sm, ptxas_v, sm90_ptxas

    ptxas = sm90_ptxas()
    from numba_flash.kernels import tf32_backward as tb

    rows = []
    for hd, (dkdv, dq) in CANDIDATES.items():
        runs = [("dkdv", bn, bm) for bn, bm in dkdv] + [("dq", bm, bn) for bm, bn in dq]
        for kernel, own, streamed in runs:
            bad = tb.problems(kernel, own, streamed, hd)
            if bad:
                print(f"d{hd} {kernel} {own}x{streamed}: cannot build: {bad}", flush=True)
                continue
            src = tb.source(kernel, own, streamed, hd, causal)
            ptx, _ = cuda.compile_ptx(src, tb.kernel_signature(kernel), cc=(9, 0))
            rep = ptxas_v(ptx, ptxas)
            smem = tb.smem_bytes(kernel, own, streamed, hd)
            row = dict(hd=hd, causal=causal, kernel=kernel, own=own, streamed=streamed,
                       **rep, smem=smem, blocks_per_sm=blocks_per_sm(rep["registers"], tb.threads(own), smem))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def gpu_sweep(B=4, H=16, N=4096, budget_s=0.4, causals=(False,)):
    import torch
    from numba import cuda

    import numba_flash
    from numba_flash import bench
    from numba_flash import backward_plan
    from numba_flash.blocks import schedule
    from numba_flash.kernels import tf32_backward as tb

    rows = []
    for hd, (dkdv, dq) in CANDIDATES.items():
        for causal in causals:
            g = torch.Generator(device="cuda").manual_seed(hd + causal)
            q, k, v, dout = (torch.randn(B, H, N, hd, device="cuda", generator=g) for _ in range(4))
            out, lse = numba_flash.forward(q, k, v, causal=causal)
            l2, dd = (torch.empty(B * H, schedule.padded_rows(N), device="cuda") for _ in range(2))
            grads = [torch.empty_like(x) for x in (q, k, v)]
            nb = [cuda.as_cuda_array(x) for x in (q, k, v, out, dout, lse, l2, dd, *grads)]
            scale = hd ** -0.5
            fwd = bench.flops(B, H, N, N, hd, causal)  # 2 products

            def run(config, kernels):
                backward_plan.launch_tf32(*nb, causal=causal, softmax_scale=scale, d=hd, config=config, stream=0,
                                          kernels=kernels)

            run(None, ("prep",))
            shipped = backward_plan.tf32_config(hd, causal)
            for kernel, cands in (("dkdv", dkdv), ("dq", dq)):
                ref = None
                for cand in cands:
                    cfg = dict(shipped, **{kernel: cand})
                    label = f"{kernel} {cand[0]}x{cand[1]}"
                    fl = 2 * fwd if kernel == "dkdv" else 1.5 * fwd
                    bad = tb.problems(kernel, *cfg[kernel], hd)
                    if bad:
                        print(f"d{hd} causal={causal} {label}: skipped: {bad}", flush=True)
                        continue
                    try:
                        run(cfg, (kernel,))
                        torch.cuda.synchronize()
                        res = [x.clone() for x in (grads[1:] if kernel == "dkdv" else grads[:1])]
                        ms, reps = bench.time_call(lambda: run(cfg, (kernel,)), budget_s=budget_s)
                    except Exception as e:  # noqa: BLE001 - a candidate that fails is a result
                        print(f"d{hd} causal={causal} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        rows.append(dict(hd=hd, causal=causal, label=label, error=str(e)[:300]))
                        continue
                    if ref is None:
                        ref = res
                    diff = max((a - b).abs().max().item() for a, b in zip(res, ref))
                    row = dict(hd=hd, causal=causal, label=label, ms=ms, tflops=fl / ms / 1e9, reps=reps,
                               max_diff_vs_first=diff)
                    rows.append(row)
                    print(f"d{hd} causal={causal} {label}: {ms:.3f} ms, {row['tflops']:.1f} TFLOP/s, "
                          f"max diff vs first {diff:.2e}", flush=True)
            del q, k, v, dout, out, lse, l2, dd, grads, nb
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptxas", action="store_true")
    ap.add_argument("--dims", type=int, nargs="+", default=None)
    ap.add_argument("--causal", action="store_true", help="causal, over CAUSAL_CANDIDATES (default: non-causal)")
    ap.add_argument("--front", action="store_true", help="only the FRONT candidates (shipped + nearest rivals)")
    args = ap.parse_args()
    if args.causal or args.front:
        CANDIDATES.clear()
        CANDIDATES.update(FRONT if args.front else CAUSAL_CANDIDATES)
    if args.dims:
        for d in list(CANDIDATES):
            if d not in args.dims:
                del CANDIDATES[d]
    rows = ptxas_report(args.causal) if args.ptxas else gpu_sweep(causals=(args.causal,))
    if os.environ.get("OUT"):
        name = "sweep_tf32_backward" + ("_causal" if args.causal else "") + ("_front" if args.front else "") + ".json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
