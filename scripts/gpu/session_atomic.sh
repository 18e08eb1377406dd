#!/usr/bin/env bash
# GPU host, one short call: backward(deterministic=False) on the GPU (error rule, GQA, ragged), then the
# quick fp16 backward benchmark with both numba_flash rows beside SDPA. Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_atomic.sh $OUT
source "$(dirname "$0")/common.sh"
run t_atomic 110 $P tests/test_mma_backward.py -x -k "atomic or deterministic"
run b_backward 100 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.2 --out "$work/results"
