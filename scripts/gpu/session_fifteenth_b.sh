#!/usr/bin/env bash
# GPU host, fifteenth session, second call: the wgmma dkdv as shipped (sm_90 default). The fp16/bf16 backward
# GPU tests through the public API and autograd (error rule, determinism, the mma.sync path kept for sm_80-89),
# the wgmma tests, memcheck of the backward family, then #6's benchmark through autograd (fp16 and fp32).
#   bash scripts/gpu/session_fifteenth_b.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_bwd 240 $P tests/test_gpu_backward.py tests/test_gpu_wgmma.py -rA \
    -k "not float32 and not tf32x3 and not fa2 and not cupy and not strided"
run bench 170 python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.3 --out $work/results
run memcheck 120 compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/sanitize_case.py backward
cat $work/results/*.md 2>/dev/null | head -40
grep -hE "PASSED|FAILED|SKIPPED|passed|failed|ERROR SUMMARY|^backward" $work/t_bwd.log $work/memcheck.log | tail -40
