"""Kernel launches without Numba's per-call array machinery.

Numba's dispatcher wraps every device argument in a ``DeviceNDArray`` (for objects with
``__cuda_array_interface__`` that is a driver query, a memory-pointer object and a finalizer
each), types it, then flattens it into the kernel's parameter list. With five to nine array
arguments per launch that Python work was 0.3-0.6 ms per ``forward`` call on the H200
(benchmarks/DESIGN.md), longer than the kernel itself at N = 1024.

Every kernel here is compiled eagerly for one signature, so the types are known in advance.
``DeviceView`` holds what the kernel needs of an array (pointer, shape, byte strides, dtype),
read straight from PyTorch / CuPy / the interface dict, and ``launch`` flattens views into
Numba's array ABI: (meminfo, parent, size, itemsize, data, *shape, *strides), checked against
the compiled signature (dtype, ndim) so a wrong argument raises instead of reading garbage.

Under the CUDA simulator there is no ABI: ``launch`` calls the dispatcher as usual, with the
simulator's own arrays (``arrays.to_device_view`` returns those there).
"""
from __future__ import annotations

import ctypes
import math
import struct
import threading
import warnings
from typing import Any

import numpy as np
from numba import config as nb_config

from .configs import SMEM_STATIC_MAX

_TORCH_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,  # bf16 as its bits
                 "float64": np.float64, "int32": np.int32, "int64": np.int64, "int16": np.int16,
                 "uint16": np.uint16, "uint8": np.uint8, "int8": np.int8, "bool": np.bool_}
_TORCH_VIEW_DTYPES: dict = {}  # torch dtype -> np.dtype of its view, filled by view_of


