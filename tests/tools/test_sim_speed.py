"""tests/sim_speed.py, the simulator's event-driven block manager: installed, and barriers, barrier
counts and a thread's exception behave as in numba-cuda's own manager."""
import os

import numpy as np
import pytest
from numba import config, cuda

pytestmark = pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="the CUDA simulator only")


def test_installed():
    from numba.cuda.simulator import kernel as sim

    if os.environ.get("NUMBA_FLASH_SIM_SPEEDUP", "1") == "1":
        assert sim.BlockManager.run.__module__ == "sim_speed"  # numba-cuda changed shape if this fails


def test_barriers_order_shared_memory(rng):
    @cuda.jit
    def rotate(x, out, rounds):
        s = cuda.shared.array(64, np.float32)
        i = cuda.threadIdx.x
        s[i] = x[cuda.blockIdx.x, i]
        cuda.syncthreads()
        for _ in range(rounds):
            v = s[(i + 1) % 64]
            cuda.syncthreads()  # every read of this round before any write
            s[i] = v + 1
            cuda.syncthreads()
        out[cuda.blockIdx.x, i] = s[i]
        n = cuda.syncthreads_count(i % 3 == 0)
        if i == 0:
            out[cuda.blockIdx.x, 64] = n

    x = rng.integers(-1000, 1000, (3, 64)).astype(np.float32)  # integers: the +1s are exact
    out = np.zeros((3, 65), np.float32)
    rotate[3, 64](x, out, 5)
    np.testing.assert_array_equal(out[:, :64], np.roll(x, -5, axis=1) + 5)
    assert (out[:, 64] == 22).all()  # 0, 3, ..., 63


def test_a_thread_exception_is_raised():
    @cuda.jit
    def bad(out):
        i = cuda.threadIdx.x
        cuda.syncthreads()
        out[i + 1] = 1.0  # thread 31 writes past the end

    with pytest.raises(IndexError):
        bad[1, 32](np.zeros(32, np.float32))
