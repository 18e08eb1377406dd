"""Compiled kernels kept on disk, so a new process does not wait for NVVM and ptxas again.

Every kernel family builds its kernels through ``compile_kernel(key, signature, fn, **options)``,
which is ``cuda.jit(signature, **options)(fn)`` plus a file per specialisation: Numba's own
serialised kernel (its PTX and the cubin for this GPU), written atomically after the first compile
and loaded instead of compiling afterwards.

The file name is a SHA-256 of everything that decides the machine code:
- the specialisation: the family's build arguments (tile / config data, causal, dtype, mods, ...),
  the kernel's signature and its jit options (fastmath, max_registers); a user mod enters as its
  ``cache_key`` (blocks/mods.py: its bytecode, constants, names, closure and global values, aux types);
- the source of the whole numba_flash package (any edit to a kernel or a building block is a miss);
- the GPU's compute capability;
- the versions of Python, numba, numba-cuda, cuda-bindings and the NVVM / nvrtc / nvJitLink wheels, and
  numba's code-generation settings (NUMBA_OPT, NUMBA_CUDA_DEBUGINFO, the default PTX target).

Where: ``$NUMBA_FLASH_CACHE_DIR``, else ``$XDG_CACHE_HOME/numba_flash``, else ``~/.cache/numba_flash``.
``NUMBA_FLASH_CACHE=0`` turns it off. Under the CUDA simulator nothing is cached (there is no
machine code). An unreadable file is compiled again and overwritten, with a ``RuntimeWarning``.
``info()`` reports the directory, its entries and this process's hits and misses; ``is_cached(key,
signature, **options)`` says whether a specialisation is on disk, and ``lookup(build)`` whether the kernel a
family's build function returns is, without compiling it. ``log()`` lists this process's specialisations:
family, seconds, and whether each was compiled or loaded.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import sys
import tempfile
import threading
import time
import warnings
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import numpy as np
from numba import config as nb_config
from numba import cuda
from numba.cuda.cudadrv.error import CudaSupportError  # (numba.cuda has no such name under the simulator)

SUFFIX = ".nbk"
FORMAT = 1  # bump when the file layout changes
_STATS = {"hits": 0, "misses": 0, "stores": 0, "errors": 0}
_LOCK = threading.Lock()
_LOG: list = []  # (family, seconds, "loaded" | "compiled" | "uncached"), one per compile_kernel call
_PROBE = threading.local()  # .active: compile_kernel raises _Probe instead of compiling (lookup)


class _Probe(Exception):
    """What compile_kernel was asked to build, raised instead of building it (``lookup``)."""

    def __init__(self, key, signature, options):
        super().__init__(key)
        self.key, self.signature, self.options = key, signature, options


def enabled() -> bool:
    return os.environ.get("NUMBA_FLASH_CACHE", "1") != "0" and not nb_config.ENABLE_CUDASIM


def cache_dir() -> Path:
    explicit = os.environ.get("NUMBA_FLASH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "numba_flash"


def canonical(x):
    """A process-independent, hashable rendering of a build argument (sets sorted, dataclasses by field)."""
    if isinstance(x, (str, bytes, bool, int, float, type(None))):
        return (type(x).__name__, x)
    if isinstance(x, np.dtype):
        return ("dtype", x.str)
    if hasattr(x, "cache_key") and not isinstance(x, type):  # a user mod (blocks.mods.UserMod): its code's identity
        return ("cache_key", canonical(x.cache_key))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__qualname__,) + tuple((f.name, canonical(getattr(x, f.name))) for f in dataclasses.fields(x))
    if isinstance(x, (set, frozenset)):
        return ("set",) + tuple(sorted((canonical(v) for v in x), key=repr))
    if isinstance(x, dict):
        return ("dict",) + tuple(sorted(((canonical(k), canonical(v)) for k, v in x.items()), key=repr))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(canonical(v) for v in x)
    if isinstance(x, np.generic):
        return canonical(x.item())
    raise TypeError(f"jit_cache: cannot key a build argument of type {type(x).__name__} ({x!r})")


@lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every .py file of the package, by relative path."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def toolchain() -> tuple:
    names = ("numba", "numba-cuda", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-nvcc", "nvidia-nvvm",
             "nvidia-nvjitlink", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvcc-cu12", "nvidia-nvjitlink-cu12")
    versions = []
    for name in names:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            pass
    # what cuda.jit reads from numba's config for a kernel's code (NUMBA_CUDA_DEBUGINFO also turns LTO off)
    numba_options = tuple((n, repr(getattr(nb_config, n, None))) for n in ("OPT", "CUDA_DEBUGINFO_DEFAULT",
                                                                        "CUDA_DEFAULT_PTX_CC"))
    return (sys.version.split()[0], tuple(versions), numba_options, os.environ.get("CUDA_HOME", ""),
            os.environ.get("CUDA_PATH", ""))


def _cc() -> tuple:
    return tuple(cuda.get_current_device().compute_capability)


def digest(key, signature, options: dict, cc: tuple) -> str:
    parts = (FORMAT, canonical(key), str(signature), canonical(options), cc, source_digest(), toolchain())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _path(key, signature, options) -> Path:
    return cache_dir() / f"{digest(key, signature, options, _cc())}{SUFFIX}"


def is_cached(key, signature, **options) -> bool:
    """Whether this specialisation's file exists for the current GPU (False when caching is off or there is no GPU)."""
    if not enabled():
        return False
    try:
        return _path(key, signature, options).exists()
    except CudaSupportError:
        return False


