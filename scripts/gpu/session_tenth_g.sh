#!/usr/bin/env bash
# GPU host, tenth session: the atomic dQ GPU tests after the dQ passes were written out (de34d47).
#   bash scripts/gpu/session_tenth_g.sh $OUT
source "$(dirname "$0")/common.sh"
run t_atomic 200 $P tests/test_mma_backward.py -rA -k "gpu_atomic_dq"
grep -E "PASSED|FAILED|ERROR|passed|failed" $work/t_atomic.log | tail -n 10
