#!/usr/bin/env bash
# GPU host, ninth session: the fp16 quick benchmark once more at the final commit (run-to-run spread).
#   bash scripts/gpu/session_ninth_g.sh $OUT
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-1.0}
run bench_fwd 200 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
grep -E "^\[" $work/bench_fwd.log
