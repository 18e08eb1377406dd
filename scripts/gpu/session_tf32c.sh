#!/usr/bin/env bash
# GPU host, fifth session, check after review: row maxima kept scaled in both tensor-core forwards
# (alpha = 2^(M_old - M_new)): accuracy tests, the fp16/bf16 grid, the fp16 quick benchmark.
#   bash scripts/gpu/session_tf32c.sh $OUT
source "$(dirname "$0")/common.sh"
run t_fwd_new 75 $P tests/test_gpu_forward.py -k "tf32x3 or drift"
run t_fwd_half 75 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run b_forward16 115 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
