#!/usr/bin/env bash
# GPU host, seventh session, first call: the opt-in fp32 tf32x3 backward on a GPU for the first time
# (accuracy vs simt, determinism; timing vs simt and SDPA), the decode quick bench with the
# back-to-back kernel row, and ncu on the decode kernels at #7's target shape.
#   bash scripts/gpu/session_seventh.sh $OUT
source "$(dirname "$0")/common.sh"
run t_bwd_tf32 200 $P tests/test_gpu_backward.py -k tf32x3 -s
run b_bwd_tf32 150 python3 scripts/bench_backward.py --tf32 --sweep-only --budget-s 0.5 --out "$work/results"
run b_decode 70 python3 scripts/bench_decode.py --quick --out "$work/results"
run ncu_decode 90 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
    -k regex:decode --launch-skip 2 -c 2 python3 scripts/profile_decode.py 32
