#!/usr/bin/env bash
# GPU host, ninth session: LAZY_RESCALE (FA4's conditional rescaling) A/B against the shipped forward configs.
#   bash scripts/gpu/session_ninth.sh $OUT
source "$(dirname "$0")/common.sh"
run ab_d128 200 python3 scripts/ab_mma.py --rounds 4 --shape 'N4096 d128$' --shape bf16 \
    --variants '128x64 mt2 epi' '128x64 mt2 epi lazy' '128x64 mt2 kv2+epi lazy'
run ab_d64 150 python3 scripts/ab_mma.py --rounds 4 --shape 'N4096 d64$' \
    --variants '128x64 mt2 kv2' '128x64 mt2 kv2 lazy' '128x64 mt2 kv2+epi lazy'
run ab_causal 150 python3 scripts/ab_mma.py --rounds 4 --shape 'd128 causal' --shape 'd64 causal' \
    --variants '128x64 mt2 grid+epi+pro' '128x64 mt2 grid+epi+pro lazy' '128x64 mt2 grid+skip+epi+pro' '128x64 mt2 grid+skip+epi+pro lazy'
cat $work/*.log | grep -v -i warn
