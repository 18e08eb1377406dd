"""Forward benchmark on the GPU: numba_flash beside PyTorch SDPA (each backend) and naive attention.

    python scripts/bench_forward.py                 # full suite, writes benchmarks/results/forward-<date>.{json,md}
    python scripts/bench_forward.py --quick         # two shapes, for a smoke run
    python scripts/bench_forward.py --sweep-simt    # also time every candidate SIMT config at the target shape

TFLOP/s = 4·B·H·Nq·Nk·d / time (half for causal). Time = median of CUDA-event timings of single
calls after warm-up. Every input tensor is larger than the 60 MB L2 at the suite's sizes except
N=1024 d=64 fp16 (8 MiB per tensor), where the figures include some L2 reuse.

A thin wrapper over numba_flash.bench (which `numba-flash bench` also runs); the SIMT tuning
candidates below are this script's data. Needs a GPU with torch and cupy; without one, use
`numba-flash bench --quick` (tiny cases on the CUDA simulator).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from numba_flash import bench  # noqa: E402

SIMT_CANDIDATES = [  # (block_q, block_k, row_threads, col_threads, share_kv[, max_registers]) for head_dim 128
    (128, 64, 16, 16, True), (64, 64, 16, 16, True), (64, 64, 16, 16, True, 128), (32, 64, 8, 16, True),
    (64, 32, 16, 8, True), (64, 64, 8, 16, True), (128, 64, 16, 8, True),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep-simt", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)

    if not bench.gpu_available():
        ap.exit(2, "bench_forward.py: no usable GPU here (or NUMBA_ENABLE_CUDASIM is set); for tiny cases on the "
                   "CUDA simulator run: numba-flash bench --quick\n")
    command = " ".join(["python", "scripts/bench_forward.py", *(argv if argv is not None else sys.argv[1:])])
    result = bench.new_result(command, simulator=False)
    if args.sweep_simt:
        print("SIMT config sweep (fp32, B4 H16 N4096 d128):", flush=True)
        result["sweep_simt"] = bench.sweep_simt(SIMT_CANDIDATES)
    try:
        result.update(bench.forward_suite(quick=args.quick, dtypes=args.dtypes, memory=not args.no_memory))
    except bench.SuiteError as e:
        ap.exit(2, f"bench_forward.py: {e}\n")
    stem = os.path.join(args.out, f"forward-{result['meta']['date'][:10]}" + ("-quick" if args.quick else ""))
    bench.write_results(result, stem)
    print(bench.markdown(result))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
