# Sourced by the session_*.sh scripts (GPU host, repo root, after the wheel install line).
# Each step runs under its own time limit, logs to $work/<name>.log, prints the log's tail, and
# re-packs everything into $out/session.tgz, so a call cut short keeps what finished.
out=${1:-/tmp/out}; work=$(mktemp -d); mkdir -p "$out" "$work/results"
export PYTHONUNBUFFERED=1
P="python3 -m pytest -q -p no:warnings -p no:cacheprovider -m gpu"
run() {  # (a VAR=value prefix before run sets it for that step)
  local name=$1 limit=$2; shift 2; echo "== $name"
  timeout "$limit" "$@" > "$work/$name.log" 2>&1; echo "rc=$?" >> "$work/$name.log"
  grep -vE "Warning|warn\(" "$work/$name.log" | tail -n 4
  tar czf "$out/session.tgz" -C "$work" .
}
