#!/usr/bin/env bash
# GPU host, fifth session, last call: the fp16/bf16 forward grid after the alpha fix, the fp16 quick
# benchmark, the causal d128 fp32 shape (direct launches beside forward), compute-sanitizer on the forward
# family (tf32x3 included). Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_tf32b.sh $OUT
source "$(dirname "$0")/common.sh"
run t_fwd_half 130 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run causal128 70 python3 scripts/sweep_tf32.py --shapes "d128 causal" --max-seconds 55
run racecheck 100 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py forward
run memcheck 60 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py forward
run b_forward16 120 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
