"""scripts/hand_calc.py and scripts/exercises.py, run as a reader would run them; the sanitizer cases
(scripts/sanitize_case.py) and the GPU runner's commands (scripts/gpu/run.sh --dry-run), checked without a GPU.

Each script runs as a subprocess with the current interpreter, from a directory outside the
repository (so the scripts must find reference/ on their own), and its --json output is checked
against numbers computed here independently.
"""

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAND_CALC = ROOT / "scripts" / "hand_calc.py"
EXERCISES = ROOT / "scripts" / "exercises.py"
SANITIZE = ROOT / "scripts" / "sanitize_case.py"
RUN_SH = ROOT / "scripts" / "gpu" / "run.sh"


def run(script, *args, cwd):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


def run_json(script, *args, cwd):
    proc = run(script, *args, "--json", cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --- hand_calc.py --------------------------------------------------------------------------------


def test_hand_calc_reproduces_the_chapter(tmp_path):
    out = run_json(HAND_CALC, cwd=tmp_path)
    assert out["ok"] and out["chapter_input"]
    assert out["l"] == 1.2034 and out["O"] == 36.88
    assert [t["order"] for t in out["traces"]] == [[0, 1], [1, 0]]  # both orders by default
    chapter = [c for c in out["checks"] if c["name"].startswith("chapter:")]
    assert len(chapter) >= 15 and all(c["ok"] for c in chapter)
    # independent arithmetic: ℓ = e^-4 + e^-2 + e^-3 + 1, O = Σ exp(x - 5)·v / ℓ
    l = sum(math.exp(x - 5) for x in (1, 3, 2, 5))
    O = sum(math.exp(x - 5) * v for x, v in zip((1, 3, 2, 5), (10, 20, 30, 40))) / l
    for t in out["traces"]:
        assert t["l"] == pytest.approx(l, rel=1e-14) and t["O"] == pytest.approx(O, rel=1e-14)
        assert t["steps"][0]["m_old"] == "-inf" and t["steps"][0]["alpha"] == 0
    natural = out["traces"][0]["steps"]
    assert natural[1]["alpha"] == pytest.approx(math.exp(-2), rel=1e-15)
    assert natural[0]["O"] == pytest.approx(math.exp(-2) * 10 + 20, rel=1e-15)


def test_hand_calc_prints_the_chapter_rounding(tmp_path):
    proc = run(HAND_CALC, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ℓ = 1.2034, O = 36.88" in proc.stdout
    assert "m̃" in proc.stdout and "α" in proc.stdout and "all checks pass" in proc.stdout


def test_hand_calc_traces_any_order(tmp_path):
    out = run_json(HAND_CALC, "--x", 1, 3, 2, 5, "--v", 10, 20, 30, 40, "--blocks", 2, 2, "--order", 1, 0, cwd=tmp_path)
    assert [t["order"] for t in out["traces"]] == [[1, 0]]
    first = out["traces"][0]["steps"][0]
    assert first["block"] == 1 and first["x"] == [2.0, 5.0] and first["m_new"] == 5.0
    assert out["l"] == 1.2034 and out["O"] == 36.88 and out["ok"]


def test_hand_calc_exercise_2_and_vector_values(tmp_path):
    out = run_json(HAND_CALC, "--x", 0, 2, 4, "--v", 1, 1, 1, "--blocks", 2, 1, "--expect-o", 1, cwd=tmp_path)
    assert out["ok"] and not out["chapter_input"]
    assert out["l"] == round(math.exp(-4) + math.exp(-2) + 1, 4) and out["O"] == 1.0
    out = run_json(HAND_CALC, "--x", 1, 2, 3, "--v", 1, 0, 0, 1, 1, 1, "--d", 2, "--blocks", 1, 2, cwd=tmp_path)
    w = [math.exp(x - 3) for x in (1, 2, 3)]
    expected = [round((w[0] + w[2]) / sum(w), 2), round((w[1] + w[2]) / sum(w), 2)]
    assert out["O"] == expected and out["ok"]


def test_hand_calc_exits_nonzero_on_a_mismatch(tmp_path):
    proc = run(HAND_CALC, "--expect-o", 36.87, cwd=tmp_path)
    assert proc.returncode == 1 and "MISMATCH" in proc.stdout
    proc = run(HAND_CALC, "--x", 0, 2, 4, "--v", 1, 1, 1, "--blocks", 2, 1, "--expect-l", 1.2, cwd=tmp_path)
    assert proc.returncode == 1
    proc = run(HAND_CALC, "--x", 1, 2, 3, "--v", 1, 2, 3, "--blocks", 1, 1, cwd=tmp_path)
    assert proc.returncode == 2 and "sum to 2" in proc.stderr and "3" in proc.stderr


def test_hand_calc_comparisons_catch_a_perturbed_trace():
    hand_calc = load(HAND_CALC)
    from reference import online_softmax_trace

    trace = online_softmax_trace([1, 3, 2, 5], [10, 20, 30, 40], blocks=[2, 2])
    assert all(c["ok"] for c in hand_calc.compare_online_standard(trace))
    assert all(c["ok"] for c in hand_calc.check_chapter(trace))
    off = dataclasses.replace(trace, O=trace.O * (1 + 1e-9))  # far beyond rounding, invisible at 2 decimals
    assert not all(c["ok"] for c in hand_calc.compare_online_standard(off))
    step = dataclasses.replace(trace.steps[0], l=trace.steps[0].l + 1e-3)  # 1.1363 instead of 1.1353
    assert not all(c["ok"] for c in hand_calc.check_chapter(dataclasses.replace(trace, steps=(step, trace.steps[1]))))


# --- exercises.py --------------------------------------------------------------------------------


def test_exercises_numbers(tmp_path):
    out = run_json(EXERCISES, cwd=tmp_path)
    n, d, bh, e = 16384, 128, 8 * 32, 2
    e1 = out["exercise1"]
    assert e1["one_S_bytes"] == n * n * e == 512 * 2**20 and e1["one_S_MiB"] == 512
    assert e1["all_S_bytes"] == bh * n * n * e and e1["all_S_GiB"] == 128

    e2 = out["exercise2"]
    assert e2["l"] == pytest.approx(math.exp(-4) + math.exp(-2) + 1, rel=1e-15)
    assert abs(e2["O_final"] - 1) <= 4 * sys.float_info.epsilon and e2["O_final_is_1"]
    assert [s["m_new"] for s in e2["steps"]] == [2, 4]

    e3 = out["exercise3"]
    flops = 4 * bh * n * n * d
    standard = bh * e * (4 * n * d + 4 * n * n)  # Q, K, V, O once; S and P written and read
    flash = bh * (e * (2 * n * d + 2 * n * d * math.ceil(n / 128)) + 4 * n)  # K, V once per Q block; fp32 L
    assert e3["flops"] == flops
    assert e3["standard"]["bytes"] == standard and e3["flash_no_cache"]["bytes"] == flash
    assert e3["standard"]["intensity_flop_per_byte"] == pytest.approx(flops / standard)
    assert e3["ridge_fp16"] == pytest.approx(989e12 / 4.8e12) and round(e3["ridge_fp16"]) == 206
    assert e3["ridge_fp32"] == pytest.approx(67e12 / 4.8e12)
    assert e3["standard"]["bound"] == "memory" and e3["flash_ideal"]["bound"] == "compute"
    assert e3["standard"]["t_min_s"] > e3["flash_no_cache"]["t_min_s"] > e3["flash_ideal"]["t_min_s"]

    e4 = out["exercise4"]
    assert e4["stored_L_bytes"] == bh * n * 4 == 16 * 2**20
    assert e4["stored_P_bytes"] == bh * n * n * e
    assert e4["recompute_flops"] == 2 * bh * n * n * d and e4["recompute_cheaper_by"] > 1

    dec = out["exercise5"]["decode"]
    assert dec["q_tile_grid"] == 32 and dec["sms"] == 132
    assert dec["splits"] == 5 and dec["split_grid"] == 160 >= 132
    short = out["exercise5"]["short_sequences"]
    assert [s["n"] for s in short] == sorted(s["n"] for s in short)
    assert short[0]["n2_share_of_standard_bytes"] == pytest.approx(0.5)  # N = d = 128


def test_exercises_text_and_options(tmp_path):
    proc = run(EXERCISES, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "512 MiB" in proc.stdout and "128 GiB" in proc.stdout and "206 FLOP/B" in proc.stdout
    out = run_json(EXERCISES, "--n", 1024, "--d", 64, "--batch", 1, "--heads", 4, "--block-q", 64, cwd=tmp_path)
    assert out["exercise1"]["one_S_bytes"] == 1024 * 1024 * 2
    assert out["exercise3"]["flash_intensity_per_kv_byte"] == 64
    assert run(EXERCISES, "--n", 0, cwd=tmp_path).returncode == 2


def test_exercise_functions_are_importable():
    exercises = load(EXERCISES)
    assert exercises.exercise1(n=4, batch=1, heads=1)["one_S_bytes"] == 32
    assert exercises.exercise2()["O_final_is_1"]


# --- sanitize_case.py: a case of every shipped kernel build ----------------------------------------


def _shipped_tables():
    """The shipped tables, read here from the package (not from the script's own list)."""
    from numba_flash import configs
    from numba_flash.kernels import simt_backward

    return {"MMA_TABLE": configs.MMA_TABLE, "TF32_TABLE": configs.TF32_TABLE, "SIMT_CONFIGS": configs.SIMT_CONFIGS,
            "MMA_BWD_TABLE": configs.MMA_BWD_TABLE, "MMA_BWD_WGMMA": configs.MMA_BWD_WGMMA,
            "MMA_WGMMA_WS": configs.MMA_WGMMA_WS,
            "TF32_BWD_TABLE": configs.TF32_BWD_TABLE, "SIMT_BWD_CONFIGS": simt_backward.BACKWARD_CONFIGS}


def test_sanitize_cases_cover_every_shipped_table_entry():
    sanitize = load(SANITIZE)
    cases = sanitize.cases()
    covered = {(name, key) for case in cases for name, key in case.covers}
    for name, table in _shipped_tables().items():
        uncovered = [key for key in table if (name, key) not in covered]
        assert not uncovered, f"{name} entries no sanitizer case covers: {uncovered}"
    assert {key for name, key in covered if name == "DECODE"} == {
        (kind, splits) for kind in ("warp_split", "block") for splits in ("one split", "splits")}
    assert not [c.label() for c in cases if c.reached], "cases on which the API picks another build than theirs"
    # the dQ schemes of each dkdv_atomic entry that has them, on mma.sync and wgmma
    schemes = {(name, key, c.scheme) for c in cases for name, key in c.covers
               if isinstance(key, tuple) and key[0] == "dkdv_atomic"}
    for name in ("MMA_BWD_TABLE", "MMA_BWD_WGMMA", "TF32_BWD_TABLE"):
        for key, tile in _shipped_tables()[name].items():
            if key[0] == "dkdv_atomic":
                assert (name, key, "atomic") in schemes
                assert (name, key, "splits") in schemes or not tile.has("deterministic_splits")
    assert all(c.wgmma for c in cases if any(n == "MMA_BWD_WGMMA" for n, _ in c.covers))
    assert all(c.wgmma is False for c in cases if any(n == "MMA_BWD_TABLE" for n, _ in c.covers))
    back = [c for c in cases if c.family == "backward"]
    assert {c.deterministic for c in back} == {True, False} and {c.causal for c in back} == {True, False}
    assert {c.dtype for c in cases} == {"float32", "float16", "bfloat16"}
    assert any(c.d not in (16, 32, 64, 96, 128, 192, 256) for c in cases if c.kernel in ("mma", "tf32x3"))
    assert all(c.shape[1] != c.shape[2] for c in cases if c.family == "decode")
    assert any(c.shape[1] != c.shape[2] for c in back) and all(c.shape[3] != c.shape[4] for c in cases)
    assert {c.kernel for c in cases if c.family == "forward"} == {"mma", "tf32x3", "tf32", "simt"}
    assert all(c.wgmma for c in cases if any(n in ("MMA_WGMMA", "MMA_WGMMA_WS") for n, _ in c.covers))
    assert all(c.ws == any(n == "MMA_WGMMA_WS" for n, _ in c.covers) for c in cases)
    assert all(c.wgmma is False for c in cases if any(n == "MMA_TABLE" for n, _ in c.covers))
    # the check itself: a case list without the wgmma cases leaves MMA_WGMMA, MMA_WGMMA_WS and MMA_BWD_WGMMA uncovered
    assert set(sanitize.missing([c for c in cases if not c.wgmma])) == {"MMA_WGMMA", "MMA_WGMMA_WS", "MMA_BWD_WGMMA"}


def test_sanitize_list_runs_without_a_gpu(tmp_path):
    proc = run(SANITIZE, "--list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    n = int(re.search(r"^(\d+) cases", proc.stdout, re.M).group(1))
    assert "0 not reached; uncovered table entries: none" in proc.stdout and n >= 60
    assert proc.stdout.count("covers ") == n and "MMA_BWD_WGMMA[('dkdv_atomic', 128)]" in proc.stdout
    shard = run(SANITIZE, "--list", "--shard", "1/4", cwd=tmp_path)
    assert shard.stdout.count("covers ") == len(range(1, n, 4))
    assert run(SANITIZE, "--shard", "4/4", cwd=tmp_path).returncode == 2


def test_sanitize_runs_a_case_on_the_simulator(tmp_path):
    sanitize = load(SANITIZE)
    i = next(i for i, c in enumerate(sanitize.cases()) if c.covers == [("SIMT_CONFIGS", 16)])
    proc = run(SANITIZE, "--case", i, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"forward simt float32 .*SIMT_CONFIGS\[16\].*max rel err \S+ \(tol \S+\) ok", proc.stdout)
    assert "1 cases, 1 ok, 0 wrong, 0 skipped" in proc.stdout


# --- scripts/gpu/run.sh ------------------------------------------------------------------------------


def run_sh(*args, env=None, cwd=ROOT):
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_run_sh_dry_run_sanitize(tmp_path):
    proc = run_sh("--dry-run", tmp_path, "sanitize")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "compute-sanitizer" in line]
    assert len(lines) == 4 * 12
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        mine = [line for line in lines if f"--tool {tool} " in line]
        assert len(mine) == 12 and all(line.startswith("[sanitize, 110s]") for line in mine)
        assert [re.search(r"--shard (\d+)/12", line).group(1) for line in mine] == [str(j) for j in range(12)]
    assert "sanitizer-summary.txt" in proc.stdout
    one = run_sh("--dry-run", tmp_path, "sanitize", env={"SANITIZE_TOOLS": "racecheck", "SANITIZE_JOBS": "1",
                                                          "SANITIZE_FAMILY": "decode", "LIMIT_sanitize": "50"})
    cmds = [line for line in one.stdout.splitlines() if "compute-sanitizer" in line]
    assert cmds == [f"[sanitize, 50s] compute-sanitizer --tool racecheck --print-limit 20 --error-exitcode 99 python3 "
                    f"scripts/sanitize_case.py decode --shard 0/1 > {tmp_path}/sanitize/racecheck-0.log &"]


def test_run_sh_dry_run_fuzz(tmp_path):
    proc = run_sh("--dry-run", tmp_path, "fuzz")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\[fuzz, 300s\] python3 scripts/fuzz.py --problems 1000 --seed 0 --out \S+ --jobs 8 "
                     r"--time-budget-s 240 --quiet", proc.stdout, re.M), proc.stdout
    more = run_sh("--dry-run", tmp_path, "fuzz", env={"FUZZ_JOBS": "12", "LIMIT_fuzz": "540", "FUZZ_N": "50"})
    assert "--problems 50 " in more.stdout and "--jobs 12 --time-budget-s 480" in more.stdout


def test_run_sh_sanitize_summary(tmp_path):
    """The sanitize step without a GPU, through a stand-in compute-sanitizer: per tool and process its summary
    line, the case count and the exit code land in sanitizer-summary.txt; an error fails the step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "compute-sanitizer"
    fake.write_text("""#!/bin/bash
tool=$2; shard=${@: -1}
echo "========= COMPUTE-SANITIZER"
echo "sanitize_case shard $shard: 3 cases, 3 ok, 0 wrong, 0 skipped"
if [ "$tool" = racecheck ]; then echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
elif [ "$shard" = 1/2 ]; then echo "========= Invalid __global__ read of size 4 bytes"; echo "========= ERROR SUMMARY: 2 errors"
  exit 99
else echo "========= ERROR SUMMARY: 0 errors"; fi
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = run_sh(out, "sanitize", env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "SANITIZE_JOBS": "2",
                                        "SANITIZE_TOOLS": "memcheck racecheck", "NUMBA_FLASH_COMMIT": "abc1234"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "results" / "sanitizer-summary.txt").read_text().splitlines()
    assert summary[0].startswith("# compute-sanitizer") and "commit abc1234" in summary[0]
    assert summary[1:] == [
        "memcheck 0/2: ERROR SUMMARY: 0 errors; sanitize_case shard 0/2: 3 cases, 3 ok, 0 wrong, 0 skipped; rc=0",
        "memcheck 1/2: ERROR SUMMARY: 2 errors; sanitize_case shard 1/2: 3 cases, 3 ok, 0 wrong, 0 skipped; rc=99",
        "memcheck: 2 errors/hazards in all; exit codes 0 99",
        "racecheck 0/2: RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings); sanitize_case shard 0/2: 3 "
        "cases, 3 ok, 0 wrong, 0 skipped; rc=0",
        "racecheck 1/2: RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings); sanitize_case shard 1/2: 3 "
        "cases, 3 ok, 0 wrong, 0 skipped; rc=0",
        "racecheck: 0 errors/hazards in all; exit codes 0 0",
    ]
    assert "Invalid __global__ read" in (out / "sanitize.log").read_text()
