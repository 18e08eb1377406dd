#!/usr/bin/env bash
# GPU host, ninth session, last call, after review: LAZY_RESCALE's threshold compared in fp32 (it was fp64) —
# the shipped lazy configs where row maxima climb, L's drift, memcheck of the forward cases (now with d64
# non-causal), the fp16 quick benchmark.
#   bash scripts/gpu/session_ninth_h.sh $OUT
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.7}
run t_lazy 80 $P tests/test_mma_forward.py tests/test_gpu_forward.py -k "lazy_rescale_moving or drift or deterministic"
run san_memcheck 70 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py forward
run bench_fwd 90 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
grep -E "^\[" $work/bench_fwd.log
