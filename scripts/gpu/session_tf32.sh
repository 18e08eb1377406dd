#!/usr/bin/env bash
# GPU host, fifth session: the fp32 tensor-core forward (3xTF32) and the alpha fix, checked and timed;
# the atomic dkdv variants swept. Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_tf32.sh $OUT
source "$(dirname "$0")/common.sh"
run accuracy 90 python3 scripts/sweep_tf32.py --accuracy
run t_ptx 60 $P tests/test_gpu_ptx.py -k "tf32 or mma"
run t_fwd_new 120 $P tests/test_gpu_forward.py -k "tf32x3 or drift"
run t_fwd_fp32 150 $P tests/test_gpu_forward.py -k "float32 or deterministic or cupy or strided or huge"
run b_forward 100 python3 scripts/bench_forward.py --quick --dtypes float32 --no-memory --out "$work/results"
run sweep_atomic 170 python3 scripts/bench_backward.py --sweep-mma --sweep-kernels dkdv-atomic-variants --sweep-only --dtypes float16 --budget-s 0.5 --out "$work/results"
run t_bwd_fp32 90 $P tests/test_gpu_backward.py -k "float32 or gradcheck"
