"""numba_flash.jit_cache: compiled kernels on disk, keyed on everything that decides the machine code.

Without a GPU: the key (stable across processes and hash seeds, sensitive to every build argument), and the
store / load / corrupt-file / off paths with cuda.jit replaced by a stand-in whose "kernel" pickles. On a
GPU (marked gpu): a second process loads what the first compiled, runs no compiler, and gives the same bits.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from numba_flash import jit_cache as jc
from numba_flash.blocks.mods import NO_MODS, Mods
from numba_flash.configs import MMA_TABLE

ROOT = Path(__file__).resolve().parents[2]
TILE = MMA_TABLE[64, True]  # flags {grid_bh_x, smem_epilogue, warp_skip}: a set, whose order is the hash seed's


def test_key_is_the_same_in_every_process():
    code = ("from numba_flash import jit_cache as jc; from numba_flash.configs import MMA_TABLE; "
            "print(jc.digest(('mma_forward', MMA_TABLE[64, True], True, 'float16'), 'sig', {'fastmath': True}, (9, 0)))")
    seen = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, NUMBA_ENABLE_CUDASIM="1")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout.strip())
    assert len(seen) == 1, seen


def test_key_changes_with_every_input():
    base = dict(key=("mma_forward", TILE, True, "float16", False, NO_MODS), signature="sig", options={}, cc=(9, 0))

    def d(**over):
        a = {**base, **over}
        return jc.digest(a["key"], a["signature"], a["options"], a["cc"])

    variants = [
        d(),
        d(key=("mma_forward", dataclasses.replace(TILE, flags=TILE.flags - {"warp_skip"}), True, "float16", False,
               NO_MODS)),
        d(key=("mma_forward", TILE, False, "float16", False, NO_MODS)),
        d(key=("mma_forward", TILE, True, "bfloat16", False, NO_MODS)),
        d(key=("mma_forward", TILE, True, "float16", False, Mods(softcap=True))),
        d(key=("mma_dq", TILE, True, "float16", False, NO_MODS)),
        d(signature="sig2"),
        d(options={"max_registers": 128}),
        d(cc=(8, 0)),
    ]
    assert len(set(variants)) == len(variants)


def test_key_covers_the_package_source(monkeypatch):
    before = jc.digest("k", "s", {}, (9, 0))
    monkeypatch.setattr(jc, "source_digest", lambda: "an edited kernel")
    assert jc.digest("k", "s", {}, (9, 0)) != before


def test_unkeyable_arguments_are_refused():
    with pytest.raises(TypeError, match="cannot key a build argument of type function"):
        jc.canonical(("x", lambda: 0))


class _Overload:  # what a compiled kernel is to the cache: something pickle can store
    def __init__(self, tag):
        self.tag = tag


class _Dispatcher:
    def __init__(self, fn, compiled):
        self.fn, self.overloads, self.compiled = fn, {}, compiled
        if compiled:
            self.overloads[("sig",)] = _Overload(fn.__name__)

    def add_overload(self, kernel, argtypes):
        self.overloads[tuple(argtypes)] = kernel

    def disable_compile(self):
        self.compile_disabled = True


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """cuda.jit and the device replaced: 'compiling' counts calls; the cache directory is tmp_path."""
    calls = {"compiles": 0}

    def jit(signature=None, **options):
        def deco(fn):
            if signature is not None:
                calls["compiles"] += 1
            return _Dispatcher(fn, signature is not None)
        return deco

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMBA_FLASH_CACHE", raising=False)  # another test's process may have turned it off
    monkeypatch.setattr(jc, "enabled", lambda: os.environ.get("NUMBA_FLASH_CACHE", "1") != "0")
    monkeypatch.setattr(jc, "_cc", lambda: (9, 0))
    monkeypatch.setattr(jc.cuda, "jit", jit)
    for k in jc._STATS:
        monkeypatch.setitem(jc._STATS, k, 0)
    return calls


def kernel_fn():
    pass


SIG = "void(float32[:])"


def test_stores_then_loads(fake_gpu, tmp_path):
    first = jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    assert fake_gpu["compiles"] == 1 and len(list(tmp_path.glob("*.nbk"))) == 1
    again = jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    assert fake_gpu["compiles"] == 1  # loaded, not compiled
    (loaded,) = again.overloads.values()
    assert loaded.tag == next(iter(first.overloads.values())).tag and again.compile_disabled
    jc.compile_kernel(("fam", 2), SIG, kernel_fn)  # another specialisation: another file
    assert fake_gpu["compiles"] == 2 and len(list(tmp_path.glob("*.nbk"))) == 2
    info = jc.info()
    assert (info["hits"], info["misses"], info["stores"], info["entries"]) == (1, 2, 2, 2)
    assert jc.is_cached(("fam", 1), SIG) and not jc.is_cached(("fam", 3), SIG)


def test_a_corrupt_file_is_compiled_again_with_a_warning(fake_gpu, tmp_path):
    jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    (path,) = tmp_path.glob("*.nbk")
    path.write_bytes(b"not a pickle")
    with pytest.warns(RuntimeWarning, match="could not load"):
        jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    assert fake_gpu["compiles"] == 2
    assert isinstance(pickle.loads(path.read_bytes()), _Overload)  # overwritten with a good one


def test_off_switch(fake_gpu, tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_FLASH_CACHE", "0")
    jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    assert fake_gpu["compiles"] == 2 and not list(tmp_path.glob("*.nbk"))


@pytest.mark.skipif(not jc.nb_config.ENABLE_CUDASIM, reason="the simulator's own path")
def test_the_simulator_never_caches(tmp_path, monkeypatch):
    """Under the simulator there is no machine code: builds are cuda.jit's, and nothing is written."""
    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMBA_FLASH_CACHE", raising=False)
    import numpy as np

    from numba_flash.kernels import mma_forward

    assert not jc.enabled()
    x = np.random.default_rng().standard_normal((1, 2, 16, 16), dtype=np.float32).astype(np.float16)
    mma_forward.build.cache_clear()  # a fresh build, not one an earlier test left in memory
    import numba_flash

    numba_flash.forward(x, x, x, causal=True, kernel="mma")
    assert not list(tmp_path.glob("*"))


