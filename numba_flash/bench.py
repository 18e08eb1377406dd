"""Benchmark suites as a library: the forward suite, a registry for the others, tables and JSON.

    numba-flash bench [--quick] [--json PATH] [--plots DIR]     every registered suite (numba_flash.cli)
    python scripts/bench_forward.py [--quick] [--sweep-simt]      the forward suite alone, written to
                                                                  benchmarks/results/forward-<date>.{json,md}

On a GPU the forward suite times numba_flash beside PyTorch SDPA (each backend) and naive CuPy
attention (S and P materialised, 3.6.2). TFLOP/s = 4·B·H·Nq·Nk·d / time (half for causal).
Time = median of CUDA-event timings of single calls after warm-up. Every input tensor is larger
than the 60 MB L2 at the suite's sizes except N=1024 d=64 fp16 (8 MiB per tensor), where the
figures include some L2 reuse.

On the CUDA simulator (no GPU) only the quick suite runs: tiny fp32 cases, labelled
"numba_flash (simulator)", each checked against ``reference.standard_attention``, beside that
NumPy reference on the CPU. Simulator times measure a Python interpreter of the kernel, not a GPU.

Result JSON (one dict)::

    {"meta": {gpu, backend, date, command, commit, versions...},
     "forward": [row, ...],     row: impl, ms, tflops, reps, B, H, N, d, dtype, causal,
                                     flops, hbm_bytes, hbm_bytes_ideal, traffic_model,
                                     [kernel, block_q, block_k] for numba_flash,
                                     [error] when it failed, [max_err] on the simulator
     "memory": [...] | None,    peak extra device memory vs N (GPU only)
     "sweep_simt": [...] | None,
     "<suite>": ...}            what every other registered suite returned

Other suites: ``scripts/bench_<name>.py`` for each name in ``SCRIPT_SUITES`` joins the registry
when the file exists. A script that defines

    run_suite(*, quick: bool, simulator: bool, progress: bool) -> dict   # {"rows": [row, ...], ...}

is called in-process (its rows use the row keys above, so they go into the table and the plots);
any other script is run whole on a GPU (``python scripts/bench_<name>.py [--quick]``) and its exit
status and the tail of its output are recorded.
"""
from __future__ import annotations

import datetime as dt
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import numba_flash
from numba_flash.configs import SimtConfig, keep
from reference import costs

REPO_ROOT = Path(__file__).resolve().parents[1]  # scripts/ lives here in a checkout (not when installed)

FULL = [  # (B, H, N, d)
    (4, 16, 1024, 64), (4, 16, 4096, 64), (4, 16, 16384, 64),
    (4, 16, 1024, 128), (4, 16, 4096, 128), (4, 16, 16384, 128),
]
QUICK = [(4, 16, 1024, 64), (4, 16, 4096, 64), (4, 16, 4096, 128)]  # every forward target shape
# Extra (B, H, N, d, dtype) cases of the full suite: the bf16 long-context target of the tensor-core issue.
EXTRA = [(1, 16, 16384, 128, "bfloat16")]
SIMULATOR_QUICK = [(1, 1, 32, 16), (1, 1, 64, 16), (1, 1, 128, 16)]  # ~1-3 s each on the simulator
SIMULATOR_IMPL = "numba_flash (simulator)"
REFERENCE_IMPL = "reference-numpy (CPU, float64)"

# Which HBM-traffic model of reference.costs each implementation follows (for the roofline).
TRAFFIC_MODEL = {
    "numba_flash": "flash", SIMULATOR_IMPL: "flash",
    "sdpa-flash": "flash", "sdpa-efficient": "flash", "sdpa-cudnn": "flash",
    "sdpa-math": "standard", "naive-cupy": "standard", REFERENCE_IMPL: "standard",
}
OTHER_FLASH_BLOCK = 128  # tile size assumed for other flash kernels (FA2's forward uses 128)
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class SuiteError(RuntimeError):
    """A suite cannot run here (no GPU, a missing package); the message says what is needed."""


# --- counting ------------------------------------------------------------------------------------


def flops(B, H, n_q, n_k, d, causal):
    """4·B·H·Nq·Nk·d, half for causal: the convention every attention benchmark reports."""
    f = 4.0 * B * H * n_q * n_k * d
    return f / 2 if causal else f


