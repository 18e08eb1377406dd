#!/usr/bin/env bash
# GPU host, for a later session: where the fp32 dQ-in-dkdv kernel spends its time (written when it was 5-7 % behind
# SDPA memory-efficient's backward at d128; since the fourteenth session's cvt.rn split it is 18 % ahead, so this
# is no longer on #6's path, only a profile to read): ncu of the first splits launch and of the atomic grid
# (stall reasons, pipes, shared-memory wavefronts and bank conflicts: dS stores are modelled 2-way, K reads in the
# dQ phase 2-way), beside the old dkdv kernel's figures in results/ncu-backward-tf32-2026-12-01.txt.
#   bash scripts/gpu/session_next_fp32.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
NCU="ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section InstructionStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_global_red.sum"
run ncu_f32 400 $NCU -k regex:"tf32_backward_dkdv_(splits|atomic)" -c 2 python3 scripts/profile_backward.py float32
grep -E "Duration|Pipe Tensor|Issue Slots Busy|Stall|bank_conflicts|wavefronts" $work/ncu_f32.log | head -40
