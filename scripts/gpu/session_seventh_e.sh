#!/usr/bin/env bash
# GPU host, seventh session, last call: the fp32 forward re-timed after the fifth session's
# scaled-max softmax change (its speed was not measured after it), and a fourth decode quick run.
#   bash scripts/gpu/session_seventh_e.sh $OUT
source "$(dirname "$0")/common.sh"
run b_fwd32 150 python3 scripts/bench_forward.py --quick --dtypes float32 --no-memory --out "$work/results/fwd32"
run b_decode4 60 python3 scripts/bench_decode.py --quick --out "$work/results/d4"
