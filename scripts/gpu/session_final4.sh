#!/usr/bin/env bash
# GPU host, fourth session, last call: the atomic-dQ backward (red.v2, 128-key blocks shipped at d=128)
# against the fp64 reference, then the quick benchmarks after this session's changes (launch plans,
# forward v7 variants, atomic tile): forward fp16 (+ bf16 N16384) beside SDPA and naive, decode beside
# SDPA / a device copy, backward fp16 beside SDPA. Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_final4.sh $OUT
source "$(dirname "$0")/common.sh"
run t_atomic 70 $P tests/test_mma_backward.py -x -k atomic
run b_forward 130 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
run b_decode 60 python3 scripts/bench_decode.py --quick --out "$work/results"
run b_backward 90 python3 scripts/bench_backward.py --quick --dtypes float16 --budget-s 0.2 --out "$work/results"
