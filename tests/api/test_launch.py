"""numba_flash.launch: device views and the flattened kernel ABI.

The CPU part checks views (strides, reshape, dtype views) and the parameter list against
Numba's array ABI as ``numba.cuda.dispatcher._Kernel._prepare_args`` writes it. The GPU part
launches every kernel family both ways (Numba's dispatcher and ``launch``) on the same inputs
and asks for the same bits.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
from numba import types

import reference
from gpu_helpers import HAVE_TORCH_CUDA, needs_gpu
from numba_flash.launch import DeviceView, _Launcher, address, c_strides, param_buffer, view_of


class _CAI:
    def __init__(self, **iface):
        self.__cuda_array_interface__ = {"version": 3, **iface}


def test_view_of_cai_fills_c_strides_and_keeps_owner():
    x = _CAI(shape=(2, 3, 5), typestr="<f2", data=(4096, False), strides=None)
    v = view_of(x, "cuda_array_interface")
    assert (v.ptr, v.shape, v.strides, v.dtype, v.owner) == (4096, (2, 3, 5), (30, 10, 2), np.float16, x)
    assert v.is_c_contiguous() and v.size == 30 and address(v) == 4096


def test_view_of_rejects_masks():
    x = _CAI(shape=(4,), typestr="<f4", data=(64, False), mask=object())
    with pytest.raises(ValueError, match="mask"):
        view_of(x, "cuda_array_interface")


def test_reshape_view_and_leading(rng):
    shape = tuple(int(n) for n in rng.integers(1, 6, size=3))
    v = DeviceView(256, shape, c_strides(shape, 4), np.float32)
    r = v.reshape((1,) + shape)
    assert r.strides == c_strides((1,) + shape, 4) and r.ptr == v.ptr
    assert v.view(np.int32).dtype == np.int32 and v.view(np.int32).strides == v.strides
    with pytest.raises(ValueError, match="item sizes differ"):
        v.view(np.float16)
    lead = v.leading(5)
    assert lead.shape == (1, 1) + shape and lead.strides[2:] == v.strides
    # A strided (non-contiguous) view cannot be reshaped without a copy: refused, not guessed.
    strided = DeviceView(0, (4, 8), (64, 4), np.float32)
    assert not strided.is_c_contiguous()
    with pytest.raises(ValueError, match="without a copy"):
        strided.reshape((32,))
    # The interface a view exports reads back as the same view.
    back = view_of(r, "cuda_array_interface")
    assert (back.ptr, back.shape, back.strides, back.dtype) == (r.ptr, r.shape, r.strides, r.dtype)


def test_c_strides_match_numpy(rng):
    for _ in range(20):
        shape = tuple(int(n) for n in rng.integers(1, 6, size=int(rng.integers(1, 5))))
        assert c_strides(shape, 2) == np.empty(shape, np.float16).strides
    # Empty arrays (NumPy gives them 0 strides): strides as if each 0 were 1, never dereferenced.
    assert c_strides((2, 0, 3), 2) == (6, 6, 2)


class _FakeCompiled:
    def __init__(self, argument_types):
        self.argument_types = argument_types


class _FakeDispatcher:
    def __init__(self, *argument_types):
        self.overloads = {argument_types: _FakeCompiled(argument_types)}


def test_flatten_follows_numbas_array_abi(rng):
    """(meminfo, parent, nitems, itemsize, data, *shape, *strides) per array, ctypes per scalar."""
    disp = _FakeDispatcher(types.Array(types.uint16, 4, "A"), types.Array(types.float32, 3, "A"),
                           types.int32, types.float32)
    shape = tuple(int(n) for n in rng.integers(1, 9, size=4))
    strides = (4096, 1024, 256, 2)
    a = DeviceView(1 << 20, shape, strides, np.uint16)
    b = DeviceView(1 << 24, shape[:3], c_strides(shape[:3], 4), np.float32)
    flat = _Launcher(disp).flatten((a, b, 7, 0.5))
    assert flat[:13] == [0, 0, a.size, 2, a.ptr, *shape, *strides]
    assert flat[13:24] == [0, 0, b.size, 4, b.ptr, *b.shape, *b.strides]
    assert isinstance(flat[24], ctypes.c_int32) and flat[24].value == 7
    assert isinstance(flat[25], ctypes.c_float) and flat[25].value == 0.5


def test_param_buffer_slots(rng):
    """One 8-byte slot per parameter; 4-byte scalars in the low half; pointers point at the slots."""
    disp = _FakeDispatcher(types.Array(types.float32, 2, "A"), types.int32, types.float32)
    ptr = int(rng.integers(1, 2**40)) * 16
    view = DeviceView(ptr, (3, 5), (-20, 4), np.float32)  # a negative stride survives the round trip
    i32, f32 = -1 - int(rng.integers(0, 2**31 - 1)), float(np.float32(rng.standard_normal()))  # negative int32
    flat = _Launcher(disp).flatten((view, i32, f32), raw=True)
    slots, pointers = param_buffer(flat)
    raw = bytes(slots)
    assert list(np.frombuffer(raw[:72], np.int64)) == [0, 0, 15, 4, ptr, 3, 5, -20, 4]
    assert np.frombuffer(raw[72:76], np.int32)[0] == i32 and np.frombuffer(raw[80:84], np.float32)[0] == f32
    assert [pointers[i] for i in range(11)] == [ctypes.addressof(slots) + 8 * i for i in range(11)]


@pytest.mark.parametrize("method", ["flatten", "pack"])
def test_flatten_refuses_wrong_dtype_rank_or_count(method):
    disp = _FakeDispatcher(types.Array(types.float32, 3, "A"), types.int32)
    launcher = _Launcher(disp)
    good = DeviceView(0, (1, 2, 3), c_strides((1, 2, 3), 4), np.float32)
    with pytest.raises(TypeError, match="expected a 3-d float32 array; got 3-d float16"):
        getattr(launcher, method)((DeviceView(0, (1, 2, 3), (12, 6, 2), np.float16), 1))
    with pytest.raises(TypeError, match="expected a 3-d float32 array; got 2-d float32"):
        getattr(launcher, method)((DeviceView(0, (2, 3), (12, 4), np.float32), 1))
    with pytest.raises(TypeError, match="takes 2 arguments; got 1"):
        getattr(launcher, method)((good,))


def test_pack_writes_the_bytes_of_param_buffer(rng):
    """pack (the launch path) = param_buffer(flatten(raw=True)), for every scalar type and any strides,
    into one reused buffer per thread; a scalar its type cannot hold raises (launch then uses flatten)."""
    disp = _FakeDispatcher(types.Array(types.uint16, 4, "A"), types.int32, types.Array(types.float32, 1, "A"),
                           types.int64, types.uint32, types.float32, types.float64, types.Array(types.float32, 5, "A"))
    launcher = _Launcher(disp)
    for _ in range(5):
        shape = tuple(int(n) for n in rng.integers(0, 6, size=4))
        a = DeviceView(int(rng.integers(1, 2**40)) * 16, shape, tuple(int(s) for s in rng.integers(-4096, 4096, 4)),
                       np.uint16)
        b = DeviceView(int(rng.integers(0, 2**40)), (int(rng.integers(0, 9)),), (4,), np.float32)
        c = DeviceView(256, (1, 2, 3, 1, 5), c_strides((1, 2, 3, 1, 5), 4), np.float32)
        args = (a, -1 - int(rng.integers(0, 2**31 - 1)), b, -int(rng.integers(0, 2**62)), int(rng.integers(0, 2**32)),
                np.float32(rng.standard_normal()), float(rng.standard_normal()), c)
        slots, _ = param_buffer(launcher.flatten(args, raw=True))
        pointers = launcher.pack(args)
        n = len(slots)
        assert [pointers[i] for i in range(n)] == [pointers[0] + 8 * i for i in range(n)]
        assert ctypes.string_at(pointers[0], 8 * n) == bytes(slots)
        assert launcher.pack(args) is pointers  # the same buffer every call on this thread
    with pytest.raises(struct.error):
        launcher.pack((a, 2**31, b, 0, 0, 0.0, 0.0, c))  # ctypes would wrap it: launch converts through flatten


# --- on the GPU: launch vs Numba's dispatcher, bit for bit ---------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")
@pytest.mark.parametrize("dtype,causal", [("float32", False), ("float32", True), ("float16", False),
                                          ("bfloat16", True)])
def test_launch_matches_dispatcher_bitwise(dtype, causal, monkeypatch):
    """forward, backward and decode through ``launch`` (first call and plan replay) and through Numba's
    dispatcher: same bits."""
    import torch
    from numba import cuda

    import numba_flash
    import numba_flash.launch as launch_mod

    g = torch.Generator(device="cuda").manual_seed(1234)
    tdt = getattr(torch, dtype)
    # d = 128: the tensor-core tile and the SIMT forward use > 48 KiB of dynamic shared memory (opt-in)
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", generator=g).to(tdt) for _ in range(3))
    dout = torch.randn(2, 4, 300, 128, device="cuda", generator=g).to(tdt)
    lens = torch.tensor([300, 17], dtype=torch.int32, device="cuda")

    def everything():
        out, lse = numba_flash.forward(q, k, v, causal=causal)
        grads = numba_flash.backward(q, k, v, out, lse, dout, causal=causal)
        dec = numba_flash.decode(q[:, :, :3].contiguous(), k, v, cache_seqlens=lens, num_splits=4)
        return (out, lse, *grads, *dec)

    from numba_flash import plans

    plans.clear()
    fast = everything()  # new signatures: the ordinary path, watched by plans
    hits = plans.cache_info()["hits"]
    replayed = everything()  # the same signatures: the plans, new outputs
    assert plans.cache_info()["hits"] == hits + 3, "forward, backward and decode did not all replay a plan"
    monkeypatch.setitem(plans._state, "enabled", False)  # the dispatcher run below must not be a replay
    calls = []

    def via_dispatcher(dispatcher, grid, block, stream, shared, *args):
        calls.append(dispatcher)
        args = [cuda.as_cuda_array(a, sync=False) if isinstance(a, DeviceView) else a for a in args]
        dispatcher[grid, block, stream, shared](*args)

    import importlib
    import pkgutil

    import numba_flash
    from shipped_ptx import OPTIONAL_MODULES

    # every module that launches: a module left out would compare the fast path with itself
    patched = 0
    for info in pkgutil.walk_packages(numba_flash.__path__, "numba_flash."):
        if info.name.endswith(OPTIONAL_MODULES) or ".integrations" in info.name:
            continue
        mod = importlib.import_module(info.name)
        if getattr(mod, "launch_kernel", None) is launch_mod.launch:
            monkeypatch.setattr(mod, "launch_kernel", via_dispatcher)
            patched += 1
    assert patched >= 5, f"only {patched} modules launch kernels through launch_kernel"
    slow = everything()
    torch.cuda.synchronize()
    assert len(calls) >= 6, "the dispatcher path did not run every kernel"
    assert launch_mod._RAW["ok"] is True, "the fast path fell back to cuda.core"
    bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # noqa: E731
    for i, (a, r, b) in enumerate(zip(fast, replayed, slow)):
        assert torch.equal(bits(a), bits(b)), f"output {i} differs ({dtype}, causal={causal})"
        assert torch.equal(bits(r), bits(b)), f"output {i} of the replayed plan differs ({dtype}, causal={causal})"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")
def test_launch_on_a_side_stream_orders_with_torch():
    """forward and decode launched on a non-default PyTorch stream: the raw launch passes that stream,
    so the work is ordered after the producer kernel on it, and the bits equal the default-stream run."""
    import torch

    import numba_flash

    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4, 257, 64, device="cuda", generator=g).half() for _ in range(3))
    ref = numba_flash.forward(q, k, v, causal=True)
    ref_dec = numba_flash.decode(q[:, :, :2].contiguous(), k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # keep the side stream busy: a launch on stream 0 would overtake it
        q2 = q * 1  # produced on the side stream, consumed by forward on the same stream
        out, lse = numba_flash.forward(q2, k, v, causal=True)
        dec, _ = numba_flash.decode(q2[:, :, :2].contiguous(), k, v)
    side.synchronize()
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]) and torch.equal(dec, ref_dec[0])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")
def test_plans_follow_pointer_alignment(monkeypatch):
    """One shape, q 16-byte aligned then 2 bytes off (tensor cores need aligned rows, so the second
    signature runs the SIMT kernel with a warning), then aligned again with new data: each call
    gives the bits of the same call with plans off."""
    import torch

    import numba_flash
    from numba_flash import plans

    g = torch.Generator(device="cuda").manual_seed(11)
    shape, n = (2, 4, 200, 64), 2 * 4 * 200 * 64
    flat = torch.randn(n + 8, device="cuda", generator=g).half()
    k, v = (torch.randn(*shape, device="cuda", generator=g).half() for _ in range(2))
    plans.clear()

    def both(q, **kw):
        got = numba_flash.forward(q, k, v, **kw)
        monkeypatch.setitem(plans._state, "enabled", False)
        ref = numba_flash.forward(q, k, v, **kw)
        monkeypatch.setitem(plans._state, "enabled", True)
        torch.cuda.synchronize()
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

    for _ in range(2):  # first call, then a hit
        both(flat[:n].view(shape), causal=True)
        with pytest.warns(numba_flash.PerformanceWarning, match="16-byte aligned"):
            both(flat[1:n + 1].view(shape), causal=True)
        with pytest.raises(ValueError, match="16-byte aligned"):
            numba_flash.forward(flat[1:n + 1].view(shape), k, v, kernel="mma")
    flat.copy_(torch.randn(n + 8, device="cuda", generator=g))
    both(flat[8:n + 8].view(shape), causal=True)  # 16 bytes on: aligned, the first plan, new data
    assert plans.cache_info()["hits"] >= 3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="GPU tests build inputs with PyTorch")
def test_cuda_core_fallback_gives_the_same_bits(monkeypatch):
    """The path taken when cuda.bindings refuses cuLaunchKernel's arguments: cuda.core's launch."""
    import torch

    import numba_flash
    import numba_flash.launch as launch_mod

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 128, device="cuda", generator=g).half() for _ in range(3))
    fast = numba_flash.forward(q, k, v)
    monkeypatch.setitem(launch_mod._RAW, "ok", False)
    slow = numba_flash.forward(q, k, v)
    torch.cuda.synchronize()
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_zero_size_views_are_contiguous():
    v = DeviceView(0, (2, 4, 0), c_strides((2, 4, 0), 4), np.float32)
    assert v.is_c_contiguous() and v.reshape((8, 0)).shape == (8, 0)


def test_data_slots_and_template(rng):
    """data_slots: where each array's data pointer sits among the 8-byte slots (a plan rewrites only
    those); template: the bytes pack writes."""
    disp = _FakeDispatcher(types.int32, types.Array(types.uint16, 4, "A"), types.float32,
                           types.Array(types.float32, 2, "A"))
    launcher = _Launcher(disp)
    a = DeviceView(int(rng.integers(1, 2**40)) * 16, (2, 3, 4, 5), c_strides((2, 3, 4, 5), 2), np.uint16)
    b = DeviceView(int(rng.integers(1, 2**40)) * 16, (6, 7), c_strides((6, 7), 4), np.float32)
    args = (7, a, 0.5, b)
    slots = np.frombuffer(launcher.template(args), np.uint64)
    assert launcher.data_slots == [None, 1 + 4, None, 1 + 13 + 1 + 4]
    assert int(slots[launcher.data_slots[1]]) == a.ptr and int(slots[launcher.data_slots[3]]) == b.ptr
    pointers = launcher.pack(args)
    assert ctypes.string_at(pointers[0], launcher.layout.size) == launcher.template(args)


def test_simulator_launches_from_threads():
    """The simulator runs one kernel at a time ('concurrent simulated kernel not supported' from a second
    thread) and swaps the kernel modules' cuda global while it runs (a kernel built meanwhile finds no
    cuda.jit); the public calls hold one lock there, so forward works from several threads, new shapes
    (kernels built under way) included."""
    from concurrent.futures import ThreadPoolExecutor

    from numba import config

    import numba_flash

    if not config.ENABLE_CUDASIM:
        pytest.skip("a GPU runs concurrent launches itself")
    rng = np.random.default_rng(0)
    problems = [[rng.standard_normal((1, 1, 40, 8)).astype(np.float32) for _ in range(3)] for _ in range(4)]
    fresh = [[rng.standard_normal((1, 1, 5, d)).astype(np.float32) for _ in range(3)] for d in (20, 36, 52)]
    expected = [numba_flash.forward(*p)[0] for p in problems]
    calls = [problems[0], fresh[0], problems[1], fresh[1], problems[2], fresh[2], problems[3]]
    with ThreadPoolExecutor(4) as pool:  # fresh head dims build their kernels while 40-row kernels run
        got = list(pool.map(lambda p: numba_flash.forward(*p)[0], calls))
    for e, g in zip(expected, got[0::2]):
        np.testing.assert_array_equal(g, e)
    for p, g in zip(fresh, got[1::2]):
        ref, _ = reference.standard_attention(*p)
        np.testing.assert_allclose(g, ref, atol=1e-5)


def test_torch_stream_pointer_from_the_raw_getter_or_the_stream_object(monkeypatch):
    """arrays._torch_stream_ptr asks PyTorch's raw getter for the device's index where the build has it (CUDA
    builds), else the current torch.cuda.Stream's pointer; a device without an index takes the latter."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from numba_flash import arrays

    asked = []
    monkeypatch.setattr(arrays, "_TORCH_RAW_STREAM", [lambda index: asked.append(index) or 7000 + index])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=42))
    assert arrays._torch_stream_ptr(SimpleNamespace(index=3)) == 7003 and asked == [3]
    assert arrays._torch_stream_ptr(SimpleNamespace(index=None)) == 42
    monkeypatch.setattr(arrays, "_TORCH_RAW_STREAM", [None])
    assert arrays._torch_stream_ptr(SimpleNamespace(index=3)) == 42
