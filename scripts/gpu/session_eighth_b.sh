#!/usr/bin/env bash
# GPU host, eighth session, second call: the fp32 3xTF32 backward with Q/dO/K swizzled (bank-conflict
# free in both fragment patterns) against the padded layout, each kernel alone (A/B in one run);
# its accuracy tests; the autograd benchmark; ncu's bank-conflict count of the new kernels.
#   bash scripts/gpu/session_eighth_b.sh $OUT
source "$(dirname "$0")/common.sh"
OUT=$work/results run sweep_ab 300 python3 scripts/sweep_tf32_backward.py --front --dims 128 64 --layouts swizzled padded
run t_bwd 200 $P tests/test_gpu_backward.py -s -k "tf32 or fp32 or float32"
run b_bwd_fp32 120 python3 scripts/bench_backward.py --quick --dtypes float32 --budget-s 0.4 --out "$work/results/fp32"
run ncu_bwd32 150 ncu --clock-control none --metrics gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active -k regex:"tf32_backward_(dkdv|dq)" -c 2 python3 scripts/profile_backward.py float32