def test_without_a_gpu_builds_are_cuda_jits(fake_gpu, tmp_path, monkeypatch):
    """No device to key on (CudaSupportError): cuda.jit compiles as it would, nothing is stored or reported cached."""
    def no_gpu():
        raise jc.CudaSupportError("no driver")

    monkeypatch.setattr(jc, "_cc", no_gpu)
    jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    assert fake_gpu["compiles"] == 2 and not list(tmp_path.glob("*"))
    assert not jc.is_cached(("fam", 1), SIG)


def test_a_failed_store_leaves_no_file(fake_gpu, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise pickle.PicklingError("not today")

    monkeypatch.setattr(jc.pickle, "dumps", refuse)
    with pytest.warns(RuntimeWarning, match="could not write"):
        jc.compile_kernel(("fam", 1), SIG, kernel_fn)
    assert not list(tmp_path.glob("*"))


def _build(tag):
    return jc.compile_kernel(("fam", tag), SIG, kernel_fn)


def test_lookup_says_cached_without_compiling(fake_gpu, tmp_path):
    """lookup runs the build up to compile_kernel and answers from the file: nothing compiled, stored or logged."""
    found = jc.lookup(lambda: _build(1))
    assert found["state"] == "not cached" and found["family"] == "fam"
    assert fake_gpu["compiles"] == 0 and not list(tmp_path.glob("*")) and jc._STATS["misses"] == 0
    _build(1)
    assert fake_gpu["compiles"] == 1
    found = jc.lookup(lambda: _build(1))
    assert found["state"] == "cached" and Path(found["file"]).exists() and fake_gpu["compiles"] == 1
    assert jc.lookup(lambda: _build(2))["state"] == "not cached"
    assert jc.lookup(lambda: "a dispatcher from an lru_cache")["state"] == "built in this process"
    _build(2)  # compile_kernel works again after a lookup (the probe is off)
    assert fake_gpu["compiles"] == 2


def test_lookup_off_and_without_a_gpu(fake_gpu, monkeypatch):
    monkeypatch.setenv("NUMBA_FLASH_CACHE", "0")
    assert jc.lookup(lambda: _build(1))["state"] == "off"
    monkeypatch.delenv("NUMBA_FLASH_CACHE")

    def no_gpu():
        raise jc.CudaSupportError("no driver")

    monkeypatch.setattr(jc, "_cc", no_gpu)
    assert jc.lookup(lambda: _build(1))["state"] == "no GPU"
    assert fake_gpu["compiles"] == 0


def test_log_has_family_seconds_and_how(fake_gpu):
    before = len(jc.log())
    _build(1)
    _build(1)
    (fam1, s1, how1), (fam2, s2, how2) = jc.log()[before:]
    assert (fam1, how1, fam2, how2) == ("fam", "compiled", "fam", "loaded") and s1 >= 0 and s2 >= 0


def test_explain_says_whether_the_forward_kernel_is_cached(fake_gpu, tmp_path, monkeypatch):
    """numba-flash explain's cache line for a real family: the build's key and signature, found without compiling;
    cached once the file is there."""
    from numba_flash import api, cli

    cfg = api.mma_config(64, True)
    facts = cli.kernel_facts("mma", cfg, True, "float16")
    family = "wgmma_forward" if cfg.has("wgmma") else "mma_forward"
    module = __import__(f"numba_flash.kernels.{family}", fromlist=["build"])
    unbuilt = dataclasses.replace(facts, jit=lambda: module.build.__wrapped__(cfg, True, "float16"))  # no lru hit
    words = cli.cache_words(unbuilt)
    assert words.startswith("not cached") and fake_gpu["compiles"] == 0
    found = jc.lookup(unbuilt.jit)
    Path(found["file"]).write_bytes(b"")  # what a GPU run would have stored
    assert cli.cache_words(unbuilt).startswith(f"cached ({found['file']})")
    monkeypatch.setenv("NUMBA_FLASH_CACHE", "0")
    assert cli.cache_words(unbuilt).startswith("off")


# --------------------------------------------------------------------------------------------
# Real GPU: two processes
# --------------------------------------------------------------------------------------------
from gpu_helpers import needs_gpu  # noqa: E402

CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import numba_flash
    from numba_flash import jit_cache
    t_import = time.perf_counter() - t0
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((2, 4, 300, 64), dtype=np.float32).astype(np.float16) for _ in range(4))
    t1 = time.perf_counter()
    out, lse = numba_flash.forward(q, k, v, causal=True)
    t_fwd = time.perf_counter() - t1
    t2 = time.perf_counter()
    dq, dk, dv = numba_flash.backward(q, k, v, out, lse, do, causal=True)
    t_bwd = time.perf_counter() - t2
    d, = numba_flash.decode(q[:, :, :2], k, v)[:1]
    info = jit_cache.info()
    print(json.dumps(dict(import_s=t_import, forward_s=t_fwd, backward_s=t_bwd, info=info,
                          bits=[a.view(np.uint16).tobytes().hex()[:4096] for a in (out, dq, dk, dv, d)]
                          + [lse.tobytes().hex()[:4096]])))
