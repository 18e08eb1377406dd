#!/usr/bin/env bash
# GPU host, fourteenth session, second call: the fp32 paths with the cvt.rn split as shipped (error rule
# against SIMT and float64, forward and backward, both dQ modes; determinism; forced splits; autograd), then
# the backward benchmark through autograd (#6's measure, fp16 and fp32 in one run).
#   bash scripts/gpu/session_fourteenth_b.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_bwd 250 $P tests/test_gpu_backward.py tests/test_tf32_backward.py -rA -s \
    -k "tf32x3_backward_as_accurate or gpu_tf32x3_dq_splits"
run t_misc 170 $P tests/test_gpu_backward.py tests/test_gpu_forward.py -rA -s \
    -k "backward_deterministic and float32 or float32_autograd or tf32x3_as_accurate"
run bench 160 python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.3 --out $work/results
cat $work/results/*.md 2>/dev/null | head -30
grep -hE "PASSED|FAILED|SKIPPED|passed|failed" $work/t_bwd.log $work/t_misc.log | tail -30
