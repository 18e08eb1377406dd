#!/usr/bin/env bash
# GPU host, tenth session: A/B of the backward with the streamed tiles' whole-tile copy path (after)
# against the tree before it (.ab/old, `git archive 85d3c0b numba_flash`), interleaved in one process.
#   bash scripts/gpu/session_tenth_b.sh $OUT
source "$(dirname "$0")/common.sh"
run ab_bwd 420 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old --rounds 5 \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal" "f16 N4096 d64"
cat $work/ab_bwd.log | grep -vE "Warning|warn\(" | tail -n 30