def hbm_bytes(row: dict) -> tuple[int, int]:
    """(counted, ideal) HBM bytes of one result row under reference.costs' model for its implementation.

    Standard attention: both are the materialising count. Flash: counted is the no-cache model (K, V
    read once per Q tile), ideal is Q, K, V, O once; on a GPU, Q tiles of one head share K/V
    through L2, so the real traffic lies between the two.
    """
    model = row.get("traffic_model") or TRAFFIC_MODEL.get(row["impl"], "flash")
    n_k = row.get("N_k", row["N"])
    shape = dict(batch=row["B"], heads=row["H"], bytes_per_element=BYTES.get(row["dtype"], 2))
    if model == "standard":
        total = costs.standard_attention_hbm_bytes(row["N"], n_k, row["d"], **shape)["total"]
        return total, total
    fa = costs.flash_attention_hbm_bytes(
        row["N"], n_k, row["d"], causal=bool(row["causal"]),
        block_q=row.get("block_q") or OTHER_FLASH_BLOCK, block_k=row.get("block_k") or OTHER_FLASH_BLOCK, **shape,
    )
    return fa["total"], fa["ideal"]


def annotate(row: dict) -> dict:
    """Add flops, the traffic model and its HBM bytes to a row (the roofline plot reads them)."""
    row["flops"] = flops(row["B"], row["H"], row["N"], row.get("N_k", row["N"]), row["d"], row["causal"])
    row["traffic_model"] = TRAFFIC_MODEL.get(row["impl"], "flash")
    row["hbm_bytes"], row["hbm_bytes_ideal"] = hbm_bytes(row)
    return row


def kernel_of(q, k, v, causal) -> dict:
    """Which numba_flash kernel and tiles ran for these arrays (validation only, nothing launched)."""
    family, cfg, _ = numba_flash.api.choose_kernel(numba_flash.api.validate(q, k, v, causal=causal))
    return {"kernel": family, "block_q": getattr(cfg, "block_q", None), "block_k": getattr(cfg, "block_k", None)}


# --- progress ------------------------------------------------------------------------------------


class Progress:
    """A tqdm bar (the ``bench`` extra) on a terminal; numbered plain lines otherwise."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.n, self.bar = total, 0, None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                pass

    def step(self, line: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.write(line)  # above the bar, which stays at the bottom
            self.bar.update()
        else:
            print(f"[{self.n}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- timing --------------------------------------------------------------------------------------


def time_call(fn, *, warmup=2, reps=None, budget_s=None):
    """Median of per-call CUDA-event timings (ms); reps adapt so one case takes ~budget_s."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    if budget_s is None:  # a whole suite's device time scales with this (env: shorter runs on a lease)
        budget_s = float(os.environ.get("NUMBA_FLASH_BENCH_BUDGET_S", "1.5"))
    reps = reps or int(min(50, max(3, budget_s / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times)), reps


def _wall_ms(fn):
    """One call's wall time in ms, and its result (the simulator: no warm-up, no compile to hide)."""
    t0 = time.perf_counter()
    res = fn()
    return (time.perf_counter() - t0) * 1e3, res


# --- the forward suite on a GPU --------------------------------------------------------------------


def naive_cupy(q, k, v, causal, scale):
    """Standard attention, materialising S and P in HBM (3.6.2), in CuPy."""
    import cupy as cp

    s = cp.matmul(q, k.swapaxes(-1, -2)) * q.dtype.type(scale)
    if causal:
        n_q, n_k = s.shape[-2:]
        mask = cp.arange(n_k)[None, :] > cp.arange(n_q)[:, None] + (n_k - n_q)
        s = cp.where(mask, s.dtype.type(-cp.inf), s)
    s = s - s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.matmul(p, v)


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }


def run_case(B, H, N, d, dtype, causal, include_naive=True, include_math=False):
    """One GPU case: numba_flash, each SDPA backend and naive CuPy on the same inputs."""
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H * N * d)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", generator=g).to(tdt) for _ in range(3))
    fl = flops(B, H, N, N, d, causal)
    rows = []

    def record(name, fn, **extra):
        try:
            ms, reps = time_call(fn)
            rows.append({"impl": name, "ms": ms, "tflops": fl / ms / 1e9, "reps": reps, **extra})
        except Exception as e:  # an unsupported backend or an OOM is a result, not a crash
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            rows.append({"impl": name, "ms": None, "tflops": None, "error": msg, **extra})
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()

    record("numba_flash", lambda: numba_flash.forward(q, k, v, causal=causal), **kernel_of(q, k, v, causal))
    for name, backend in sdpa_backends().items():
        if name == "sdpa-math" and not include_math:
            continue

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        record(name, sdpa)
    if include_naive and dtype != "bfloat16":  # CuPy has no bfloat16
        qc, kc, vc = (cp.asarray(t) for t in (q, k, v))
        record("naive-cupy", lambda: naive_cupy(qc, kc, vc, causal, 1 / math.sqrt(d)))
    for r in rows:
        r.update(B=B, H=H, N=N, d=d, dtype=dtype, causal=causal)
        annotate(r)
    return rows


