#!/usr/bin/env bash
# GPU host, eighth session, last minutes: host time of a backward through autograd, piece by piece.
#   bash scripts/gpu/session_eighth_h.sh $OUT
source "$(dirname "$0")/common.sh"
run host_bwd16 100 python3 scripts/profile_backward_host.py float16
