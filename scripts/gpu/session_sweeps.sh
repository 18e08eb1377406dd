#!/usr/bin/env bash
# GPU host, one call: the tensor-core backward's tile sweep (with the quick fp16 backward benchmark
# beside SDPA), the decode sweep (block-wide vs warp_split tiles), the SIMT forward sweep when present,
# and the launch-path GPU tests not yet run. Re-packs $OUT/session.tgz per step.
#   bash scripts/gpu/session_sweeps.sh $OUT
source "$(dirname "$0")/common.sh"
run b_backward 200 python3 scripts/bench_backward.py --quick --sweep-mma --dtypes float16 --budget-s 0.3 --out "$work/results"
run s_decode 150 python3 scripts/sweep_decode.py --json "$work/results/sweep-decode.json"
if [ -f scripts/sweep_simt.py ]; then OUT=$work/results run s_simt 120 python3 scripts/sweep_simt.py; fi
run t_launch 100 $P tests/test_launch.py
