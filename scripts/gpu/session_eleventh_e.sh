#!/usr/bin/env bash
# GPU host, eleventh session: compute-sanitizer memcheck of the backward family after its address changes, and
# the fa2-layout dkdv tests session_eleventh_d's limit cut.
#   bash scripts/gpu/session_eleventh_e.sh $OUT      (carry .whl)
source "$(dirname "$0")/common.sh"
run san_memcheck_bwd 150 compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py backward
run t_fa2 150 $P tests/test_gpu_backward.py -rA -k "fa2"
tail -4 $work/san_memcheck_bwd.log; grep -E "PASSED|FAILED|passed|failed" $work/t_fa2.log | tail -8
