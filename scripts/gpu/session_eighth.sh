#!/usr/bin/env bash
# GPU host, eighth session: ncu on the backward kernels at #6's shape (fp16 deterministic pair, the
# atomic-dQ dkdv, the fp32 3xTF32 pair) and on the fp16 forward at d128 / d64 (#4), for the notes'
# "what limits it". Profiles the first launches of each kernel (the kernel is the same every call).
#   bash scripts/gpu/session_eighth.sh $OUT
source "$(dirname "$0")/common.sh"
NCU="ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum,smsp__inst_executed_op_ldsm.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__sass_inst_executed_op_global_red.sum"
run ncu_bwd16 300 $NCU -k regex:"mma_backward_(dkdv|dq)" -c 4 python3 scripts/profile_backward.py float16
run ncu_fwd16 150 $NCU -k regex:mma_forward -c 1 python3 scripts/profile_case.py float16
run ncu_fwd16_d64 150 $NCU -k regex:mma_forward -c 1 python3 scripts/profile_case.py float16 --d 64
run ncu_bwd32 300 $NCU -k regex:"tf32_backward_(dkdv|dq)" -c 2 python3 scripts/profile_backward.py float32
