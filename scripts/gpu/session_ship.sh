#!/usr/bin/env bash
# GPU host, one call after shipping the sweeps' choices: the tensor-core backward GPU tests (new d=128
# dkdv tile), the launch-path tests, the decode GPU tests (new default tiles), the fp32 forward tests at
# d 64 / 128 (new SIMT copies), then the quick backward (fp32 + fp16), decode and fp32 forward benchmarks
# beside SDPA. Re-packs $OUT/session.tgz per step.
#   bash scripts/gpu/session_ship.sh $OUT
source "$(dirname "$0")/common.sh"
run t_mma_backward 100 $P tests/test_mma_backward.py -x -k "sweep or deterministic or 64 or 128"
run t_launch 80 $P tests/test_launch.py
run t_decode 110 $P tests/test_gpu_decode.py -x
run t_forward32 70 $P tests/test_gpu_forward.py -x -k "float32 and (64 or 128)"
run b_backward 90 python3 scripts/bench_backward.py --quick --budget-s 0.3 --out "$work/results"
run b_decode 60 python3 scripts/bench_decode.py --quick --out "$work/results"
run b_forward 60 python3 scripts/bench_forward.py --quick --dtypes float32 --no-memory --out "$work/results"
