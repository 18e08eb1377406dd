#!/usr/bin/env bash
# GPU host, tenth session, first call: per-instruction stall sampling (ncu SourceCounters) of the
# d64 forward (#4's open target) and of the fp16 d128 backward kernels (#6), exported as SASS-level
# CSV so the stalls can be read against the disassembly here.
#   bash scripts/gpu/session_tenth.sh $OUT
source "$(dirname "$0")/common.sh"
SRC="ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no"
page() {  # report -> SASS-level CSV (per-instruction samples) and the details page
  ncu -i "$1.ncu-rep" --page source --csv --print-source sass > "$1.sass.csv" 2> "$1.sass.err"
  ncu -i "$1.ncu-rep" --page details > "$1.details.txt" 2>&1
}
cd "$work"
R=$OLDPWD
run ncu_fwd_d64 150 $SRC -k regex:mma_forward -c 1 -o fwd_d64 python3 $R/scripts/profile_case.py float16 --d 64
page fwd_d64
run ncu_fwd_d128 150 $SRC -k regex:mma_forward -c 1 -o fwd_d128 python3 $R/scripts/profile_case.py float16
page fwd_d128
run ncu_bwd_det 200 $SRC -k regex:"mma_backward_(dkdv|dq)" -c 2 -o bwd_det python3 $R/scripts/profile_backward.py float16
page bwd_det
run ncu_bwd_atomic 200 $SRC -k regex:"mma_backward_dkdv" --launch-skip 1 -c 1 -o bwd_atomic python3 $R/scripts/profile_backward.py float16
page bwd_atomic
ls -la "$work" | tail -20
tar czf "$out/session.tgz" -C "$work" .
