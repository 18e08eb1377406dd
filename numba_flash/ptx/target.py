"""Which machine the intrinsics are built for: the CUDA simulator or a GPU, and which GPU.

Every intrinsic of this package has a twin, a Python function that computes the same thing for one
simulated thread. ``pick`` chooses between the two, once, beside each definition.
"""
import functools

from numba import config, cuda
from numba.cuda.extending import register_jitable

SIMULATOR = bool(config.ENABLE_CUDASIM)
SM90_ONLY = "red.global.add.v2/.v4.f32, cp.async.bulk, mbarrier expect_tx"  # what needs sm_90+ (mem, copy)
SMEM_ALIGN = None if SIMULATOR else 16  # ldmatrix rows and cp.async targets are 16-byte aligned
WGMMA_ALIGN = None if SIMULATOR else 1024  # wgmma's 128-byte swizzle works on 1024-byte aligned addresses
FULL_MASK = 0xFFFFFFFF


def pick(intrinsic, twin):
    """The public name of an intrinsic: ``twin`` under the simulator (NUMBA_ENABLE_CUDASIM=1), else ``intrinsic``."""
    return twin if SIMULATOR else intrinsic


# --------------------------------------------------------------------------------------------
# Which GPU the intrinsics are for: vector red and the bulk copy exist from sm_90 on (ptxas rejects
# them for sm_80-89), so kernels that use them pick a fallback below it.
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _compute_capability_of(device_id: int) -> tuple:  # one driver query per device, not per call
    return tuple(cuda.gpus[device_id].compute_capability)


def compute_capability(device_id: int | None = None) -> tuple:
    """(major, minor) of a device (default: the current one)."""
    return _compute_capability_of(cuda.get_current_device().id if device_id is None else device_id)


def current_wgmma() -> bool:
    """True when the current device has wgmma (sm_90a: compute capability 9.x; not sm_80-89, and not sm_100+,
    where wgmma is gone). The simulator: True (its twins have it)."""
    return SIMULATOR or compute_capability()[0] == 9


def current_sm90() -> bool:
    """True when the current device is sm_90 or newer (the simulator: True, its twins have all)."""
    return SIMULATOR or compute_capability() >= (9, 0)


# --------------------------------------------------------------------------------------------
# Device helpers for kernels, callable from a kernel like any function: compiled as device
# functions and inlined by NVVM (so fragment arrays passed to them still become registers).
# Unlike a plain cuda.jit(device=True) function, register_jitable is also an ordinary Python
# function in the simulator.
# --------------------------------------------------------------------------------------------
def inline_device(fn):
    return register_jitable(inline="never")(fn)

