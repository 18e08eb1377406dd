#!/usr/bin/env bash
# GPU host, eleventh session, last call: the backward's streamed-tile copies by per-thread plans (the forward's
# copy_plan / load_tile_fast, shared through tile_copies; ignore-src zero fill) A/B against main before them
# (.ab/old2 = git archive 2e9a4d7 numba_flash; deterministic gradients compared bit for bit), the backward's
# error-rule, atomic and determinism GPU tests, memcheck.
#   bash scripts/gpu/session_eleventh_f.sh $OUT      (carry .whl and .ab)
source "$(dirname "$0")/common.sh"
run ab_bwd 150 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old2 --rounds 3 \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal"
run t_bwd 130 $P tests/test_mma_backward.py tests/test_gpu_backward.py -rA \
    -k "(gpu_deterministic or gpu_atomic_dq or error_rule or backward_deterministic) and not tf32 and not fp32 and not float32 and not fa2"
run san_memcheck_bwd 80 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
grep -hE " ms |bitwise|checks" $work/ab_bwd.log | cut -c1-150; tail -3 $work/t_bwd.log; tail -2 $work/san_memcheck_bwd.log
