#!/usr/bin/env bash
# GPU host, fourteenth session, second call: the fp32 paths with the cvt.rn split as shipped (error rule
# against SIMT and float64, forward and backward, both dQ modes; determinism; forced splits; autograd), the
# backward benchmark through autograd (#6's measure, fp16 and fp32 in one run), and the dkdv + dq kernels
# plan (dq_scheme's fallback: its d128 dkdv now spills 272 B under ptxas, 0 with cvt.rna) timed rn vs rna.
#   bash scripts/gpu/session_fourteenth_b.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_f32 330 $P tests/test_gpu_backward.py tests/test_gpu_forward.py tests/test_tf32_backward.py -rA -s \
    -k "tf32x3_backward_as_accurate or backward_deterministic and float32 or float32_autograd or tf32x3_as_accurate or gpu_tf32x3_dq_splits"
run bench 160 python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.3 --out $work/results
OUT=$work/results run ab_k 100 python3 scripts/ab_split_round.py --dq-kernel --no-accuracy --modes rn rna \
    --rounds 2 --shapes "N4096 d128"
cat $work/results/*.md 2>/dev/null | head -30
grep -E "PASSED|FAILED|passed|failed|tf32x3 " $work/t_f32.log | tail -40
tail -4 $work/ab_k.log
