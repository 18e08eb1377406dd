#!/usr/bin/env bash
# GPU host, short call: racecheck of the decode kernels after the syncwarp fix, and the backward
# config sweep (fp32, kernels only). Re-packs $OUT/session.tgz after every step.
#   bash scripts/gpu/session_racecheck.sh $OUT
source "$(dirname "$0")/common.sh"
run san_racecheck_decode 80 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py decode
run sweep_backward 130 python3 scripts/bench_backward.py --sweep --quick --dtypes float32 --budget-s 0.2 --out "$work/results"
