"""A faster block manager for Numba's CUDA simulator (tests only; numba-cuda 0.30.x).

The simulator runs each thread of a block as a Python thread, and its BlockManager.run polls them
in a busy loop to release syncthreads barriers. That loop holds the GIL in 5 ms slices (the
interpreter's switch interval), so a simulated thread that wakes up waits for it: every lane of a
warp-wide tensor-core twin (a 32-lane rendezvous, numba_flash.ptx) paid up to 5 ms per call. This
version does what the original does, in the same order, but sleeps between polls while nothing
changes (backing off from 10 µs to 1 ms), so the simulated threads get the GIL when they want it.
Installed by conftest.py when the simulator is on; if numba-cuda's simulator changed shape, it is
left alone (tests are then slower, not wrong).
"""
from __future__ import annotations

import time

import numpy as np

MIN_PAUSE, MAX_PAUSE = 1e-5, 1e-3


def install() -> bool:
    try:
        from numba.cuda.simulator import kernel as sim
    except ImportError:
        return False
    if not (hasattr(sim, "BlockManager") and hasattr(sim, "BlockThread")
            and hasattr(sim.BlockManager, "run")):
        return False
    thread_cls = sim.BlockThread

    def run(self, grid_point, *args):
        threads = []
        for block_point in np.ndindex(*self._block_dim):

            def target():
                self._f(*args)

            t = thread_cls(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.append(t)
        live, blocked = set(threads), set()
        pause = 0.0
        while live:
            changed = False
            for t in live:
                if t.syncthreads_blocked:
                    changed |= t not in blocked
                    blocked.add(t)
                elif t.exception:  # abort the others, as the original does
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if live == blocked:  # every live thread waits at the barrier: release them
                for t in blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blocked = set()
                changed = True
            still = {t for t in live if t.is_alive()}
            changed |= len(still) != len(live)
            live = still
            pause = 0.0 if changed else min(max(2 * pause, MIN_PAUSE), MAX_PAUSE)
            time.sleep(pause)  # sleep(0) still lets a waiting thread take the GIL
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    sim.BlockManager.run = run
    return True