def peak_memory(d=128, dtype="float16", B=1, H=16):
    """Peak extra device memory (beyond q, k, v) of ours vs naive as N grows, until naive OOMs."""
    import torch

    out = []
    tdt = getattr(torch, dtype)
    for N in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
        row = {"N": N, "B": B, "H": H, "d": d, "dtype": dtype}
        q, k, v = (torch.randn(B, H, N, d, device="cuda").to(tdt) for _ in range(3))
        for name, fn in (
            ("numba_flash", lambda: numba_flash.forward(q, k, v)),
            ("naive-torch", lambda: torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(d), -1) @ v),
        ):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                res = fn()
                torch.cuda.synchronize()
                row[name] = torch.cuda.max_memory_allocated() - base
                del res
            except torch.OutOfMemoryError:
                row[name] = None
        row["ours_expected"] = B * H * N * d * torch.finfo(tdt).bits // 8 + B * H * N * 4
        out.append(row)
        del q, k, v
        torch.cuda.empty_cache()
        if row["naive-torch"] is None and N >= 32768:
            break
    return out


def sweep_simt(candidates, B=4, H=16, N=4096, d=128, causal=False):
    """Time each candidate SIMT config (block_q, block_k, row_threads, col_threads, share_kv) in fp32."""
    import torch
    from numba import cuda

    from numba_flash.kernels import simt_forward

    q, k, v = (torch.randn(B, H, N, d, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda")
    qd, kd, vd, od, ld = (cuda.as_cuda_array(t, sync=False) for t in (q, k, v, out, lse))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:1, :1].double(), k[:1, :1].double(), v[:1, :1].double(), is_causal=causal).cpu().numpy()
    rows = []
    for cand in candidates:
        bq, bk, rt, ct, share, *cap = cand
        cfg = SimtConfig(bq, bk, rt, ct, d, share_kv=share, max_registers=cap[0] if cap else None)
        if not keep([cfg]):
            rows.append({"config": list(cand), "error": "; ".join(cfg.problems())})
            continue
        run = lambda: simt_forward.launch(cfg, qd, kd, vd, od, ld, causal=causal,  # noqa: E731
                                          softmax_scale=d ** -0.5, dtype="float32", d=d)
        try:  # a config can fail to launch (registers x threads), which is a result too
            ms, _ = time_call(run)
            err = float(abs(od[:1, :1].copy_to_host().astype("f8") - ref).max())
        except Exception as e:  # noqa: BLE001
            rows.append({"config": list(cand), "error": str(e).splitlines()[0][:120]})
            print(f"  simt {cand}: failed: {rows[-1]['error']}", flush=True)
            continue
        kern = simt_forward.make_forward_kernel(cfg, causal, "float32")
        regs = next(iter(kern.overloads.values()))._codelibrary.get_cufunc().attrs.regs
        rows.append({"config": list(cand), "ms": ms, "tflops": flops(B, H, N, N, d, causal) / ms / 1e9,
                     "regs": regs, "smem": cfg.smem_bytes, "max_err": err})
        print(f"  simt {cand}: {rows[-1]['tflops']:.1f} TFLOP/s, {regs} regs, "
              f"{cfg.smem_bytes} B smem, max err {err:.1e}", flush=True)
    return rows


# --- the forward suite on the simulator ----------------------------------------------------------------


def run_case_simulator(B, H, N, d, dtype, causal):
    """One tiny case on the CUDA simulator, checked against the float64 NumPy reference."""
    from reference import standard_attention

    rng = np.random.default_rng(B * H * N * d)
    q, k, v = (rng.standard_normal((B, H, N, d)).astype(dtype) for _ in range(3))
    ms_ref, (ref_o, _) = _wall_ms(lambda: standard_attention(q, k, v, causal=causal))
    ms, (out, _) = _wall_ms(lambda: numba_flash.forward(q, k, v, causal=causal))
    fl = flops(B, H, N, N, d, causal)
    ours = {"impl": SIMULATOR_IMPL, "ms": ms, "tflops": fl / ms / 1e9, "reps": 1,
            "max_err": float(np.max(np.abs(out.astype(np.float64) - ref_o))), **kernel_of(q, k, v, causal)}
    ref = {"impl": REFERENCE_IMPL, "ms": ms_ref, "tflops": fl / ms_ref / 1e9, "reps": 1}
    rows = [ours, ref]
    for r in rows:
        r.update(B=B, H=H, N=N, d=d, dtype=dtype, causal=causal)
        annotate(r)
    return rows


