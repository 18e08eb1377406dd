#!/usr/bin/env bash
# GPU host, one call: compute-sanitizer memcheck and racecheck over every kernel family (the
# DeviceView launch path and the dynamic-smem tensor-core kernel included), the decode and
# backward config sweeps, and host time per call. Re-packs $OUT/session.tgz after every step.
#   bash scripts/gpu/session_final.sh $OUT
source "$(dirname "$0")/common.sh"
run san_memcheck 110 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py
run san_racecheck 110 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py
run host_overhead 35 python3 scripts/host_overhead.py --json "$work/results/host_overhead.json"
run sweep_decode 100 python3 scripts/sweep_decode.py --json "$work/results/sweep_decode.json"
run sweep_backward 110 python3 scripts/bench_backward.py --sweep --quick --dtypes float32 --budget-s 0.3 --out "$work/results"
