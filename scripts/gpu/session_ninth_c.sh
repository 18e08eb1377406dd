#!/usr/bin/env bash
# GPU host, ninth session: the rest of the tensor-core forward GPU tests with LAZY_RESCALE shipped (L's drift
# at Nk = 16384, the mma unit/config tests that session_ninth_b's 120 s limit cut short).
#   bash scripts/gpu/session_ninth_c.sh $OUT
source "$(dirname "$0")/common.sh"
run t_drift 100 $P tests/test_gpu_forward.py -k "drift"
run t_mma 420 $P tests/test_mma_forward.py
