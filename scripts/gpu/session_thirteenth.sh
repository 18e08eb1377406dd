#!/usr/bin/env bash
# GPU host, thirteenth session: fp32's dQ formed in the tf32x3 dK/dV kernel (atomic grid, deterministic splits).
# GPU tests of the fp32 paths (error rule vs SIMT and float64, 20-run determinism of the splits), then an A/B of
# fp32 d128 (causal and not) against main before the session (.ab/old4 = git archive 2ead176 numba_flash).
#   bash scripts/gpu/session_thirteenth.sh $OUT      (carry .whl .ab)
source "$(dirname "$0")/common.sh"
run t_tf32 300 $P tests/test_gpu_backward.py -rA -s \
    -k "tf32x3_backward_as_accurate and 128 or backward_deterministic and float32 or error_rule and float32-4-2048"
run ab 240 python3 scripts/ab_backward.py --old .ab/old4 --shapes "f32 N4096 d128" "f32 N4096 d128 causal" \
    --rounds 3 --iters 5
cp "$OUT/ab_backward.json" "$work/results/" 2>/dev/null
for f in t_tf32 ab; do tail -12 $work/$f.log; done
