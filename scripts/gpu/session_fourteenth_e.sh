#!/usr/bin/env bash
# GPU host, fourteenth session, last call: the rest of the fp32 GPU tests with the cvt.rn split (the forward
# grid, odd head dims, huge logits, the backward error rule), then d32 and d64 causal timed rn against rna.
#   bash scripts/gpu/session_fourteenth_e.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_f32all 230 $P tests/test_gpu_forward.py tests/test_gpu_backward.py -rA \
    -k "float32 and not tf32x3_as_accurate and not tf32x3_backward_as_accurate and not float32_autograd and not backward_deterministic"
OUT=$work/results run ab 110 python3 scripts/ab_split_round.py --no-accuracy --modes rn rna --rounds 2 \
    --shapes "N4096 d32" "N4096 d64 causal"
grep -hE "FAILED|passed|failed" $work/t_f32all.log | tail -8
tail -3 $work/ab.log
