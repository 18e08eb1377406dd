#!/usr/bin/env bash
# GPU host, fourteenth session: the 3xTF32 split by cvt.rn (sm_90: one F2FP) instead of cvt.rna (four
# instructions). The rounding intrinsics bit for bit, then an A/B of the three split roundings (time of the
# fp32 forward and deterministic backward beside SDPA memory-efficient, error against float64 beside SIMT).
#   bash scripts/gpu/session_fourteenth.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_round 100 $P tests/test_gpu_ptx.py -rA -k "tf32"
OUT=$work/results run ab 420 python3 scripts/ab_split_round.py --rounds 3 --shapes "N4096 d128" "N4096 d128 causal" "N4096 d64"
for f in t_round ab; do tail -14 $work/$f.log; done
