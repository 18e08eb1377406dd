#!/usr/bin/env bash
# GPU host, ninth session, last call: d64 ships kv2 + SMEM_EPILOGUE — the half-precision forward grid through
# forward, then the fp16 quick benchmark beside SDPA.
#   bash scripts/gpu/session_ninth_f.sh $OUT
source "$(dirname "$0")/common.sh"
export NUMBA_FLASH_BENCH_BUDGET_S=${NUMBA_FLASH_BENCH_BUDGET_S:-1.0}
run t_forward_half 120 $P tests/test_gpu_forward.py -k "float16 or bfloat16"
run bench_fwd 200 python3 scripts/bench_forward.py --quick --dtypes float16 --no-memory --out "$work/results"
grep -E "numba_flash|sdpa-flash" $work/bench_fwd.log | head -20
