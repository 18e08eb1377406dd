"""Inline-PTX intrinsics for Numba CUDA kernels, each beside its simulator twin, grouped by kind.

On a GPU every public name is a ``numba.cuda.extending.intrinsic`` that emits one inline-PTX
instruction (``mma.sync``, ``ldmatrix``, ``cp.async``, ``cvt``, ``ex2``, ...). Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same name is a Python function that computes the same thing for one
simulated thread, exchanging registers with the other lanes of its warp, so a kernel's fragment
indexing is checked on a machine without a GPU. ``target.pick`` makes the choice at import time.

    mma        mma.sync (f16/bf16, tf32), ldmatrix, fragment layouts, tf32 rounding, 16-bit bit patterns
    copy       cp.async and its groups, mbarriers, cp.async.bulk
    warpgroup  wgmma, its descriptors, fences, commits and waits
    tma        TMA tensor copies (cp.async.bulk.tensor) and bulk groups, plain mbarrier arrivals, named barriers,
               setmaxnreg (warp-specialised kernels)
    mem        loads, stores and reductions on global and shared memory, bit casts, packing, ex2.approx
    warp       shfl_xor_sync, syncwarp
    target     SIMULATOR, pick, alignments, inline_device, the device's compute capability
    sim        the twins' machinery (warp rendezvous, async groups, mbarrier state, byte views)
    _llvm      the llvmlite helpers of the intrinsics

Shared-memory addresses are passed as (array, element offset): the 16 bytes at that element of the
array's memory. The ``*_at`` loads take a byte address instead, ``shared_base(array) + 2·offset``
(0-based in the simulator): a kernel that adds a compile-time offset last lets ptxas fold it into the
instruction (``[R+imm]``), where an element offset is scaled after every add. Arrays handed to
``ldmatrix_*`` / ``cp_async_*`` must be 16-byte aligned: declare shared arrays as
``cuda.shared.array(shape, dtype, alignment=SMEM_ALIGN)`` (``SMEM_ALIGN`` is None in the simulator,
which refuses an alignment argument).
"""
from . import copy, mem, mma, sim, target, tma, warp, warpgroup
from .copy import (
    cp_async_16, cp_async_16_zero_if, cp_async_16_zfill, cp_async_bulk, cp_async_commit, cp_async_wait,
    fence_mbarrier_init, mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_try_wait_parity,
)
from .mem import (
    bits_from_f32, ex2_approx, f16x2_to_f32, f32_from_bits, ld_global_nc_v4, ld_shared_f32x4, ld_shared_u32x4,
    ld_shared_v4, pack_bf16x2, pack_f16x2, red_add_f32, red_add_v2_f32, red_add_v4_f32, shared_base,
    st_global_f32, st_global_v2_f32, st_global_v4, st_shared_b32, st_shared_f32x4,
)
from .mma import (
    a_fragment_coords, b_fragment_coords, bf16_bits, bf16_value, c_fragment_coords, f16_bits, f16_value, halves,
    ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans, ldmatrix_x4_trans_at, mma_m16n8k8_tf32, mma_m16n8k16_bf16,
    mma_m16n8k16_f16, tf32_a_coords, tf32_b_coords, tf32_round, tf32_round_rn, tf32_value,
)
from .sim import warp_exchange
from .target import (
    FULL_MASK, SIMULATOR, SM90_ONLY, SMEM_ALIGN, WGMMA_ALIGN, compute_capability, current_sm90, current_wgmma,
    inline_device, pick,
)
from .warp import shfl_xor_sync, syncwarp
from .warpgroup import (
    WGMMA_SBO, WGMMA_SWIZZLE_128B, fence_proxy_async, wgmma, wgmma_commit, wgmma_desc_bits, wgmma_fence,
    wgmma_hold, wgmma_wait,
)

__all__ = [
    "SIMULATOR", "SM90_ONLY", "SMEM_ALIGN", "WGMMA_ALIGN", "FULL_MASK", "pick", "inline_device",
    "compute_capability", "current_sm90", "current_wgmma", "warp_exchange",
    "mma_m16n8k16_f16", "mma_m16n8k16_bf16", "mma_m16n8k8_tf32", "tf32_round", "tf32_round_rn",
    "ldmatrix_x4", "ldmatrix_x4_trans", "ldmatrix_x4_at", "ldmatrix_x4_trans_at",
    "a_fragment_coords", "b_fragment_coords", "c_fragment_coords", "tf32_a_coords", "tf32_b_coords", "tf32_value",
    "f16_bits", "bf16_bits", "f16_value", "bf16_value", "halves",
    "cp_async_16", "cp_async_16_zfill", "cp_async_16_zero_if", "cp_async_commit", "cp_async_wait",
    "mbarrier_init", "fence_mbarrier_init", "mbarrier_arrive_expect_tx", "mbarrier_try_wait_parity", "cp_async_bulk",
    "wgmma", "wgmma_hold", "wgmma_wait", "wgmma_fence", "wgmma_commit", "fence_proxy_async", "wgmma_desc_bits",
    "WGMMA_SBO", "WGMMA_SWIZZLE_128B",
    "shared_base", "pack_f16x2", "pack_bf16x2", "ex2_approx", "red_add_f32", "red_add_v2_f32", "red_add_v4_f32",
    "st_global_f32", "st_global_v2_f32", "st_shared_b32", "ld_shared_v4", "st_global_v4", "ld_global_nc_v4",
    "ld_shared_f32x4", "st_shared_f32x4", "ld_shared_u32x4", "f32_from_bits", "bits_from_f32", "f16x2_to_f32",
    "shfl_xor_sync", "syncwarp",
]
