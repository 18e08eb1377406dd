#!/usr/bin/env bash
# GPU host: the 128-key atomic dkdv (shipped at d=128 for deterministic=False) against the fp64 reference,
# and the quick fp32 forward benchmark after the launch plans. Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_atomic128.sh $OUT
source "$(dirname "$0")/common.sh"
run t_atomic128 120 $P "tests/test_mma_backward.py::test_gpu_atomic_dq[128-True-float16-128]" \
  "tests/test_mma_backward.py::test_gpu_atomic_dq[64-False-bfloat16-128]"
run b_forward32 100 python3 scripts/bench_forward.py --quick --dtypes float32 --no-memory --out "$work/results"
