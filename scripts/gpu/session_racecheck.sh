#!/usr/bin/env bash
# GPU host, short call: racecheck of the decode kernels after the syncwarp fix, and the backward
# config sweep (fp32, kernels only). Re-packs $OUT/session.tgz after every step.
#   bash scripts/gpu/session_racecheck.sh $OUT
out=${1:-/tmp/out}; work=$(mktemp -d); mkdir -p "$out" "$work/results"
export PYTHONUNBUFFERED=1
run() {
  local name=$1 limit=$2; shift 2; echo "== $name"
  timeout "$limit" "$@" > "$work/$name.log" 2>&1; echo "rc=$?" >> "$work/$name.log"
  grep -vE "Warning: Race|warn\(" "$work/$name.log" | tail -n 5
  tar czf "$out/session.tgz" -C "$work" .
}
run san_racecheck_decode 80 compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py decode
run sweep_backward 130 python3 scripts/bench_backward.py --sweep --quick --dtypes float32 --budget-s 0.2 --out "$work/results"
