#!/usr/bin/env bash
# GPU host, fifteenth session, third call: DEFER_DQ in the wgmma dkdv (each step's dQ product left in flight
# through the next step's barrier and prefetch). Its GPU tests (both builds), the fp16/bf16 public-API tests,
# an A/B against the wgmma kernel without it (ab_old/ = git archive 5e013c3 numba_flash), #6's benchmark.
#   bash scripts/gpu/session_fifteenth_c.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_wgmma 200 $P tests/test_gpu_wgmma.py tests/test_gpu_backward.py -rA \
    -k "wgmma or (deterministic and float16) or (error_rule and 16 and not mma_sync)"
OUT=$work/results run ab 200 python3 scripts/ab_backward.py --old ab_old --rounds 3 \
  --shapes "f16 N4096 d128" "f16 N4096 d128 causal" "f16 N4096 d64"
run bench 120 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.3 --out $work/results
tail -22 $work/ab.log; cat $work/results/*.md 2>/dev/null | sed -n 8,16p
grep -hE "FAILED|passed|failed" $work/t_wgmma.log | tail -8
