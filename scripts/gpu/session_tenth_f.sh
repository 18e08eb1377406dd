#!/usr/bin/env bash
# GPU host, tenth session, last call: A/B of the atomic dkdv with its two dQ passes written out (after)
# against 30feab4 (.ab/old: the pass loop, rolled), deterministic=False only, d128 and d128 causal.
#   bash scripts/gpu/session_tenth_f.sh $OUT
source "$(dirname "$0")/common.sh"
run ab_bwd 330 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old --rounds 7 --modes atomic \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal"
grep -vE "Warning|warn\(" $work/ab_bwd.log | tail -n 12
