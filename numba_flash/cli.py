"""The numba-flash command: demo | trace | explain | bench | plot (also ``python -m numba_flash``).

    numba-flash demo                       forward on a real problem (GPU) or a small one (CUDA simulator), checked
    numba-flash trace --x 1 3 2 5 --v 10 20 30 40 --blocks 2 2 [--order 1 0]
    numba-flash explain --shape B H Nq Nk d --dtype float16 [--causal] [--hkv N]
    numba-flash bench [--quick] [--json PATH] [--plots DIR]
    numba-flash plot RESULTS.json --out DIR
    numba-flash warmup --shape B H Nq Nk d [--dtype float16 ...] [--causal] [--hkv N] [--backward] [--decode]
    numba-flash cache [--clear]            the on-disk kernel cache (numba_flash.jit_cache): where, how big

Exit status: 0 success; 1 a check failed (demo, trace); 2 bad input, an unsupported case
(explain prints the error ``forward`` would raise), or a missing optional package.

GPU or simulator: Numba reads NUMBA_ENABLE_CUDASIM once, at its first import, so the choice is
made cheaply before any kernel runs: --simulator, or no /dev/nvidiactl and no /dev/nvidia0 (no
NVIDIA driver), means the simulator. Importing numba_flash already imports numba, so a command
that runs kernels and finds numba loaded with the simulator off re-starts itself once with
NUMBA_ENABLE_CUDASIM=1, and says so.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

SIM_ENV = "NUMBA_ENABLE_CUDASIM"
REASON_ENV = "NUMBA_FLASH_BACKEND_REASON"  # carries the detection's reason across the re-start
DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0")

CHAPTER_X = (1.0, 3.0, 2.0, 5.0)  # the worked example of 3.6.5
CHAPTER_V = (10.0, 20.0, 30.0, 40.0)

GPU_DEMO = (4, 16, 4096, 128)  # (B, H, N, d): one attention layer of a mid-size LLM
SIM_DEMO = (1, 2, 128, 64)  # about 10 s on the simulator
DEMO_CHECK_HEADS = 4  # heads checked in float64 when all would be slow (each is an N×N float64 matrix)
LONG_CONTEXT = {"n": 131072, "batch": 1, "heads": 32}  # 128k tokens: where S stops fitting on any GPU
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class CLIError(Exception):
    """Bad input or a missing package: printed as the command's error, exit status 2."""


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


# --- GPU or simulator ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    simulator: bool
    reason: str


def detect_backend(force_simulator: bool = False) -> Backend:
    """GPU or CUDA simulator, decided without importing numba or touching the driver."""
    restarted = os.environ.get(REASON_ENV)  # set when this process is the re-started command
    if force_simulator:
        return Backend(True, restarted or "--simulator was given")
    value = os.environ.get(SIM_ENV, "")
    if value not in ("", "0"):
        return Backend(True, restarted or f"{SIM_ENV}={value} is set in the environment")
    present = [p for p in DEVICE_FILES if os.path.exists(p)]
    if not present:
        return Backend(True, f"no NVIDIA driver: neither {' nor '.join(DEVICE_FILES)} exists")
    return Backend(False, f"{present[0]} exists")


def activate(backend: Backend, restart_argv: list[str] | None) -> Backend:
    """Make numba run where ``backend`` says (re-starting if needed); returns it with the whole story."""
    if not backend.simulator:
        from numba import cuda

        if cuda.is_available():
            return Backend(False, f"{backend.reason} and numba.cuda.is_available() is True")
        backend = Backend(True, f"{backend.reason}, but numba.cuda.is_available() is False (no usable driver)")
    reason = backend.reason
    if "numba" not in sys.modules:
        os.environ[SIM_ENV] = "1"  # numba is not imported yet: setting the variable is enough
        reason += f"; {SIM_ENV}=1 was set before numba was imported"
    from numba import config

    if not config.ENABLE_CUDASIM:
        _restart_with_simulator(reason, restart_argv)
    return Backend(True, f"{reason}; numba.config.ENABLE_CUDASIM = {config.ENABLE_CUDASIM}")


def _restart_with_simulator(reason: str, restart_argv: list[str] | None):
    """Run this command again in a fresh interpreter with NUMBA_ENABLE_CUDASIM=1 (never returns)."""
    if restart_argv is None:  # called as a function, not as a command: replacing the process would be rude
        raise CLIError(f"{reason}, but numba is already imported here with the simulator off; set {SIM_ENV}=1 "
                       "before importing numba, or run the command as `python -m numba_flash ...`")
    env = dict(os.environ)
    env[SIM_ENV] = "1"
    env[REASON_ENV] = (f"{reason}; so the command re-started itself with {SIM_ENV}=1 (numba reads it once, "
                       "at import, and importing numba_flash had already imported numba)")
    package_root = str(Path(__file__).resolve().parents[1])  # the child must import this same numba_flash
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "numba_flash", *restart_argv], env)


