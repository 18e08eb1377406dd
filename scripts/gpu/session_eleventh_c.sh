#!/usr/bin/env bash
# GPU host, eleventh session: the backward kernels' leaner step loops (ldmatrix offsets XOR the k-step, dSᵀ
# stores by st.shared.b32, int32 schedules) A/B against the tenth session's (.ab/old = git archive 1301634
# numba_flash; gradients compared bit for bit), the half-precision forward grid with the causal rows' new
# configs, and the fp16/bf16 backward GPU tests.
#   bash scripts/gpu/session_eleventh_c.sh $OUT      (carry .whl and .ab)
source "$(dirname "$0")/common.sh"
run ab_bwd 200 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old --rounds 5 \
    --shapes "f16 N4096 d128" "f16 N4096 d128 causal" "f16 N4096 d64"
run t_forward_half 90 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run t_bwd 270 $P tests/test_mma_backward.py tests/test_gpu_backward.py -k "not tf32 and not fp32 and not float32"
grep -hE "ms|equal" $work/ab_bwd.log | grep -v -i warn | cut -c1-190 | tail -24
