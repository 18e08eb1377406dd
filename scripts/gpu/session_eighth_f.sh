#!/usr/bin/env bash
# GPU host, eighth session, last call: launch plans in threads without a CUDA context (autograd's
# device threads) and for deterministic=False's zeroed scratch: the autograd timings again, the
# standard backward benchmark, the launch/plan GPU tests and the backward tests.
#   bash scripts/gpu/session_eighth_f.sh $OUT
source "$(dirname "$0")/common.sh"
run prof_bwd16 150 python3 scripts/profile_backward_autograd.py float16
run b_bwd 200 python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.4 --out "$work/results/bwd"
run t_launch 120 $P tests/test_launch.py tests/test_gpu_backward.py -k "not fa2 and not tf32x3" -s
