#!/usr/bin/env bash
# GPU host, fourteenth session, third call: the dkdv + dq kernels plan (dq_scheme's fallback; its d128 dkdv
# spills 272 B under ptxas with the cvt.rn split, 0 with cvt.rna) timed rn against rna, and memcheck of the
# backward cases with the cvt.rn builds.
#   bash scripts/gpu/session_fourteenth_c.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
OUT=$work/results run ab_k 150 python3 scripts/ab_split_round.py --dq-kernel --no-accuracy --modes rn rna \
    --rounds 2 --shapes "N4096 d128" "N4096 d128 causal"
tail -4 $work/ab_k.log
