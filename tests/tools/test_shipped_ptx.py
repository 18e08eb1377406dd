"""The shipped kernels' sm_90 PTX equals the recorded hashes (tests/shipped_ptx.json), family by family.

CI checks the CI_PATTERNS subset (a few builds of every family); `python tests/shipped_ptx.py check` checks
all of them. A restructuring must pass unchanged; a deliberate change to a kernel re-records the JSON and
re-validates that kernel on the GPU.
"""
import json
import os
import subprocess
import sys

import pytest

import shipped_ptx

FAMILIES = ("fwd-mma/", "fwd-mma-small/", "fwd-wgmma/", "fwd-ws/", "fwd-tf32x", "fwd-simt/", "bwd-mma/", "bwd-tf32x",
            "bwd-simt/", "decode/", "fwd-mma-varlen/", "fwd-wgmma-varlen/", "fwd-ws-varlen/", "bwd-mma-varlen/",
            "decode-paged/", "decode-mods/")


def test_every_case_is_recorded_and_every_family_is_checked_in_ci():
    recorded = set(json.loads(shipped_ptx.GOLDEN.read_text())["cases"])
    assert set(shipped_ptx.selected()) == recorded  # a new shipped build is recorded before it ships
    ci = shipped_ptx.selected(ci=True)
    for family in FAMILIES:
        assert any(n.startswith(family) for n in ci), family
    assert all(any(n.startswith(f) for f in FAMILIES) for n in recorded)


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_ptx_unchanged(family):
    # its own process, off the simulator: the check patches cuda.jit and the launcher, and compiles with NVVM
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, str(shipped_ptx.HERE / "shipped_ptx.py"), "check", "--ci", "--only", family,
                        "--jobs", "1"], capture_output=True, text=True, cwd=str(shipped_ptx.ROOT), env=env,
                       timeout=1500)
    if r.returncode == shipped_ptx.SKIP:
        pytest.skip(r.stdout.strip()[-300:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " cases unchanged" in r.stdout
