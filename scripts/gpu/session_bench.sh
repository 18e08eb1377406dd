#!/usr/bin/env bash
# GPU host, one call: half-precision forward tests at real sizes (tensor-core configs), backward GPU
# tests, then the forward / backward / decode benchmarks and the plots; everything under $OUT.
#   bash scripts/gpu/session_bench.sh $OUT
out=${1:-/tmp/out}; mkdir -p "$out/results"
export PYTHONUNBUFFERED=1 NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.3}
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"; grep -vE "Warning|warn\(" "$out/$name.log" | tail -n 3; }
P="python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu"
run t_forward_half 80 $P tests/test_gpu_forward.py -k "(float16 or bfloat16) and (-64- or -128-)"
run t_backward 70 $P tests/test_gpu_backward.py
run b_forward 110 python3 scripts/bench_forward.py --quick --dtypes float32 float16 --out "$out/results"
run b_backward 50 python3 scripts/bench_backward.py --quick --budget-s 0.3 --out "$out/results"
run b_decode 40 python3 scripts/bench_decode.py --quick --out "$out/results"
run plots 20 python3 -m numba_flash plot "$(ls "$out"/results/forward-*.json | head -1)" --out "$out/results/plots"
cd "$out" && tar czf session.tgz *.log results && rm -rf *.log results
