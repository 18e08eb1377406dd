#!/usr/bin/env bash
# GPU host, ninth session: d64 non-causal, the shipped kv2 against kv2 + shared-memory epilogue (never timed
# together before) with and without LAZY_RESCALE, 6 interleaved rounds.
#   bash scripts/gpu/session_ninth_e.sh $OUT
source "$(dirname "$0")/common.sh"
run ab_d64 200 python3 scripts/ab_mma.py --rounds 6 --shape 'N4096 d64$' \
    --variants '128x64 mt2 kv2' '128x64 mt2 kv2+epi' '128x64 mt2 kv2+epi lazy' '128x64 mt2 kv2 lazy'
grep -E "TFLOP" $work/ab_d64.log | cut -c1-170
