#!/usr/bin/env bash
# GPU host, one call: the tensor-core backward's GPU tests, its tile sweep beside the quick backward
# benchmark (SDPA backends in the same run), then the existing backward GPU tests (fp16/bf16 now
# take the tensor-core path). Re-packs $OUT/session.tgz per step.
#   bash scripts/gpu/session_mma_backward.sh $OUT
source "$(dirname "$0")/common.sh"
run t_mma_backward 240 $P tests/test_mma_backward.py -x
run b_backward 200 python3 scripts/bench_backward.py --quick --sweep-mma --dtypes float16 --budget-s 0.3 --out "$work/results"
run t_backward 120 $P tests/test_gpu_backward.py
