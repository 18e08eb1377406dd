"""scripts/fuzz.py run as a user runs it: a tiny draw on the simulator passes, an injected error fails.

The script runs as a subprocess from the repository root (it finds numba_flash and reference on
its own); under the simulator the environment set by conftest.py (NUMBA_ENABLE_CUDASIM=1) is
inherited. Shapes stay tiny: simulated kernels run every thread in Python.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import needs_gpu

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "scripts" / "fuzz.py"
TINY = ["--max-n", "40", "--max-d", "40", "--seed", "0"]
VERDICTS = ("passed", "failed", "refused")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(FUZZ), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def load_json(out_dir):
    paths = sorted(Path(out_dir).glob("fuzz-*.json"))
    assert len(paths) == 1, paths
    return json.loads(paths[0].read_text())


def check_counts(doc, proc, n_problems):
    """Every problem counted once: per family/dtype and in the printed total."""
    assert len(doc["problems"]) == n_problems
    for key, c in doc["summary"].items():
        assert c["drawn"] == sum(c[v] for v in VERDICTS), (key, c)
    assert sum(c["drawn"] for c in doc["summary"].values()) == n_problems
    total = re.search(r"total\s+drawn\s+(\d+)\s+passed\s+(\d+)\s+failed\s+(\d+)\s+refused\s+(\d+)", proc.stdout)
    assert total, proc.stdout
    drawn, *counts = map(int, total.groups())
    assert drawn == n_problems == sum(counts)
    assert counts == [sum(c[v] for c in doc["summary"].values()) for v in VERDICTS]


def test_tiny_draw_passes_on_every_family(tmp_path):
    proc = run("--problems", 6, *TINY, "--out", tmp_path, "--quiet")  # every family twice (they take turns)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = load_json(tmp_path)
    check_counts(doc, proc, 6)
    assert {p["spec"]["family"] for p in doc["problems"]} == {"forward", "backward", "decode"}
    assert all(p["verdict"] == "passed" for p in doc["problems"])
    assert all(p["errors"] and p["bounds"] for p in doc["problems"] if p["verdict"] == "passed")
    assert doc["device"] and doc["versions"]["numba"]


def test_injected_error_fails_and_the_fail_line_reproduces(tmp_path):
    proc = run("--problems", 2, *TINY, "--families", "forward", "decode", "--inject-error", "--out", tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = load_json(tmp_path)
    check_counts(doc, proc, 2)
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL ")]
    assert fails and len(fails) == sum(c["failed"] for c in doc["summary"].values())
    assert all(re.search(r"err \S+ > bound \S+", line) for line in fails), fails
    again = run("--repro", fails[0], "--inject-error")  # the one line is enough to rerun the problem
    assert again.returncode == 1 and fails[0] in again.stdout, again.stdout + again.stderr
    clean = run("--repro", fails[0])
    assert clean.returncode == 0, clean.stdout + clean.stderr


def test_time_budget_stops_the_draw():
    proc = run("--problems", 50, *TINY, "--families", "decode", "--time-budget-s", 0, "--quiet")
    assert proc.returncode == 0 and "time budget reached" in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"total\s+drawn\s+0\b", proc.stdout), proc.stdout


@pytest.mark.gpu
@needs_gpu
def test_fuzz_on_the_gpu(tmp_path):
    proc = run("--problems", 200, "--max-n", 2048, "--seed", 0, "--out", tmp_path, "--time-budget-s", 400,
               "--quiet", timeout=560)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    doc = load_json(tmp_path)
    check_counts(doc, proc, len(doc["problems"]))
