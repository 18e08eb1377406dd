#!/usr/bin/env bash
# GPU host, for the next session: what the twelfth session could not run at its shipped build (bb39135 and later)
# for lack of device time: the remaining deterministic-splits GPU tests (fp16 8 splits, causal Nq > Nk with 2,
# d64 with 5), the 48-case backward grid and the bf16 error-rule cases, and a per-kernel profile of the splits
# (prep, the 16 dkdv launches, convert) beside the atomic grid, to separate the 0.25 ms the splits still lose.
#   bash scripts/gpu/session_next_splits.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_split 300 $P tests/test_mma_backward.py -rA -k "gpu_dq_splits"
run t_grid 280 $P tests/test_mma_backward.py tests/test_gpu_backward.py -rA \
    -k "(gpu_grid or backward_error_rule) and not float32"
run prof 120 python3 scripts/profile_backward_autograd.py
for f in t_split t_grid prof; do tail -4 $work/$f.log; done
