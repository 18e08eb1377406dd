"""Plans vs the ordinary path, launch by launch, on a CPU: run by tests/api/test_plans.py in a subprocess.

numba_flash runs in GPU mode with the driver and PyTorch stubbed (scripts/host_overhead.py
``install_stubs``: kernels are not compiled, ``torch.empty`` hands out fake pointers). Every
cuLaunchKernel is logged as (kernel, grid, block, shared bytes, stream, parameter bytes), so a
call through a plan (its first call and later hits) can be compared byte for byte with the same
call with plans off: same kernels, same configs, same parameters, same errors, same warnings.

    python tests/plans_stub_check.py forward|decode|backward|errors|bound
    NUMBA_FLASH_PLAN_CACHE=0 python tests/plans_stub_check.py off
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import types as pytypes
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import host_overhead  # noqa: E402

torch = host_overhead.install_stubs()
StubTensor = host_overhead.StubTensor

from cuda.bindings import driver as cu  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash import launch, plans  # noqa: E402
from numba_flash.api import PerformanceWarning  # noqa: E402

LOG: list = []
_FUNCS: dict = {}


def _cufunc(self, device_id):  # one fake function per kernel, so the log names the kernel
    fn = _FUNCS.get(id(self))
    if fn is None:
        fn = _FUNCS[id(self)] = pytypes.SimpleNamespace(handle=id(self), device=pytypes.SimpleNamespace(id=0),
                                                        name=f"k{len(_FUNCS)}", launcher=self)
    return fn


def _launch_kernel(handle, gx, gy, gz, bx, by, bz, shared, stream, pointers, extra):
    n = _FUNCS[handle].launcher.layout.size // 8
    slots = [ctypes.c_void_p.from_address(pointers + 8 * i).value for i in range(n)]
    params = b"".join(ctypes.string_at(p, 8) for p in slots)
    LOG.append((_FUNCS[handle].name, (gx, gy, gz), (bx, by, bz), shared, stream, params))
    THREAD_LOG.append((threading.get_ident(), _FUNCS[handle].launcher, params))
    return (cu.CUresult.CUDA_SUCCESS,)


THREAD_LOG: list = []


launch._Launcher.cufunc = _cufunc
cu.cuLaunchKernel = _launch_kernel
ZEROED: list = []  # shapes of the zero-filled scratch allocated (the stub cannot fill memory)


def _zeros(shape, dtype=None, device=None):
    ZEROED.append(tuple(shape))
    return torch.empty(shape, dtype=dtype, device=device)


torch.zeros = _zeros  # deterministic=False's scratch: a plan allocates (and zeroes) it per call
OUT_BASE = 1 << 44  # outputs get the same fake pointers in every run compared


def tensor(shape, dtype="float16", strides=None, misalign=0):
    t = StubTensor(shape, getattr(torch, dtype))
    if strides is not None:
        t._strides = tuple(strides)
    t._ptr += misalign
    return t


def run(fn, enabled: bool):
    """(launch log, error, warnings) of one call with plans on or off."""
    plans.set_enabled(enabled)
    LOG.clear()
    StubTensor._next[0] = OUT_BASE
    err = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - compared, not handled
            err = (type(e).__name__, str(e))
    return list(LOG), err, [(w.category.__name__, str(w.message), os.path.basename(w.filename)) for w in caught]


def same(label, fn, expect_hit=True):
    """Plans off, first call with plans, a hit: the same launches, error and warnings."""
    ref = run(fn, False)
    first = run(fn, True)
    hits = plans.cache_info()["hits"]
    again = run(fn, True)
    assert first == ref, f"{label}: first call through plans differs\n{first}\n{ref}"
    assert again == ref, f"{label}: replayed call differs\n{again}\n{ref}"
    if expect_hit:
        assert plans.cache_info()["hits"] == hits + 1, f"{label}: the second call was not a hit"
    assert ref[0] or ref[1] or "empty" in label, f"{label}: nothing launched"
    return ref


def check_forward():
    cases = {
        "fp16 mma": dict(q=(2, 4, 100, 64)),
        "fp32 causal scale": dict(q=(2, 4, 100, 64), dtype="float32", causal=True, softmax_scale=0.3),
        "bf16 d128 GQA": dict(q=(1, 8, 77, 128), kv=(1, 2, 150, 128), dtype="bfloat16", causal=True),
        "fp16 d72 3-d": dict(q=(4, 33, 72), kv=(4, 65, 72)),
        "fp16 strided q": dict(q=(2, 4, 100, 64), q_strides=(4 * 100 * 128, 100 * 128, 128, 1)),
        "fp16 odd-strided q (simt)": dict(q=(2, 4, 100, 64), q_strides=(4 * 100 * 65, 100 * 65, 65, 1)),
        "fp16 misaligned q (simt)": dict(q=(2, 4, 100, 64), misalign=2),
        "fp16 kernel=simt": dict(q=(2, 4, 100, 64), kernel="simt"),
        "fp16 Nk=0": dict(q=(1, 2, 5, 64), kv=(1, 2, 0, 64)),
        "fp16 empty Nq=0": dict(q=(1, 2, 0, 64), kv=(1, 2, 8, 64)),
        "fp16 mma misaligned (error)": dict(q=(2, 4, 100, 64), misalign=2, kernel="mma"),
    }
    for label, c in cases.items():
        dt = c.get("dtype", "float16")
        kv = c.get("kv", c["q"])
        q = tensor(c["q"], dt, c.get("q_strides"), c.get("misalign", 0))
        k, v = tensor(kv, dt), tensor(kv, dt)
        opts = {n: c[n] for n in ("causal", "softmax_scale", "kernel") if n in c}
        ref = same(label, lambda: numba_flash.forward(q, k, v, **opts), expect_hit="error" not in label)
        # New arrays of the same signature (other pointers, same alignment): a hit, same as plans off.
        q2 = tensor(c["q"], dt, c.get("q_strides"), c.get("misalign", 0))
        k2, v2 = tensor(kv, dt), tensor(kv, dt)
        assert run(lambda: numba_flash.forward(q2, k2, v2, **opts), True) == \
            run(lambda: numba_flash.forward(q2, k2, v2, **opts), False), label
        if "misaligned (simt)" in label:
            assert ref[2] and ref[2][0][0] == "PerformanceWarning", label
            assert ref[2][0][2] == "plans_stub_check.py", f"warning points at {ref[2][0][2]}, not the caller"
    # One signature seen with q aligned, then with q 2 bytes off: the plan of the aligned call must not
    # be used (cp.async needs 16-byte aligned rows), whether the first call cached it or not.
    for kernel in ("auto", "mma"):
        q, k, v = (tensor((2, 4, 100, 64)) for _ in range(3))
        same(f"aligned {kernel}", lambda: numba_flash.forward(q, k, v, kernel=kernel))
        for off in (2, 8, 16):
            qm = tensor((2, 4, 100, 64), misalign=off)
            same(f"q {off} B off, kernel={kernel}", lambda: numba_flash.forward(qm, k, v, kernel=kernel),
                 expect_hit=not (kernel == "mma" and off % 16))
    # The same object passed as q, k and v, then three objects of that signature.
    x = tensor((1, 2, 64, 64))
    same("forward(x, x, x)", lambda: numba_flash.forward(x, x, x))
    a, b, c = (tensor((1, 2, 64, 64)) for _ in range(3))
    assert run(lambda: numba_flash.forward(a, b, c), True) == run(lambda: numba_flash.forward(a, b, c), False)
    assert run(lambda: numba_flash.forward(a, a, c), True) == run(lambda: numba_flash.forward(a, a, c), False)


def check_decode():
    for label, (B, H, Hkv, N, d, lens_dtype, splits, misalign) in {
        "Hkv8 auto splits": (8, 32, 8, 32768, 128, None, None, 0),
        "Hkv8 int32 lens": (8, 32, 8, 32768, 128, "int32", None, 0),
        "Hkv32 1 split int64 lens": (8, 32, 32, 32768, 128, "int64", None, 0),
        "small d64 lens, 3 splits": (1, 8, 8, 256, 64, "int32", 3, 0),
        "fp32 GQA d72": (2, 8, 2, 300, 72, None, None, 0),
        "misaligned k (scalar loads)": (2, 8, 2, 300, 64, None, 2, 4),
    }.items():
        dt = "float32" if "fp32" in label else "float16"
        q = tensor((B, H, 1, d), dt)
        k, v = tensor((B, Hkv, N, d), dt, misalign=misalign), tensor((B, Hkv, N, d), dt)
        lens = tensor((B,), lens_dtype) if lens_dtype else None
        same(label, lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=splits))
        q2, k2, v2 = tensor((B, H, 1, d), dt), tensor((B, Hkv, N, d), dt, misalign=misalign), tensor((B, Hkv, N, d), dt)
        lens2 = tensor((B,), lens_dtype) if lens_dtype else None
        assert run(lambda: numba_flash.decode(q2, k2, v2, cache_seqlens=lens2, num_splits=splits), True) == \
            run(lambda: numba_flash.decode(q2, k2, v2, cache_seqlens=lens2, num_splits=splits), False), label
    # NumPy lengths are checked by value on every call: never a plan.
    import numpy as np

    q, k, v = tensor((2, 4, 1, 64)), tensor((2, 4, 64, 64)), tensor((2, 4, 64, 64))
    size = plans.cache_info()["size"]
    same("numpy lens", lambda: numba_flash.decode(q, k, v, cache_seqlens=np.array([64, 3], np.int32)),
         expect_hit=False)
    assert plans.cache_info()["size"] == size
    same("numpy lens out of range", lambda: numba_flash.decode(q, k, v, cache_seqlens=np.array([65, 3], np.int32)),
         expect_hit=False)


def check_backward():
    for label, (shape, kv, dt, causal, dout_off) in {
        "fp32 simt": ((1, 2, 64, 64), None, "float32", False, 0),
        "fp16 mma causal": ((2, 4, 100, 64), None, "float16", True, 0),
        "bf16 mma GQA d128": ((1, 4, 70, 128), (1, 2, 90, 128), "bfloat16", True, 0),
        "fp16 dout misaligned (simt)": ((2, 4, 100, 64), None, "float16", False, 2),
    }.items():
        kv = kv or shape
        q, k, v = tensor(shape, dt), tensor(kv, dt), tensor(kv, dt)
        out, dout, lse = tensor(shape, dt), tensor(shape, dt, misalign=dout_off), tensor(shape[:-1], "float32")
        same(label, lambda: numba_flash.backward(q, k, v, out, lse, dout, causal=causal))
        q2, k2, v2 = tensor(shape, dt), tensor(kv, dt), tensor(kv, dt)
        o2, do2, l2 = tensor(shape, dt), tensor(shape, dt, misalign=dout_off), tensor(shape[:-1], "float32")
        assert run(lambda: numba_flash.backward(q2, k2, v2, o2, l2, do2, causal=causal), True) == \
            run(lambda: numba_flash.backward(q2, k2, v2, o2, l2, do2, causal=causal), False), label
    # Zero-filled scratch (deterministic=False): a plan zeroes a fresh one per call, as the ordinary
    # path does; zero gradients (Nk = 0): no plan, the ordinary path.
    q, k, v, out, dout = (tensor((1, 2, 64, 64)) for _ in range(5))
    lse = tensor((1, 2, 64), "float32")
    before = plans.cache_info()["uncacheable"]
    ZEROED.clear()
    same("deterministic=False", lambda: numba_flash.backward(q, k, v, out, lse, dout, deterministic=False))
    assert len(ZEROED) == 3 and len(set(ZEROED)) == 1, ZEROED  # off, first call, hit: one scratch each
    k0, v0 = tensor((1, 2, 0, 64)), tensor((1, 2, 0, 64))
    same("Nk=0 empty", lambda: numba_flash.backward(q, k0, v0, out, lse, dout), expect_hit=False)
    assert plans.cache_info()["uncacheable"] == before + 1


def check_errors():
    """A signature cached from a good call; then inputs that differ in one way each: every call
    raises (or not) exactly as with plans off."""
    q, k, v = (tensor((2, 4, 64, 64)) for _ in range(3))
    same("good", lambda: numba_flash.forward(q, k, v, causal=True, softmax_scale=0.125))
    variants = {
        "causal=1": dict(causal=1),
        "causal=None": dict(causal=None),
        "softmax_scale=True": dict(softmax_scale=True),
        "softmax_scale=1 (int, accepted)": dict(softmax_scale=1),
        "softmax_scale=nan": dict(softmax_scale=float("nan")),
        "softmax_scale=-1.0": dict(softmax_scale=-1.0),
        "kernel=bogus": dict(kernel="bogus"),
    }
    for label, opts in variants.items():
        kw = {"causal": True, "softmax_scale": 0.125, **opts}
        same(label, lambda: numba_flash.forward(q, k, v, **kw), expect_hit=False)
    bad = {
        "k fp32": (q, tensor((2, 4, 64, 64), "float32"), v),
        "k other d": (q, tensor((2, 4, 64, 32)), v),
        "v other shape": (q, k, tensor((2, 4, 63, 64))),
        "q int32": (tensor((2, 4, 64, 64), "int32"), k, v),
        "H not a multiple of Hkv": (tensor((2, 5, 64, 64)), tensor((2, 2, 64, 64)), tensor((2, 2, 64, 64))),
        "d = 300": tuple(tensor((1, 1, 4, 300)) for _ in range(3)),
    }
    for label, (qq, kk, vv) in bad.items():
        ref = same(label, lambda: numba_flash.forward(qq, kk, vv), expect_hit=False)
        assert ref[1] is not None, f"{label}: expected an error"
    # decode: a good call cached, then num_splits / config / lengths that the checks refuse
    from numba_flash.kernels.decode import decode_config

    qd, kc, vc = tensor((2, 8, 1, 64)), tensor((2, 2, 128, 64)), tensor((2, 2, 128, 64))
    same("decode good", lambda: numba_flash.decode(qd, kc, vc, num_splits=2))
    for label, kw in {
        "num_splits=0": dict(num_splits=0),
        "num_splits=True": dict(num_splits=True),
        "num_splits=2.0": dict(num_splits=2.0),
        "config of another dtype": dict(config=decode_config(64, "float32", 4)),
        "lens float32": dict(cache_seqlens=tensor((2,), "float32")),
        "lens shape": dict(cache_seqlens=tensor((3,), "int32")),
    }.items():
        ref = same(label, lambda: numba_flash.decode(qd, kc, vc, **kw), expect_hit=False)
        assert ref[1] is not None, f"{label}: expected an error"


def check_bound():
    plans.MAX_PLANS = 8
    for n in range(1, 30):
        q, k, v = (tensor((1, 1, n, 64)) for _ in range(3))
        plans.set_enabled(True)
        numba_flash.forward(q, k, v)
        assert plans.cache_info()["size"] <= 8
    q, k, v = (tensor((1, 1, 29, 64)) for _ in range(3))
    hits = plans.cache_info()["hits"]
    numba_flash.forward(q, k, v)
    assert plans.cache_info()["hits"] == hits + 1  # the newest kept, the oldest dropped
    q, k, v = (tensor((1, 1, 1, 64)) for _ in range(3))
    numba_flash.forward(q, k, v)
    assert plans.cache_info()["hits"] == hits + 1


def check_fallback():
    """The cuda.core fallback replays a step through launch.launch on views at the call's pointers:
    those views pack to the bytes the fast path writes (template, pointer slots rewritten)."""
    import random

    import numpy as np

    check_forward()
    check_decode()
    check_backward()
    rnd = random.Random(5)
    n_steps = 0
    for plan in [p for p in plans._plans.values() if p]:
        for step in plan.steps:
            ptrs = [rnd.randrange(1, 1 << 30) * 256 for _ in range(16)]
            fast = np.frombuffer(step.template, np.uint64).copy()
            for slot, buffer, offset in step.patches:
                fast[slot] = ptrs[buffer] + offset
            assert step.launcher.template(step.views(ptrs)) == fast.tobytes()
            n_steps += 1
    assert n_steps > 20, n_steps


def check_threads():
    """Threads replaying plans (and recording new ones while another thread clears them): every
    launch carries its own thread's q, k and v pointers (slot buffers and recording are per thread)."""
    import numpy as np

    plans.set_enabled(True)
    shapes = [(1, 2, 64, 64), (2, 4, 100, 64), (1, 2, 64, 32)]
    mine: dict = {}
    errors = []

    def work(t):
        try:
            for i in range(150):
                shape = shapes[(t + i) % len(shapes)]
                dt = "float16" if (i // 3) % 2 else "float32"
                q, k, v = (tensor(shape, dt) for _ in range(3))
                mine.setdefault(threading.get_ident(), set()).update(x.data_ptr() for x in (q, k, v))
                numba_flash.forward(q, k, v, causal=bool(i % 2))
                if t == 0 and i % 10 == 0:
                    plans.clear()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    THREAD_LOG.clear()
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(THREAD_LOG) == 4 * 150
    for ident, launcher, params in THREAD_LOG:
        slots = np.frombuffer(params, np.uint64)
        inputs = {int(slots[s]) for s in launcher.data_slots[:3]}
        if int(slots[launcher.data_slots[0]]) in host_overhead.MAPS_OF:  # the ws forward: q, k, v in its TMA maps
            inputs = set(host_overhead.MAPS_OF[int(slots[launcher.data_slots[0]])][:3])
        assert inputs <= mine[ident], "a launch carried another thread's pointers"
    assert plans.cache_info()["hits"] > 0


def check_nocontext():
    """A thread with no current CUDA context (PyTorch's autograd device threads bind none): a plan
    replays there inside its device's context (a hit, not the ordinary path every time), launching
    what the ordinary path launches."""
    from numba import cuda

    state = threading.local()
    real = cu.cuCtxGetDevice
    entered = []

    def ctx_get_device():
        if getattr(state, "none", False):
            return cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, 0
        return real()

    class Device(pytypes.SimpleNamespace):  # cuda.gpus[i]: a context manager making device i current
        def __enter__(self):
            entered.append(threading.get_ident())
            self.saved, state.none = getattr(state, "none", False), False
            return self

        def __exit__(self, *exc):
            state.none = self.saved

    gpus = cuda.gpus
    cu.cuCtxGetDevice, cuda.gpus = ctx_get_device, [Device(**vars(gpus[0]))]
    errors = []

    def work():
        state.none = True
        try:
            for label, shape, dt, det in (("backward fp16", (2, 4, 100, 64), "float16", True),
                                          ("backward fp16 atomic", (1, 2, 64, 128), "float16", False),
                                          ("backward fp32", (1, 2, 64, 64), "float32", True)):
                q, k, v, out, dout = (tensor(shape, dt) for _ in range(5))
                lse = tensor(shape[:-1], "float32")
                entered.clear()
                same(f"no context: {label}", lambda: numba_flash.backward(q, k, v, out, lse, dout, causal=True,
                                                                          deterministic=det))
                assert len(entered) >= 3, entered  # every call (off, first, hit) ran inside the device's context
                assert launch.current_device_id() is None  # and left the thread as it found it
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        th = threading.Thread(target=work)
        th.start()
        th.join()
    finally:
        cu.cuCtxGetDevice, cuda.gpus = real, gpus
    assert not errors, errors


def check_off():
    """Run with NUMBA_FLASH_PLAN_CACHE=0: no plans at all."""
    q, k, v = (tensor((1, 2, 64, 64)) for _ in range(3))
    numba_flash.forward(q, k, v)
    numba_flash.forward(q, k, v)
    info = plans.cache_info()
    assert not info["enabled"] and info["size"] == 0 and info["hits"] == info["misses"] == 0, info


if __name__ == "__main__":
    for name in sys.argv[1:]:
        globals()[f"check_{name}"]()
        print(f"{name}: ok")