class DeviceView:
    """A strided device array as a kernel sees it; ``owner`` keeps the memory alive."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "owner")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype, owner: Any = None):
        self.ptr, self.shape, self.strides = int(ptr), tuple(shape), tuple(strides)
        self.dtype, self.owner = np.dtype(dtype), owner
        if len(self.strides) != len(self.shape):
            raise ValueError(f"strides {self.strides} do not match shape {self.shape}")

    def __repr__(self) -> str:
        return f"DeviceView(ptr=0x{self.ptr:x}, shape={self.shape}, strides={self.strides}, dtype={self.dtype})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict:  # lets Numba, CuPy or PyTorch read a view too
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.ptr, False), "version": 3}

    def is_c_contiguous(self) -> bool:
        if self.size == 0:
            return True
        expect = self.dtype.itemsize
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and st != expect:
                return False
            expect *= n
        return True

    def view(self, dtype) -> "DeviceView":
        """The same bytes as another dtype of the same size (f16 or bf16 as uint16 words)."""
        dtype = np.dtype(dtype)
        if dtype.itemsize != self.dtype.itemsize:
            raise ValueError(f"cannot view {self.dtype} as {dtype}: item sizes differ")
        return DeviceView(self.ptr, self.shape, self.strides, dtype, self.owner)

    def reshape(self, shape: tuple) -> "DeviceView":
        """A C-contiguous view with another shape (fresh outputs only: no copies are made here)."""
        shape = tuple(int(n) for n in shape)
        if math.prod(shape) != self.size or not self.is_c_contiguous():
            raise ValueError(f"cannot view {self!r} as shape {shape} without a copy")
        return DeviceView(self.ptr, shape, c_strides(shape, self.dtype.itemsize), self.dtype, self.owner)

    def leading(self, ndim: int) -> "DeviceView":
        """View as ``ndim`` dims by adding unit dims in front (their strides are never used)."""
        lead = ndim - self.ndim
        if lead < 0:
            raise ValueError(f"{self!r} has more than {ndim} dims")
        return DeviceView(self.ptr, (1,) * lead + self.shape, (0,) * lead + self.strides, self.dtype, self.owner)


def c_strides(shape: tuple, itemsize: int) -> tuple:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def view_of(x: Any, kind: str) -> DeviceView:
    """A DeviceView of a device array; kind is ``arrays.kind_of(x)`` (torch, cupy or any CAI)."""
    if kind == "torch":
        dtype = _TORCH_VIEW_DTYPES.get(x.dtype)
        if dtype is None:  # once per torch dtype: str() of it and a NumPy lookup cost more than the view
            dtype = _TORCH_VIEW_DTYPES[x.dtype] = np.dtype(_TORCH_DTYPES[str(x.dtype).replace("torch.", "")])
        item = dtype.itemsize
        return DeviceView(x.data_ptr(), tuple(x.shape), tuple(s * item for s in x.stride()), dtype, x)
    if kind == "cupy":
        return DeviceView(x.data.ptr, x.shape, x.strides, x.dtype, x)
    cai = x.__cuda_array_interface__
    if cai.get("mask") is not None:
        raise ValueError("arrays with a __cuda_array_interface__ mask are not supported")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    strides = cai.get("strides") or c_strides(shape, dtype.itemsize)
    return DeviceView(cai["data"][0] or 0, shape, strides, dtype, x)


def unused_slopes(lse: Any) -> Any:
    """A (1, 1) float32 view of lse's first element: the slopes argument of a kernel built without ALiBi,
    never read (a view of the call's own output, so plans find its pointer)."""
    if isinstance(lse, DeviceView):
        return DeviceView(lse.ptr, (1, 1), (4, 4), np.float32, lse.owner)
    return lse[(0,) * (lse.ndim - 2)][:1, :1]  # simulator arrays


def address(x: Any) -> int:
    """Device address of x's first element (simulator arrays: the host address of their data)."""
    if isinstance(x, DeviceView):
        return x.ptr
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is None:  # simulator arrays wrap a NumPy array
        from . import ptx

        return ptx.sim._numpy_of(x).ctypes.data
    return iface["data"][0] or 0


# --- the launch ------------------------------------------------------------------------------------


class _Launcher:
    """Flattens DeviceViews and scalars into the parameter list of one compiled kernel."""

    def __init__(self, dispatcher):
        from numba.cuda import types

        overloads = list(dispatcher.overloads.values())
        if len(overloads) != 1:
            raise ValueError(f"expected one compiled signature, found {len(overloads)}")
        self.compiled = overloads[0]
        self.cufuncs: dict = {}  # device id -> loaded function
        self.smem_opt_in: dict = {}  # device id -> dynamic shared bytes this kernel may use there
        self.params = []  # per argument: ("array", np.dtype, ndim) or ("scalar", ctypes type)
        self.data_slots = []  # per argument: index of the 8-byte slot holding an array's data pointer, or None
        fmt = "<"  # the 8-byte slots of flatten(raw=True) as one struct layout, for pack()
        for ty in self.compiled.argument_types:
            slot = struct.calcsize(fmt) // 8  # every field is 8 bytes: the next free slot
            if isinstance(ty, types.Array):
                if ty.layout != "A":  # views carry any strides; a C/F signature would need checks here
                    raise TypeError(f"launch: array argument {ty} must have layout 'A'")
                self.params.append(("array", np.dtype(str(ty.dtype)), ty.ndim))
                self.data_slots.append(slot + 4)
                fmt += "16xqqQ" + "q" * (2 * ty.ndim)  # meminfo, parent (0), nitems, itemsize, data, shape, strides
                continue
            self.data_slots.append(None)
            if isinstance(ty, types.Integer):
                ctype = getattr(ctypes, f"c_{ty}")
                self.params.append(("scalar", ctype))
                fmt += _slot_format(_INT_CODES[ty.signed][ctypes.sizeof(ctype)])
            elif ty == types.float32:
                self.params.append(("scalar", ctypes.c_float))
                fmt += _slot_format("f")
            elif ty == types.float64:
                self.params.append(("scalar", ctypes.c_double))
                fmt += _slot_format("d")
            else:
                raise TypeError(f"launch: argument type {ty} is not handled")
        self.layout = struct.Struct(fmt)
        self._buffers = threading.local()  # this thread's reusable (slots, pointers), see pack()

    def flatten(self, args, raw: bool = False) -> list:
        """Numba's parameter list: per array (meminfo, parent, nitems, itemsize, data, *shape,
        *strides) as Python ints; per scalar a ctypes value of the compiled type, or with ``raw``
        the int whose low 4 or 8 little-endian bytes are that value (one cuLaunchKernel slot)."""
        if len(args) != len(self.params):
            raise TypeError(f"kernel takes {len(self.params)} arguments; got {len(args)}")
        flat = []
        for i, (param, a) in enumerate(zip(self.params, args)):
            if param[0] == "scalar":
                value = param[1](a)
                flat.append(int.from_bytes(bytes(value), "little") if raw else value)
                continue
            if not isinstance(a, DeviceView):
                a = view_of(a, "cai")
            if a.dtype != param[1] or a.ndim != param[2]:
                raise TypeError(f"kernel argument {i}: expected a {param[2]}-d {param[1]} array; "
                                f"got {a.ndim}-d {a.dtype}")
            flat += [0, 0, a.size, a.dtype.itemsize, a.ptr, *a.shape, *a.strides]
        return flat

    def pack(self, args):
        """``param_buffer(flatten(args, raw=True))[1]`` without building ctypes arrays per call (they
        cost ~20 us at 100 slots): the values go by one struct.pack_into into this thread's slot
        buffer, whose pointer array is made once. cuLaunchKernel copies the parameters before it
        returns, so the next launch may overwrite them. Raises struct.error / OverflowError for a
        scalar its type cannot hold (launch then takes flatten's ctypes conversion instead)."""
        slots, pointers = self.buffers()
        self.layout.pack_into(slots, 0, *self._values(args))
        return pointers

    def template(self, args) -> bytes:
        """The bytes ``pack`` writes into the slots (a plan's pre-packed parameters, see plans.py)."""
        return self.layout.pack(*self._values(args))

    def buffers(self):
        """This thread's (slots, pointers): uint64 slots and the ``void **`` array pointing at them."""
        pair = getattr(self._buffers, "pair", None)
        if pair is None:
            pair = self._buffers.pair = param_buffer([0] * (self.layout.size // 8))
        return pair

    def _values(self, args) -> list:
        """The values of the slots in layout order (what ``flatten(raw=True)`` holds, scalars unconverted)."""
        if len(args) != len(self.params):
            raise TypeError(f"kernel takes {len(self.params)} arguments; got {len(args)}")
        values = []
        for i, (param, a) in enumerate(zip(self.params, args)):
            if param[0] == "scalar":
                values.append(a)
                continue
            if not isinstance(a, DeviceView):
                a = view_of(a, "cai")
            if a.dtype != param[1] or len(a.shape) != param[2]:
                raise TypeError(f"kernel argument {i}: expected a {param[2]}-d {param[1]} array; "
                                f"got {a.ndim}-d {a.dtype}")
            values += (math.prod(a.shape), a.dtype.itemsize, a.ptr, *a.shape, *a.strides)
        return values

    def cufunc(self, device_id: int | None):
        """The function loaded on the current context's device (device_id; None: no context yet)."""
        fn = self.cufuncs.get(device_id)
        if fn is None:  # loads the module (creating a context if there is none) the first time
            fn = self.compiled._codelibrary.get_cufunc()
            self.cufuncs[fn.device.id] = fn
        return fn


_INT_CODES = {True: {1: "b", 2: "h", 4: "i", 8: "q"}, False: {1: "B", 2: "H", 4: "I", 8: "Q"}}  # struct codes by size


def _slot_format(code: str) -> str:
    """struct format of one scalar in an 8-byte little-endian slot, zero bytes above it."""
    pad = 8 - struct.calcsize("<" + code)
    return code + f"{pad}x" if pad else code


def param_buffer(slots: list):
    """cuLaunchKernel's ``void **kernelParams`` for ``flatten(..., raw=True)``: one 8-byte slot per
    parameter (a 4-byte scalar in its low half) and the array of pointers to the slots."""
    n = len(slots)
    # uint64 slots: the two's complement of a negative stride is the same 8 bytes
    buf = (ctypes.c_uint64 * n)(*[x & 0xFFFFFFFFFFFFFFFF for x in slots])
    base = ctypes.addressof(buf)
    return buf, (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))


def _bindings():
    """cuda.bindings.driver, imported on first use (the simulator never needs it) and kept:
    an import statement per call costs about a microsecond, and a launch made several."""
    global _cu
    if _cu is None:
        from cuda.bindings import driver as cu

        _cu = cu
    return _cu


_cu = None


def current_device_id() -> int | None:
    """The device of the current CUDA context (one driver call), or None when there is none."""
    cu = _bindings()
    err, dev = cu.cuCtxGetDevice()
    return int(dev) if err == cu.CUresult.CUDA_SUCCESS else None


_LAUNCHERS: dict = {}
# cuLaunchKernel straight from the bindings: None until the first launch, then True, or False if
# the installed cuda.bindings refused that first call's argument types (then cuda.core launches).
_RAW = {"ok": None}
# plans.py watches the launches of a call it is about to cache: while this thread's
# ``recording.launches`` is a list, ``launch`` appends (dispatcher, grid, block, stream,
# shared_bytes, args) to it (and launches as usual); ``arrays.empty_like_kind`` notes allocations, and
# ``derived`` the arguments computed from the call's arrays (recording.derived: id(owner) -> (sources, rebuild)).
recording = threading.local()
# The CUDA simulator runs one kernel at a time (a second thread's launch fails an assert in numba), and while
# one runs it swaps the kernel modules' ``cuda`` global for its fake (a kernel built meanwhile finds no
# cuda.jit): one re-entrant lock, held by each launch and, through api._on_device, by each public call.
SIM_LOCK = threading.RLock()


def derived(view: DeviceView, sources: list, rebuild) -> DeviceView:
    """Note for plans that the launch argument ``view`` is computed from the call's arrays ``sources`` [(DeviceView,
    extra), ...] by ``rebuild(sources, stream) -> DeviceView`` (TMA maps hold their tensors' addresses): a replay
    rebuilds it at that call's pointers. Returns ``view``."""
    watched = getattr(recording, "derived", None)
    if watched is not None:
        watched[id(view.owner)] = (sources, rebuild)
    return view


def launcher_of(dispatcher) -> _Launcher:
    launcher = _LAUNCHERS.get(dispatcher)
    if launcher is None:
        launcher = _LAUNCHERS[dispatcher] = _Launcher(dispatcher)
    return launcher


def launch(dispatcher, grid, block, stream, shared_bytes: int, *args) -> None:
    """``dispatcher[grid, block, stream, shared_bytes](*args)``, minus Numba's per-array work.

    args: DeviceViews (or anything with ``__cuda_array_interface__``) for array parameters,
    Python numbers for scalars. stream: 0 or a Numba stream.
    """
    watched = getattr(recording, "launches", None)
    if watched is not None:
        watched.append((dispatcher, grid, block, stream, shared_bytes, args))
    if nb_config.ENABLE_CUDASIM:
        with SIM_LOCK:
            dispatcher[grid, block, stream, shared_bytes](*args)
        return
    launcher = launcher_of(dispatcher)
    cufunc = function(launcher, current_device_id(), shared_bytes)
    grid = grid if isinstance(grid, tuple) else (grid,)
    block = block if isinstance(block, tuple) else (block,)
    if _RAW["ok"] is not False:
        gx, gy, gz = (int(n) for n in (grid + (1, 1))[:3])
        bx, by, bz = (int(n) for n in (block + (1, 1))[:3])
        slots = None  # keeps the fallback's slot buffer alive until cuLaunchKernel has copied it
        try:
            pointers = launcher.pack(args)
        except (struct.error, OverflowError):  # a scalar out of its type's range: ctypes converts as before
            slots, pointers = param_buffer(launcher.flatten(args, raw=True))
        try:
            raw_launch(cufunc, (gx, gy, gz), (bx, by, bz), shared_bytes, stream, pointers)
        except TypeError as e:
            if _RAW["ok"]:  # it worked before: this is a real error, not a bindings mismatch
                raise
            _RAW["ok"] = False  # these bindings take other argument types: cuda.core from now on
            warnings.warn(f"numba_flash.launch: cuLaunchKernel refused the call ({e}); launching through "
                          "cuda.core instead (slower per call)", RuntimeWarning, stacklevel=2)
        else:
            _RAW["ok"] = True
            return
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv import driver

    config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)
    core_launch(driver._to_core_stream(stream), config, cufunc.kernel, *launcher.flatten(args))


def function(launcher: _Launcher, device_id: int | None, shared_bytes: int):
    """The kernel loaded on the current context's device, allowed ``shared_bytes`` of dynamic shared memory."""
    cufunc = launcher.cufunc(device_id)
    device_id = cufunc.device.id
    if shared_bytes > SMEM_STATIC_MAX and launcher.smem_opt_in.get(device_id, 0) < shared_bytes:
        # Above 48 KiB a kernel must opt in to dynamic shared memory, once per device.
        from numba.cuda.cudadrv import driver

        attr = driver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        try:
            driver.driver.cuKernelSetAttribute(attr, shared_bytes, cufunc.handle, device_id)
        except driver.CudaAPIError as e:  # e.g. a 64 KiB tile on a GPU with less opt-in shared memory
            limit = cufunc.device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            raise ValueError(f"{cufunc.name}: {shared_bytes} B of dynamic shared memory requested; device "
                             f"{device_id} allows at most {limit} B per block ({e})") from e
        launcher.smem_opt_in[device_id] = shared_bytes
    return cufunc


def raw_launch(cufunc, grid: tuple, block: tuple, shared_bytes: int, stream, pointers) -> None:
    """cuLaunchKernel with 3-int grid and block and a ``void **`` parameter array; raises on an error
    code (TypeError where the installed cuda.bindings take other argument types)."""
    cu = _bindings()
    (err,) = cu.cuLaunchKernel(cufunc.handle, *grid, *block, int(shared_bytes),
                              stream.handle if stream else 0, ctypes.addressof(pointers), 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        from numba.cuda.cudadrv import driver

        raise driver.CudaAPIError(err, f"cuLaunchKernel of {cufunc.name} (grid {grid}, block {block}, "
                                       f"{shared_bytes} B dynamic shared memory)")