def _backend_lines(backend: Backend) -> str:
    if backend.simulator:
        return f"backend: CUDA simulator (kernels run as Python threads on the CPU)\n  why: {backend.reason}"
    from numba_flash.bench import gpu_name

    return f"backend: GPU {gpu_name()}\n  why: {backend.reason}"


# --- trace ---------------------------------------------------------------------------------------


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def online_matches_standard(trace, rtol: float = 1e-12) -> bool:
    """Online ℓ, O, L equal the whole-row computation up to float64 rounding (hand_calc.py's rtol)."""
    pairs = [(trace.l, trace.standard_l), (trace.L, trace.standard_L),
             *zip(_as_tuple(trace.O), _as_tuple(trace.standard_O))]
    return all(a == b or abs(a - b) <= rtol * max(1.0, abs(b)) for a, b in pairs)


def cmd_trace(args, restart_argv) -> int:
    from reference import format_trace, online_softmax_trace

    if args.x is not None and args.v is None:
        raise CLIError("--x was given without --v; give the values too (d per key)")
    x = list(CHAPTER_X if args.x is None else args.x)
    v = list(CHAPTER_V if args.v is None else args.v)
    n, d = len(x), args.d
    if d < 1 or len(v) != n * d:
        raise CLIError(f"--v needs n·d = {n}·{d} = {n * d} numbers (d per key); got {len(v)}")
    values = v if d == 1 else [v[i * d:(i + 1) * d] for i in range(n)]
    blocks = args.blocks or ([n] if n < 2 else [n - n // 2, n // 2])  # default: two halves, as hand_calc.py
    orders = [args.order] if args.order else [None] + ([list(range(len(blocks)))[::-1]] if len(blocks) > 1 else [])
    try:
        traces = [online_softmax_trace(x, values, blocks=blocks, order=o) for o in orders]
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from None
    agree = all(online_matches_standard(t) for t in traces)
    first = traces[0]
    O = round(first.O, 2) if d == 1 else [round(o, 2) for o in first.O]  # the chapter's rounding: ℓ 4, O 2
    if args.json:
        print(json.dumps({"traces": [t.to_dict() for t in traces], "l": round(first.l, 4), "O": O,
                          "online_equals_standard": agree}, indent=1, ensure_ascii=False))
    else:
        for t in traces:
            print(format_trace(t, digits=args.digits), end="\n\n")
        print(f"ℓ = {first.l:.4f}, O = {O}")
        print("online = standard, in every order shown (up to float64 rounding)" if agree
              else "MISMATCH: the online result differs from the standard one beyond float64 rounding")
    return 0 if agree else 1


# --- explain -------------------------------------------------------------------------------------


class _DeviceShape:
    """Shape and dtype of a device array with no data behind it (a dtype NumPy lacks, e.g. bfloat16)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "|V2", "data": (0, True), "version": 3, "strides": None}


def shape_only(shape, dtype: str):
    """An array of this shape and dtype that costs no memory: all validation needs, nothing more."""
    import numpy as np

    if dtype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
        except ImportError:
            return _DeviceShape(shape, dtype)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:  # a name NumPy does not know: validation will say what is accepted
        return _DeviceShape(shape, dtype)
    # zero strides over a one-element buffer: any index reads that element, nothing is allocated
    return np.lib.stride_tricks.as_strided(np.zeros(1, np_dtype), shape=tuple(shape), strides=(0,) * len(shape),
                                           writeable=False)


def find_ptxas() -> str | None:
    found = shutil.which("ptxas")
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))
    return found or (candidates[-1] if candidates else None)


@dataclass(frozen=True)
class KernelFacts:
    """What explain reports about one kernel specialisation, whatever its family's config looks like."""

    block_q: int
    block_k: int
    threads: int | None
    smem_bytes: int | None
    roof: str  # the compute roof: "fp32" (CUDA-core FMA), "fp16"/"bf16"/"tf32"/"tf32x3" (tensor cores)
    jit: object = None  # () -> the compiled cuda.jit kernel (on a GPU)
    source: object = None  # () -> (python kernel, signature, fastmath) for cuda.compile_ptx
    arch: str = "sm_90"  # the target of that source's ptxas -v (wgmma: sm_90a)


def kernel_facts(family: str, cfg, causal: bool, dtype: str) -> KernelFacts:
    """Tiles, threads, shared memory and how to compile, for each family api.choose_kernel returns."""
    if family == "simt":
        from numba_flash.kernels import simt_forward as m

        return KernelFacts(cfg.block_q, cfg.block_k, cfg.threads, cfg.smem_bytes, "fp32",
                           jit=lambda: m.make_forward_kernel(cfg, causal, dtype),
                           source=lambda: (m.kernel_source(cfg, causal, dtype), m.kernel_signature(dtype), m.FASTMATH))
    if family == "mma" and cfg.has("wgmma"):  # sm_90's forward (api.mma_config's MMA_WGMMA tiles)
        from numba_flash.kernels import wgmma_forward as m

        return KernelFacts(cfg.block_q, cfg.block_k, m.threads(cfg), m.smem_bytes(cfg),
                           "bf16" if dtype == "bfloat16" else "fp16",
                           jit=lambda: m.build(cfg, bool(causal), dtype),
                           source=lambda: (m.kernel_source(cfg, causal, dtype), m.kernel_signature(), None),
                           arch="sm_90a")
    if family == "mma":
        from numba_flash.kernels import mma_forward as m

        # the same key as mma_forward.launch (contiguous out: rows 16-byte aligned when d % 8 == 0), so a GPU
        # run reuses its compiled kernel
        return KernelFacts(cfg.block_q, cfg.block_k, m.threads(cfg), m.smem_bytes(cfg),
                           "bf16" if dtype == "bfloat16" else "fp16",
                           jit=lambda: m.build(cfg, bool(causal), dtype),
                           source=lambda: (m.kernel_source(cfg, causal, dtype), m.kernel_signature(), None))
    if family in ("tf32x3", "tf32"):
        from numba_flash.kernels import tf32_forward as m

        passes = 3 if family == "tf32x3" else 1
        tile = cfg if passes == 3 else cfg.with_(flags=cfg.flags - {"presplit"})  # as launch builds it
        # the same key as tf32_forward.launch (the device's split rounding included), so a GPU run reuses its
        # compiled kernel; the source is for ptxas's sm_90, whose split is cvt.rn
        return KernelFacts(tile.block_q, tile.block_k, m.threads(tile), m.smem_bytes(tile, passes), family,
                           jit=lambda: m.build(tile, bool(causal), passes, m.split_round_for_device()),
                           source=lambda: (m.kernel_source(tile, causal, passes, "rn"), m.kernel_signature(), None))
    return KernelFacts(128, 128, None, None, "fp16" if dtype != "float32" else "fp32")  # a family explain predates


def cache_words(facts: KernelFacts) -> str:
    """Whether the forward kernel of this specialisation is in the on-disk cache (numba_flash.jit_cache), found
    without compiling it."""
    from numba_flash import jit_cache

    if facts.jit is None:
        return "n/a (explain does not know how to build this kernel family)"
    found = jit_cache.lookup(facts.jit)
    state = found["state"]
    if state == "cached":
        return f"cached ({found['file']}): the first call loads it instead of compiling"
    if state == "not cached":
        return (f"not cached: the first call compiles it (numba-flash warmup stores it in {jit_cache.cache_dir()})")
    if state == "off":
        why = "the CUDA simulator is on" if jit_cache.nb_config.ENABLE_CUDASIM else "NUMBA_FLASH_CACHE=0"
        return f"off ({why})"
    if state == "no GPU":
        return "n/a without GPU (the cache key holds the GPU's compute capability)"
    return state


def kernel_resources(facts: KernelFacts) -> dict | str:
    """Registers and local memory per thread: from the GPU, else ptxas -v for sm_90, else why not."""
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        return "n/a without GPU (the CUDA simulator is on: nothing is compiled)"
    if facts.jit is None:
        return "n/a (explain does not know how to compile this kernel family)"
    try:
        if cuda.is_available():
            kernel = facts.jit()
            attrs = next(iter(kernel.overloads.values()))._codelibrary.get_cufunc().attrs
            return {"registers": attrs.regs, "local_bytes": attrs.local, "source": "compiled for this GPU"}
        ptxas = find_ptxas()
        if ptxas is None:
            return "n/a without GPU (and no ptxas to ask)"
        kernel, signature, fastmath = facts.source()
        cc = (9, 0, "a") if facts.arch == "sm_90a" else (9, 0)
        with _compile_for_sm90_without_gpu():
            ptx, _ = cuda.compile_ptx(kernel, signature, cc=cc, fastmath=fastmath or False)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            Path(src).write_text(ptx)
            proc = subprocess.run([ptxas, f"-arch={facts.arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True, timeout=300)
        return {**parse_ptxas(proc.stderr + proc.stdout), "source": f"ptxas -v for {facts.arch} (no GPU here)"}
    except Exception as e:  # no NVVM, a ptxas failure: the rest of explain still stands
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return f"n/a (compiling failed: {type(e).__name__}: {first})"


class _compile_for_sm90_without_gpu:
    """Numba asks the current device for its compute capability while compiling device functions,
    even for compile_ptx(cc=...); with no GPU, answer sm_90, the target (as tests/kernels/test_ptx.py does)."""

    def __enter__(self):
        import numba.cuda.dispatcher as dispatcher

        self.dispatcher, self.saved = dispatcher, dispatcher.get_current_device
        dispatcher.get_current_device = lambda: type("Sm90", (), {"compute_capability": (9, 0)})()

    def __exit__(self, *exc):
        self.dispatcher.get_current_device = self.saved


def parse_ptxas(report: str) -> dict:
    """Registers and local memory (stack + spills) from ``ptxas -v`` output."""
    regs = re.search(r"Used (\d+) registers", report)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if regs is None:
        raise ValueError(f"no register count in ptxas output: {report.strip()[-200:]!r}")
    local = int(frame.group(1)) + int(frame.group(2)) if frame else 0
    return {"registers": int(regs.group(1)), "local_bytes": local}


def _config_line(cfg) -> str:
    from numba_flash.tiles import Tile

    if isinstance(cfg, Tile):
        return str(cfg)
    if is_dataclass(cfg):
        return ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg))
    if isinstance(cfg, dict):
        return ", ".join(f"{k}={v}" for k, v in cfg.items())
    return repr(cfg)


def _explain_shape(values) -> tuple[int, int, int, int, int]:
    if len(values) not in (4, 5) or min(values) < 1:
        raise CLIError(f"--shape takes B H Nq Nk d (or B H N d), all >= 1; got {' '.join(map(str, values))}")
    B, H, n_q, *rest = values
    return (B, H, n_q, n_q, rest[0]) if len(rest) == 1 else (B, H, n_q, rest[0], rest[1])


def cmd_explain(args, restart_argv) -> int:
    from numba_flash import api
    from numba_flash.configs import REGS_PER_SM
    from reference import costs

    B, H, n_q, n_k, d = _explain_shape(args.shape)
    hkv = H if args.hkv is None else args.hkv
    q_shape, kv_shape = (B, H, n_q, d), (B, hkv, n_k, d)
    call = f"forward(q {q_shape}, k/v {kv_shape}, {args.dtype}, causal={args.causal})"
    q, kv = shape_only(q_shape, args.dtype), shape_only(kv_shape, args.dtype)
    try:  # forward runs exactly these two steps before it launches anything
        p = api.validate(q, kv, kv, causal=args.causal, softmax_scale=args.scale)
        family, cfg, reasons = api.choose_kernel(p, args.kernel)
    except (TypeError, ValueError) as e:
        print(f"{call}\nunsupported: forward would raise {type(e).__name__}: {e}", file=sys.stderr)
        return 2

    print(call)
    print(f"kernel: {family}")
    for r in reasons:
        print(f"  {r}")
    print(f"config: {_config_line(cfg)}")
    facts = kernel_facts(family, cfg, p.causal, p.dtype)
    block_q, block_k, threads = facts.block_q, facts.block_k, facts.threads
    print(f"grid: {math.ceil(n_q / block_q)} Q tiles × {B * H} (batch·head) = "
          f"{math.ceil(n_q / block_q) * B * H} thread blocks" + (f" of {threads} threads" if threads else ""))
    if facts.smem_bytes is not None:
        parts = ", ".join(f"{k} {4 * w}" for k, w in getattr(cfg, "smem_words", {}).items() if w)
        print(f"shared memory: {facts.smem_bytes} B per block" + (f" ({parts} B)" if parts else ""))
    print(f"kernel cache: {cache_words(facts)}")  # before kernel_resources, which compiles on a GPU
    res = kernel_resources(facts)
    if isinstance(res, dict):
        per_sm = f"; × {threads} threads = {res['registers'] * threads} of {REGS_PER_SM} per SM" if threads else ""
        print(f"registers: {res['registers']} per thread, {res['local_bytes']} B local memory "
              f"(stack + spills){per_sm} — {res['source']}")
    else:
        print(f"registers: {res}")
    if args.causal:
        from numba_flash.plots import causal_tile_counts

        c = causal_tile_counts(n_q, n_k, block_q, block_k)
        print(f"causal tiles: {c['full']} full, {c['masked']} masked, {c['skipped']} skipped of {sum(c.values())} "
              "per batch·head (skipped tiles are never loaded)")

    e = BYTES.get(p.dtype, 2)
    shape = dict(bytes_per_element=e, batch=B, heads=H)
    std = costs.standard_attention_hbm_bytes(n_q, n_k, d, **shape)
    fa = costs.flash_attention_hbm_bytes(n_q, n_k, d, block_q=block_q, block_k=block_k, causal=p.causal, **shape)
    fl = costs.attention_flops(n_q, n_k, d, batch=B, heads=H, causal=p.causal)
    n2 = std["write S"] + std["read S"] + std["write P"] + std["read P"]
    print(f"HBM traffic (reference.costs models, {e}-byte elements" + (", K/V counted per query head" if hkv != H else "") + "):")
    print(f"  standard attention  {fmt_bytes(std['total']):>10}  (S and P written and read: {fmt_bytes(n2)})")
    print(f"  this kernel         {fmt_bytes(fa['total']):>10}  (K/V read once per {block_q}-row Q tile; "
          f"{fmt_bytes(fa['ideal'])} if each tensor were read once, as L2 reuse approaches)")
    print(f"  → {std['total'] / fa['total']:.1f}× to {std['total'] / fa['ideal']:.0f}× less traffic than standard attention")
    roof = facts.roof
    print(f"FLOPs: {fl:.3e} (4·B·H·visible pairs·d); arithmetic intensity: standard {fl / std['total']:.0f}, "
          f"this kernel {fl / fa['total']:.0f}–{fl / fa['ideal']:.0f} FLOP/B; H200 ridge {costs.H200.ridge_point(roof):.0f} "
          f"FLOP/B for its {roof} roof" + (" (CUDA-core FMA)" if roof == "fp32" else " (tensor cores)"))
    s_bytes = costs.score_matrix_bytes(n_q, n_k, bytes_per_element=e, batch=B, heads=H)
    print(f"materialising S would take {fmt_bytes(s_bytes)} (B·H·Nq·Nk × {e} B), and P as much again; "
          f"this kernel writes O and L only: {fmt_bytes(B * H * n_q * (d * e + 4))}")
    return 0


# --- demo ----------------------------------------------------------------------------------------


def _run_on_gpu(q, k, v, causal: bool, reps: int):
    """forward on device arrays (CuPy if installed, else Numba), timed with CUDA events after a warm-up."""
    import numpy as np
    from numba import cuda

    import numba_flash

    try:
        import cupy as cp

        dev, kind, to_host = [cp.asarray(x) for x in (q, k, v)], "CuPy arrays", cp.asnumpy
    except ImportError:
        dev, kind = [cuda.to_device(x) for x in (q, k, v)], "Numba device arrays (CuPy is not installed)"
        to_host = lambda a: a.copy_to_host()  # noqa: E731
    out, lse = numba_flash.forward(*dev, causal=causal)  # the first call compiles this specialisation
    cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = cuda.event(), cuda.event()
        start.record()
        numba_flash.forward(*dev, causal=causal)
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return to_host(out), to_host(lse), float(np.median(times)), kind


def check_against_reference(q, k, v, out, lse, causal: bool) -> dict:
    """Max errors of O and L against float64 reference.standard_attention, on all heads or a sample."""
    import numpy as np

    from reference import standard_attention

    B, H, N, _ = q.shape
    heads = [(b, h) for b in range(B) for h in range(H)]
    if len(heads) * N * k.shape[2] > 2**24:  # a float64 S per head: keep the check to seconds
        step = max(1, len(heads) // DEMO_CHECK_HEADS)
        heads = heads[::step][:DEMO_CHECK_HEADS - 1] + [heads[-1]]
    err_o = err_l = 0.0
    scale = 1.0
    masked_rows_agree = True
    for b, h in heads:
        ref_o, ref_l = standard_attention(q[b, h], k[b, h], v[b, h], causal=causal)
        err_o = max(err_o, float(np.max(np.abs(out[b, h].astype(np.float64) - ref_o))))
        fin = np.isfinite(ref_l)
        masked_rows_agree &= bool(np.array_equal(np.isfinite(lse[b, h]), fin))
        if fin.any():
            err_l = max(err_l, float(np.max(np.abs(lse[b, h][fin].astype(np.float64) - ref_l[fin]))))
        scale = max(scale, float(np.max(np.abs(ref_o))))
    # fp32: the GPU tests' bound; fp16/bf16: the output is rounded to its dtype, so one ulp more
    eps = 0.0 if q.dtype == np.float32 else float(np.finfo(q.dtype).eps)
    tol_o, tol_l = (2e-5 + eps) * scale, 1e-4
    ok = err_o <= tol_o and err_l <= tol_l and masked_rows_agree
    return {"heads": len(heads), "of": B * H, "err_o": err_o, "tol_o": tol_o, "err_l": err_l, "tol_l": tol_l,
            "masked_rows_agree": masked_rows_agree, "ok": ok}


def cmd_demo(args, restart_argv) -> int:
    backend = activate(detect_backend(args.simulator), restart_argv)
    import numpy as np

    import numba_flash
    from reference import costs

    sim = backend.simulator
    B, H, N, d = args.shape or (SIM_DEMO if sim else GPU_DEMO)
    dtype = args.dtype or ("float32" if sim else "float16")
    print(_backend_lines(backend))
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((B, H, N, d), dtype=np.float32).astype(dtype) for _ in range(3))
    print(f"problem: B={B} H={H} Nq=Nk={N} d={d} {dtype}, causal={args.causal}")
    try:  # forward's own checks (e.g. d > 256): a usage error, not a traceback
        chosen = numba_flash.explain(q, k, v, causal=args.causal)
    except (TypeError, ValueError) as e:
        raise CLIError(f"--shape {B} {H} {N} {d} --dtype {dtype}: forward would raise {type(e).__name__}: {e}") from None
    print("kernel: " + chosen.replace("\n", "\n        "))

    flops = costs.attention_flops(N, N, d, batch=B, heads=H, causal=args.causal)
    if sim:
        t0 = time.perf_counter()
        out, lse = numba_flash.forward(q, k, v, causal=args.causal)  # NumPy in, NumPy out
        print(f"time: {time.perf_counter() - t0:.1f} s for one call on the simulator (the kernel interpreted in "
              "Python: a correctness run, not a performance figure)")
    else:
        out, lse, ms, kind = _run_on_gpu(q, k, v, args.causal, args.reps)
        print(f"time: {ms:.3f} ms per call (median of {args.reps} CUDA-event timings after a warm-up; {kind}) = "
              f"{flops / ms / 1e9:.1f} TFLOP/s")

    c = check_against_reference(q, k, v, out, lse, args.causal)
    print(f"check vs reference.standard_attention (float64 NumPy) on {c['heads']} of {c['of']} heads:")
    print(f"  max |O - O_ref| = {c['err_o']:.2e} (tolerance {c['tol_o']:.1e} for {dtype} output)")
    print(f"  max |L - L_ref| = {c['err_l']:.2e} (tolerance {c['tol_l']:.0e})"
          + ("" if c["masked_rows_agree"] else "; fully masked rows (L = -inf) DIFFER"))
    print("  PASS" if c["ok"] else "  FAIL")

    e = BYTES[dtype]
    s_here = costs.score_matrix_bytes(N, N, bytes_per_element=e, batch=B, heads=H)
    s_long = costs.score_matrix_bytes(LONG_CONTEXT["n"], LONG_CONTEXT["n"], bytes_per_element=2,
                                      batch=LONG_CONTEXT["batch"], heads=LONG_CONTEXT["heads"])
    cap = costs.H200.hbm_capacity_bytes
    print(f"memory: materialising S (B·H·Nq·Nk × {e} B) would take {fmt_bytes(s_here)} here, and P as much again;")
    print(f"  at a 128k context (N = {LONG_CONTEXT['n']}, B={LONG_CONTEXT['batch']}, H={LONG_CONTEXT['heads']}, fp16) "
          f"{fmt_bytes(s_long)}: {s_long / cap:.0f}× an H200's {cap / 1e9:.0f} GB;")
    print(f"  numba_flash writes only O and L: {fmt_bytes(B * H * N * (d * e + 4))} here, O(N) not O(N²).")
    return 0 if c["ok"] else 1


# --- bench and plot --------------------------------------------------------------------------------


def _need_matplotlib():
    from numba_flash import plots

    try:
        plots._pyplot()
    except ImportError as e:
        raise CLIError(str(e)) from None
    return plots


def cmd_bench(args, restart_argv) -> int:
    plots = _need_matplotlib() if args.plots else None  # before a long run, not after it
    backend = activate(detect_backend(args.simulator), restart_argv)
    from numba_flash import bench

    print(_backend_lines(backend))
    if backend.simulator:
        print("  simulator: tiny fp32 cases, each checked against the NumPy reference; no SDPA or CuPy; "
              "times are not performance figures")
    try:
        result = bench.run_suites(args.suites, command=" ".join(["numba-flash", *args.argv]), quick=args.quick,
                                  simulator=backend.simulator, progress=not args.no_progress,
                                  dtypes=args.dtypes, memory=not args.no_memory)
    except bench.SuiteError as e:
        raise CLIError(str(e)) from None
    print()
    print(bench.markdown(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if plots is not None:
        _report_plots(*plots.render_all(result, args.plots))
    return 0


def _report_plots(written, skipped):
    for path in written:
        print(f"wrote {path}")
    for why in skipped:
        print(f"skipped {why}")


def cmd_plot(args, restart_argv) -> int:
    plots = _need_matplotlib()
    result = None
    if args.results:
        try:
            with open(args.results) as f:
                result = json.load(f)
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read results JSON {args.results}: {e}") from None
    cases = []
    for t in args.tiles or ():
        if len(t) not in (2, 4) or min(t) < 1:
            raise CLIError(f"--tiles takes Nq Nk [block_q block_k], all >= 1; got {' '.join(map(str, t))}")
        cases.append(tuple(t) if len(t) == 4 else (*t, 64, 64))
    _report_plots(*plots.render_all(result, args.out, tile_cases=cases or plots.DEFAULT_TILE_CASES))
    return 0


# --- the parser ----------------------------------------------------------------------------------


def _int_at_least(low: int):
    """An argparse type: an int >= low, else a usage error (exit 2) saying what is accepted."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"got {n}; accepted: an int >= {low}")
        return n
    return parse


# What argparse reads as a negative number, not an option: its own -1 and -.5, plus -1e3, -inf and -nan,
# so that `trace --x -inf 1` works (argparse has no public switch for this; its option strings never look so).
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="numba-flash", description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="run forward on the GPU (or the simulator), check it, time it")
    p.add_argument("--simulator", action="store_true", help="use Numba's CUDA simulator even if there is a GPU")
    p.add_argument("--shape", type=_int_at_least(1), nargs=4, metavar=("B", "H", "N", "d"),
                   help=f"problem size (default {' '.join(map(str, GPU_DEMO))} on a GPU, "
                        f"{' '.join(map(str, SIM_DEMO))} on the simulator)")
    p.add_argument("--dtype", choices=("float32", "float16"), help="default float16 on a GPU, float32 on the simulator")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=_int_at_least(1), default=20, help="timed calls on a GPU (default 20)")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("trace", help="the online-softmax step table for one row of scores (3.6.5)")
    p._negative_number_matcher = _NEGATIVE_NUMBER  # values such as -inf or -1e3 after --x and --v
    p.add_argument("--x", type=float, nargs="+",
                   help="one row of scores, -inf for a masked key (default: the chapter's 1 3 2 5)")
    p.add_argument("--v", type=float, nargs="+", help="values, d per key (default: the chapter's 10 20 30 40)")
    p.add_argument("--d", type=int, default=1, help="value dimension: --v holds n·d numbers, key by key")
    p.add_argument("--blocks", type=int, nargs="+", help="block sizes summing to len(x) (default: two halves)")
    p.add_argument("--order", type=int, nargs="+", help="block order, a permutation (default: natural and reversed)")
    p.add_argument("--digits", type=_int_at_least(0), default=4, help="decimals in the table (default 4)")
    p.add_argument("--json", action="store_true", help="print the traces as JSON")

    p = sub.add_parser("explain", help="which kernel would run for a shape, its config and costs (no arrays needed)")
    p.add_argument("--shape", type=int, nargs="+", required=True, metavar="N",
                   help="B H Nq Nk d (or B H N d for Nq = Nk)")
    p.add_argument("--dtype", default="float16", help="float32, float16 or bfloat16 (default float16)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--hkv", type=int, help="K/V heads (GQA/MQA; default H)")
    p.add_argument("--scale", type=float, help="softmax scale (default 1/sqrt(d))")
    p.add_argument("--kernel", default="auto", help="kernel family (default auto)")

    p = sub.add_parser("bench", help="the benchmark suites: table, JSON, plots")
    p.add_argument("--quick", action="store_true", help="a few shapes (on the simulator: tiny cases)")
    p.add_argument("--json", metavar="PATH", help="write the results JSON here")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here (needs matplotlib)")
    p.add_argument("--suites", nargs="+", metavar="NAME", help="suites to run (default: every registered one)")
    p.add_argument("--simulator", action="store_true", help="use Numba's CUDA simulator even if there is a GPU")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16"], help="GPU forward dtypes")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory sweep (GPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("plot", help="PNG plots from a results JSON, and the causal tile grid")
    p.add_argument("results", nargs="?", help="results JSON from bench (omit for the tile grid only)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the PNG files")
    p.add_argument("--tiles", type=int, nargs="+", action="append", metavar="N",
                   help="a causal tile grid: Nq Nk [block_q block_k] (repeatable; default 1000 1000 and 300 1000, 64×64)")

    p = sub.add_parser("warmup", help="compile the kernels of a shape into the on-disk cache (GPU)")
    p.add_argument("--shape", type=int, nargs="+", required=True, metavar="N", help="B H Nq Nk d (or B H N d)")
    p.add_argument("--dtype", nargs="+", default=["float16"], choices=("float32", "float16", "bfloat16"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--both", action="store_true", help="causal and not")
    p.add_argument("--hkv", type=int, help="K/V heads (GQA/MQA; default H)")
    p.add_argument("--backward", action="store_true", help="the backward's kernels too (both dQ schemes)")
    p.add_argument("--decode", action="store_true", help="decode's kernels too (Nq <= 16)")

    p = sub.add_parser("cache", help="the on-disk kernel cache: directory, entries, size")
    p.add_argument("--clear", action="store_true", help="delete the cached kernels")
    return ap


def cmd_warmup(args, restart_argv) -> int:
    """Compile (and store in the disk cache) what forward / backward / decode run for these shapes."""
    backend = detect_backend(False)
    if not backend.simulator:
        from numba import cuda

        if not cuda.is_available():
            backend = Backend(True, f"{backend.reason}, but numba.cuda.is_available() is False")
    if backend.simulator:
        raise CLIError(f"warmup compiles GPU kernels; there is no GPU here ({backend.reason})")
    import numpy as np

    import numba_flash
    from numba_flash import jit_cache

    B, H, n_q, n_k, d = _explain_shape(args.shape)
    hkv = H if args.hkv is None else args.hkv
    if args.decode and n_q > 16:
        raise CLIError(f"--decode with Nq = {n_q}: decode takes at most 16 queries per sequence (give Nq <= 16)")
    if args.both and args.causal:
        raise CLIError("--both already warms causal and not; give one of --both and --causal")
    rng = np.random.default_rng(0)
    print(f"cache: {jit_cache.cache_dir()} ({'on' if jit_cache.enabled() else 'off: NUMBA_FLASH_CACHE=0'})")
    for dtype in args.dtype:
        for causal in ([False, True] if args.both else [args.causal]):
            if dtype == "bfloat16":
                try:
                    import ml_dtypes
                except ImportError:
                    raise CLIError("warmup --dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
            storage = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)

            def arr(*shape):  # NumPy in: copied to the GPU, contiguous rows as most callers pass
                return rng.standard_normal(shape, dtype=np.float32).astype(storage)
            before, logged = dict(jit_cache.info()), len(jit_cache.log())
            t0 = time.perf_counter()
            q, k, v = arr(B, H, n_q, d), arr(B, hkv, n_k, d), arr(B, hkv, n_k, d)
            try:
                out, lse = numba_flash.forward(q, k, v, causal=causal)
                if args.backward:  # both dQ schemes: deterministic (the default) and atomic (flash-attn's default)
                    dout = arr(B, H, n_q, d)
                    for deterministic in (True, False):
                        numba_flash.backward(q, k, v, out, lse, dout, causal=causal, deterministic=deterministic)
                if args.decode and n_q <= 16:
                    numba_flash.decode(q, k, v)
            except (TypeError, ValueError, NotImplementedError) as e:
                raise CLIError(f"--shape {' '.join(map(str, args.shape))} --dtype {dtype}: {type(e).__name__}: {e}")
            after = jit_cache.info()
            print(f"{dtype} causal={causal}: {time.perf_counter() - t0:.2f} s, {after['misses'] - before['misses']} "
                  f"compiled ({after['stores'] - before['stores']} stored), {after['hits'] - before['hits']} loaded")
            for family, seconds, how in jit_cache.log()[logged:]:  # one line per kernel specialisation
                print(f"  {family:24s} {seconds:7.2f} s  {how}")
    info = jit_cache.info()
    print(f"cache: {info['entries']} kernels, {fmt_bytes(info['bytes'])}")
    return 0


def cmd_cache(args, restart_argv) -> int:
    from numba_flash import jit_cache

    if args.clear:
        print(f"removed {jit_cache.clear()} kernels from {jit_cache.cache_dir()}")
        return 0
    info = jit_cache.info()
    print(f"dir: {info['dir']}\nenabled: {info['enabled']}\nkernels: {info['entries']} ({fmt_bytes(info['bytes'])})")
    return 0


COMMANDS = {"demo": cmd_demo, "trace": cmd_trace, "explain": cmd_explain, "bench": cmd_bench, "plot": cmd_plot,
            "warmup": cmd_warmup, "cache": cmd_cache}


def main(argv: list[str] | None = None) -> int:
    restart_argv = sys.argv[1:] if argv is None else None  # only a real command line may re-start itself
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return COMMANDS[args.command](args, restart_argv)
    except CLIError as e:
        parser.exit(2, f"numba-flash {args.command}: error: {e}\n")
