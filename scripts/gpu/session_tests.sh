#!/usr/bin/env bash
# GPU host, one call: GPU tests of the tensor-core, backward and decode families, compute-sanitizer
# memcheck on small cases of every family, and the SIMT and tensor-core config sweeps.
# Usage (repo root, after the wheel install line of shared/gpu-host/prepare-wheels.sh):
#   bash scripts/gpu/session_tests.sh $OUT
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.5}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n 3 "$out/$name.log"; }
P="python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu"
run t_mma 50 $P tests/test_mma_forward.py tests/test_gpu_ptx.py -k "not gpu_sweep"
run t_backward 80 $P tests/test_gpu_backward.py
run t_decode 80 $P tests/test_gpu_decode.py
run san_memcheck 50 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py
run sweep_simt 45 python3 -c "import sys; sys.path.insert(0,'scripts'); import bench_forward as b; from numba_flash import bench; import json; json.dump(bench.sweep_simt(b.SIMT_CANDIDATES), open('$out/sweep_simt.json','w'), indent=1)"
run sweep_mma 110 python3 scripts/sweep_mma.py --max-seconds 95
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