def lookup(build) -> dict:
    """Whether the kernel ``build()`` returns (a family's build function with its arguments bound) is on disk,
    without compiling it: build runs with compile_kernel raising what it was asked for. Returns dict(state=...):
    "cached" or "not cached" (with the file), "built in this process" (build's own lru_cache answered), "off" (no
    cache: NUMBA_FLASH_CACHE=0, the simulator), or "no GPU" (the key holds the GPU's compute capability)."""
    _PROBE.active = True
    try:
        build()
    except CudaSupportError:  # the build asked the GPU for something before its compile_kernel
        return dict(state="no GPU")
    except _Probe as p:
        if not enabled():
            return dict(state="off")
        try:
            path = _path(p.key, p.signature, p.options)
        except CudaSupportError:
            return dict(state="no GPU")
        return dict(state="cached" if path.exists() else "not cached", file=str(path), family=_family(p.key))
    finally:
        _PROBE.active = False
    return dict(state="built in this process")


def _family(key) -> str:
    return str(key[0] if isinstance(key, tuple) and key else key)


def log() -> list:
    """This process's specialisations in order: (family, seconds, "loaded" | "compiled" | "uncached")."""
    with _LOCK:
        return list(_LOG)


def compile_kernel(key, signature, fn, **options):
    """``cuda.jit(signature, **options)(fn)``, loaded from / stored to the disk cache where it is enabled.

    key: the family's name and build arguments (anything ``canonical`` renders). Returns a dispatcher with
    exactly one compiled overload, as cuda.jit with a signature does.
    """
    if getattr(_PROBE, "active", False):
        raise _Probe(key, signature, options)
    t0 = time.perf_counter()
    dispatcher, how = _compile_or_load(key, signature, fn, options)
    with _LOCK:
        _LOG.append((_family(key), time.perf_counter() - t0, how))
    return dispatcher


def _compile_or_load(key, signature, fn, options):
    if not enabled():
        return cuda.jit(signature, **options)(fn), "uncached"
    try:
        path = _path(key, signature, options)
    except CudaSupportError:  # no GPU to compile for: whatever cuda.jit does there
        return cuda.jit(signature, **options)(fn), "uncached"
    if path.exists():
        try:
            from numba.cuda.core import sigutils

            kernel = pickle.loads(path.read_bytes())
            dispatcher = cuda.jit(**options)(fn)  # lazy: given the loaded overload instead of compiling
            dispatcher.add_overload(kernel, sigutils.normalize_signature(signature)[0])
            dispatcher._specialized = True  # as cuda.jit(signature) leaves it: one overload, no call-time compiles
            dispatcher.disable_compile()
            with _LOCK:
                _STATS["hits"] += 1
            return dispatcher, "loaded"
        except Exception as e:  # a truncated or foreign file: compile again and overwrite it
            with _LOCK:
                _STATS["errors"] += 1
            warnings.warn(f"numba_flash.jit_cache: could not load {path} ({type(e).__name__}: {e}); compiling again",
                          RuntimeWarning, stacklevel=3)
    dispatcher = cuda.jit(signature, **options)(fn)
    with _LOCK:
        _STATS["misses"] += 1
    _store(path, next(iter(dispatcher.overloads.values())))
    return dispatcher, "compiled"


def _store(path: Path, kernel) -> None:
    tmp = None
    try:
        data = pickle.dumps(kernel, protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
        with _LOCK:
            _STATS["stores"] += 1
    except Exception as e:  # a read-only home, or a kernel that does not pickle: it still runs
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        warnings.warn(f"numba_flash.jit_cache: could not write {path} ({type(e).__name__}: {e}); the kernel runs, "
                      "uncached", RuntimeWarning, stacklevel=3)


def info() -> dict:
    """The cache directory, whether it is on, its files and bytes, and this process's hits / misses / stores."""
    d = cache_dir()
    files = sorted(d.glob(f"*{SUFFIX}")) if d.exists() else []
    return dict(dir=str(d), enabled=enabled(), entries=len(files), bytes=sum(f.stat().st_size for f in files),
                **dict(_STATS))


def clear() -> int:
    """Delete the cache's files; returns how many."""
    d = cache_dir()
    n = 0
    for f in (d.glob(f"*{SUFFIX}") if d.exists() else []):
        f.unlink(missing_ok=True)
        n += 1
    return n
