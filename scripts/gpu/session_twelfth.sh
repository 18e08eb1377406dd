#!/usr/bin/env bash
# GPU host, twelfth session, first call: backward(deterministic=True) by deterministic splits of the dQ-in-dkdv
# kernel (FA2's deterministic scheme) at d128; its GPU tests (error rule, 20 runs bitwise), the pending
# d % 8 != 0 forward test, memcheck; A/B against main before it (.ab/old3 = git archive 79c41fd numba_flash).
#   bash scripts/gpu/session_twelfth.sh $OUT      (carry .whl and .ab)
source "$(dirname "$0")/common.sh"
run t_split 200 $P tests/test_mma_backward.py tests/test_gpu_backward.py -rA -x \
    -k "gpu_dq_splits or gpu_deterministic or gpu_atomic_dq or backward_deterministic"
run t_fwd8 60 $P tests/test_gpu_forward.py -rA -k "not_a_multiple_of_8"
run ab_bwd 170 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old3 --rounds 5 \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal"
mv $work/results/ab_backward.json $work/results/ab_backward_d128.json 2>/dev/null
run ab_d64 120 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old3 --rounds 3 --after-dq splits \
    --modes deterministic --shapes "f16 N4096 d64" "f16 N4096 d64 causal"
run san_memcheck_bwd 80 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
grep -hE " ms |bitwise|checks" $work/ab_bwd.log $work/ab_d64.log | cut -c1-160; tail -3 $work/t_split.log $work/t_fwd8.log; tail -2 $work/san_memcheck_bwd.log
