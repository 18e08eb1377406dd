#!/usr/bin/env bash
# GPU host, one call: the launch path bit-for-bit against Numba's dispatcher, host time per call
# (before/after, with a profile), the tensor-core sweep, and GPU tests of forward (half precision,
# every shipped tensor-core config), decode and the mma unit tests.
# Usage (repo root, after the wheel install line of shared/gpu-host/prepare-wheels.sh; .old_pkg is
# an older numba_flash for the before/after, e.g. `git archive <commit> numba_flash | tar -x -C .old_pkg`):
#   bash scripts/gpu/session_tests.sh $OUT
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.5}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; grep -vE "Warning|warn\(" "$out/$name.log" | tail -n 4; }
P="python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu"
run t_launch 90 $P tests/test_launch.py
old=(); [ -d .old_pkg ] && old=(--old .old_pkg)
run host_overhead 100 python3 scripts/host_overhead.py "${old[@]}" --profile --json "$out/host_overhead.json"
export OUT="$out"; run sweep_mma 170 python3 scripts/sweep_mma.py --max-seconds 150
run t_forward_half 90 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run t_decode 60 $P tests/test_gpu_decode.py
run t_mma 40 $P tests/test_mma_forward.py tests/test_gpu_ptx.py -k "not gpu_sweep"
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
