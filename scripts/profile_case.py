"""One forward call per kernel family at the benchmark's target shapes, for ncu (GPU).

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        -k regex:flash_forward -c 1 python scripts/profile_case.py float32 [--causal] [--d 64]
"""
import sys

import torch

import numba_flash

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
causal = "--causal" in sys.argv
d = int(sys.argv[sys.argv.index("--d") + 1]) if "--d" in sys.argv else 128
q, k, v = (torch.randn(4, 16, 4096, d, device="cuda").to(dtype) for _ in range(3))
for _ in range(2):  # the first call compiles; ncu -c 1 with --launch-skip 1 profiles the second
    out, lse = numba_flash.forward(q, k, v, causal=causal)
torch.cuda.synchronize()
print(numba_flash.explain(q, k, v, causal=causal).splitlines()[0])
