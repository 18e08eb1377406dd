#!/usr/bin/env bash
# GPU host, twelfth session, second call: the deterministic splits as their own dkdv build (DQ_SPLITS: the key
# block loop on the host, a launch per S key blocks; deterministic=False's kernel as before), A/B against main
# before this session (.ab/old3 = git archive 79c41fd numba_flash); GPU tests of the splits, the atomic path and
# determinism; the quick autograd benchmark.
#   bash scripts/gpu/session_twelfth_b.sh $OUT      (carry .whl and .ab)
source "$(dirname "$0")/common.sh"
run ab_bwd 200 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old3 --rounds 5 \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal"
run t_split 150 $P tests/test_mma_backward.py -rA -x -k "gpu_dq_splits or gpu_deterministic or gpu_atomic_dq"
run t_det 100 $P tests/test_gpu_backward.py -rA -x -k "backward_deterministic and float16"
run bench 120 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.3 --out $work/results
grep -hE " ms |bitwise|checks" $work/ab_bwd.log | cut -c1-160; for f in t_split t_det bench; do tail -3 $work/$f.log; done
