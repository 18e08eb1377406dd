#!/usr/bin/env bash
# GPU host, ninth session: SPLIT_TAIL (the last wave of Q tiles shared by every block slot) — GPU tests,
# then an A/B against the shipped non-causal configs.
#   bash scripts/gpu/session_ninth_d.sh $OUT
source "$(dirname "$0")/common.sh"
run t_split 150 $P tests/test_mma_forward.py -k "split_tail"
run ab_split 300 python3 scripts/ab_mma.py --rounds 5 --profile --shape 'N4096 d64$' --shape 'N4096 d128$' --shape bf16 \
    --variants '128x64 mt2 kv2' '128x64 mt2 kv2 split' '128x64 mt2 epi lazy' '128x64 mt2 epi lazy split'
tail -3 $work/t_split.log; grep -E "TFLOP|kernel" $work/ab_split.log | cut -c1-150
