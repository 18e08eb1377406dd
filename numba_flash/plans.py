"""Plans: a repeated call skips validation and planning (host time per call, benchmarks/DESIGN.md).

``forward``, ``decode`` and ``backward`` check their inputs, choose a kernel and a tile config,
allocate the outputs, view the arrays and pack ~100 kernel parameters: 45-75 us of Python per call
while the GPU waits (a decode step that the kernels finish in 45 us looks twice as long). A second
call with the same *signature* (the same kinds of arrays, shapes, strides, dtypes, device, 16-byte
alignment of each pointer, and the same other arguments) makes every one of those decisions the
same way; only the data pointers differ. So the first call of a signature runs the ordinary path
while this module watches it (the launches and their parameters, the allocations, the warning it
gives) and keeps what it saw as a ``Plan``. A later call of that signature reads the data pointers,
allocates the outputs, copies each launch's pre-packed parameter bytes into the kernel's slot
buffer, writes the pointer slots, and launches.

Why a hit is safe:
- The key holds everything the checks and choices read: per array its Python type, dtype, shape,
  strides, device and ``pointer % 16`` (cp.async paths need 16-byte aligned rows; alignment, unlike
  shape, can change between calls, so it is in the key); which arguments are the same object (the
  plan finds its pointers by object); the other arguments with their types (``causal=1`` raises,
  ``causal=True`` does not, and ``1 == True`` in a dict). A call that raises stores nothing, so
  the same input raises again, from the same check.
- Every array parameter of every watched launch must point into an argument or an allocation of
  the call, at a fixed byte offset; otherwise the signature is marked uncacheable and keeps taking
  the ordinary path (degenerate backward shapes). Zero-filled scratch (deterministic=False) is an
  allocation like the outputs: a plan allocates and zeroes it again per call, as the ordinary path
  does (``arrays.zeros_like_kind``).
- A plan is published only after its first call has launched (shared-memory opt-in done), and its
  launches go through the same cuLaunchKernel and per-thread slot buffers as ``launch.launch``.
- A plan replays on the device its first call launched on (else the ordinary path runs), the
  stream is the framework's current one at each call, and allocations go through the same
  ``arrays`` function with the same arguments. A thread with no current CUDA context (PyTorch's
  autograd runs ``loss.backward()`` on its own device threads, which bind no driver context)
  replays inside the plan's device's context, as the ordinary path's ``_on_device`` would run
  (otherwise every such call misses: 0.6 ms of host time per fp16 backward).

Plans see launches through ``launch.launch`` only: code that replaces a kernel module's
``launch_kernel`` (tests comparing with Numba's dispatcher) must turn plans off first, or the
plan it records launches nothing.

Not cached (the ordinary path, unchanged): NumPy arrays anywhere (copied, and checked by value, per
call), the CUDA simulator (no parameter buffers), inputs on a device that is not the current one
(the ordinary path switches context). At most MAX_PLANS signatures, the oldest dropped first
(FIFO, so that a hit is one lock-free dict read).
``NUMBA_FLASH_PLAN_CACHE=0`` in the environment, or ``set_enabled(False)``, turns plans off.
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading
import warnings

from numba import config as nb_config
from numba import cuda

from . import arrays
from . import launch as _launch
from .kernels.decode import DecodeConfig
from .launch import DeviceView, current_device_id, recording

MAX_PLANS = 256
# Other arguments that may be part of a key: plain immutable values (and the decode tile config, a
# frozen dataclass). Anything else (a NumPy bool, a 0-d array) takes the ordinary path.
_OPTION_TYPES = frozenset({bool, int, float, str, type(None), DecodeConfig})

_plans: dict = {}  # key -> Plan, or False for an uncacheable signature; insertion order = age
_lock = threading.Lock()  # for inserting and evicting; lookups are single dict reads
_state = {"enabled": os.environ.get("NUMBA_FLASH_PLAN_CACHE", "1") != "0", "hits": 0, "misses": 0}
_KINDS: dict = {}  # Python type -> arrays kind, for the types whose kind the type alone decides


def set_enabled(enabled: bool) -> None:
    """Turn plans on or off for the whole process (off: every call takes the ordinary path)."""
    _state["enabled"] = bool(enabled)


def clear() -> None:
    with _lock:
        _plans.clear()
        _state["hits"] = _state["misses"] = 0


def cache_info() -> dict:
    """enabled, size, max, uncacheable signatures, hits and misses (counted without a lock: approximate
    under threads)."""
    return {"enabled": _state["enabled"], "size": len(_plans), "max": MAX_PLANS,
            "uncacheable": sum(p is False for p in list(_plans.values())),
            "hits": _state["hits"], "misses": _state["misses"]}


def call(entry, args: tuple, options: tuple):
    """``entry(*args, *options)``, through a plan when there is one for this signature.

    args: the array arguments, q first (None where an optional one is absent); options: the other
    arguments, in ``entry``'s order. ``entry`` is the uncached function (api._forward, ...).
    """
    found = _key(entry, args, options) if _state["enabled"] else None
    if found is None:
        return entry(*args, *options)
    key, ptrs = found
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable attribute of some array-like object: no plan for it
        return entry(*args, *options)
    if plan:
        result = plan.run(args, ptrs)
        if result is not None:
            _state["hits"] += 1
            return result
    if plan is not None:  # uncacheable, or inputs not on the current device
        return entry(*args, *options)
    _state["misses"] += 1
    recording.launches, recording.allocations, recording.warnings, recording.derived = [], [], [], {}
    try:
        result = entry(*args, *options)
        watched = recording.launches, recording.allocations, recording.warnings, recording.derived
    finally:
        recording.launches = recording.allocations = recording.warnings = recording.derived = None
    try:
        plan = Plan.build(args, ptrs, result, *watched)
    except Exception as e:  # a bug here must not cost the user a result the ordinary path computed
        warnings.warn(f"numba_flash.plans: no plan for this call ({type(e).__name__}: {e}); it keeps "
                      "taking the ordinary path", RuntimeWarning, stacklevel=3)
        plan = None
    with _lock:
        while len(_plans) >= MAX_PLANS:
            del _plans[next(iter(_plans))]
        _plans[key] = plan or False
    return result


def warn(message: str, category) -> None:
    """``warnings.warn`` pointing at the user's call of forward/decode/backward (frames: warn <- the
    uncached entry <- call <- the public function <- user); a plan gives it again on every hit."""
    watched = getattr(recording, "warnings", None)
    if watched is not None:
        watched.append((message, category))
    warnings.warn(message, category, stacklevel=5)


# --- the key ---------------------------------------------------------------------------------------


def _key(entry, args: tuple, options: tuple):
    """(key, data pointers of args) or None when this call takes the ordinary path."""
    if nb_config.ENABLE_CUDASIM:
        return None
    for o in options:
        if type(o) not in _OPTION_TYPES:
            return None
    first: dict = {}  # id(array) -> position of its first occurrence: which arguments are one object
    parts, ptrs = [entry, tuple(map(type, options)), options], []
    try:
        for i, x in enumerate(args):
            if x is None:
                parts.append(None)
                ptrs.append(0)
                continue
            found = _signature(x)
            if found is None:
                return None
            parts.append((first.setdefault(id(x), i), found[0]))
            ptrs.append(found[1])
    except Exception:  # an object the checks would refuse: let them say so
        return None
    return tuple(parts), ptrs


def _signature(x):
    """(what the checks read of a device array, its data pointer), or None (NumPy, not an array)."""
    kind = _KINDS.get(type(x)) or arrays.kind_of(x)
    if kind == arrays.TORCH:
        _KINDS[type(x)] = kind
        ptr = x.data_ptr()
        return (type(x), x.dtype, x.shape, x.stride(), x.device, ptr & 15), ptr
    if kind == arrays.CUPY:
        _KINDS[type(x)] = kind
        ptr = x.data.ptr
        return (type(x), x.dtype, x.shape, x.strides, x.device.id, ptr & 15), ptr
    if kind in (arrays.NUMBA, arrays.CAI):  # validation reads .dtype and .shape, the view the interface
        cai = x.__cuda_array_interface__
        ptr = cai["data"][0] or 0
        strides = cai.get("strides")
        return (type(x), str(x.dtype), tuple(x.shape), cai["typestr"], tuple(cai["shape"]),
                strides and tuple(strides), cai.get("mask") is None, ptr & 15), ptr
    return None


# --- plans -----------------------------------------------------------------------------------------


class _Step:
    """One watched launch: its kernel, grid, block, shared memory, the parameter bytes as packed for
    the first call, and the slots to rewrite per call: (slot, buffer, byte offset), where buffer
    indexes the call's pointers (arguments, then allocations); and the arguments computed from the call's
    arrays (launch.derived): (slot, sources as (buffer, byte offset, shape, strides, dtype, extra), rebuild)."""

    __slots__ = ("dispatcher", "launcher", "grid", "block", "shared_bytes", "template", "patches", "args",
                 "rebuilds")

    def rebuilt(self, ptrs: list, stream) -> list:
        """(slot, view) of each derived argument, rebuilt from this call's arrays."""
        out = []
        for slot, sources, rebuild in self.rebuilds:
            specs = [(DeviceView(ptrs[buffer] + offset, shape, strides, dtype), extra)
                     for buffer, offset, shape, strides, dtype, extra in sources]
            out.append((slot, rebuild(specs, stream)))
        return out

    def launch(self, ptrs: list, stream, device_id) -> None:
        fresh = self.rebuilt(ptrs, stream) if self.rebuilds else ()
        if _launch._RAW["ok"]:
            cufunc = _launch.function(self.launcher, device_id, self.shared_bytes)
            slots, pointers = self.launcher.buffers()  # this thread's, shared with launch.launch
            ctypes.memmove(slots, self.template, len(self.template))
            for slot, buffer, offset in self.patches:
                slots[slot] = ptrs[buffer] + offset
            for slot, view in fresh:
                slots[slot] = view.ptr
            _launch.raw_launch(cufunc, self.grid, self.block, self.shared_bytes, stream, pointers)
        else:  # the cuda.core fallback: the ordinary launch, on views at this call's pointers
            _launch.launch(self.dispatcher, self.grid, self.block, stream, self.shared_bytes,
                           *self.views(ptrs, fresh))

    def views(self, ptrs: list, fresh=()) -> list:
        """The watched arguments with each array moved to this call's pointer (derived ones: ``fresh``)."""
        args = list(self.args)
        for slot, buffer, offset in self.patches:
            i = self.launcher.data_slots.index(slot)
            a = args[i]
            args[i] = DeviceView(ptrs[buffer] + offset, a.shape, a.strides, a.dtype)
        for slot, view in fresh:
            args[self.launcher.data_slots.index(slot)] = view
        return args


