#!/usr/bin/env bash
# GPU host, one call: the launch path bit-for-bit against Numba's dispatcher, host time per call
# (before/after, with a profile), the tensor-core sweep, and GPU tests of forward (half precision,
# every shipped tensor-core config), decode and the mma unit tests.
# Usage (repo root, after the wheel install line of shared/gpu-host/prepare-wheels.sh; .old_pkg is
# an older numba_flash for the before/after, e.g. `git archive <commit> numba_flash | tar -x -C .old_pkg`):
#   bash scripts/gpu/session_tests.sh $OUT
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.5}
run t_launch 90 $P tests/test_launch.py
old=(); [ -d .old_pkg ] && old=(--old .old_pkg)
run host_overhead 100 python3 scripts/host_overhead.py "${old[@]}" --profile --json "$work/results/host_overhead.json"
export OUT="$work/results"; run sweep_mma 170 python3 scripts/sweep_mma.py --max-seconds 150
run t_forward_half 90 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run t_decode 60 $P tests/test_gpu_decode.py
run t_mma 40 $P tests/test_mma_forward.py tests/test_gpu_ptx.py -k "not gpu_sweep"
