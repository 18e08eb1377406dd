#!/usr/bin/env bash
# GPU host, fifteenth session: the fp16/bf16 dQ-in-dkdv kernel on wgmma (kernels/wgmma_backward.py). Its GPU
# tests (the intrinsics, the kernel against float64 by the error rule, 20-run determinism of its splits), then
# an A/B of the shipped mma.sync kernels against the wgmma ones beside SDPA's FA2. (As run, at 87df9f0, the
# wgmma kernel was not yet the default and ab_backward.py took --after-wgmma to switch it on; since it is
# the sm_90 default the plain command below compares against the shipped builds, DEFER_DQ where configs
# say.)
#   bash scripts/gpu/session_fifteenth.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run t_wgmma 200 $P tests/test_gpu_wgmma.py -rA -x
# the "before" package: ab_old/ (git archive 0f74de5 numba_flash), copied with the tree (the device copy's git is stale)
OUT=$work/results run ab 360 python3 scripts/ab_backward.py --old ab_old --rounds 3 \
  --shapes "f16 N4096 d128" "f16 N4096 d128 causal" "f16 N4096 d64" "f16 N4096 d64 causal" "bf16 N4096 d128"
for f in t_wgmma ab; do tail -40 $work/$f.log | grep -vE "Warning|warn\("; done
