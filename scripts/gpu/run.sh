#!/usr/bin/env bash
# The GPU host's runner: named steps, each under its own time limit, logged to OUTDIR/<step>.log (its
# tail printed), everything re-packed into OUTDIR/run.tgz after each step, so a call cut short keeps
# what finished. Result files (JSON / md / txt) land in OUTDIR/results.
#
#   bash scripts/gpu/run.sh [--dry-run] OUTDIR STEP [STEP ...]
#
# Run from the repository root. The GPU host has no index to install from: the wheels travel in .whl/
# and are installed first (the runner does this itself when .whl/ exists):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# Steps:
#   tests     the GPU test suite (pytest -m 'gpu or anywhere' tests; PYTEST_K=expr narrows it with -k; PYTEST_N workers, default 8)
#   bench     the backward (autograd, fp16 + fp32) and decode quick benchmarks, then the forward suite
#             (numba-flash bench --quick: the registered suites, JSON and plots)
#   forward   the full forward benchmark (scripts/bench_forward.py, fp32 and fp16, memory sweep) and its plots
#   sanitize  compute-sanitizer over scripts/sanitize_case.py (a small case of every shipped kernel build), one tool
#             after another: SANITIZE_TOOLS (default "memcheck racecheck synccheck initcheck"), each under its own
#             LIMIT_sanitize (default 110 s), the cases split over SANITIZE_JOBS processes at once (default 12: kernel
#             builds are most of the time); SANITIZE_FAMILY=forward|backward|decode narrows the cases. Per tool and
#             process, the sanitizer's summary line, the case count and the exit code go to
#             results/sanitizer-summary.txt (99: the sanitizer found errors; 1: a wrong result; 124: the time limit)
#   ab        A/B against another version of the package: AB_OLD=DIR holds a numba_flash extracted by
#             `mkdir -p DIR && git archive <commit> numba_flash | tar -x -C DIR` (or AB_COMMIT=<commit> with a git
#             checkout: the runner extracts it to .ab/old). Runs scripts/ab_backward.py --old DIR (AB_SHAPES,
#             AB_ROUNDS) and, when AB_MMA_VARIANTS is set, scripts/ab_mma.py --old DIR --variants ...
#             (AB_MMA_SHAPE: a regex on sweep_mma's shape labels, default 'N4096 d128$')
#   abapi     A/B of forward, backward and decode through the public API against AB_OLD / AB_COMMIT (as ab):
#             scripts/ab_api.py --old DIR --rounds AB_ROUNDS [--cases AB_CASES] (bitwise comparison of the outputs,
#             SDPA beside)
#   ptx       the PTX intrinsic GPU tests (tests/kernels/test_gpu_ptx.py)
#   host      host time per call (scripts/host_overhead.py)
#   mods      the attention variants: tests/kernels/test_mods.py + test_gpu_mods.py, then scripts/bench_mods.py
#             (ours vs FlexAttention and SDPA; MODS_QUICK=1 for N 4096); MODS_USER=1 also runs the user-mod and
#             block-sparse tests (test_user_mods.py, test_block_mask.py, test_block_sparse.py) and bench_mods.py --user
#             (with the numba_flash+block_mask rows)
#   torch     numba_flash inside PyTorch: scripts/bench_torch.py (the custom-op and transformers tests as PASS/FAIL
#             lines, host time per call, the compiled 4-layer Llama training step; TORCH_QUICK=1 for B2 N1024)
#   jit       kernel compile time per family, cold (an empty NUMBA_FLASH_CACHE_DIR) and loaded from the cache, and the
#             first call of each entry point in a fresh process (scripts/bench_jit.py; PASS: <= 0.5 s per warm kernel)
#   fuzz      the differential fuzz (scripts/fuzz.py --problems FUZZ_N (default 1000) --seed FUZZ_SEED --out results) in
#             FUZZ_JOBS processes (default 8: each new kernel specialisation is seconds of JIT on one core), merged into one summary and one JSON
#
# Each step's time limit (seconds) can be overridden by LIMIT_<step>=N, e.g. LIMIT_tests=400.
# --dry-run prints each step's commands without running them (no GPU needed).
set -u

dry=0
if [ "${1:-}" = "--dry-run" ] || [ "${1:-}" = "-n" ]; then dry=1; shift; fi
if [ $# -lt 2 ]; then
  sed -n '2,/^set -u/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1; shift
steps=("$@")
known=" tests bench forward sanitize ab abapi ptx host mods torch jit fuzz "
for s in "${steps[@]}"; do
  case "$known" in *" $s "*) ;; *) echo "unknown step: $s (steps:$known)" >&2; exit 2 ;; esac
