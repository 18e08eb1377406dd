#!/usr/bin/env bash
# GPU host, tenth session, last minutes: the fp16 quick backward benchmark after the atomic dQ passes were
# written out (README's fp16 rows).
#   bash scripts/gpu/session_tenth_h.sh $OUT
source "$(dirname "$0")/common.sh"
run bench_bwd 170 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.3 --out "$work/results"
grep -E "^\|" $work/bench_bwd.log | head -12
