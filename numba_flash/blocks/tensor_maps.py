"""Tensor maps (CUtensorMap) of the (B, H, N, d) arrays the TMA kernels copy, encoded on the host.

A map describes a 4-D tensor of 16-bit words, dims innermost first (d, N, H, B) with the array's byte strides,
and one box of 64 columns (128 bytes: a column atom of wgmma's 128-byte swizzle) x ``box_rows`` rows x 1 x 1,
copied with that swizzle; elements outside the tensor read as zeros (and are never written by a store). On a GPU
the driver's cuTensorMapEncodeTiled (libcuda.so.1, through ctypes) writes the 128 bytes; in the simulator the
bytes hold a key into ptx/tma.py's registry, which keeps the array itself, so the twins copy from it directly.

Numba cannot pass a __grid_constant__ parameter, so the maps travel in a device uint8 array (64-byte aligned
slots, written by a host-to-device copy before the launch: the copies' generic address of a .global map needs
no proxy fence then). ``device_maps`` keeps the arrays of recent launches (keyed by pointer, shape, strides,
box) so a repeated call encodes and copies nothing.
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np
from numba import cuda

from ..launch import DeviceView, address, current_device_id, derived
from ..ptx import SIMULATOR
from ..ptx.tma import TMA_SWIZZLE_BYTES, TMAP_ALIGN, TMAP_BYTES

_UINT16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _OOB_ZEROS = 1, 0, 3, 3, 0  # cuda.h's enum values
BOX_COLS = TMA_SWIZZLE_BYTES // 2  # 16-bit columns of a box row
_CACHE_SIZE = 64

_lib = None
_lock = threading.Lock()
_cache: OrderedDict = OrderedDict()


def _driver():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _lib = fn
    return _lib


def _check(x, box_rows):
    shape, strides = tuple(x.shape), tuple(x.strides)
    if len(shape) != 4 or np.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"tensor map: a 4-D array of 16-bit words, got shape {shape}, dtype {x.dtype}")
    if strides[-1] != 2:
        raise ValueError(f"tensor map: the last dim must have unit stride, strides are {strides}")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"tensor map: box_rows={box_rows}, TMA boxes take 1..256 rows")
    bad = [s for s, n in zip(strides[:-1], shape[:-1]) if n > 1 and (s % 16 or s <= 0)]
    if bad or address(x) % 16:
        raise ValueError(f"tensor map: TMA needs a 16-byte aligned data pointer and positive byte strides that are "
                         f"multiples of 16 (dims of size 1 aside); got strides {strides}, pointer % 16 = "
                         f"{address(x) % 16}; pad the rows")
    return shape, strides


def encode(x, box_rows: int) -> np.ndarray:
    """The 128 bytes of a map over x (B, H, N, d) of 16-bit words, box BOX_COLS x box_rows, 128-byte swizzle."""
    shape, strides = _check(x, box_rows)
    out = np.zeros(TMAP_BYTES, np.uint8)
    if SIMULATOR:
        from ..ptx import sim, tma

        view = sim._numpy_of(x)
        key = tma.sim_register(view, (BOX_COLS, box_rows, 1, 1))
        out[:8] = np.frombuffer(np.int64(key).tobytes(), np.uint8)
        out[8:10] = np.frombuffer(np.uint16(tma._SIM_MAGIC).tobytes(), np.uint8)
        return out
    dims = (ctypes.c_uint64 * 4)(shape[3], shape[2], shape[1], shape[0])
    # a dim of one element has no stride of its own: the next-inner extent keeps the driver's checks happy
    st = []
    inner = shape[3] * 2
    for n, s in ((shape[2], strides[2]), (shape[1], strides[1]), (shape[0], strides[0])):
        s = s if n > 1 else max(-(-inner // 16) * 16, 16)
        st.append(s)
        inner = s * n
    gstrides = (ctypes.c_uint64 * 3)(*st)
    box = (ctypes.c_uint32 * 4)(BOX_COLS, box_rows, 1, 1)
    ones = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    raw = np.zeros(TMAP_BYTES + TMAP_ALIGN, np.uint8)  # CUtensorMap is 64-byte aligned
    start = (-raw.ctypes.data) % TMAP_ALIGN
    slot = raw[start:start + TMAP_BYTES]
    rc = _driver()(slot.ctypes.data, _UINT16, 4, address(x), dims, gstrides, box, ones, _INTERLEAVE_NONE,
                   _SWIZZLE_128B, _L2_256B, _OOB_ZEROS)
    if rc != 0:
        raise ValueError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for shape {shape}, byte strides {strides}, "
                         f"box {BOX_COLS}x{box_rows}")
    out[:] = slot
    return out


def _stream_id(stream) -> int:
    """A stream's driver handle as an int (0: the legacy default stream)."""
    if not stream:
        return 0
    try:
        return int(stream.handle)
    except (TypeError, AttributeError):
        return id(stream)


def device_maps(specs, stream=0):
    """A device uint8 array of the maps of ``specs`` [(array, box_rows), ...] in order, map i at byte
    i·TMAP_BYTES; cached for repeated calls on the same arrays (a map holds only the address, shape and strides,
    so an array freed and another allocated in its place, alike, reuses it). The copy runs on ``stream``, the
    launch's; a hit from another stream first waits for that copy once."""
    if not SIMULATOR:
        key = (current_device_id(),) + tuple((address(x), tuple(x.shape), tuple(x.strides), int(r))
                                             for x, r in specs)
        with _lock:
            found = _cache.get(key)
            if found is not None:
                _cache.move_to_end(key)
        if found is not None:
            dev, copied_on = found
            if copied_on is not None and _stream_id(copied_on) != _stream_id(stream):
                copied_on.synchronize()
                with _lock:
                    _cache[key] = (dev, None)
            return dev
    host = np.concatenate([encode(x, int(r)) for x, r in specs])
    dev = cuda.to_device(host, stream=stream) if stream else cuda.to_device(host)  # stream 0: synchronous
    if not SIMULATOR:
        with _lock:
            _cache[key] = (dev, stream if stream else None)
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return dev


def maps_view(specs, stream=0) -> DeviceView:
    """device_maps(specs, stream) as a launch argument (a uint8 DeviceView), noted for plans as computed from the
    specs' arrays (launch.derived): a replayed call gets the maps of its own arrays."""
    dev = device_maps(specs, stream)
    view = DeviceView(address(dev), (len(specs) * TMAP_BYTES,), (1,), np.uint8, owner=dev)
    return derived(view, list(specs), maps_view)
