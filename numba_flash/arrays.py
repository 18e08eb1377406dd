"""Arrays in and out: CuPy, PyTorch, Numba device arrays, any __cuda_array_interface__, NumPy.

Device inputs are viewed, never copied (Numba views them through __cuda_array_interface__);
outputs are allocated by the same framework as q. NumPy inputs are copied to the device and
the results copied back, which is also how the CUDA simulator runs everything.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import config as nb_config
from numba import cuda

from .launch import DeviceView, recording, view_of

NUMPY, CUPY, TORCH, NUMBA, CAI = "numpy", "cupy", "torch", "numba", "cuda_array_interface"
DTYPES = ("float32", "float16", "bfloat16")


def kind_of(x: Any) -> str | None:
    """Which family an array belongs to, or None for something that is not an array."""
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return NUMPY
    if mod == "torch" and hasattr(x, "is_cuda"):
        return TORCH  # CPU tensors included; validation says they must be on the GPU
    if hasattr(x, "__cuda_array_interface__"):
        if mod == "cupy":
            return CUPY
        if mod.startswith("numba"):
            return NUMBA
        return CAI
    if mod == "numba" and getattr(x, "__cuda_ndarray__", False):  # the simulator's device arrays have no interface
        return NUMBA
    return None


def refuse_unreadable(name: str, x: Any, kind: str) -> None:
    """TypeError for arrays the kernels would misread: NumPy masked arrays (the mask would be dropped)
    and sparse PyTorch tensors (no strided data to view). Reads attributes only: torch is not imported."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a NumPy masked array; its mask would be ignored. Accepted: plain arrays "
                        f"(np.ma.filled({name}, value) fills the masked entries, np.asarray({name}) drops the mask)")
    if kind == TORCH:
        layout = str(getattr(x, "layout", "torch.strided"))
        if getattr(x, "is_sparse", False) or layout != "torch.strided":
            raise TypeError(f"{name} is a PyTorch tensor with layout {layout}; accepted: dense (torch.strided) "
                            f"tensors ({name}.to_dense())")


def dtype_name(x: Any) -> str:
    """'float32', 'float16', 'bfloat16' or the foreign name, for any supported array kind."""
    dt = x.dtype
    name = str(dt).replace("torch.", "")
    return name


def shape_of(x: Any) -> tuple:
    return tuple(int(n) for n in x.shape)


def device_of(x: Any) -> int | None:
    """CUDA device ordinal holding x (None for host arrays or when the framework cannot say)."""
    k = kind_of(x)
    if k == TORCH:
        return x.device.index if x.is_cuda else None
    if k == CUPY:
        return int(x.device.id)
    return None


def last_dim_contiguous(x: Any) -> bool:
    shape = shape_of(x)
    if not shape or shape[-1] <= 1:
        return True
    k = kind_of(x)
    if k == TORCH:
        return x.stride(-1) == 1
    if k == NUMPY:
        return x.strides[-1] == x.itemsize
    strides = x.__cuda_array_interface__.get("strides")
    return strides is None or strides[-1] == np.dtype(x.__cuda_array_interface__["typestr"]).itemsize


def current_stream(x: Any, kind: str | None = None):
    """The stream work on x should run on: the framework's current stream, else the default.
    ``kind``: kind_of(x) where the caller knows it."""
    k = kind or kind_of(x)
    if nb_config.ENABLE_CUDASIM:
        return 0
    if k == CUPY:
        import cupy

        return _external_stream(cupy.cuda.get_current_stream().ptr)
    if k == TORCH:
        return _external_stream(_torch_stream_ptr(x.device))
    return 0


_TORCH_RAW_STREAM: list = []  # torch._C._cuda_getCurrentRawStream, or None where the build lacks it


def _torch_stream_ptr(device) -> int:
    """PyTorch's current stream of ``device`` as a pointer: its raw getter (what inductor's generated code calls)
    skips building a torch.cuda.Stream object per call."""
    if not _TORCH_RAW_STREAM:
        import torch

        _TORCH_RAW_STREAM.append(getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None))
    raw = _TORCH_RAW_STREAM[0]
    if raw is not None and device.index is not None:
        return raw(device.index)
    import torch

    return torch.cuda.current_stream(device).cuda_stream


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int):
    """Numba's wrapper of a framework stream, made once per stream (it costs a driver query)."""
    return cuda.external_stream(ptr) if ptr else 0


def as_4d(dev: Any, ndim: int = 4) -> Any:
    """View a device array with unit dims added in front up to ``ndim`` dims, strides kept."""
    if dev.ndim == ndim:
        return dev
    if isinstance(dev, DeviceView):
        return dev.leading(ndim)
    return dev.reshape((1,) * (ndim - dev.ndim) + tuple(dev.shape))  # simulator arrays


def packed_as_batch(dev: Any, n_seq: int) -> Any:
    """A packed varlen array, (total, H, d) or lse's (H, total), as (n_seq, H, total[, d]) with a batch stride
    of 0: every sequence's view is the whole pack, and the varlen kernels add the sequence's first row."""
    if dev.ndim == 3:
        shape, strides = (n_seq, dev.shape[1], dev.shape[0], dev.shape[2]), (0, dev.strides[1], dev.strides[0],
                                                                           dev.strides[2])
    elif dev.ndim == 2:
        shape, strides = (n_seq, *dev.shape), (0, *dev.strides)
    else:
        raise ValueError(f"packed_as_batch: a (total, H, d) array or a (H, total) lse, got shape {tuple(dev.shape)}")
    if isinstance(dev, DeviceView):
        return DeviceView(dev.ptr, shape, strides, dev.dtype, dev.owner)
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # the simulator's arrays: a numpy view

    return FakeCUDAArray(np.lib.stride_tricks.as_strided(dev._ary, shape, strides), stream=dev.stream)