""")


@pytest.mark.gpu
@needs_gpu
def test_second_process_loads_instead_of_compiling(tmp_path):
    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=str(tmp_path / "cache"), NUMBA_FLASH_CACHE="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    print(f"cold: forward {cold['forward_s']:.2f} s, backward {cold['backward_s']:.2f} s, {cold['info']}")
    print(f"warm: forward {warm['forward_s']:.2f} s, backward {warm['backward_s']:.2f} s, {warm['info']}")
    assert cold["info"]["misses"] > 0 and cold["info"]["hits"] == 0
    assert warm["info"]["misses"] == 0 and warm["info"]["hits"] == cold["info"]["misses"]
    assert warm["bits"] == cold["bits"]  # the same machine code, the same results
    assert warm["forward_s"] < cold["forward_s"] and warm["backward_s"] < cold["backward_s"]


@pytest.mark.gpu
@needs_gpu
def test_warmup_prints_each_kernel_then_loads_it(tmp_path):
    """numba-flash warmup: one line per kernel specialisation with its seconds, compiled on the first run and
    loaded on the second (a fresh process on the same cache directory)."""
    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=str(tmp_path / "cache"), NUMBA_FLASH_CACHE="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "numba_flash", "warmup", "--shape", "1", "2", "64", "64",
                            "--causal", "--backward"], env=env, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        print(r.stdout)
        runs.append([line.split() for line in r.stdout.splitlines() if line.startswith("  ")])
    cold, warm = runs
    assert cold and [row[0] for row in cold] == [row[0] for row in warm]
    assert all(row[-1] == "compiled" for row in cold) and all(row[-1] == "loaded" for row in warm)
    assert any(row[0] in ("mma_forward", "wgmma_forward") for row in cold)
