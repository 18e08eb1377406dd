#!/usr/bin/env bash
# GPU host, seventh session, second call: the tf32x3 backward tile sweep (each kernel alone, d128 and
# d64, non-causal) and two more runs of the decode quick bench (#7's figure run to run).
#   bash scripts/gpu/session_seventh_b.sh $OUT
source "$(dirname "$0")/common.sh"
OUT=$work/results run sweep_tf32_bwd 330 python3 scripts/sweep_tf32_backward.py
run b_decode2 60 python3 scripts/bench_decode.py --quick --out "$work/results/d2"
run b_decode3 60 python3 scripts/bench_decode.py --quick --out "$work/results/d3"
