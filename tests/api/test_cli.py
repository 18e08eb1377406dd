"""The numba-flash command, run as a user runs it: ``python -m numba_flash ...`` in a subprocess.

Each run starts in a directory outside the repository with the repository on PYTHONPATH. Where
there is no GPU, conftest.py has set NUMBA_ENABLE_CUDASIM=1 and the children inherit it; one test
removes it to check that the command detects the missing driver by itself.
"""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_flash
from numba import config as nb_config
from numba_flash import api, cli
from numba_flash.configs import simt_config
from reference import costs

ROOT = Path(__file__).resolve().parents[2]
NO_DRIVER = not any(os.path.exists(p) for p in cli.DEVICE_FILES)


def run(*args, cwd, env=None, timeout=300):
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "numba_flash", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def number_after(label, text):
    m = re.search(re.escape(label) + r"\s*=?\s*([-+0-9.e]+)", text)
    assert m, f"{label!r} not in output:\n{text}"
    return float(m.group(1))


# --- trace ---------------------------------------------------------------------------------------


def test_trace_reproduces_the_chapter(tmp_path):
    proc = run("trace", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ℓ = 1.2034, O = 36.88" in proc.stdout
    assert proc.stdout.count("online   (order") == 2  # natural and reversed by default
    assert "m̃" in proc.stdout and "α" in proc.stdout and "online = standard" in proc.stdout


def test_trace_any_order_as_json(tmp_path):
    proc = run("trace", "--x", 1, 3, 2, 5, "--v", 10, 20, 30, 40, "--blocks", 2, 2, "--order", 1, 0, "--json",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["l"] == 1.2034 and out["O"] == 36.88 and out["online_equals_standard"]
    [trace] = out["traces"]
    assert trace["order"] == [1, 0]
    first = trace["steps"][0]
    assert first["block"] == 1 and first["x"] == [2.0, 5.0] and first["m_old"] == "-inf" and first["alpha"] == 0
    # independent arithmetic: ℓ = Σ exp(x − 5), O = Σ exp(x − 5)·v / ℓ
    l = sum(math.exp(x - 5) for x in (1, 3, 2, 5))
    assert trace["l"] == pytest.approx(l, rel=1e-14)
    assert trace["O"] == pytest.approx(sum(math.exp(x - 5) * v for x, v in zip((1, 3, 2, 5), (10, 20, 30, 40))) / l)


def test_trace_exercise_2_and_vector_values(tmp_path):
    proc = run("trace", "--x", 0, 2, 4, "--v", 1, 1, 1, "--blocks", 2, 1, cwd=tmp_path)
    assert proc.returncode == 0 and "O = 1.0" in proc.stdout
    proc = run("trace", "--x", 1, 2, 3, "--v", 1, 0, 0, 1, 1, 1, "--d", 2, "--blocks", 1, 2, "--json", cwd=tmp_path)
    w = [math.exp(x - 3) for x in (1, 2, 3)]
    assert json.loads(proc.stdout)["O"] == [round((w[0] + w[2]) / sum(w), 2), round((w[1] + w[2]) / sum(w), 2)]


def test_trace_bad_input_says_what_is_accepted(tmp_path):
    proc = run("trace", "--x", 1, 2, 3, "--v", 1, 2, 3, "--blocks", 1, 1, cwd=tmp_path)
    assert proc.returncode == 2 and "sum to 2" in proc.stderr and "3" in proc.stderr
    proc = run("trace", "--x", 1, 2, cwd=tmp_path)
    assert proc.returncode == 2 and "--v" in proc.stderr


def test_trace_reads_negative_and_infinite_scores(capsys):
    """argparse took -inf (and -1e3) for an option: `trace --x -inf 1` was a usage error."""
    assert cli.main(["trace", "--x", "-inf", "1", "--v", "10", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["l"] == 1.0 and out["O"] == 20.0 and out["online_equals_standard"]
    assert cli.main(["trace", "--x", "-1e3", "2", "-.5", "--v", "10", "20", "30", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["traces"][0]["x"] == [-1000.0, 2.0, -0.5]


@pytest.mark.parametrize("argv,words", [
    (["trace", "--digits", "-1"], "argument --digits: got -1; accepted: an int >= 0"),
    (["demo", "--shape", "1", "1", "16", "0"], "argument --shape: got 0; accepted: an int >= 1"),
    (["demo", "--shape", "1", "1", "-3", "8"], "argument --shape: got -3; accepted: an int >= 1"),
    (["demo", "--shape", "0", "1", "16", "8"], "argument --shape: got 0; accepted: an int >= 1"),
    (["demo", "--shape", "1", "1", "4", "8", "--reps", "0"], "argument --reps: got 0; accepted: an int >= 1"),
])
def test_bad_numbers_are_usage_errors(capsys, argv, words):
    """A traceback (d = 0, B = 0, N < 0, --digits -1) or nan timings (--reps 0) before: exit 2 now."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_demo_unsupported_shape_is_a_usage_error(capsys):
    if not nb_config.ENABLE_CUDASIM:
        pytest.skip("in-process demo needs the simulator on")
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--simulator", "--shape", "1", "1", "4", "300"])
    assert e.value.code == 2
    assert "forward would raise ValueError: head dim d=300" in capsys.readouterr().err


def test_trace_uses_reference_trace():
    """One code path: the CLI's comparison is the reference's trace against its own standard row."""
    from reference import online_softmax_trace

    trace = online_softmax_trace([1, 3, 2, 5], [10, 20, 30, 40], blocks=[2, 2])
    assert cli.online_matches_standard(trace)
    import dataclasses

    assert not cli.online_matches_standard(dataclasses.replace(trace, O=trace.O * (1 + 1e-9)))


# --- explain -------------------------------------------------------------------------------------


def expected_kernel(q_shape, kv_shape, dtype, causal=False):
    """What api.choose_kernel picks in this process (explain's child must agree)."""
    q, kv = cli.shape_only(q_shape, dtype), cli.shape_only(kv_shape, dtype)
    family, cfg, reasons = api.choose_kernel(api.validate(q, kv, kv, causal=causal))
    return family, cfg, reasons, cli.kernel_facts(family, cfg, causal, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_explain_names_kernel_config_and_costs(tmp_path, dtype):
    proc = run("explain", "--shape", 1, 16, 4096, 4096, 128, "--dtype", dtype, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    family, cfg, reasons, facts = expected_kernel((1, 16, 4096, 128), (1, 16, 4096, 128), dtype)
    assert f"kernel: {family}" in out and all(r in out for r in reasons)
    assert f"config: {cli._config_line(cfg)}" in out
    assert f"shared memory: {facts.smem_bytes} B per block" in out
    if family == "mma":  # the shipped kernel's, K/V stages included (not a variant-free build's)
        from numba_flash.kernels import mma_forward, wgmma_forward

        tile = api.mma_config(128, False)  # MMA_TABLE's, or where wgmma exists (the simulator too) MMA_WGMMA's
        assert facts.smem_bytes == (wgmma_forward if tile.has("wgmma") else mma_forward).smem_bytes(tile)
    assert f"grid: {-(-4096 // facts.block_q)} Q tiles × 16" in out
    # one warp per 16·M_TILES query rows (the SIMT block is its thread grid)
    threads = (32 * cfg.warps if family == "mma" else 32 * cfg.block_q // 16 if family == "tf32x3" else cfg.threads)
    assert f"thread blocks of {threads} threads" in out
    assert "registers: " in out
    assert "kernel cache: " in out and out.index("kernel cache: ") < out.index("registers: ")
    if dtype == "float32":
        # the simulator keeps fp32 on SIMT; a GPU runs the 3xTF32 tensor-core kernel
        assert (family == "simt" and cfg == simt_config(128)) if nb_config.ENABLE_CUDASIM else family == "tf32x3"
    e = 2 if dtype == "float16" else 4
    std = costs.standard_attention_hbm_bytes(4096, 4096, 128, bytes_per_element=e, heads=16)["total"]
    assert f"standard attention  {cli.fmt_bytes(std):>10}" in out
    fa = costs.flash_attention_hbm_bytes(4096, 4096, 128, block_q=facts.block_q, block_k=facts.block_k,
                                         bytes_per_element=e, heads=16)["total"]
    assert f"this kernel         {cli.fmt_bytes(fa):>10}" in out
    s_bytes = costs.score_matrix_bytes(4096, 4096, bytes_per_element=e, heads=16)
    assert s_bytes == e * 256 * 2**20 and f"materialising S would take {cli.fmt_bytes(s_bytes)}" in out


def test_explain_unsupported_head_dim_gives_forwards_error(tmp_path):
    proc = run("explain", "--shape", 1, 16, 4096, 4096, 300, "--dtype", "float16", cwd=tmp_path)
    assert proc.returncode == 2
    tiny = np.zeros((1, 1, 1, 300), np.float16)
    with pytest.raises(ValueError) as err:
        numba_flash.forward(tiny, tiny, tiny)  # validation raises before any kernel work
    assert f"ValueError: {err.value}" in proc.stderr
    assert "d=300" in proc.stderr and "1 <= d <= 256" in proc.stderr


def test_explain_other_unsupported_cases(tmp_path):
    proc = run("explain", "--shape", 1, 6, 64, 64, "--hkv", 4, cwd=tmp_path)
    assert proc.returncode == 2 and "H=6" in proc.stderr and "Hkv=4" in proc.stderr
    proc = run("explain", "--shape", 1, 1, 64, 64, "--dtype", "float64", cwd=tmp_path)
    assert proc.returncode == 2 and "float64" in proc.stderr and "float32, float16, bfloat16" in proc.stderr
    proc = run("explain", "--shape", 1, 1, 64, cwd=tmp_path)
    assert proc.returncode == 2 and "B H Nq Nk d" in proc.stderr


def test_explain_huge_shapes_allocate_nothing(tmp_path):
    """A million-token causal GQA problem: terabytes if materialised, nothing allocated here."""
    proc = run("explain", "--shape", 8, 32, 2**20, 2**20, 128, "--dtype", "bfloat16", "--causal", "--hkv", 8,
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    family, *_ = expected_kernel((8, 32, 2**20, 128), (8, 8, 2**20, 128), "bfloat16", causal=True)
    assert f"kernel: {family}" in proc.stdout and "bfloat16" in proc.stdout and "causal tiles:" in proc.stdout
    s = costs.score_matrix_bytes(2**20, 2**20, bytes_per_element=2, batch=8, heads=32)
    assert f"materialising S would take {cli.fmt_bytes(s)}" in proc.stdout


def test_shape_only_costs_no_memory():
    x = cli.shape_only((64, 64, 2**20, 256), "float16")
    low, high = np.lib.array_utils.byte_bounds(x)
    assert x.shape == (64, 64, 2**20, 256) and x.dtype == np.float16 and high - low == 2  # one element
    bf = cli.shape_only((2, 3, 4, 5), "bfloat16")
    assert tuple(bf.shape) == (2, 3, 4, 5) and str(bf.dtype) == "bfloat16"


@pytest.mark.slow
@pytest.mark.skipif(cli.find_ptxas() is None, reason="ptxas not found")
def test_explain_registers_from_ptxas_without_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = run("explain", "--shape", 1, 16, 4096, 64, "--dtype", "float32", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("registers:"))
    if "n/a" in line:
        pytest.skip(f"could not compile for ptxas here: {line}")
    assert 0 < number_after("registers:", line) <= 255 and "0 B local memory" in line


def test_parse_ptxas():
    report = ("ptxas info    : Used 135 registers, used 1 barriers, 384 bytes cmem[0]\n"
              "ptxas info    : Function properties for flash_forward\n"
              "    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n")
    assert cli.parse_ptxas(report) == {"registers": 135, "local_bytes": 24}


# --- demo ----------------------------------------------------------------------------------------


def test_demo_passes_on_the_simulator(tmp_path):
    proc = run("demo", "--simulator", "--shape", 1, 2, 64, 32, "--causal", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "backend: CUDA simulator" in out and "--simulator was given" in out
    assert "PASS" in out and "kernel: " in out
    assert number_after("max |O - O_ref|", out) <= 2e-5
    assert number_after("max |L - L_ref|", out) <= 1e-4
    assert f"would take {cli.fmt_bytes(2 * 64 * 64 * 4)} here" in out
    assert "1.0 TiB" in out  # 128k context, 32 heads, fp16


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has an NVIDIA driver")
def test_demo_detects_no_gpu_by_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = run("demo", "--shape", 1, 1, 32, 16, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend: CUDA simulator" in proc.stdout
    assert "/dev/nvidiactl" in proc.stdout and "NUMBA_ENABLE_CUDASIM=1" in proc.stdout
    assert "numba.config.ENABLE_CUDASIM = 1" in proc.stdout and "PASS" in proc.stdout


def test_check_fails_on_a_wrong_answer():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(3))
    from reference import standard_attention

    o, l = standard_attention(q, k, v)
    good = cli.check_against_reference(q, k, v, o.astype(np.float32), l.astype(np.float32), False)
    assert good["ok"] and good["heads"] == 2
    bad = cli.check_against_reference(q, k, v, (o * 1.001).astype(np.float32), l.astype(np.float32), False)
    assert not bad["ok"]


def test_in_process_main_refuses_to_replace_the_process():
    """Called as a function with numba loaded the wrong way, main says so instead of exec'ing."""
    from numba import config

    if config.ENABLE_CUDASIM:
        pytest.skip("the simulator is on here: nothing to refuse")
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--simulator"])
    assert e.value.code == 2


def test_help_lists_every_command(tmp_path):
    proc = run("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for cmd in ("demo", "trace", "explain", "bench", "plot"):
        assert cmd in proc.stdout
    assert run(cwd=tmp_path).returncode == 2  # no command