def _case_line(rows, simulator):
    r0 = rows[0]
    head = f"{r0['dtype']:8s} causal={r0['causal']!s:5s} B{r0['B']} H{r0['H']} N{r0['N']} d{r0['d']}: "
    if simulator:  # TFLOP/s of an interpreter mean nothing; the time and the check do
        return head + ", ".join(f"{r['impl']} {r['ms']:.3g} ms" for r in rows) + f"; max err {r0['max_err']:.1e}"
    return head + ", ".join(f"{r['impl']} {r['tflops']:.1f}" if r.get("tflops") else f"{r['impl']} —" for r in rows)


def forward_suite(*, quick=False, simulator=False, dtypes=("float32", "float16"), memory=True, progress=True) -> dict:
    """The forward suite: {"forward": rows, "memory": peak-memory rows or None}."""
    if simulator:
        if not quick:
            raise SuiteError("the full forward suite needs a GPU; on the CUDA simulator only --quick runs (tiny cases)")
        cases = [(B, H, N, d, "float32", c) for (B, H, N, d) in SIMULATOR_QUICK for c in (False, True)]
        run = run_case_simulator
    else:
        if not gpu_available():
            raise SuiteError("no usable GPU here (or the CUDA simulator is on); the simulator runs only the quick "
                             "suite: numba-flash bench --quick")
        _require("torch", "cupy")
        cases = [(B, H, N, d, dt_, c) for (B, H, N, d) in (QUICK if quick else FULL) for dt_ in dtypes for c in (False, True)]
        cases += [(B, H, N, d, dt_, False) for (B, H, N, d, dt_) in EXTRA]
        run = lambda *case: run_case(*case, include_math=case[2] <= 4096 and not quick)  # noqa: E731
    rows = []
    bar = Progress(len(cases), "forward", enabled=progress)
    try:
        for case in cases:
            case_rows = run(*case)
            rows.extend(case_rows)
            bar.step(_case_line(case_rows, simulator))
    finally:
        bar.close()
    return {"forward": rows, "memory": peak_memory() if memory and not simulator else None}


