#!/usr/bin/env bash
# GPU host, eighth session: where a backward call's time goes through torch autograd (kernel-only
# sums are ~0.8 ms below bench_backward's "bwd" at fp16 and fp32 alike).
#   bash scripts/gpu/session_eighth_e.sh $OUT
source "$(dirname "$0")/common.sh"
run prof_bwd16 200 python3 scripts/profile_backward_autograd.py float16
run prof_bwd32 200 python3 scripts/profile_backward_autograd.py float32
