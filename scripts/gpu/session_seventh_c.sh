#!/usr/bin/env bash
# GPU host, seventh session, third call: the tf32x3 backward sweep, causal (d128, d64, d32) and
# non-causal d32 (each kernel alone).
#   bash scripts/gpu/session_seventh_c.sh $OUT
source "$(dirname "$0")/common.sh"
OUT=$work/results run sweep_tf32_bwd_causal 330 python3 scripts/sweep_tf32_backward.py --causal
OUT=$work/results run sweep_tf32_bwd_d32 150 python3 scripts/sweep_tf32_backward.py --dims 32
