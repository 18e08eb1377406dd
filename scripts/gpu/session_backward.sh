#!/usr/bin/env bash
# GPU host, one call: the launch path bit-for-bit against Numba's dispatcher, host time per call
# with profiles, backward GPU tests and benchmark, decode GPU tests and benchmark. Outputs are
# re-packed into $OUT/session.tgz after every step, so a call cut short keeps what finished.
#   bash scripts/gpu/session_backward.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch 90 $P tests/test_launch.py
run host_overhead 60 python3 scripts/host_overhead.py --profile --json "$work/results/host_overhead.json"
run t_backward 110 $P tests/test_gpu_backward.py
run b_backward 120 python3 scripts/bench_backward.py --quick --budget-s 0.3 --out "$work/results"
run b_decode 60 python3 scripts/bench_decode.py --quick --out "$work/results"
run t_decode 100 $P tests/test_gpu_decode.py
