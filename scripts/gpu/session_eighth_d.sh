#!/usr/bin/env bash
# GPU host, eighth session, last call: the fa2 dkdv's error rule on the GPU (the third call's test
# patched the wrong object and never ran the kernels).
#   bash scripts/gpu/session_eighth_d.sh $OUT
source "$(dirname "$0")/common.sh"
run t_fa2 240 $P tests/test_gpu_backward.py -s -k fa2
