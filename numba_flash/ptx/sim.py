"""The simulator's side of the twins.

Simulated threads are Python threads; what the hardware shares between them (a warp's registers in a
collective, a thread's queue of asynchronous copies or products, an mbarrier's phase) is kept here, and
memory is read and written as byte views checked the way the hardware would fault.
"""
import ctypes
import threading

import numpy as np


# --------------------------------------------------------------------------------------------
# Simulator plumbing: a per-warp rendezvous. Simulated threads are Python threads (BlockThread)
# that carry threadIdx/blockIdx and a per-block manager; warp collectives meet in a slot kept on
# that manager, so its state lives and dies with the block.
# --------------------------------------------------------------------------------------------
class _WarpRendezvous:
    """All ``lanes`` lanes (a warp: 32; a warpgroup: 128) deposit a value; the last to arrive runs
    ``combine`` once for the group."""

    def __init__(self, lanes=32):
        self.lanes = lanes
        self.cond = threading.Condition()
        self.values = [None] * lanes
        self.arrived = 0
        self.generation = 0
        self.result = None
        self.error = None
        self.op = None

    def exchange(self, lane, value, combine, op):
        thread = threading.current_thread()
        with self.cond:
            if self.arrived and self.op != op:
                raise RuntimeError(f"warp divergence: lane {lane} calls {op} while others call {self.op}")
            self.op = op
            generation = self.generation
            self.values[lane] = value
            self.arrived += 1
            if self.arrived == self.lanes:
                try:
                    self.result, self.error = None, None
                    self.result = combine(self.values)
                except Exception as e:  # every lane fails with it, not with a missing result
                    self.error = e
                    raise
                finally:
                    self.values, self.arrived, self.op = [None] * self.lanes, 0, None
                    self.generation += 1
                    self.cond.notify_all()
            while self.generation == generation:
                # Poll so that a crash elsewhere in the block (abort flag) does not hang us.
                self.cond.wait(timeout=0.05)
                if getattr(thread, "abort", False):
                    raise RuntimeError(f"lane {lane}: block aborted while waiting in {op}")
            if self.result is None and self.error is not None:
                raise RuntimeError(f"lane {lane}: {op} failed in another lane: {self.error}")
            return self.result[lane]


_slots_lock = threading.Lock()


def _lane_and_slot(lanes=32):
    thread = threading.current_thread()
    manager = thread._manager
    block = manager._block_dim
    nthreads = block[0] * block[1] * block[2]
    if nthreads % lanes:
        what = "warps" if lanes == 32 else f"groups of {lanes} threads"
        raise RuntimeError(f"this PTX needs whole {what}; block has {nthreads} threads")
    group, lane = divmod(thread.thread_id, lanes)
    with _slots_lock:
        slots = manager.__dict__.setdefault("_ptx_warp_slots", {})
        slot = slots.get((lanes, group))
        if slot is None:
            slot = slots[(lanes, group)] = _WarpRendezvous(lanes)
    return lane, slot


def warp_exchange(value, combine, op="exchange", lanes=32):
    """Twin helper: every lane of the warp (lanes=128: the warpgroup) passes value; returns
    combine(values_by_lane)[lane]."""
    lane, slot = _lane_and_slot(lanes)
    return slot.exchange(lane, value, combine, op)


def _numpy_of(array):
    """The NumPy array behind a simulator array (shared arrays already are NumPy)."""
    while not isinstance(array, np.ndarray):
        inner = array.__dict__  # FakeWithinKernelCUDAArray wraps _item, FakeCUDAArray wraps _ary
        array = inner["_item"] if "_item" in inner else inner["_ary"]
    return array


def _flat_bytes(array, offset, nbytes, what):
    """Byte view of nbytes at element offset of array's memory, checked like the hardware would."""
    ary = _numpy_of(array)
    if not (ary.flags.c_contiguous or (ary.ndim == 1 and ary.strides[0] == ary.itemsize)):
        raise ValueError(f"{what}: array must be C-contiguous (or a unit-stride row), got strides {ary.strides}")
    start = int(offset) * ary.itemsize
    if start % 16:
        raise ValueError(f"{what}: address not 16-byte aligned (element offset {offset}, itemsize {ary.itemsize})")
    flat = ary.reshape(-1).view(np.uint8)
    if start < 0 or start + nbytes > flat.size:
        raise IndexError(f"{what}: bytes [{start}, {start + nbytes}) outside an array of {flat.size} bytes")
    return flat[start : start + nbytes]


# Bytes an asynchronous copy writes at issue, before it lands: 0xFF reads as NaN in f16, bf16 and f32.
_POISON = 0xFF


class _AsyncGroups:
    """One simulated thread's queue of an asynchronous unit's operations (cp.async, wgmma), as the hardware
    keeps it: those issued since the last commit, then committed groups; retire(pending) runs each operation
    (a callable) of every group but the newest ``pending``, in issue order."""

    def __init__(self):
        self.open, self.committed = [], []

    def commit(self):
        self.committed.append(self.open)
        self.open = []

    def retire(self, pending):
        while len(self.committed) > pending:
            for land in self.committed.pop(0):
                land()


def _async_groups(unit):
    """The current simulated thread's _AsyncGroups of ``unit`` ("cp.async", "wgmma")."""
    state = threading.current_thread().__dict__
    groups = state.get(f"_ptx_{unit}")
    if groups is None:  # not setdefault: this runs for every simulated copy
        groups = state[f"_ptx_{unit}"] = _AsyncGroups()
    return groups


def _span_bytes(array, offset, nbytes, what):
    """Byte copy of nbytes at element offset from the array's data pointer, as the hardware reads it.

    Unlike _flat_bytes the array may be strided (a 4-D view of padded rows): the offset is flat
    from the first element, and the bytes must lie inside the memory the view spans.
    """
    ary = _numpy_of(array)
    if ary.flags.c_contiguous:
        return _flat_bytes(array, offset, nbytes, what)
    start = int(offset) * ary.itemsize
    if start % 16:
        raise ValueError(f"{what}: address not 16-byte aligned (element offset {offset}, itemsize {ary.itemsize})")
    low, high = np.lib.array_utils.byte_bounds(ary)
    address = ary.ctypes.data + start
    if address < low or address + nbytes > high:
        raise IndexError(f"{what}: bytes [{start}, {start + nbytes}) outside the {high - low} bytes the array spans")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


# One _MBarrier per (block, address). A wait that never completes (wrong parity, a missing arrive)
# raises after MBARRIER_WAIT_LIMIT_S instead of hanging the simulator.
_MBAR_LOCK = threading.Lock()
MBARRIER_WAIT_LIMIT_S = 20.0


class _MBarrier:
    def __init__(self, count):
        self.count = self.pending = int(count)
        self.tx = 0
        self.phase = 0  # completed phases
        self.copies = []

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


def _mbarrier_key(bar, bar_offset):
    ary = _numpy_of(bar)
    start = int(bar_offset) * ary.itemsize
    if start % 8:
        raise ValueError(f"mbarrier: address not 8-byte aligned (element offset {bar_offset}, itemsize {ary.itemsize})")
    return ary.ctypes.data + start


def _mbarriers():
    manager = threading.current_thread()._manager
    with _slots_lock:
        return manager.__dict__.setdefault("_ptx_mbarriers", {})


def _mbarrier(bar, bar_offset, what):
    found = _mbarriers().get(_mbarrier_key(bar, bar_offset))
    if found is None:
        raise RuntimeError(f"{what}: mbarrier at element offset {bar_offset} used before mbarrier.init")
    return found