def _require(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SuiteError(
            f"the GPU forward suite compares against PyTorch SDPA and CuPy; missing: {', '.join(missing)} "
            "(pip install torch cupy-cuda12x)"
        )


# --- the registry of suites ------------------------------------------------------------------------


SCRIPT_SUITES = ("backward", "decode")  # scripts/bench_<name>.py, written beside this module


@dataclass(frozen=True)
class Suite:
    name: str
    source: str
    run: Callable[..., dict]  # (quick=, simulator=, progress=) -> dict merged into the result


def _forward_entry(*, quick, simulator, progress, dtypes=("float32", "float16"), memory=True):
    return forward_suite(quick=quick, simulator=simulator, progress=progress, dtypes=dtypes, memory=memory)


def load_script(path: Path):
    """Import a script as a module (its ``if __name__ == "__main__"`` part does not run)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_suite(name: str, path: Path) -> Suite:
    """A scripts/bench_<name>.py as a suite: its run_suite() if it has one, else the script run whole."""

    def run(*, quick, simulator, progress, **_):
        module = load_script(path)
        if hasattr(module, "run_suite"):
            return {name: module.run_suite(quick=quick, simulator=simulator, progress=progress)}
        if simulator:
            return {name: {"skipped": f"{path.name} defines no run_suite(); run whole, it needs a GPU"}}
        proc = subprocess.run([sys.executable, str(path), *(["--quick"] if quick else [])],
                              capture_output=True, text=True, cwd=path.parent.parent)
        return {name: {"script": str(path), "returncode": proc.returncode,
                       "output_tail": (proc.stdout + proc.stderr)[-4000:]}}

    return Suite(name, str(path), run)


def registry(root: Path = REPO_ROOT) -> dict[str, Suite]:
    """Every suite that can run from here: forward, then each scripts/bench_<name>.py present."""
    suites = {"forward": Suite("forward", "numba_flash.bench", _forward_entry)}
    for name in SCRIPT_SUITES:
        path = root / "scripts" / f"bench_{name}.py"
        if path.exists():
            suites[name] = script_suite(name, path)
    return suites


def gpu_available() -> bool:
    """A real GPU that numba can use (the simulator does not count)."""
    from numba import config, cuda

    return not config.ENABLE_CUDASIM and cuda.is_available()


def gpu_name() -> str:
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def metadata(command: str, *, simulator: bool) -> dict:
    """Where and how a result was measured (GPU, date, command, commit, versions)."""
    import numba

    gpu = "none (CUDA simulator)" if simulator else gpu_name()
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    # NUMBA_FLASH_COMMIT: set where the tree was copied without its current git metadata (GPU host).
    commit = os.environ.get("NUMBA_FLASH_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=REPO_ROOT).stdout.strip()
    except OSError:  # no git: a result without a commit is still a result
        commit = ""
    return {
        "gpu": gpu, "backend": "simulator" if simulator else "gpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": command,
        "torch": torch_version, "python": platform.python_version(), "numba": numba.__version__,
        "numba_flash": numba_flash.__version__, "commit": commit,
    }


def new_result(command: str, *, simulator: bool) -> dict:
    return {"meta": metadata(command, simulator=simulator), "forward": [], "sweep_simt": None, "memory": None}


def run_suites(names, *, command, quick=False, simulator=False, progress=True, **forward_options) -> dict:
    """Run the named suites (all registered when names is empty) into one result dict."""
    suites = registry()
    unknown = [n for n in names or () if n not in suites]
    if unknown:
        raise SuiteError(f"unknown suite(s) {', '.join(unknown)}; registered here: {', '.join(suites)}")
    result = new_result(command, simulator=simulator)
    result["suites"] = list(names or suites)
    for name in result["suites"]:
        opts = forward_options if name == "forward" else {}
        try:
            result.update(suites[name].run(quick=quick, simulator=simulator, progress=progress, **opts))
        except Exception as e:  # a broken extra suite must not lose the others' results
            if name == "forward":
                raise
            result[name] = {"error": f"{type(e).__name__}: {e}"}
    return result


# --- tables and files ----------------------------------------------------------------------------------


def _fmt_tflops(t):
    return f"{t:.1f}" if t >= 0.1 else f"{t:.1e}"  # simulator figures are ~1e-6


def table(rows):
    lines = ["| dtype | causal | B | H | N | d | impl | ms | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = _fmt_tflops(r["tflops"]) if r.get("tflops") else f"— ({r.get('error', '')[:60]})"
        ms = f"{r['ms']:.3f}" if r.get("ms") else "—"
        lines.append(f"| {r.get('dtype', '—')} | {r.get('causal', '—')} | {r.get('B', '—')} | {r.get('H', '—')} | "
                     f"{r.get('N', '—')} | {r.get('d', '—')} | {r['impl']} | {ms} | {val} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The result as markdown: header, the forward table, memory, the sweep, other suites."""
    meta = result["meta"]
    md = [f"# Forward benchmark\n\nGPU: {meta['gpu']}; date: {meta['date']}; command: `{meta['command']}`; "
          f"commit {meta['commit']}; torch {meta['torch']}.\n", table(result["forward"])]
    if meta.get("backend") == "simulator":
        md.insert(1, "CUDA simulator: the kernel runs in a Python interpreter; times are not performance figures.\n")
    if result.get("memory"):
        r0 = result["memory"][0]
        md.append(f"\n## Peak extra device memory (bytes beyond q, k, v), {_short(r0['dtype'])} B{r0['B']} H{r0['H']} d{r0['d']}\n")
        md.append("| N | numba_flash | out+lse | naive (torch) |\n|---|---|---|---|")
        for r in result["memory"]:
            md.append(f"| {r['N']} | {r['numba_flash']} | {r['ours_expected']} | "
                      f"{r['naive-torch'] if r['naive-torch'] is not None else 'OOM'} |")
    if result.get("sweep_simt"):
        md.append("\n## SIMT config sweep, fp32 B4 H16 N4096 d128\n\n| block_q, block_k, row_threads, col_threads, "
                  "share_kv | TFLOP/s | regs | smem B |\n|---|---|---|---|")
        for r in result["sweep_simt"]:
            md.append(f"| {r['config']} | {r.get('tflops', 0):.1f} | {r.get('regs', '')} | {r.get('smem', r.get('error', ''))} |")
    for name in result.get("suites", ()):
        if name == "forward":
            continue
        part = result.get(name)
        md.append(f"\n## {name}\n")
        if isinstance(part, dict) and part.get("rows"):
            md.append(table(part["rows"]))
        else:
            md.append(f"```\n{json.dumps(part, indent=1)[:2000]}\n```")
    return "\n".join(md)


def _short(dtype):
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def write_results(result: dict, stem: str) -> tuple[str, str]:
    """Write <stem>.json and <stem>.md; returns their paths."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    return stem + ".json", stem + ".md"
