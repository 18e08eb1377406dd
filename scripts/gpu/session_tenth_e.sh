#!/usr/bin/env bash
# GPU host, tenth session: the GPU tests session_tenth_d.sh's 300 s cut off (58 of 73 had passed): the
# atomic dQ and determinism tests of test_mma_backward.py, and test_gpu_backward.py (fp16/bf16).
#   bash scripts/gpu/session_tenth_e.sh $OUT
source "$(dirname "$0")/common.sh"
run t_bwd_rest 380 $P tests/test_mma_backward.py tests/test_gpu_backward.py -rA \
    -k "(gpu_deterministic or gpu_atomic_dq or test_gpu_backward) and not tf32 and not fp32 and not float32"
grep -E "PASSED|FAILED|ERROR|passed|failed" $work/t_bwd_rest.log | tail -n 30
