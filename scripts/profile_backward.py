"""Backward calls at issue #6's target shape, for ncu (GPU): the default (deterministic: the dkdv and dq
kernels, or the deterministic splits' dkdv launches and the conversion, as explain_backward says) and then
deterministic=False (dkdv with atomic dQ, then the conversion), one of each. float32 runs the tf32x3 kernels.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        -k regex:backward_dkdv -c 2 python scripts/profile_backward.py float16 [--causal] [--d 64]

The first call of each kind compiles; ncu profiles launches in order, so -c counts from the first.
"""
import argparse

import torch

import numba_flash

ap = argparse.ArgumentParser()
ap.add_argument("dtype", nargs="?", default="float16")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--n", type=int, default=4096)
args = ap.parse_args()
dtype = getattr(torch, args.dtype)
q, k, v, dout = (torch.randn(4, 16, args.n, args.d, device="cuda").to(dtype) for _ in range(4))
out, lse = numba_flash.forward(q, k, v, causal=args.causal)
for deterministic in (True, False):
    numba_flash.backward(q, k, v, out, lse, dout, causal=args.causal, deterministic=deterministic)
torch.cuda.synchronize()
print(numba_flash.explain_backward(q, k, v, causal=args.causal).splitlines()[0])
