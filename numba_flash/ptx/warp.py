"""Warp shuffles and __syncwarp: the simulator has neither, so the twins meet through sim.warp_exchange."""
from numba import cuda

from .sim import warp_exchange
from .target import FULL_MASK, inline_device, pick


def _shfl_xor_sync_twin(mask, value, lane_mask):
    if int(mask) != FULL_MASK:
        raise NotImplementedError("the shfl_xor_sync twin supports only the full-warp mask")
    return warp_exchange(value, lambda vals: [vals[lane ^ int(lane_mask)] for lane in range(32)], "shfl_xor")


def _syncwarp_twin(mask=FULL_MASK):
    """__syncwarp(): the 32 lanes meet (the simulator has no syncwarp)."""
    if int(mask) != FULL_MASK:
        raise NotImplementedError("the syncwarp twin supports only the full-warp mask")
    warp_exchange(0, lambda vals: vals, "syncwarp")


@inline_device
def _syncwarp_device():  # cuda.syncwarp is a typing stub, callable only as an attribute of cuda
    cuda.syncwarp()


shfl_xor_sync = pick(getattr(cuda, "shfl_xor_sync", None), _shfl_xor_sync_twin)  # the simulator's cuda has none
syncwarp = pick(_syncwarp_device, _syncwarp_twin)
