#!/usr/bin/env bash
# GPU host, one call: half-precision forward tests at real sizes (tensor-core configs), backward GPU
# tests, then the forward / backward / decode benchmarks and the plots. Work happens in a scratch
# folder that is re-packed into $OUT/session.tgz after every step, so a call cut short keeps
# everything finished so far.
#   bash scripts/gpu/session_bench.sh $OUT
out=${1:-/tmp/out}; work=$(mktemp -d); mkdir -p "$out" "$work/results"
export PYTHONUNBUFFERED=1 NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-0.3}
run() {
  local name=$1 limit=$2; shift 2; echo "== $name"
  timeout "$limit" "$@" > "$work/$name.log" 2>&1; echo "rc=$?" >> "$work/$name.log"
  grep -vE "Warning|warn\(" "$work/$name.log" | tail -n 3
  tar czf "$out/session.tgz" -C "$work" .
}
P="python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu"
run t_forward_half 70 $P tests/test_gpu_forward.py -k "(float16 or bfloat16) and (-64- or -128-)"
run t_backward 60 $P tests/test_gpu_backward.py
run b_forward 100 python3 scripts/bench_forward.py --quick --dtypes float32 float16 --out "$work/results"
run b_backward 45 python3 scripts/bench_backward.py --quick --budget-s 0.3 --out "$work/results"
run b_decode 35 python3 scripts/bench_decode.py --quick --out "$work/results"
run plots 15 python3 -m numba_flash plot "$(ls "$work"/results/forward-*.json | head -1)" --out "$work/results/plots"
