"""numba_flash.bench and numba_flash.plots: the quick suite on the simulator, the suite registry,
the HBM-traffic counts behind the roofline, and every plot from a small synthetic results JSON.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numba_flash import bench, plots
from reference import causal_mask, costs

ROOT = Path(__file__).resolve().parents[2]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
needs_mpl = pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed (the plot extra)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*args, cwd, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "numba_flash", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, path


# --- the quick suite, end to end -----------------------------------------------------------------------


def test_bench_quick_on_the_simulator(tmp_path):
    from numba import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("a GPU is in use: the quick GPU suite is for the GPU host, not CI")
    out_json, plot_dir = tmp_path / "r.json", tmp_path / "plots"
    t0 = time.perf_counter()
    proc = run("bench", "--quick", "--json", out_json, *(["--plots", plot_dir] if HAVE_MPL else []), cwd=tmp_path)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 60, f"bench --quick took {elapsed:.0f} s on the simulator (CI budget 60 s)"
    assert "| dtype | causal | B | H | N | d | impl | ms | TFLOP/s |" in proc.stdout
    assert bench.SIMULATOR_IMPL in proc.stdout and "sdpa" not in proc.stdout and "cupy" not in proc.stdout

    result = json.loads(out_json.read_text())
    assert {"meta", "forward", "memory", "sweep_simt", "suites"} <= set(result)
    assert result["meta"]["backend"] == "simulator" and "simulator" in result["meta"]["gpu"]
    assert {"date", "command", "commit", "python", "numba_flash"} <= set(result["meta"])
    ours = [r for r in result["forward"] if r["impl"] == bench.SIMULATOR_IMPL]
    assert len(ours) == 2 * len(bench.SIMULATOR_QUICK)  # causal and not, per shape
    for r in ours:
        assert {"impl", "ms", "tflops", "B", "H", "N", "d", "dtype", "causal", "flops", "hbm_bytes",
                "hbm_bytes_ideal", "kernel", "block_q", "block_k", "max_err"} <= set(r)
        assert r["max_err"] < 2e-5 and r["ms"] > 0
        assert r["flops"] == bench.flops(r["B"], r["H"], r["N"], r["N"], r["d"], r["causal"])
    assert result["memory"] is None  # measured on a GPU only
    if HAVE_MPL:
        for name in ("forward-tflops.png", "forward-roofline.png", "causal-tiles.png"):
            assert_png(plot_dir / name)
        assert "skipped forward-memory.png" in proc.stdout


def test_full_suite_needs_a_gpu():
    with pytest.raises(bench.SuiteError, match="--quick"):
        bench.forward_suite(quick=False, simulator=True)


# --- counting ------------------------------------------------------------------------------------


def test_rows_count_flops_and_bytes_with_reference_costs():
    row = bench.annotate({"impl": "numba_flash", "B": 2, "H": 4, "N": 1024, "d": 64, "dtype": "float16",
                          "causal": True, "block_q": 64, "block_k": 32})
    assert row["flops"] == 4 * 2 * 4 * 1024 * 1024 * 64 / 2
    fa = costs.flash_attention_hbm_bytes(1024, 1024, 64, block_q=64, block_k=32, causal=True, batch=2, heads=4)
    assert row["traffic_model"] == "flash" and (row["hbm_bytes"], row["hbm_bytes_ideal"]) == (fa["total"], fa["ideal"])
    std = bench.annotate({"impl": "naive-cupy", "B": 2, "H": 4, "N": 1024, "d": 64, "dtype": "float32", "causal": False})
    total = costs.standard_attention_hbm_bytes(1024, 1024, 64, bytes_per_element=4, batch=2, heads=4)["total"]
    assert std["traffic_model"] == "standard" and std["hbm_bytes"] == std["hbm_bytes_ideal"] == total
    other = bench.annotate({"impl": "sdpa-flash", "B": 1, "H": 1, "N": 512, "d": 64, "dtype": "float16", "causal": False})
    assert other["hbm_bytes"] == costs.flash_attention_hbm_bytes(512, 512, 64, block_q=128, block_k=128)["total"]


def test_table_and_markdown_format():
    rows = [bench.annotate({"impl": "numba_flash", "ms": 1.5, "tflops": 12.25, "reps": 3, "B": 1, "H": 2, "N": 256,
                            "d": 64, "dtype": "float16", "causal": False}),
            {"impl": "sdpa-cudnn", "ms": None, "tflops": None, "error": "not supported here", "B": 1, "H": 2,
             "N": 256, "d": 64, "dtype": "float16", "causal": False}]
    text = bench.table(rows)
    assert "| float16 | False | 1 | 2 | 256 | 64 | numba_flash | 1.500 | 12.2 |" in text
    assert "| sdpa-cudnn | — | — (not supported here) |" in text
    result = {"meta": {"gpu": "H200", "date": "2026-01-01T00:00:00+00:00", "command": "c", "commit": "abc",
                       "torch": "2.5"}, "forward": rows, "memory": None, "sweep_simt": None}
    md = bench.markdown(result)
    assert md.startswith("# Forward benchmark\n\nGPU: H200; date: 2026-01-01") and text in md


# --- the registry --------------------------------------------------------------------------------


def test_registry_has_forward_and_present_scripts(tmp_path):
    (tmp_path / "scripts").mkdir()
    assert list(bench.registry(tmp_path)) == ["forward"]
    (tmp_path / "scripts" / "bench_decode.py").write_text(
        "def run_suite(*, quick, simulator, progress):\n"
        "    return {'rows': [{'impl': 'decode', 'ms': 1.0, 'tflops': 2.0, 'B': 1, 'H': 1, 'N': 8, 'd': 16,\n"
        "                      'dtype': 'float32', 'causal': False}], 'quick': quick, 'simulator': simulator}\n"
    )
    (tmp_path / "scripts" / "bench_backward.py").write_text("print('a script without run_suite')\n")
    suites = bench.registry(tmp_path)
    assert list(suites) == ["forward", "backward", "decode"]
    decode = suites["decode"].run(quick=True, simulator=True, progress=False)
    assert decode["decode"]["quick"] and decode["decode"]["rows"][0]["impl"] == "decode"
    backward = suites["backward"].run(quick=True, simulator=True, progress=False)
    assert "run_suite" in backward["backward"]["skipped"]


def test_run_suites_rejects_unknown_names():
    with pytest.raises(bench.SuiteError, match="registered here: forward"):
        bench.run_suites(["nope"], command="x", quick=True, simulator=True)


def test_bench_forward_script_is_a_thin_wrapper(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_forward", ROOT / "scripts" / "bench_forward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SIMT_CANDIDATES and all(len(c) in (5, 6) for c in module.SIMT_CANDIDATES)  # [, max_registers]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_forward.py"), "--help"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0
    for flag in ("--quick", "--sweep-simt", "--no-memory", "--dtypes", "--out"):
        assert flag in proc.stdout


# --- plots ---------------------------------------------------------------------------------------


def synthetic_result():
    rows = []
    for N in (1024, 4096):
        for impl, tf, extra in (("numba_flash", 20.0, {"block_q": 64, "block_k": 64}), ("sdpa-flash", 300.0, {}),
                                ("naive-cupy", 40.0, {})):
            for causal in (False, True):
                rows.append(bench.annotate({"impl": impl, "ms": 1.0, "tflops": tf * N / 1024, "reps": 5, "B": 4,
                                            "H": 16, "N": N, "d": 128, "dtype": "float16", "causal": causal, **extra}))
    rows.append({"impl": "sdpa-cudnn", "ms": None, "tflops": None, "error": "x", "B": 4, "H": 16, "N": 1024,
                 "d": 128, "dtype": "float16", "causal": False})
    memory = [{"N": N, "B": 1, "H": 16, "d": 128, "dtype": "float16", "numba_flash": 16 * N * 260,
               "ours_expected": 16 * N * 260, "naive-torch": 16 * N * N * 4 if N < 65536 else None}
              for N in (1024, 4096, 16384, 65536)]
    return {"meta": {"gpu": "synthetic", "date": "2026-01-01T00:00:00+00:00", "command": "test", "commit": "abc",
                     "torch": None}, "forward": rows, "memory": memory, "sweep_simt": None}


@needs_mpl
def test_every_plot_renders_from_a_synthetic_json(tmp_path):
    written, skipped = plots.render_all(synthetic_result(), str(tmp_path))
    assert skipped == []
    assert sorted(Path(p).name for p in written) == sorted([*plots.PLOTS, "causal-tiles.png"])
    for p in written:
        assert_png(p)


@needs_mpl
def test_plot_command_from_a_results_file(tmp_path):
    path = tmp_path / "forward-test.json"
    result = synthetic_result()
    for r in result["forward"]:  # an older JSON without the counts: the plot recomputes them
        r.pop("hbm_bytes", None), r.pop("hbm_bytes_ideal", None)
    path.write_text(json.dumps(result))
    proc = run("plot", path, "--out", tmp_path / "out", "--tiles", 256, 512, 32, 64, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in [*plots.PLOTS, "causal-tiles.png"]:
        assert_png(tmp_path / "out" / name)
    assert run("plot", tmp_path / "missing.json", "--out", tmp_path, cwd=tmp_path).returncode == 2


@needs_mpl
def test_causal_tile_plot_alone(tmp_path):
    assert_png(plots.causal_tiles(str(tmp_path / "tiles.png"), [(100, 100, 16, 16), (40, 100, 16, 32)]))


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed")
def test_plots_say_which_extra_is_missing(tmp_path):
    with pytest.raises(ImportError, match=r"numba-flash\[plot\]"):
        plots.render_all(synthetic_result(), str(tmp_path))


@pytest.mark.parametrize("n_q,n_k,bq,bk", [(128, 128, 32, 32), (100, 100, 16, 32), (40, 100, 16, 16),
                                           (100, 40, 32, 16), (1, 50, 64, 8), (65, 65, 64, 64), (77, 77, 8, 24),
                                           (30, 61, 8, 16), (61, 30, 16, 8)])
def test_causal_tile_grid_matches_the_mask(n_q, n_k, bq, bk):
    """A tile is skipped iff every (query, key) in it is masked, full iff none is, masked otherwise."""
    grid = plots.causal_tile_grid(n_q, n_k, bq, bk)
    assert grid.shape == (-(-n_q // bq), -(-n_k // bk))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            hidden = causal_mask(i * bq, min((i + 1) * bq, n_q), j * bk, min((j + 1) * bk, n_k), n_q, n_k)
            expected = plots.SKIPPED if hidden.all() else plots.FULL if not hidden.any() else plots.MASKED
            assert grid[i, j] == expected, (i, j)
    assert plots.causal_tile_counts(n_q, n_k, bq, bk) == plots.tile_counts(grid)
    assert (plots.causal_tile_grid(n_q, n_k, bq, bk, causal=False) == plots.FULL).all()
    assert plots.causal_tile_counts(n_q, n_k, bq, bk, causal=False)["full"] == grid.size
    with pytest.raises(ValueError, match="block_q must be an int >= 1"):
        plots.causal_tile_grid(n_q, n_k, 0, bk)
