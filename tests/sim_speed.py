"""A faster block manager for Numba's CUDA simulator (tests only; numba-cuda 0.30.x).

The simulator runs each thread of a block as a Python thread, and its BlockManager.run polls them
in a busy loop to release syncthreads barriers. That loop holds the GIL in 5 ms slices (the
interpreter's switch interval), so a simulated thread that wakes up waits for it: every lane of a
warp-wide tensor-core twin (a 32-lane rendezvous, numba_flash.ptx) paid up to 5 ms per call.

This version makes the same decisions in the same order (release a barrier when every live thread
waits at it; on a thread's exception abort the others and re-raise), but sleeps between scans
until a thread reports something: a thread arriving at syncthreads or finishing bumps a counter
under a condition the manager waits on (with a 1 ms timeout as a safety net). Installed by
conftest.py when the simulator is on; if numba-cuda's simulator has changed shape it is left alone
(tests are then slower, not wrong). NUMBA_FLASH_SIM_SPEEDUP=0 turns it off.
"""
from __future__ import annotations

import threading

import numpy as np

SAFETY_TIMEOUT = 1e-3  # s: a missed wake-up costs at most this


def _event(manager):
    """Tell the block's manager that a thread blocked or finished."""
    cond = manager.__dict__.get("_sim_cond")
    if cond is not None:
        with cond:
            manager._sim_events += 1
            cond.notify()


def install() -> bool:
    try:
        from numba.cuda.simulator import kernel as sim
    except ImportError:
        return False
    thread_cls, manager_cls = getattr(sim, "BlockThread", None), getattr(sim, "BlockManager", None)
    if thread_cls is None or manager_cls is None or not all(
            hasattr(thread_cls, name) for name in ("syncthreads", "run")) or not hasattr(manager_cls, "run"):
        return False

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        self.syncthreads_blocked = True
        _event(self._manager)
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run(self, grid_point, *args):
        cond = self._sim_cond = threading.Condition()
        self._sim_events = 0
        threads = []
        for block_point in np.ndindex(*self._block_dim):

            def target():
                try:
                    self._f(*args)
                finally:
                    _event(self)

            t = thread_cls(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.append(t)
        live, blocked = set(threads), set()
        while live:
            with cond:
                seen = self._sim_events
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
            if live and not changed:
                with cond:
                    if self._sim_events == seen:  # nothing reported since the scan began
                        cond.wait(SAFETY_TIMEOUT)
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    thread_cls.syncthreads = syncthreads
    manager_cls.run = run
    return True
