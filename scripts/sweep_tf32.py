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
SHAPES = [
    ("fp32 B4H16 N4096 d128", 128, False, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=128, BLOCK_K=64), dict(BLOCK_Q=64, BLOCK_K=32),
        dict(BLOCK_Q=128, BLOCK_K=32), dict(BLOCK_Q=64, BLOCK_K=64, PASSES_=1)]),
    ("fp32 B4H16 N4096 d128 causal", 128, True, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=128, BLOCK_K=64), dict(BLOCK_Q=64, BLOCK_K=32)]),
    ("fp32 B4H16 N4096 d64", 64, False, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=128, BLOCK_K=64), dict(BLOCK_Q=64, BLOCK_K=32),
        dict(BLOCK_Q=128, BLOCK_K=128), dict(BLOCK_Q=128, BLOCK_K=64, MAX_REGS=128),
        dict(BLOCK_Q=64, BLOCK_K=64, PASSES_=1)]),
    ("fp32 B4H16 N4096 d64 causal", 64, True, 4096, [
        dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=128, BLOCK_K=64)]),
    ("fp32 B4H16 N1024 d128", 128, False, 1024, [dict(BLOCK_Q=64, BLOCK_K=64), dict(BLOCK_Q=128, BLOCK_K=64)]),
]
B, H = 4, 16


def name_of(v):
    s = f"{v['BLOCK_Q']}x{v['BLOCK_K']}"
    if v.get("PASSES_", 3) == 1:
        s += " tf32x1"
    if v.get("MAX_REGS"):
        s += f" r{v['MAX_REGS']}"
    return s


def ptxas_report():
    import re
    import subprocess
    import tempfile

    from numba import cuda
    if not cuda.is_available():  # compile_ptx asks the current device for its cc: answer sm_90
        import numba.cuda.dispatcher as dispatcher

        class _Sm90:
            compute_capability = (9, 0)

        dispatcher.get_current_device = lambda: _Sm90()
    from numba_flash.kernels import tf32_forward as tf

    rows = []
    for label, d, causal, _, variants in SHAPES:
        for v in variants:
            hd = tf.head_dim_for(d)
            ptx, _ = cuda.compile_ptx(tf.kernel_source(v["BLOCK_Q"], v["BLOCK_K"], hd, causal, v.get("PASSES_", 3)),
                                      tf.kernel_signature(), cc=(9, 0))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(ptx)
            flags = [f"-maxrregcount={v['MAX_REGS']}"] if v.get("MAX_REGS") else []
            r = subprocess.run(["ptxas", "-arch=sm_90", "-v", *flags, f.name, "-o", "/dev/null"],
                               capture_output=True, text=True)
            os.unlink(f.name)
            rep = r.stderr + r.stdout
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
            regs = int(re.search(r"Used (\d+) registers", rep).group(1))
            smem = tf.smem_bytes(v["BLOCK_Q"], v["BLOCK_K"], hd)
            warps = v["BLOCK_Q"] // 16
            blocks = min(65536 // (((regs * 32 + 255) // 256) * 256 * warps), (228 * 1024) // (smem + 1024))
            row = dict(shape=label, variant=name_of(v), regs=regs, spill_stores=int(spill.group(1)),
                       spill_loads=int(spill.group(2)), smem=smem, blocks_per_sm=blocks, mma=ptx.count("mma.sync"))
            rows.append(row)
            print(f"{label:30s} {row['variant']:14s} {regs:4d} regs  spill {row['spill_stores']}/{row['spill_loads']} B"
                  f"  smem {smem} B  blocks/SM {blocks}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=150.0, help="start no new variant after this")
    ap.add_argument("--ptxas", action="store_true")
    args = ap.parse_args(argv)
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
            measure("tf32 " + name_of(var), lambda var=var, hd=hd: tf.launch(
                qd, kd, vd, od, ld, causal=causal, softmax_scale=d ** -0.5, HEAD_DIM=hd, **var))
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
