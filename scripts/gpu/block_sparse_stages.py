"""Times each stage of tests/kernels/test_block_sparse.py::test_gpu_document_mask_block_sparse on the GPU
(B=2, H=4, Hkv=2, N=1000, d=128, document mask), synchronising after each, so a stage that never finishes is
named: faulthandler prints every thread's stack after WATCHDOG seconds and the process exits.

    python scripts/gpu/block_sparse_stages.py [causal|full] [wgmma|mma_sync]
"""
import faulthandler
import sys
import time

import numpy as np
from numba import cuda

import numba_flash
from numba_flash.mods import document_mask
from numba_flash.sparsity import forward_tile

WATCHDOG = 90
causal = (sys.argv[1:2] or ["causal"])[0] == "causal"
if (sys.argv[2:3] or ["wgmma"])[0] == "mma_sync":
    numba_flash.api._wgmma_here = lambda: False
faulthandler.dump_traceback_later(WATCHDOG, exit=True)
rng = np.random.default_rng(0)
B, H, Hkv, n, d = 2, 4, 2, 1000, 128
q = (rng.standard_normal((B, H, n, d)) * 1.5).astype(np.float16)
k, v = (rng.standard_normal((B, Hkv, n, d)).astype(np.float16) for _ in range(2))
cuts = np.sort(rng.choice(np.arange(1, n), size=(B, 5), replace=False), axis=1)
seg = (np.arange(n)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)


def stage(name, fn):
    t = time.perf_counter()
    r = fn()
    cuda.synchronize()
    print(f"{name}: {time.perf_counter() - t:.2f} s", flush=True)
    return r


print("tile", forward_tile(d, causal), "causal", causal, flush=True)
bm = stage("block_mask", lambda: numba_flash.block_mask(document_mask(seg), B, H, n, n, *forward_tile(d, causal)))
print(bm, "counts", bm.lists(causal)[0].reshape(-1).tolist(), flush=True)
stage("sparse forward (compile + run)", lambda: numba_flash.forward(q, k, v, causal=causal, block_mask=bm))
stage("sparse forward (run)", lambda: numba_flash.forward(q, k, v, causal=causal, block_mask=bm))
stage("dense mask_mod forward (compile + run)",
      lambda: numba_flash.forward(q, k, v, causal=causal, mask_mod=document_mask(seg)))
stage("dense mask_mod forward (run)", lambda: numba_flash.forward(q, k, v, causal=causal, mask_mod=document_mask(seg)))
print("jit log", numba_flash.jit_cache.log(), flush=True)
