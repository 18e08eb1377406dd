"""scripts/fuzz.py run as a user runs it: a tiny draw on the simulator passes, an injected error fails.
Its draw imported: the same for every machine.

The script runs as a subprocess from the repository root (it finds numba_flash and reference on
its own); under the simulator the environment set by conftest.py (NUMBA_ENABLE_CUDASIM=1) is
inherited. Shapes stay tiny: simulated kernels run every thread in Python.
"""
import argparse
import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_helpers import needs_gpu

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "scripts" / "fuzz.py"
TINY = ["--max-n", "40", "--max-d", "40", "--seed", "0"]
VERDICTS = ("passed", "failed", "refused", "skipped")


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_under_test", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    total = re.search(r"total\s+drawn\s+(\d+)\s+passed\s+(\d+)\s+failed\s+(\d+)\s+refused\s+(\d+)\s+skipped\s+(\d+)",
                      proc.stdout)
    assert total, proc.stdout
    drawn, *counts = map(int, total.groups())
    assert drawn == n_problems == sum(counts)
    assert counts == [sum(c[v] for c in doc["summary"].values()) for v in VERDICTS]


def test_tiny_draw_passes_on_every_family(tmp_path):
    proc = run("--problems", 6, *TINY, "--out", tmp_path, "--quiet")  # every family twice (they take turns)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = load_json(tmp_path)
    check_counts(doc, proc, 6)
    assert {p["spec"]["family"] for p in doc["problems"] if p["verdict"] == "passed"} == {"forward", "backward", "decode"}
    # without ml_dtypes the bfloat16 problems are skipped, not run as another dtype
    assert all(p["verdict"] == "passed" or (p["verdict"] == "skipped" and p["spec"]["dtype"] == "bfloat16"
                                            and "ml_dtypes" in p["message"]) for p in doc["problems"])
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


def test_draw_is_the_same_on_every_machine(monkeypatch):
    """(seed, idx) gives one problem whether or not ml_dtypes and PyTorch CUDA are there (the draw took
    bfloat16 and the backend's random number only where they were)."""
    fuzz = load_fuzz()
    args = argparse.Namespace(families=list(fuzz.FAMILIES), max_n=8192, max_d=256, max_work=2**31, max_bh=None,
                              torch_fraction=0.7)
    draws = []
    for have in (False, True):
        monkeypatch.setattr(fuzz, "ml_dtypes", object() if have else None)
        monkeypatch.setattr(fuzz, "HAVE_TORCH_CUDA", have)
        draws.append([fuzz.draw(seed, idx, args) for seed in (0, 7) for idx in range(150)])
    assert draws[0] == draws[1]
    assert {s["dtype"] for s in draws[0]} == set(fuzz.DTYPES) and {s["backend"] for s in draws[0]} == {"numpy", "torch"}


def test_available_remaps_or_skips(monkeypatch):
    fuzz = load_fuzz()
    monkeypatch.setattr(fuzz, "HAVE_TORCH_CUDA", False)
    monkeypatch.setattr(fuzz, "ml_dtypes", None)
    spec = dict(family="backward", dtype="float16", backend="torch", B=1, H=2, Hkv=1, Nq=8, Nk=8, d=16, via="autograd")
    ran, why = fuzz.available(spec)
    assert not why and ran["backend"] == "numpy" and ran["via"] == "api" and spec["backend"] == "torch"
    assert "ml_dtypes" in fuzz.available(dict(spec, dtype="bfloat16"))[1]
    assert "host references" in fuzz.available(dict(spec, Nq=2**12, Nk=2**12, H=4))[1]
    monkeypatch.setattr(fuzz, "HAVE_TORCH_CUDA", True)
    assert fuzz.available(dict(spec, dtype="bfloat16")) == (dict(spec, dtype="bfloat16"), "")


def test_jobs_merge_into_one_summary_and_json(tmp_path):
    proc = run("--problems", 6, *TINY, "--jobs", 2, "--out", tmp_path, "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes" in proc.stdout
    doc = load_json(tmp_path)
    check_counts(doc, proc, 6)
    assert [p["spec"]["idx"] for p in doc["problems"]] == list(range(6)) and doc["jobs"] == 2
    assert not list(tmp_path.glob("fuzz-parts-*")), "the workers' files are removed once merged"
    one = run("--problems", 6, *TINY, "--out", tmp_path / "one", "--quiet")  # the same problems, one process
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert [p["spec"] for p in load_json(tmp_path / "one")["problems"]] == [p["spec"] for p in doc["problems"]]


def test_sigterm_keeps_the_json(tmp_path):
    """The JSON is rewritten while the draw runs; SIGTERM (run.sh's limit) writes the summary and the JSON."""
    proc = subprocess.Popen([sys.executable, str(FUZZ), "--problems", "500", *TINY, "--families", "decode", "--quiet",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    deadline = time.time() + 120
    while not list(tmp_path.glob("fuzz-*.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)  # the first write, WRITE_EVERY_S into the draw
    assert list(tmp_path.glob("fuzz-*.json")), "no JSON while the draw ran"
    partial = load_json(tmp_path)
    assert partial["interrupted"] and partial["problems"]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    doc = load_json(tmp_path)
    assert "stopped by SIGTERM" in out and doc["stopped_by_sigterm"] and "interrupted" not in doc, out + err
    assert len(doc["problems"]) >= len(partial["problems"])


@pytest.mark.gpu
@needs_gpu
def test_fuzz_on_the_gpu(tmp_path):
    proc = run("--problems", 200, "--max-n", 2048, "--seed", 0, "--out", tmp_path, "--time-budget-s", 400,
               "--quiet", timeout=560)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    doc = load_json(tmp_path)
    check_counts(doc, proc, len(doc["problems"]))
