#!/usr/bin/env bash
# GPU host, eighth session, third call: FA2's dkdv warp tiles (mma_backward.dkdv_fa2_source) against
# the shipped dkdv and atomic dkdv, kernel by kernel (fp16 B4 H16 N4096 d128 / causal / d64), and
# their error rule on the GPU.
#   bash scripts/gpu/session_eighth_c.sh $OUT
source "$(dirname "$0")/common.sh"
run sweep_fa2 330 python3 scripts/bench_backward.py --sweep-mma --sweep-only --sweep-kernels dkdv-shipped dkdv-atomic dkdv-fa2 dkdv-atomic-fa2 --dtypes float16 --budget-s 0.4 --out "$work/results/fa2"
run t_fa2 200 $P tests/test_gpu_backward.py -s -k fa2
