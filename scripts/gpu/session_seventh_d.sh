#!/usr/bin/env bash
# GPU host, seventh session, fourth call: the shipped tf32x3 backward tiles, now auto for fp32 — the
# backward GPU tests, its timing vs simt and SDPA (kernel level and through torch autograd), and
# compute-sanitizer memcheck / racecheck on the backward cases.
#   bash scripts/gpu/session_seventh_d.sh $OUT
source "$(dirname "$0")/common.sh"
run t_bwd 200 $P tests/test_gpu_backward.py -s
run b_bwd_tf32 100 python3 scripts/bench_backward.py --tf32 --sweep-only --budget-s 0.4 --out "$work/results/tf32"
run b_bwd_fp32 90 python3 scripts/bench_backward.py --quick --dtypes float32 --budget-s 0.4 --out "$work/results/fp32"
run memcheck 60 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
run racecheck 90 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py backward
