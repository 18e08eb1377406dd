#!/usr/bin/env bash
# GPU host, eighth session, last call: test_launch with the tf32 modules patched too (the fp32 cases
# had compared the fast path with itself since fp32 went to tf32x3), the fa2 test with its launch spy.
#   bash scripts/gpu/session_eighth_g.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch2 150 $P tests/test_launch.py -s
run t_fa2b 150 $P tests/test_gpu_backward.py -s -k fa2
