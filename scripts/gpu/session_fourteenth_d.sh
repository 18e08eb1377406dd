#!/usr/bin/env bash
# GPU host, fourteenth session, fourth call: the fp32 forward's tiles re-swept with the cvt.rn split (PRESPLIT
# saved per-warp splits that now cost one instruction each; the shipped configs beside their cvt.rna builds).
#   bash scripts/gpu/session_fourteenth_d.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
OUT=$work/results run sweep 420 python3 scripts/sweep_tf32.py --shapes "N4096 d128" "N4096 d64" --max-seconds 330
grep -vE "Warning|warn\(" $work/sweep.log | tail -45
