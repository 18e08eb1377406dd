#!/usr/bin/env bash
# GPU host, fourth session, second call: launch plans bit for bit against Numba's dispatcher; the
# bulk-copy decode (gate: the bare cp.async.bulk + mbarrier ring; then its sweep beside the shipped
# configs); the atomic-dQ backward with red.v2 and 128-key blocks (kernel sweep + quick autograd
# suite); the fp16/bf16 forward GPU tests with the v7 variants now shipped. Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_midway.sh $OUT
source "$(dirname "$0")/common.sh"
run t_launch 110 $P tests/test_launch.py -x
run t_fwd 80 $P tests/test_gpu_forward.py -x -k "float16 or bfloat16"
run b_atomic 110 python3 scripts/bench_backward.py --quick --sweep-mma --sweep-kernels dkdv-atomic \
  --dtypes float16 --budget-s 0.2 --out "$work/results"
run t_bulk_ptx 45 $P tests/test_gpu_ptx.py -x -k bulk
grep -q "^rc=0$" "$work/t_bulk_ptx.log" || { echo "bulk-copy ring failed: the bulk sweep skipped"; exit 1; }
run s_decode_bulk 180 python3 scripts/sweep_decode.py --only bulk --json "$work/results/sweep-decode-bulk.json"
