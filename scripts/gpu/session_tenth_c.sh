#!/usr/bin/env bash
# GPU host, tenth session: (1) A/B of the backward without the per-step integer division (after) against
# c5e404f (.ab/old); (2) the tensor-core backward's tile and variant sweep at d128 non-causal again, now that
# the streamed copies are cheap and the atomic dkdv no longer spills (kernels alone).
#   bash scripts/gpu/session_tenth_c.sh $OUT
source "$(dirname "$0")/common.sh"
run ab_bwd 150 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old --rounds 5 --shapes "f16 N4096 d128"
grep -vE "Warning|warn\(" $work/ab_bwd.log | tail -n 7
run sweep 330 python3 scripts/bench_backward.py --sweep-mma --sweep-only --sweep-d 128 --sweep-causal False \
    --sweep-kernels dkdv dq dkdv-atomic dkdv-fa2 dkdv-atomic-fa2 dkdv-atomic-variants --out $work/results
grep -E "^  mma" $work/sweep.log
