#!/usr/bin/env bash
# GPU host, tenth session: the backward after the whole-tile copies and step_tile, checked and measured —
# the tensor-core backward's GPU tests (error rule, determinism, gradcheck, GQA, odd shapes), memcheck of
# the backward cases, and the fp16 quick benchmark (SDPA in the same run).
#   bash scripts/gpu/session_tenth_d.sh $OUT
source "$(dirname "$0")/common.sh"
run t_bwd 300 $P tests/test_mma_backward.py tests/test_gpu_backward.py -k "not tf32 and not fp32 and not float32"
run san_memcheck 90 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
run bench_bwd 150 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.5 --out "$work/results"
grep -E "^\|" $work/bench_bwd.log | head -30
