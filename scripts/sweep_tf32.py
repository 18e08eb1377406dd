"""Sweep the fp32 tensor-core forward (3xTF32 / TF32, kernels/tf32_forward.py) beside the SIMT kernel and SDPA.

    python3 scripts/sweep_tf32.py                  # GPU: about a minute on an H200, compiles included
    python3 scripts/sweep_tf32.py --ptxas          # no GPU: registers / spills / smem per variant (sm_90)

For each shape (fp32, B4 H16 N4096): every tile variant of tf32_forward.launch, the shipped SIMT kernel
(simt_forward.launch) and PyTorch SDPA's memory-efficient backend (CUTLASS, 3xTF32 on sm_80+) on the
same inputs. Each output's max |error| against a float64 reference on batch 0, heads 0-1 is printed
beside its time, so the 3xTF32 kernel's accuracy is judged against fp32 SIMT and SDPA in one run.
Timing: CUDA events around single calls, median (bench.time_call). TFLOP/s = 4·B·H·N²·d / t (half
causal). Writes $OUT/sweep_tf32.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (label, d, causal, N, variants); a variant is tf32_forward.launch keywords. First = baseline.
PRE = dict(PRESPLIT=True)
SHAPES = [
    ("fp32 B4H16 N4096 d128", 128, False, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64), 
        dict(BLOCK_Q=64, BLOCK_K=32, **PRE), dict(BLOCK_Q=128, BLOCK_K=32, **PRE), dict(BLOCK_Q=128, BLOCK_K=64, **PRE),
        dict(BLOCK_Q=64, BLOCK_K=64, **PRE), dict(BLOCK_Q=64, BLOCK_K=32),
        dict(BLOCK_Q=64, BLOCK_K=64, PASSES_=1),
        # with the split by cvt.rn (one instruction), the per-warp splits PRESPLIT saves cost less
        dict(BLOCK_Q=128, BLOCK_K=64), dict(BLOCK_Q=128, BLOCK_K=32), dict(BLOCK_Q=128, BLOCK_K=64, SPLIT_ROUND="rna", **PRE)]),
    ("fp32 B4H16 N4096 d128 causal", 128, True, 4096, [
        dict(BLOCK_Q=128, BLOCK_K=32, **PRE), dict(BLOCK_Q=128, BLOCK_K=32, GRID_BH_X=True, **PRE),
        dict(BLOCK_Q=128, BLOCK_K=64, GRID_BH_X=True, **PRE), dict(BLOCK_Q=64, BLOCK_K=32, GRID_BH_X=True, **PRE),
        dict(BLOCK_Q=64, BLOCK_K=64, GRID_BH_X=True),
        dict(BLOCK_Q=128, BLOCK_K=32, GRID_BH_X=True), dict(BLOCK_Q=128, BLOCK_K=64, GRID_BH_X=True),
        dict(BLOCK_Q=128, BLOCK_K=32, GRID_BH_X=True, SPLIT_ROUND="rna", **PRE)]),
    ("fp32 B4H16 N4096 d64", 64, False, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64),
        dict(BLOCK_Q=64, BLOCK_K=64, **PRE), dict(BLOCK_Q=128, BLOCK_K=64, **PRE),
        dict(BLOCK_Q=64, BLOCK_K=32, **PRE),
        dict(BLOCK_Q=128, BLOCK_K=64)]),
    ("fp32 B4H16 N4096 d64 causal", 64, True, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64, **PRE), dict(BLOCK_Q=64, BLOCK_K=64, GRID_BH_X=True, **PRE),
        dict(BLOCK_Q=128, BLOCK_K=64, GRID_BH_X=True, **PRE), dict(BLOCK_Q=128, BLOCK_K=64, GRID_BH_X=True)]),
    ("fp32 B4H16 N1024 d128", 128, False, 1024, [dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=64, BLOCK_K=32, **PRE)]),
    ("fp32 B1H16 N16384 d128", 128, False, 16384, [dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=64, BLOCK_K=32, **PRE)]),
]
B, H = 4, 16  # N16384: B = 1


def tile_of(v, hd):
    """The Tile of a variant dict (BLOCK_Q, BLOCK_K, PRESPLIT, GRID_BH_X; its PASSES_ and SPLIT_ROUND are launch's)."""
    from numba_flash.tiles import Tile

    return Tile(v["BLOCK_Q"], v["BLOCK_K"], hd, flags={f.lower() for f in ("PRESPLIT", "GRID_BH_X") if v.get(f)})


def launch_variant(v, hd, *arrays, causal, softmax_scale):
    from numba_flash.kernels import tf32_forward as tf

    tf.launch(*arrays, tile_of(v, hd), causal=causal, softmax_scale=softmax_scale, passes=v.get("PASSES_", 3),
              split_round=v.get("SPLIT_ROUND"))


def name_of(v):
    s = f"{v['BLOCK_Q']}x{v['BLOCK_K']}"
    if v.get("PASSES_", 3) == 1:
        s += " tf32x1"
    if v.get("SPLIT_ROUND"):
        s += f" {v['SPLIT_ROUND']}"
    if v.get("PRESPLIT"):
        s += " presplit"
    if v.get("GRID_BH_X"):
        s += " grid"
    return s


def ptxas_report():
    from numba import cuda

    from ptxas_util import blocks_per_sm, ptxas_v, sm90_ptxas

    ptxas = sm90_ptxas()
    from numba_flash.kernels import tf32_forward as tf

    rows = []
    for label, d, causal, _, variants in SHAPES:
        for v in variants:
            hd = tf.head_dim_for(d)
            ptx, _ = cuda.compile_ptx(tf.kernel_source(tile_of(v, hd), causal, v.get("PASSES_", 3),
                                                       v.get("SPLIT_ROUND", "rn")),
                                      tf.kernel_signature(), cc=(9, 0))
            rep = ptxas_v(ptx, ptxas, [])
            regs = rep["registers"]
            smem = tf.smem_bytes(tile_of(v, hd), v.get("PASSES_", 3))
            blocks = blocks_per_sm(regs, v["BLOCK_Q"] // 16 * 32, smem)
            row = dict(shape=label, variant=name_of(v), regs=regs, spill_stores=rep["spill_stores"],
                       spill_loads=rep["spill_loads"], smem=smem, blocks_per_sm=blocks, mma=ptx.count("mma.sync"))
            rows.append(row)
            print(f"{label:30s} {row['variant']:14s} {regs:4d} regs  spill {row['spill_stores']}/{row['spill_loads']} B"
                  f"  smem {smem} B  blocks/SM {blocks}", flush=True)
    return rows


def accuracy_study(d=128, H=2):
    """max |O - fp64| and |L - fp64| of 3xTF32, TF32, SIMT and SDPA-efficient (whose L comes from
    aten._scaled_dot_product_efficient_attention) by N; inputs as drawn (normal) and rounded to tf32
    (then 3xTF32's lo parts are 0 and only accumulation and the softmax differ from exact)."""
    import torch
    from numba import cuda

    from numba_flash.configs import simt_config
    from numba_flash.kernels import simt_forward
    from numba_flash.kernels import tf32_forward as tf

    rows = []
    for N in (1024, 4096, 16384):
        for inputs in ("normal", "tf32-exact"):
            g = torch.Generator(device="cuda").manual_seed(N)
            q, k, v = (torch.randn(1, H, N, d, device="cuda", generator=g) for _ in range(3))
            if inputs == "tf32-exact":
                q, k, v = (x.view(torch.int32).bitwise_and(-8192).view(torch.float32) for x in (q, k, v))
            s = (q.double() @ k.double().transpose(-1, -2)) * d ** -0.5
            ref_l = torch.logsumexp(s, -1)
            ref_o = torch.softmax(s, -1) @ v.double()
            del s
            out, lse = torch.empty_like(q), torch.empty(1, H, N, device="cuda")
            qd, kd, vd, od, ld = (cuda.as_cuda_array(t, sync=False) for t in (q, k, v, out, lse))
            runs = {
                "3xtf32 128x64 presplit": lambda: launch_variant(dict(BLOCK_Q=128, BLOCK_K=64, PRESPLIT=True), d, qd, kd,
                                                                 vd, od, ld, causal=False, softmax_scale=d ** -0.5),
                "3xtf32 64x64": lambda: launch_variant(dict(BLOCK_Q=64, BLOCK_K=64), d, qd, kd, vd, od, ld, causal=False,
                                                       softmax_scale=d ** -0.5),
                "tf32 64x64": lambda: launch_variant(dict(BLOCK_Q=64, BLOCK_K=64, PASSES_=1), d, qd, kd, vd, od, ld,
                                                     causal=False, softmax_scale=d ** -0.5),
                "simt": lambda: simt_forward.launch(simt_config(d), qd, kd, vd, od, ld, causal=False,
                                                    softmax_scale=d ** -0.5, dtype="float32", d=d),
            }
            for name, fn in runs.items():
                fn()
                torch.cuda.synchronize()
                row = dict(N=N, inputs=inputs, impl=name, err_o=(out.double() - ref_o).abs().max().item(),
                           err_l=(lse.double() - ref_l).abs().max().item(),
                           mean_l=(lse.double() - ref_l).mean().item())
                rows.append(row)
            o_e, l_e = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
            rows.append(dict(N=N, inputs=inputs, impl="sdpa-efficient", err_o=(o_e.double() - ref_o).abs().max().item(),
                             err_l=(l_e[..., :N].double() - ref_l).abs().max().item(),
                             mean_l=(l_e[..., :N].double() - ref_l).mean().item()))
            for r in rows[-5:]:
                print(f"N{r['N']:6d} {r['inputs']:10s} {r['impl']:24s} max|O-f64| {r['err_o']:.2e}  max|L-f64| "
                      f"{r['err_l']:.2e}  mean(L-f64) {r['mean_l']:+.2e}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "accuracy_tf32.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=150.0, help="start no new variant after this")
    ap.add_argument("--ptxas", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=None, help="only shapes whose label contains one of these")
    ap.add_argument("--accuracy", action="store_true",
                    help="only the error study: O and L errors vs fp64 by N, for inputs as drawn and rounded to tf32")
    args = ap.parse_args(argv)
    if args.accuracy:
        return accuracy_study()
    if args.ptxas:
        rows = ptxas_report()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "sweep_tf32_ptxas.json"), "w") as f:
                json.dump(rows, f, indent=1)
        return

    import torch
    import torch.nn.functional as F
    from numba import cuda
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash
    from numba_flash import bench
    from numba_flash.configs import simt_config
    from numba_flash.kernels import simt_forward
    from numba_flash.kernels import tf32_forward as tf

    if not torch.cuda.is_available():
        sys.exit("sweep_tf32.py needs a CUDA GPU with torch (or --ptxas)")
    t_start = time.time()
    gpu = torch.cuda.get_device_name()
    print(f"# sweep_tf32 on {gpu}, torch {torch.__version__}", flush=True)
    rows = []
    for label, d, causal, N, variants in SHAPES:
        if args.shapes and not any(x in label for x in args.shapes):
            continue
        B = 1 if N > 4096 else 4
        g = torch.Generator(device="cuda").manual_seed(N * d + causal)
        q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(B, H, N, device="cuda")
        qd, kd, vd, od, ld = (cuda.as_cuda_array(t, sync=False) for t in (q, k, v, out, lse))
        fl = bench.flops(B, H, N, N, d, causal)
        ref = F.scaled_dot_product_attention(q[:1, :2].double(), k[:1, :2].double(), v[:1, :2].double(),
                                             is_causal=causal)
        s = (q[:1, :2].double() @ k[:1, :2].double().transpose(-1, -2)) * d ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        ref_lse = torch.logsumexp(s, dim=-1)
        del s

        def measure(name, run, result=None):
            row = dict(shape=label, impl=name)
            if time.time() - t_start > args.max_seconds:
                rows.append(dict(row, skipped="deadline"))
                print(f"{label:30s} {name:22s} skipped (deadline)", flush=True)
                return
            try:
                out.fill_(float("nan"))
                t0 = time.time()
                res = run()
                torch.cuda.synchronize()
                row["compile_s"] = time.time() - t0
                o = (result(res) if result else out)[:1, :2].double()
                row["err_o"] = (o - ref).abs().max().item()
                if result is None:
                    row["err_lse"] = (lse[:1, :2].double() - ref_lse).abs().max().item()
                ms, reps = bench.time_call(run, warmup=2, reps=args.iters)
                row.update(ms=ms, tflops=fl / ms / 1e9)
                print(f"{label:30s} {name:22s} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s  max|O - f64| "
                      f"{row['err_o']:.2e}  |L - f64| {row.get('err_lse', float('nan')):.2e}  "
                      f"(1st call {row['compile_s']:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - a failing variant is a result too
                row["error"] = repr(e)[:300]
                print(f"{label:30s} {name:22s} FAILED {row['error']}", flush=True)
            rows.append(row)

        for var in variants:
            hd = tf.head_dim_for(d)
            measure("tf32 " + name_of(var), lambda var=var, hd=hd: launch_variant(
                var, hd, qd, kd, vd, od, ld, causal=causal, softmax_scale=d ** -0.5))
        measure("numba_flash.forward (auto)", lambda: numba_flash.forward(q, k, v, causal=causal), result=lambda r: r[0])
        cfg = simt_config(d)
        measure("simt (shipped)", lambda: simt_forward.launch(cfg, qd, kd, vd, od, ld, causal=causal,
                                                              softmax_scale=d ** -0.5, dtype="float32", d=d))

        def sdpa():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        measure("sdpa-efficient", sdpa, result=lambda o: o)
        del q, k, v, out, lse, ref, ref_lse
        torch.cuda.empty_cache()

    total = time.time() - t_start
    print(f"# total {total:.1f} s")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "sweep_tf32.json")
        with open(path, "w") as f:
            json.dump(dict(gpu=gpu, B=B, H=H, rows=rows, total_s=total), f, indent=1, default=str)
        print(f"# wrote {path}")


if __name__ == "__main__":
    main()
