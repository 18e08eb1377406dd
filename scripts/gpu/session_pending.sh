#!/usr/bin/env bash
# GPU host, one call: the GPU tests the second session added or could not finish (launch path on a
# side stream, the cuda.core fallback, the >48 KiB opt-in; the tail of the decode tests; the mma
# unit tests), then host time per call after the last changes. Re-packs $OUT/session.tgz per step.
#   bash scripts/gpu/session_pending.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch 120 $P tests/test_launch.py
run t_decode 150 $P tests/test_gpu_decode.py
run t_mma 120 $P tests/test_mma_forward.py tests/test_gpu_ptx.py -k "not gpu_sweep"
run host_overhead 45 python3 scripts/host_overhead.py --profile --json "$work/results/host_overhead.json"
