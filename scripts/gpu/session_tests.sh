#!/usr/bin/env bash
# GPU host, one call: every family's GPU tests, compute-sanitizer on small cases, the SIMT sweep.
# Usage (repo root, after the wheel install line of shared/gpu-host/prepare-wheels.sh):
#   bash scripts/gpu/session_tests.sh $OUT
out=${1:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.5}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; tail -n 4 "$out/$name.log"; }
P="python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu"
run t_forward_half 110 $P tests/test_gpu_forward.py -k "float16 or bfloat16 or deterministic or cupy or strided"
run t_mma 50 $P tests/test_mma_forward.py tests/test_gpu_ptx.py
run t_backward 110 $P tests/test_gpu_backward.py
run t_decode 110 $P tests/test_gpu_decode.py
run san_memcheck 60 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py
run san_racecheck 60 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py
run sweep_simt 70 python3 -c "import sys; sys.argv=['x']; sys.path.insert(0,'scripts'); import bench_forward as b; from numba_flash import bench; import json; r=bench.sweep_simt(b.SIMT_CANDIDATES); r2=bench.sweep_simt(b.SIMT_CANDIDATES[:4], causal=True); json.dump({'noncausal': r, 'causal': r2}, open('$out/sweep_simt.json','w'), indent=1)"
cd "$out" && tar czf logs.tgz *.log && rm -f *.log
