"""One decode call at issue #7's target shape, for ncu (GPU).

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        -k regex:decode --launch-skip 2 -c 2 python scripts/profile_decode.py [Hkv]
"""
import sys

import torch

import numba_flash
from numba_flash.decode import plan

hkv = int(sys.argv[1]) if len(sys.argv) > 1 else 32
q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(8, hkv, 32768, 128, device="cuda", dtype=torch.float16) for _ in range(2))
for _ in range(2):  # the first call compiles; --launch-skip skips its kernels
    out, lse = numba_flash.decode(q, k, v)
torch.cuda.synchronize()
print(plan(q, k, v)[1:])
