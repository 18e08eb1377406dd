#!/usr/bin/env bash
# GPU host, twelfth session, third call: the splits' first launch stores (no memset), prep and convert by
# 16-byte loads and stores; A/B against main before this session (.ab/old3 = git archive 79c41fd numba_flash):
# the table's choice at d128 (splits) and the dq-kernel path (d64, and d128 causal forced with --after-dq
# kernel); the splits / atomic / determinism GPU tests; the quick autograd benchmark; memcheck.
#   bash scripts/gpu/session_twelfth_c.sh $OUT      (carry .whl and .ab)
source "$(dirname "$0")/common.sh"
run ab_bwd 170 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old3 --rounds 5 \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal"
mv $work/results/ab_backward.json $work/results/ab_backward_d128.json 2>/dev/null
run ab_kernel 110 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old3 --rounds 3 --after-dq kernel \
    --modes deterministic --shapes "f16 N4096 d128 causal" "f16 N4096 d64"
run t_split 170 $P tests/test_mma_backward.py -rA -x -k "gpu_dq_splits or gpu_atomic_dq"
run t_det 100 $P tests/test_gpu_backward.py -rA -x -k "(backward_deterministic and float16) or (backward_error_rule and 16 and 128)"
run bench 110 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.3 --out $work/results
run san 60 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
grep -hE " ms |bitwise|checks" $work/ab_bwd.log $work/ab_kernel.log | cut -c1-160
for f in t_split t_det bench san; do tail -3 $work/$f.log; done
