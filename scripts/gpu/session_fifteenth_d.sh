#!/usr/bin/env bash
# GPU host, fifteenth session, last call: #6's benchmark through autograd with the shipped combination
# (wgmma dkdv; DEFER_DQ for deterministic=False at d128, for both schemes at d64).
#   bash scripts/gpu/session_fifteenth_d.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run bench 110 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.25 --out $out
cat $out/*.md 2>/dev/null | sed -n 8,22p
