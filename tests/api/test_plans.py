"""numba_flash.plans: a repeated call replays the first call's launches for new pointers.

Plans exist only in GPU mode, so the comparisons run in a subprocess with the driver and PyTorch
stubbed (tests/plans_stub_check.py): every launch of a call through a plan (its first call and a
hit) must equal, byte for byte, the launch of the same call with plans off; errors and warnings
too. On the GPU, tests/api/test_launch.py::test_launch_matches_dispatcher_bitwise compares the bits of
the results of replayed calls with Numba's dispatcher.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_flash
from numba_flash import plans

ROOT = Path(__file__).resolve().parents[2]


def _stub_check(*names, env=None):
    env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "plans_stub_check.py"), *names],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


@pytest.mark.parametrize("check", ["forward", "decode", "backward", "errors", "bound", "fallback", "threads",
                                   "nocontext"])
def test_plans_launch_what_the_ordinary_path_launches(check):
    """Same kernels, grids, blocks, shared memory, streams and parameter bytes; same errors and
    warnings; alignment, aliasing, NumPy lengths, uncacheable calls and the bound (see the script)."""
    assert f"{check}: ok" in _stub_check(check)


def test_env_var_turns_plans_off():
    assert "off: ok" in _stub_check("off", env={"NUMBA_FLASH_PLAN_CACHE": "0"})


def test_no_plans_in_the_simulator_or_for_numpy(rng):
    """The simulator has no parameter buffers and NumPy inputs are copied per call: ordinary path."""
    q, k, v = (rng.standard_normal((1, 2, 16, 16), dtype=np.float32) for _ in range(3))
    assert plans._key(numba_flash.api._forward, (q, k, v), (False, None, "auto")) is None
    before = plans.cache_info()
    out, _ = numba_flash.forward(q, k, v)
    out2, _ = numba_flash.forward(q, k, v)
    assert np.array_equal(out, out2) and plans.cache_info()["size"] == before["size"]