def to_device_view(x: Any, stream, ndim: int = 4) -> Any:
    """An ``ndim``-D device view of x (bfloat16 as uint16 bits); NumPy is copied over.

    On a GPU this is a ``launch.DeviceView`` read straight from the framework (pointer, shape,
    strides: no driver call, no copy); under the simulator, the simulator's own array.
    """
    k = kind_of(x)
    name = dtype_name(x)
    if k == NUMPY:
        host = np.ascontiguousarray(x)
        if name == "bfloat16":  # ml_dtypes.bfloat16
            host = host.view(np.uint16)
        dev = cuda.to_device(host, stream=stream)
        return as_4d(dev if nb_config.ENABLE_CUDASIM else view_of(dev, CAI), ndim)
    if not nb_config.ENABLE_CUDASIM:
        return as_4d(view_of(x, k), ndim)  # PyTorch bfloat16 becomes uint16 here
    dev = x if k == NUMBA else cuda.as_cuda_array(x, sync=False)  # simulator arrays (nothing else exists there)
    return as_4d(dev.view(np.uint16) if name == "bfloat16" else dev, ndim)


def empty_like_kind(kind: str, ref: Any, shape: tuple, dtype: str, stream):
    """Allocate (original-kind object, device view) for an output of the given shape and dtype."""
    return _recorded(kind, ref, shape, dtype, stream, False)


def zeros_like_kind(kind: str, ref: Any, shape: tuple, dtype: str, stream):
    """``empty_like_kind``, zero-filled by ref's framework on its current stream (Numba and other
    arrays: by a host copy); a plan that replays the call allocates and zeroes it again."""
    return _recorded(kind, ref, shape, dtype, stream, True)


def _recorded(kind: str, ref: Any, shape: tuple, dtype: str, stream, zeroed: bool):
    obj, view = alloc_like_kind(kind, ref, shape, dtype, stream, zeroed)
    watched = getattr(recording, "allocations", None)
    if watched is not None:  # plans.py is watching this call: how to allocate the same again
        watched.append((obj, view, (kind, ref, tuple(shape), dtype, zeroed)))
    return obj, view


def allocate(kind: str, ref: Any, shape: tuple, dtype: str, stream, zeroed: bool = False) -> tuple:
    """(object, data pointer) of ``empty_like_kind`` / ``zeros_like_kind`` without its view and not
    recorded (plans.py: per call)."""
    if kind == TORCH:  # the hot case without building a view
        import torch

        obj = (torch.zeros if zeroed else torch.empty)(shape, dtype=getattr(torch, dtype), device=ref.device)
        return obj, obj.data_ptr()
    obj, view = alloc_like_kind(kind, ref, shape, dtype, stream, zeroed)
    return obj, view.ptr


def alloc_like_kind(kind: str, ref: Any, shape: tuple, dtype: str, stream, zeroed: bool = False):
    """(object of ref's kind, device view), empty or zero-filled; not recorded for plans."""
    if kind == CUPY:
        import cupy

        with cupy.cuda.Device(ref.device.id):
            obj = (cupy.zeros if zeroed else cupy.empty)(shape, dtype=dtype)
        return obj, view_of(obj, CUPY)
    if kind == TORCH:
        import torch

        obj = (torch.zeros if zeroed else torch.empty)(shape, dtype=getattr(torch, dtype), device=ref.device)
        return obj, view_of(obj, TORCH)
    storage = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    if zeroed:
        dev = cuda.to_device(np.zeros(shape, storage), stream=stream)
    else:
        dev = cuda.device_array(shape, dtype=storage, stream=stream)
    return dev, (dev if nb_config.ENABLE_CUDASIM else view_of(dev, CAI))


def full_like_kind(kind: str, ref: Any, shape: tuple, dtype: str, value: float, stream):
    """``alloc_like_kind`` filled with ``value`` by ref's framework (dtype: one NumPy has, e.g. float32); not
    recorded for plans, so a call that returns it keeps the ordinary path."""
    if kind == CUPY:
        import cupy

        with cupy.cuda.Device(ref.device.id):
            obj = cupy.full(shape, value, dtype=dtype)
        return obj, view_of(obj, CUPY)
    if kind == TORCH:
        import torch

        obj = torch.full(shape, value, dtype=getattr(torch, dtype), device=ref.device)
        return obj, view_of(obj, TORCH)
    dev = cuda.to_device(np.full(shape, value, np.dtype(dtype)), stream=stream)
    return dev, (dev if nb_config.ENABLE_CUDASIM else view_of(dev, CAI))


def to_host_kind(kind: str, obj: Any, dtype: str, stream):
    """NumPy inputs get NumPy results (bfloat16 as ml_dtypes.bfloat16 when available)."""
    if kind != NUMPY:
        return obj
    host = obj.copy_to_host(stream=stream)
    if stream != 0:
        stream.synchronize()
    if dtype == "bfloat16":
        import ml_dtypes

        host = host.view(ml_dtypes.bfloat16)
    return host
