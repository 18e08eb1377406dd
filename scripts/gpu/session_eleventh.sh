#!/usr/bin/env bash
# GPU host, eleventh session: the forward's leaner K/V loop (copy offsets stepped per tile, int32 tile counter,
# ignore-src zero fill, ldmatrix byte addresses) A/B against the tenth session's kernels (.ab/old = git archive
# 1301634 numba_flash), then the new intrinsics' and the half-precision forward's GPU tests and memcheck.
#   bash scripts/gpu/session_eleventh.sh $OUT      (carry .whl and .ab)
source "$(dirname "$0")/common.sh"
run ab_d128 200 python3 scripts/ab_mma.py --old .ab/old --rounds 5 --shape 'N4096 d128$' --shape bf16 \
    --variants '128x64 mt2 epi lazy' '128x64 mt2 kv2+epi lazy'
run ab_d64 150 python3 scripts/ab_mma.py --old .ab/old --rounds 5 --shape 'N4096 d64$' \
    --variants '128x64 mt2 kv2+epi' '128x64 mt2 kv2+epi lazy'
run ab_causal 150 python3 scripts/ab_mma.py --old .ab/old --rounds 5 --shape 'd128 causal' --shape 'd64 causal' \
    --variants '128x64 mt2 grid+epi+pro lazy' '128x64 mt2 grid+skip+epi+pro'
run t_ptx 60 $P tests/test_gpu_ptx.py
run t_forward_half 120 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run san_memcheck 100 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py forward
grep -hE "TFLOP|bitwise" $work/ab_*.log | cut -c1-175
