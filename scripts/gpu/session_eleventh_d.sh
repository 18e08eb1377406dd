#!/usr/bin/env bash
# GPU host, eleventh session, last call: the fp16 quick benchmarks beside SDPA (forward through forward, backward
# through autograd) for README's tables, then the second half of the fp16/bf16 backward GPU tests
# (session_eleventh_c's 270 s cut them after 58 passed).
#   bash scripts/gpu/session_eleventh_d.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-1.0}
run bench_fwd 190 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
run bench_bwd 160 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.3 --out "$work/results"
run t_bwd_rest 180 $P tests/test_mma_backward.py tests/test_gpu_backward.py -rA \
    -k "(gpu_deterministic or gpu_atomic_dq or test_gpu_backward) and not tf32 and not fp32 and not float32"
grep -E "numba_flash|sdpa-flash" $work/bench_fwd.log | head -12; grep -E "^\|" $work/bench_bwd.log | head -12