class Plan:
    """What one call of a signature did, to be done again for new pointers."""

    __slots__ = ("kind", "device", "allocations", "steps", "result", "warnings")

    def run(self, args: tuple, ptrs: list):
        """The call's result (the same objects the ordinary path returns), or None to take that path."""
        device_id = current_device_id()
        if device_id is None and self.device is not None:  # no context in this thread: the device's
            with cuda.gpus[self.device]:
                return self._run(args, ptrs, self.device)
        if device_id != self.device:
            return None  # the ordinary path: it makes the inputs' device current, or chooses for this one
        return self._run(args, ptrs, device_id)

    def _run(self, args: tuple, ptrs: list, device_id: int):
        for message, category in self.warnings:
            warnings.warn(message, category, stacklevel=5)  # _run <- run <- call <- public function <- user
        stream = arrays.current_stream(args[0], self.kind)
        objs = []
        for kind, ref, shape, dtype, zeroed in self.allocations:
            obj, ptr = arrays.allocate(kind, args[ref], shape, dtype, stream, zeroed)
            objs.append(obj)
            ptrs.append(ptr)
        for step in self.steps:
            step.launch(ptrs, stream, device_id)
        return tuple(objs[i] for i in self.result)

    @classmethod
    def build(cls, args, ptrs, result, launches, allocations, warned, derived=None):
        """The plan of a watched call, or None if some launch reads memory the plan cannot place."""
        n_args = len(args)
        where = {}  # id(object) -> index into the call's pointers
        for i, x in enumerate(args):
            if x is not None:
                where.setdefault(id(x), i)
        base = list(ptrs)
        plan = cls()
        plan.allocations = []
        for obj, view, (kind, ref, shape, dtype, zeroed) in allocations:
            ref_index = where.get(id(ref))
            if ref_index is None or ref_index >= n_args or not isinstance(view, DeviceView):
                return None
            where[id(obj)] = len(base)
            base.append(view.ptr)
            plan.allocations.append((kind, ref_index, shape, dtype, zeroed))
        if not isinstance(result, tuple) or any(where.get(id(r), -1) < n_args for r in result):
            return None  # results that are not this call's allocations (zeros, host copies)
        plan.result = tuple(where[id(r)] - n_args for r in result)
        plan.steps = []
        stream = arrays.current_stream(args[0])
        for dispatcher, grid, block, launch_stream, shared_bytes, largs in launches:
            if launch_stream != stream:
                return None
            step = _Step()
            step.dispatcher, step.launcher = dispatcher, _launch.launcher_of(dispatcher)
            # the arguments without their owners: a plan must not keep its first call's arrays alive
            step.args = tuple(DeviceView(a.ptr, a.shape, a.strides, a.dtype) if isinstance(a, DeviceView) else a
                              for a in largs)
            step.grid = tuple(int(n) for n in ((grid if isinstance(grid, tuple) else (grid,)) + (1, 1))[:3])
            step.block = tuple(int(n) for n in ((block if isinstance(block, tuple) else (block,)) + (1, 1))[:3])
            step.shared_bytes = int(shared_bytes)
            try:
                step.template = step.launcher.template(largs)
            except (struct.error, OverflowError, TypeError):
                return None
            step.patches, step.rebuilds = [], []
            for a, slot in zip(largs, step.launcher.data_slots):
                if slot is None:
                    continue
                if not isinstance(a, DeviceView):
                    return None
                buffer = where.get(id(a.owner))
                if buffer is None and derived and id(a.owner) in derived:  # rebuilt per call from its sources
                    sources, rebuild = derived[id(a.owner)]
                    placed = []
                    for src, extra in sources:
                        b = where.get(id(src.owner)) if isinstance(src, DeviceView) else None
                        if b is None:
                            return None
                        placed.append((b, src.ptr - base[b], src.shape, src.strides, src.dtype, extra))
                    step.rebuilds.append((slot, tuple(placed), rebuild))
                    continue
                if buffer is None:
                    if a.ptr == 0 and a.owner is None:
                        continue  # a placeholder the kernel never reads (decode without lengths)
                    return None
                step.patches.append((slot, buffer, a.ptr - base[buffer]))
            step.patches, step.rebuilds = tuple(step.patches), tuple(step.rebuilds)
            plan.steps.append(step)
        # The device the launches ran on: the inputs' (the ordinary path makes it current), or for
        # arrays that do not say (Numba, __cuda_array_interface__) the current one, whose compute
        # capability and SM count the kernel choice and the split count were taken from.
        devices = [arrays.device_of(x) for x in args if x is not None]
        plan.device = next((d for d in devices if d is not None), None)
        if plan.device is None:
            plan.device = current_device_id()
        plan.warnings = tuple(warned)
        plan.kind = arrays.kind_of(args[0])
        return plan