done

mkdir -p "$out/results"
out=$(cd "$out" && pwd)
res=$out/results
export PYTHONUNBUFFERED=1 OUT=$res
export NUMBA_FLASH_COMMIT=${NUMBA_FLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
P=(python3 -m pytest -q -p no:warnings -p no:cacheprovider -m "gpu or anywhere")

if [ $dry = 0 ] && [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi

pack() { [ $dry = 1 ] || tar czf "$out/run.tgz" --exclude run.tgz -C "$out" .; }

# run NAME LIMIT CMD...: one command of a step, under LIMIT seconds, appended to OUTDIR/NAME.log.
run() {
  local name=$1 limit=$2; shift 2
  if [ $dry = 1 ]; then echo "[$name, ${limit}s] $(printf '%q ' "$@")"; return 0; fi
  echo "== $name: $*" | tee -a "$out/$name.log"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1; local rc=$?
  echo "rc=$rc" >> "$out/$name.log"
  grep -vE "Warning|warn\(" "$out/$name.log" | tail -n 6
  pack
  return $rc
}

limit() { local v="LIMIT_$1"; echo "${!v:-$2}"; }

step_tests() {
  local k=(); [ -n "${PYTEST_K:-}" ] && k=(-k "$PYTEST_K")
  # kernel compiles dominate the suite's time: spread them over PYTEST_N workers (xdist travels in .whl/)
  local n=(); python3 -c "import xdist" 2> /dev/null && n=(-n "${PYTEST_N:-8}")
  run tests "$(limit tests 560)" "${P[@]}" tests -rfE "${n[@]}" "${k[@]}"
}

step_bench() {
  local l; l=$(limit bench 300)
  run bench "$l" python3 scripts/bench_backward.py --quick --dtypes float16 float32 --budget-s 0.3 --out "$res"
  run bench "$l" python3 scripts/bench_decode.py --quick --out "$res"
  run bench "$l" python3 -m numba_flash bench --quick --no-progress --json "$res/bench-quick.json" --plots "$res/plots"
}

step_forward() {
  run forward "$(limit forward 400)" python3 scripts/bench_forward.py --dtypes float32 float16 --out "$res"
  local f; f=$(ls "$res"/forward-*.json 2>/dev/null | head -1)
  [ -n "$f" ] || [ $dry = 1 ] && run forward 60 python3 -m numba_flash plot "${f:-$res/forward-DATE.json}" --out "$res/plots"
}

step_sanitize() {
  local l jobs summary=$res/sanitizer-summary.txt status=0 fam=() tool j
  l=$(limit sanitize 110); jobs=${SANITIZE_JOBS:-12}
  [ -n "${SANITIZE_FAMILY:-}" ] && fam=("$SANITIZE_FAMILY")
  mkdir -p "$out/sanitize"
  [ $dry = 1 ] || echo "# compute-sanitizer, scripts/sanitize_case.py ${fam[*]} in $jobs processes, ${l} s per tool;" \
    "commit $NUMBA_FLASH_COMMIT, $(date -u +%Y-%m-%d)" > "$summary"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    local pids=()
    for ((j = 0; j < jobs; j++)); do
      local cmd=(compute-sanitizer --tool "$tool" --print-limit 20 --error-exitcode 99
                 python3 scripts/sanitize_case.py "${fam[@]}" --shard "$j/$jobs")
      local log=$out/sanitize/$tool-$j.log
      if [ $dry = 1 ]; then echo "[sanitize, ${l}s] $(printf '%q ' "${cmd[@]}")> $log &"; continue; fi
      echo "== sanitize: ${cmd[*]}" > "$log"
      timeout --kill-after=10 "$l" "${cmd[@]}" >> "$log" 2>&1 &
      pids+=($!)
    done
    [ $dry = 1 ] && continue
    local rcs=() total=0
    for ((j = 0; j < jobs; j++)); do
      wait "${pids[$j]}"; local rc=$?
      local log=$out/sanitize/$tool-$j.log
      echo "rc=$rc" >> "$log"
      local lines cases
      lines=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | sed 's/^=* *//' | paste -sd '|' -)
      cases=$(grep -E "^sanitize_case shard" "$log" | tail -n 1)
      total=$((total + $(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | grep -oE "SUMMARY: [0-9]+" | awk '{s += $2} END {print s + 0}')))
      echo "$tool $j/$jobs: ${lines:-no sanitizer summary (cut off?)}; ${cases:-no case count}; rc=$rc" >> "$summary"
      rcs+=("$rc"); [ "$rc" = 0 ] || status=1
    done
    echo "$tool: $total errors/hazards in all; exit codes ${rcs[*]}" | tee -a "$summary"
    cat "$out/sanitize/$tool"-*.log >> "$out/sanitize.log"
    pack
  done
  [ $dry = 1 ] && echo "[sanitize] per tool and process: summary line, case count, exit code -> $summary"
  return $status
}

# ab_old: the directory holding the "before" numba_flash (AB_OLD, or AB_COMMIT extracted to .ab/old)
ab_old() {
  old=${AB_OLD:-}
  if [ -z "$old" ] && [ -n "${AB_COMMIT:-}" ]; then
    old=.ab/old
    if [ $dry = 1 ]; then echo "[ab] git archive $AB_COMMIT numba_flash | tar -x -C $old"
    else rm -rf "$old" && mkdir -p "$old" && git archive "$AB_COMMIT" numba_flash | tar -x -C "$old" || return 1; fi
  fi
  if [ -z "$old" ]; then echo "ab: set AB_OLD=DIR (a numba_flash extracted by git archive) or AB_COMMIT=<commit>" >&2
    return 2; fi
}

step_abapi() {
  local old; ab_old || return $?
  local cases=(); [ -n "${AB_CASES:-}" ] && eval "cases=(--cases $AB_CASES)"
  run abapi "$(limit abapi 420)" python3 scripts/ab_api.py --old "$old" --rounds "${AB_ROUNDS:-3}" "${cases[@]}"
}

step_ab() {
  local old; ab_old || return $?
  local shapes=(); [ -n "${AB_SHAPES:-}" ] && eval "shapes=(--shapes $AB_SHAPES)"
  run ab "$(limit ab 300)" python3 scripts/ab_backward.py --old "$old" --rounds "${AB_ROUNDS:-3}" "${shapes[@]}"
  if [ -n "${AB_MMA_VARIANTS:-}" ]; then
    local variants; eval "variants=($AB_MMA_VARIANTS)"
    run ab "$(limit ab 300)" python3 scripts/ab_mma.py --old "$old" --rounds "${AB_ROUNDS:-5}" \
      --shape "${AB_MMA_SHAPE:-N4096 d128\$}" --variants "${variants[@]}"
  fi
}

step_ptx() { run ptx "$(limit ptx 120)" "${P[@]}" tests/kernels/test_gpu_ptx.py -rfE; }

step_host() { run host "$(limit host 100)" python3 scripts/host_overhead.py --json "$res/host_overhead.json"; }

step_mods() {
  local n=(); python3 -c "import xdist" 2> /dev/null && n=(-n "${PYTEST_N:-8}")
  run mods "$(limit mods 240)" "${P[@]}" tests/kernels/test_mods.py tests/kernels/test_gpu_mods.py -rfE "${n[@]}"
  run mods "$(limit mods 400)" python3 scripts/bench_mods.py --out "$res" ${MODS_QUICK:+--quick}
  if [ -n "${MODS_USER:-}" ]; then
    run mods "$(limit mods 240)" "${P[@]}" tests/kernels/test_user_mods.py tests/kernels/test_block_mask.py \
      tests/kernels/test_block_sparse.py -rfE "${n[@]}"
    run mods "$(limit mods 400)" python3 scripts/bench_mods.py --user --out "$res" ${MODS_QUICK:+--quick}
  fi
}

step_torch() {
  run torch "$(limit torch 420)" python3 scripts/bench_torch.py --out "$res" ${TORCH_QUICK:+--quick}
}

step_jit() { run jit "$(limit jit 300)" python3 scripts/bench_jit.py --out "$res"; }

step_fuzz() {
  local l; l=$(limit fuzz 300)
  # the budget stops drawing 60 s before the limit (a worker's last problem took up to 30 s on the H200), so the
  # summary and the JSON are still written
  run fuzz "$l" python3 scripts/fuzz.py --problems "${FUZZ_N:-1000}" --seed "${FUZZ_SEED:-0}" --out "$res" \
    --jobs "${FUZZ_JOBS:-8}" --time-budget-s $((l > 120 ? l - 60 : l / 2)) --quiet
}

status=0
for s in "${steps[@]}"; do
  [ $dry = 1 ] || echo "## step $s"
  "step_$s" || status=1
done
pack
[ $dry = 1 ] || ls "$res"
exit $status
