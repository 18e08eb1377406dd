#!/usr/bin/env bash
# GPU host, one call: the launch path against Numba's dispatcher, host time per call, the full
# forward benchmark (N 1024..16384, fp32 and fp16, causal and not, bf16 N16384, memory) and its
# plots, then the fp32 forward GPU tests. Work happens in a scratch
# folder that is re-packed into $OUT/session.tgz after every step, so a call cut short keeps
# everything finished so far.
#   bash scripts/gpu/session_bench.sh $OUT
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.3}
run t_launch 80 $P tests/test_launch.py
run host_overhead 45 python3 scripts/host_overhead.py --json "$work/results/host_overhead.json"
run b_forward 330 python3 scripts/bench_forward.py --dtypes float32 float16 --out "$work/results"
run plots 20 python3 -m numba_flash plot "$(ls "$work"/results/forward-*.json | head -1)" --out "$work/results/plots"
run t_forward_fp32 60 $P tests/test_gpu_forward.py -k float32
