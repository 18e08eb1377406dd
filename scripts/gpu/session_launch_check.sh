#!/usr/bin/env bash
# GPU host, one short call after the parameter-buffer change in launch.py: the launch path bit for bit
# against Numba's dispatcher (forward, backward, decode), host time per call, the quick decode benchmark.
#   bash scripts/gpu/session_launch_check.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch 95 $P tests/test_launch.py -x -k "bitwise or side_stream"
run host_overhead 40 python3 scripts/host_overhead.py --json "$work/results/host_overhead.json"
run b_decode 55 python3 scripts/bench_decode.py --quick --out "$work/results"
