#!/usr/bin/env bash
# GPU host, fourth session: time the tensor-core forward's v7 candidates (grid order, shared-memory
# epilogue, prologue, double-buffered K/V, warp skip, d=64 tiles) and the SIMT forward's larger
# register tiles, each beside the shipped config. Re-packs $OUT/session.tgz per step.
#   bash scripts/gpu/session_variants.sh $OUT
source "$(dirname "$0")/common.sh"
OUT=$work/results run s_mma 330 python3 scripts/sweep_mma.py --shapes N4096 --max-seconds 290 \
  --variants '^(128x64 mt2|64x64|128x128 mt2 qsmem)( (epi|pro|grid|kv2|r168|qsmem|skip)\S*)?$'
OUT=$work/results run s_simt 150 python3 scripts/sweep_simt.py --max-seconds 120 \
  --only "128x128 stage4" "128x64 stage4" "64x128 stage4" "128x128 pre4"
