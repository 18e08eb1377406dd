#!/usr/bin/env bash
# GPU host, one call after numba_flash/plans.py (per-signature launch plans): replayed calls bit for bit
# against Numba's dispatcher and against the ordinary path (alignment change, side stream, cuda.core
# fallback), the GPU test files of decode and forward (repeated shapes: plan hits against references),
# host time per call before/after, the quick decode benchmark (end to end vs kernels at Hkv32 / Hkv8).
# Usage (repo root, after the wheel install line; .old_pkg = the package before plans, e.g.
# `mkdir .old_pkg && git archive 613ab89 numba_flash | tar -x -C .old_pkg`):
#   bash scripts/gpu/session_plans.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch 150 $P tests/test_launch.py -x
run t_plans_stub 120 python3 -m pytest -q -p no:cacheprovider tests/test_plans.py -x
old=(); [ -d .old_pkg ] && old=(--old .old_pkg)
run host_overhead 100 python3 scripts/host_overhead.py "${old[@]}" --json "$work/results/host_overhead.json"
run b_decode 55 python3 scripts/bench_decode.py --quick --out "$work/results"
run t_decode 90 $P tests/test_gpu_decode.py -x
run t_forward_half 90 $P tests/test_gpu_forward.py -x -k "float16 or bfloat16"
