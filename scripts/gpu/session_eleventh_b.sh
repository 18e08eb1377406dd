#!/usr/bin/env bash
# GPU host, eleventh session: kv2 + lazy for the causal rows too (A/B in one run), the half-precision forward
# grid through forward with the new MMA_TABLE, the mma unit tests of the leaner loop (default tiles, padded
# head dims 40 / 96, the lazy rescale's moving maxima, determinism, a long sequence).
#   bash scripts/gpu/session_eleventh_b.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run ab_causal 170 python3 scripts/ab_mma.py --rounds 5 --shape 'd128 causal' --shape 'd64 causal' \
    --variants '128x64 mt2 grid+epi+pro lazy' '128x64 mt2 grid+kv2+epi lazy' \
               '128x64 mt2 grid+skip+epi+pro' '128x64 mt2 grid+skip+kv2+epi lazy' '128x64 mt2 grid+skip+epi+pro lazy'
run t_forward_half 100 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run t_mma 260 $P tests/test_mma_forward.py -k "matches_float64 or lazy or strided or deterministic or long_sequence"
grep -hE "TFLOP|bitwise" $work/ab_*.log | cut -c1-175
