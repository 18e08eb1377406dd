#!/usr/bin/env bash
# GPU host, one call: the sm_90 bulk-copy decode (DecodeConfig.bulk). First the bare intrinsics (a
# 2-stage cp.async.bulk + mbarrier ring); if that fails or hangs, stop (a wrong PTX assumption would
# hang every later step). Then the bulk configs against the fp64 reference, the decode sweep's
# bulk candidates beside the shipped configs (end to end, GB/s of K+V), and the quick decode
# benchmark (shipped: kernels alone, end to end, cuDNN, device copy). Re-packs $OUT/session.tgz.
#   bash scripts/gpu/session_decode_bulk.sh $OUT     (step limits sum to 480 s)
source "$(dirname "$0")/common.sh"
run t_bulk_ptx 60 $P tests/test_gpu_ptx.py -x -k bulk
grep -q "^rc=0$" "$work/t_bulk_ptx.log" || { echo "bulk-copy ring failed: later steps skipped"; exit 1; }
run t_bulk_decode 150 $P tests/test_gpu_decode.py -x -k bulk
run s_decode_bulk 220 python3 scripts/sweep_decode.py --only bulk --json "$work/results/sweep-decode-bulk.json"
run b_decode 50 python3 scripts/bench_decode.py --quick --out "$work/results"
