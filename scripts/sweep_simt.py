"""Sweep the SIMT forward's K/V copy variants (issue #3) against the shipped config, fp32.

    python3 scripts/sweep_simt.py                   # GPU: < 90 s on an H200, compiles included
    python3 scripts/sweep_simt.py --max-seconds 80  # start no new variant after 80 s
    python3 scripts/sweep_simt.py --ptxas           # no GPU: registers / spills / smem per variant (ptxas, sm_90)

Variants are compile-time options of simt_forward's factory (``SimtConfig`` fields), on the shipped
tiles of each head dim (d=128: 64x64, 16x16 threads, V in K's buffer, 128-register cap; d=64: 128x64,
16x16, uncapped):

- ``stageN``: each K/V tile's global loads go out N trips (4 elements each) at a time before their
  shared stores, as ld.global.nc (cannot alias shared memory, so they need not wait for earlier
  stores) and without per-element checks on whole tiles. The shipped loop does one trip's 4
  generic loads, waits for them, stores, and repeats: 8 round trips to L2 per tile at d=128.
- ``preN``: N trips of V_j are loaded into registers before S_j = Q K_jᵀ is computed and N of
  K_{j+1} before P V_j, so that latency hides behind the GEMMs; the rest is staged where stored.
- ``r128``: a 128-register cap (2 blocks/SM at 256 threads) where the shipped config has none.

Every variant runs on torch CUDA tensors through ``simt_forward.launch`` (Numba views made once);
its O and L are compared with the shipped kernel's on the same inputs (the maths is unchanged, so
they should be bitwise equal: ``same_bits``), then timed: CUDA events around single calls, median
of --iters after --warmup (``bench.time_call``). TFLOP/s = 4·B·H·N²·d / t (half for causal).
Prints a table; writes $OUT/sweep_simt.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (label, head dim, causal, [(variant name, SimtConfig overrides)]); order = priority (a deadline
# skips the tail). The first variant of each shape is the shipped config: the baseline.
SHAPES = [
    ("fp32 B4H16 N4096 d128", 128, False, [
        ("shipped", {}),
        ("stage4", dict(stage_trips=4)),
        ("stage8", dict(stage_trips=8)),
        ("pre8", dict(prefetch_trips=8)),
        ("pre2 stage2", dict(prefetch_trips=2, stage_trips=2)),
        ("128x128 stage4", dict(block_q=128, block_k=128, max_registers=None, stage_trips=4)),
        ("128x64 stage4", dict(block_q=128, max_registers=None, stage_trips=4)),
        ("64x128 stage4", dict(block_k=128, max_registers=None, stage_trips=4)),
    ]),
    ("fp32 B4H16 N4096 d128 causal", 128, True, [
        ("shipped", {}),
        ("stage4", dict(stage_trips=4)),
        ("pre8", dict(prefetch_trips=8)),
        ("128x128 stage4", dict(block_q=128, block_k=128, max_registers=None, stage_trips=4)),
    ]),
    ("fp32 B4H16 N4096 d64", 64, False, [
        ("shipped", {}),
        ("stage4", dict(stage_trips=4)),
        ("pre4", dict(prefetch_trips=4)),
        ("r128", dict(max_registers=128)),
        ("pre4 r128", dict(prefetch_trips=4, max_registers=128)),
        ("128x128 pre4", dict(block_k=128, prefetch_trips=4)),
        ("128x128 stage4", dict(block_k=128, prefetch_trips=0, stage_trips=4)),
    ]),
]
# Larger register tiles (the "NxM" variants: 8 x 8 scores per thread at 128x128 with 16 x 16 threads
# instead of 4 x 4) halve shared-memory operand traffic per FMA, at 1 block (8 warps) per SM; their
# sums run in another order than the shipped tile's, so they are checked against SDPA in float64.
B, H, N = 4, 16, 4096


def variant_config(head_dim, overrides):
    from numba_flash.configs import SIMT_CONFIGS

    return dataclasses.replace(SIMT_CONFIGS[head_dim], **overrides)


def ptxas_report(only=None):
    """Registers, spills and shared memory of every variant, compiled for sm_90 (no GPU needed)."""
    from numba import cuda

    from ptxas_util import blocks_per_sm, ptxas_v, sm90_ptxas

    ptxas = sm90_ptxas()
    from numba_flash.kernels.simt_forward import FASTMATH, kernel_signature, kernel_source

    rows = []
    for label, d, causal, variants in SHAPES:
        for name, overrides in variants:
            if only and not any(o == name for o in only):
                continue
            cfg = variant_config(d, overrides)
            ptx, _ = cuda.compile_ptx(kernel_source(cfg, causal, "float32"), kernel_signature("float32"),
                                      cc=(9, 0), fastmath=FASTMATH)
            flags = [f"-maxrregcount={cfg.max_registers}"] if cfg.max_registers else []
            rep = ptxas_v(ptx, ptxas, flags)
            regs = rep["registers"]
            blocks = blocks_per_sm(regs, cfg.threads, cfg.smem_bytes)
            row = dict(shape=label, variant=name, regs=regs, stack=rep["stack"],
                       spill_stores=rep["spill_stores"], spill_loads=rep["spill_loads"],
                       smem=cfg.smem_bytes, blocks_per_sm=blocks)
            rows.append(row)
            print(f"{label:30s} {name:12s} {regs:4d} regs  spill {row['spill_stores']:4d}/{row['spill_loads']:4d} B"
                  f"  stack {row['stack']:4d} B  smem {cfg.smem_bytes} B  blocks/SM {blocks}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=80.0, help="start no new variant after this")
    ap.add_argument("--ptxas", action="store_true", help="no GPU: ptxas registers/spills per variant")
    ap.add_argument("--only", nargs="+", default=None,
                    help="these variant names only (the shipped baseline is always timed)")
    args = ap.parse_args(argv)
    if args.ptxas:
        rows = ptxas_report(args.only)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "sweep_simt_ptxas.json"), "w") as f:
                json.dump(rows, f, indent=1)
        return

    import torch
    from numba import cuda

    from numba_flash import bench
    from numba_flash.kernels import simt_forward

    if not torch.cuda.is_available():
        sys.exit("sweep_simt.py needs a CUDA GPU with torch (or --ptxas)")
    t_start = time.time()
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"# sweep_simt on {gpu}, torch {torch.__version__}", flush=True)
    rows = []
    for label, d, causal, variants in SHAPES:
        q, k, v = (torch.randn(B, H, N, d, device="cuda") for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
        qd, kd, vd, od, ld = (cuda.as_cuda_array(t, sync=False) for t in (q, k, v, out, lse))
        fl = bench.flops(B, H, N, N, d, causal)
        base_o = base_l = None
        for name, overrides in variants:
            row = dict(shape=label, variant=name, config=overrides)
            if args.only and name != "shipped" and name not in args.only:
                continue
            if time.time() - t_start > args.max_seconds:
                rows.append(dict(row, skipped="deadline"))
                print(f"{label:30s} {name:12s} skipped (deadline)", flush=True)
                continue
            try:
                cfg = variant_config(d, overrides)
                run = lambda: simt_forward.launch(cfg, qd, kd, vd, od, ld, causal=causal,  # noqa: E731
                                                  softmax_scale=d ** -0.5, dtype="float32", d=d)
                t0 = time.time()
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                row["compile_s"] = time.time() - t0
                if base_o is None:  # the shipped config: the reference for the rest
                    base_o, base_l = out.clone(), lse.clone()
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        q[:1, :2].double(), k[:1, :2].double(), v[:1, :2].double(), is_causal=causal)
                row["err_vs_sdpa_f64"] = (out[:1, :2].double() - ref).abs().max().item()
                row["max_diff_o"] = (out - base_o).abs().max().item()
                row["max_diff_lse"] = (lse - base_l).abs().max().item()
                row["same_bits"] = bool(torch.equal(out, base_o) and torch.equal(lse, base_l))
                ms, reps = bench.time_call(run, warmup=args.warmup, reps=args.iters)
                kern = simt_forward.make_forward_kernel(cfg, bool(causal), "float32")
                attrs = next(iter(kern.overloads.values()))._codelibrary.get_cufunc().attrs
                row.update(ms=ms, tflops=fl / ms / 1e9, regs=attrs.regs, local_bytes=attrs.local,
                           smem=cfg.smem_bytes)
                print(f"{label:30s} {name:12s} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s  regs {attrs.regs:3d} "
                      f"local {attrs.local:4d} B  same bits {row['same_bits']} (max |dO| {row['max_diff_o']:.1e})"
                      f"  compile+1st {row['compile_s']:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - a failing variant is a result too
                row["error"] = repr(e)[:300]
                print(f"{label:30s} {name:12s} FAILED {row['error']}", flush=True)
            rows.append(row)
        del q, k, v, out, lse, base_o, base_l
        torch.cuda.empty_cache()

    print("\n# speed-up over shipped, per shape")
    for label, *_ in SHAPES:
        timed = [r for r in rows if r["shape"] == label and "tflops" in r]
        base = next((r for r in timed if r["variant"] == "shipped"), None)
        for r in timed:
            ratio = r["tflops"] / base["tflops"] if base else float("nan")
            print(f"{label:30s} {r['variant']:14s} {r['tflops']:6.1f} TFLOP/s  x{ratio:.3f}"
                  f"  err vs SDPA f64 {r['err_vs_sdpa_f64']:.1e}{'' if r['same_bits'] else '  (other bits)'}")
    total = time.time() - t_start
    print(f"# total {total:.1f} s")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "sweep_simt.json")
        with open(path, "w") as f:
            json.dump(dict(gpu=gpu, B=B, H=H, N=N, rows=rows, total_s=total), f, indent=1, default=str)
        print(f"# wrote {path}")


if __name__ == "__main__":
    main()
