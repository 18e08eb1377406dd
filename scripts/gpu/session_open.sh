#!/usr/bin/env bash
# GPU host, first call of the fourth session: the launch parameter-buffer change bit for bit against
# Numba's dispatcher (+ host time, quick decode bench), the tensor-core backward GPU tests after the
# shared-factory refactors, and the backward kernel sweep that times dkdv-split for the first time.
#   bash scripts/gpu/session_open.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch 95 $P tests/test_launch.py -x -k "bitwise or side_stream"
run host_overhead 40 python3 scripts/host_overhead.py --json "$work/results/host_overhead.json"
run b_decode 55 python3 scripts/bench_decode.py --quick --out "$work/results"
run t_mma_backward 110 $P tests/test_mma_backward.py -x -k "sweep or deterministic or 128 or atomic"
run b_backward 200 python3 scripts/bench_backward.py --quick --sweep-mma --dtypes float16 --budget-s 0.3 --out "$work/results"
