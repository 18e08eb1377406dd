#!/usr/bin/env bash
# GPU host, thirteenth session, last call: the backward benchmark through autograd (#6's measure: fp16 and fp32
# B4 H16 N4096 d128 beside SDPA's backends and naive attention, one run); the fp16 d128 determinism and
# error-rule tests after the launch helpers were shared with fp32; two forced fp32 splits cases (d32 causal
# Nq > Nk, d128), plane by plane.
#   bash scripts/gpu/session_thirteenth_c.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run bench 200 python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.3 --out $work/results
run t_f16 110 $P tests/test_gpu_backward.py -rA -k "backward_deterministic and float16-128 or error_rule and float16-4-2048"
run t_split 100 $P tests/test_tf32_backward.py -rA -k "gpu_tf32x3_dq_splits and (32-True or 128-False)"
cat $work/results/*.md 2>/dev/null | head -30
for f in t_f16 t_split; do tail -3 $work/$f.log; done
