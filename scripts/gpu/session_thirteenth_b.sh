#!/usr/bin/env bash
# GPU host, thirteenth session, second call: the fp32 dQ-in-dkdv at d32 / d64 too (dS in a region of its own where
# it does not fit the stage), 16-byte fp32 prep. Every fp32 GPU backward test, memcheck of the backward cases
# (both dQ modes), then an A/B of fp32 d32 / d64 / d128 against main before the session (.ab/old4 = 2ead176).
#   bash scripts/gpu/session_thirteenth_b.sh $OUT      (carry .whl .ab)
source "$(dirname "$0")/common.sh"
run t_tf32 240 $P tests/test_gpu_backward.py -rA -s -k "float32 or tf32x3"
run san 90 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
run ab 220 env OUT=$work/results python3 scripts/ab_backward.py --old .ab/old4 --rounds 3 --iters 5 --shapes \
    "f32 N4096 d64" "f32 N4096 d64 causal" "f32 N4096 d32" "f32 N4096 d32 causal" "f32 N4096 d128"
grep -hE " ms |checks" $work/ab.log | cut -c1-200
for f in t_tf32 san; do tail -4 $work/$f.log; done
