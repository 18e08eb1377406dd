#!/usr/bin/env bash
# GPU host, thirteenth session, last call: the backward benchmark through autograd (#6's measure: fp16 and fp32
# B4 H16 N4096 d128 beside SDPA's backends and naive attention, one run), then the fp16 d128 determinism and
# error-rule tests at the final build (the 16-byte prep and the convert source now serve fp32 too).
#   bash scripts/gpu/session_thirteenth_c.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run bench 230 python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.3 --out $work/results
run t_f16 120 $P tests/test_gpu_backward.py -rA -k "backward_deterministic and float16-128 or error_rule and float16-4-2048"
cat $work/results/*.md 2>/dev/null | head -40
for f in t_f16; do tail -3 $work/$f.log; done
