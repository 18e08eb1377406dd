#!/usr/bin/env bash
# GPU host, ninth session: LAZY_RESCALE shipped at d128 — GPU tests of the half-precision forward (every
# shipped tensor-core config), compute-sanitizer on the forward family, the fp16 quick benchmark beside SDPA.
#   bash scripts/gpu/session_ninth_b.sh $OUT
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-1.0}
run t_forward_half 120 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run t_mma 120 $P tests/test_mma_forward.py
run san_memcheck 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py forward
run san_racecheck 100 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py forward
run bench_fwd 200 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
cat $work/bench_fwd.log | grep -v -i warn | tail -30
