"""Differential fuzz of the public API (forward, backward, decode) against float64.

    python3 scripts/fuzz.py --problems 1000 --seed 0 --out results --jobs 8        # GPU (PyTorch optional)
    python3 scripts/fuzz.py --problems 12 --max-n 40 --max-d 40 --seed 0           # CUDA simulator, NumPy only
    python3 scripts/fuzz.py --seed 0 --only-index 57                               # one problem of that draw again
    python3 scripts/fuzz.py --repro "forward dtype=float16 backend=numpy B=1 ... seed=0 idx=57"

Each problem (dtype, shapes, GQA group, causal, softmax_scale, memory layout, and per family
deterministic / via autograd, or cache lengths / num_splits; a sliding window for 60 % of the forward and
backward problems the mma kernels take: fp16 / bf16, d <= 128, d % 8 == 0, rows 16-byte aligned) is drawn from its own generator seeded
by (seed, idx), so one index can be rerun alone. The draw depends on (seed, idx) and the arguments only,
not on the machine: every value is drawn, in one fixed order, whether the problem uses it or not and
whatever is installed (the simulator's defaults of --max-work and --max-bh are smaller: pass them to
draw a GPU run's problems there). What the machine cannot run is then decided per problem (``available``):
a problem drawn for PyTorch CUDA tensors runs on NumPy arrays where there is no PyTorch CUDA (autograd
and device lengths becoming the API and host lengths; the summary counts these as 'remapped'), or is
'skipped' if its float64 references would be too large for the host; a bfloat16 problem on NumPy
arrays without ml_dtypes is 'skipped' (not run as another dtype: the verdict would be another problem's).
Inputs are standard normal, rounded to the dtype.
Checks, as tests/kernels/test_gpu_forward.py and test_gpu_backward.py:
    fp16 / bf16: max |ours - fp64| <= 2 * max |naive same-dtype - fp64| + 1 ulp of max |fp64|
    fp32:        out <= 2e-5 * max(1, max |fp64|) * c, gradients <= 1e-4 * max |fp64| * c
    lse:         max |ours - fp64| <= 1e-4 * max(1, max |fp64|) over the rows that see a key
where c = max(1, max |scaled score| / 16) (an fp32 weight carries |s|·2^-24 relative rounding; the
tests' inputs have |s| <~ 16). Ours must be finite where fp64 is, rows that see no key must be
exactly O = 0, L = -inf. A ValueError / TypeError from the API counts as 'refused' and, as every
drawn problem is valid input, fails the run unless --allow-refusals; any other exception is a failure.
Each failure prints one line that --repro takes back. Exit 1 on any failure.

--out's JSON is rewritten while the draw runs (every few seconds, atomically: a temporary file, then
os.replace), so a killed run keeps what it ran; SIGTERM stops the draw and writes the summary and the JSON.
--jobs N runs N processes of this script, process j drawing the indices j mod N with the whole time
budget each (on a GPU each new kernel specialisation is seconds of JIT compile on one core), and merges
their results into one summary and one JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

# No GPU driver: run on Numba's CUDA simulator, decided before numba is imported (as tests/conftest.py).
if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
if SIM and os.environ.get("NUMBA_FLASH_SIM_SPEEDUP", "1") == "1":
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:  # the simulator without its busy loop: same results, faster
        import sim_speed

        sim_speed.install()
    except ImportError:
        pass

import numba  # noqa: E402

import numba_flash  # noqa: E402

try:
    import torch

    HAVE_TORCH_CUDA = (not SIM) and torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_TORCH_CUDA = False
try:
    import ml_dtypes  # NumPy bfloat16
except ImportError:
    ml_dtypes = None

FAMILIES = ("forward", "backward", "decode")
LAYOUTS = ("contiguous", "bnhd", "slice_n", "slice_d", "offset")
COMMON_D = (16, 32, 64, 80, 96, 128, 256)
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
SCORE_SCALE = 16.0  # |scaled score| the fp32 bounds of the tests were set at
INJECT = 0.1  # relative perturbation of ours with --inject-error (above every dtype's bound, bf16's ~1.6 %)
DEFAULT_WORK = 2**31 if not SIM else 2**16  # B·H·Nq·Nk·d per problem
DEFAULT_BH = None if not SIM else 4  # the simulator runs every block's threads in Python: few batch-heads
ABS_FLOOR = 1e-6  # degenerate problems (one key: P = 1, dS = 0) have exact-zero references that fp32 sums miss
MAX_SCORES = 2**28  # B·H·Nq·Nk: 2 GiB per float64 score matrix of the reference
MAX_HOST_SCORES = 2**24  # the NumPy references run on the host's cores: 128 MiB per matrix
DTYPES = ("float32", "float16", "bfloat16")
MAX_B = 4  # batch sizes 1 .. MAX_B


# --------------------------------------------------------------------------------------------
# The draw
# --------------------------------------------------------------------------------------------
def _log_uniform_int(rng, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)) - 0.5)))))


def draw(seed: int, idx: int, args) -> dict:
    """Problem idx of the draw: a dict of plain values (the spec a FAIL line prints).

    A function of (seed, idx) and the arguments only: every value is drawn, in one fixed order, whether or not
    the problem uses it (a forward has no splits) and whatever this machine has (``available`` then says
    what it can run)."""
    rng = np.random.default_rng([seed, idx])
    family = args.families[idx % len(args.families)]
    backend = "torch" if rng.random() < args.torch_fraction else "numpy"
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    common = [x for x in COMMON_D if x <= args.max_d]
    pick_common, which_common = rng.random() < 0.5, rng.random()
    d_log = _log_uniform_int(rng, 1, args.max_d)
    d = common[int(which_common * len(common))] if common and pick_common else d_log
    g = int(rng.choice([1, 2, 4, 8]))
    Hkv = int(rng.integers(1, 5))
    B = int(rng.integers(1, MAX_B + 1))
    decode_n_q = int(rng.integers(1, 5))
    n_a, n_b = _log_uniform_int(rng, 1, args.max_n), _log_uniform_int(rng, 1, args.max_n)
    same_n, one_query = rng.random() < 0.2, rng.random() < 0.15
    if family == "decode":
        n_q, n_k = decode_n_q, n_a
    else:
        n_q, n_k = (1 if one_query else n_a), (n_a if same_n else n_b)
    # bounded work: B, then Hkv, then the group, then the longer length
    max_bh = args.max_bh or math.inf
    max_scores = MAX_SCORES if backend == "torch" else MAX_HOST_SCORES
    while (B * Hkv * g * n_q * n_k * d > args.max_work or B * Hkv * g * n_q * n_k > max_scores
           or B * Hkv * g > max_bh):
        if B > 1:
            B -= 1
        elif Hkv > 1:
            Hkv -= 1
        elif g > 1:
            g //= 2
        elif n_k >= n_q and n_k > 1:
            n_k = (n_k + 1) // 2
        elif n_q > 1:
            n_q = (n_q + 1) // 2
        else:
            break
    causal = rng.random() < 0.5
    layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
    default_scale, log_scale = rng.random() < 0.5, rng.uniform(-2, 0.5)
    deterministic, autograd = rng.random() < 0.5, rng.random() < 0.5
    auto_splits, n_splits = rng.random() < 0.4, int(rng.integers(1, 9))
    lens_kind, lens_frac, lens_on_device = rng.random(), rng.random(MAX_B), rng.random() < 0.5
    windowed, left_frac, right_frac, left_open = rng.random() < 0.6, rng.random(), rng.random(), rng.random() < 0.2

    spec = dict(family=family, dtype=dtype, backend=backend, B=B, H=Hkv * g, Hkv=Hkv, Nq=n_q, Nk=n_k, d=d)
    spec["causal"] = True if family == "decode" else bool(causal)
    spec["layout"] = layout
    spec["scale"] = None if default_scale else float(f"{10 ** log_scale:.4g}")
    if family == "backward":
        spec["deterministic"] = bool(deterministic)
        spec["via"] = "autograd" if backend == "torch" and autograd else "api"
    if family == "decode":
        spec["splits"] = None if auto_splits else n_splits
        if lens_kind < 0.15:
            spec["lens"] = None  # Nmax for every sequence
        else:
            lens = [int(f * (n_k + 1)) for f in lens_frac[:B]]  # 0 .. n_k
            if lens_kind < 0.3:
                lens[0] = n_k
            spec["lens"] = lens
        spec["lens_on"] = "device" if backend == "torch" and lens_on_device else "host"
    # a sliding window (flash-attn's window_size) where the mma kernels take it: fp16/bf16, d <= 128 and d % 8 == 0
    # in a layout whose rows start 16-byte aligned (elsewhere it raises NotImplementedError, by design)
    if (windowed and family != "decode" and dtype != "float32" and d <= 128 and d % 8 == 0
            and layout in ("contiguous", "bnhd", "slice_n")):
        left = -1 if left_open else int(left_frac * (n_k + 8))
        spec["window"] = f"{left},{0 if spec['causal'] else int(right_frac * (n_k + 8)) - 4}"  # right -4 .. : -1 open
        if int(spec["window"].split(",")[1]) < -1:
            spec["window"] = f"{left},-1"
    spec["seed"], spec["idx"] = seed, idx
    return spec


def window_of(spec: dict) -> tuple:
    """The spec's window_size, (-1, -1) when it has none."""
    w = spec.get("window")
    return tuple(int(x) for x in w.split(",")) if w else (-1, -1)


def available(spec: dict) -> tuple[dict, str]:
    """(the spec this machine runs, why not: "" when it can). Drawn for PyTorch without PyTorch CUDA here: the same
    problem on NumPy arrays (autograd and device lengths become the API and host lengths), unless its float64
    references would be too large for the host (MAX_HOST_SCORES). bfloat16 on NumPy without ml_dtypes: not run."""
    if spec["backend"] == "torch" and not HAVE_TORCH_CUDA:
        if spec["B"] * spec["H"] * spec["Nq"] * spec["Nk"] > MAX_HOST_SCORES:
            return spec, f"unavailable: no PyTorch CUDA, and host references past {MAX_HOST_SCORES} scores"
        spec = dict(spec, backend="numpy")
        if spec.get("via") == "autograd":
            spec["via"] = "api"
        if spec.get("lens_on") == "device":
            spec["lens_on"] = "host"
    if spec["dtype"] == "bfloat16" and spec["backend"] == "numpy" and ml_dtypes is None:
        return spec, "unavailable: bfloat16 NumPy arrays need ml_dtypes"
    return spec, ""


def format_spec(spec: dict) -> str:
    parts = [spec["family"]]
    for key, val in spec.items():
        if key == "family":
            continue
        if key == "lens" and val is not None:
            val = ",".join(map(str, val)) if val else "[]"
        parts.append(f"{key}={val}")
    return " ".join(parts)


_INT_KEYS = ("B", "H", "Hkv", "Nq", "Nk", "d", "seed", "idx")


def parse_spec(text: str) -> dict:
    """The inverse of format_spec; takes a whole FAIL line as well."""
    head = text.split(": ", 1)[0].split()
    if head and head[0] == "FAIL":
        head = head[1:]
    spec = {"family": head[0]}
    for tok in head[1:]:
        key, val = tok.split("=", 1)
        if val == "None":
            spec[key] = None
        elif key in _INT_KEYS:
            spec[key] = int(val)
        elif key in ("causal", "deterministic"):
            spec[key] = val == "True"
        elif key == "scale":
            spec[key] = float(val)
        elif key == "splits":
            spec[key] = int(val)
        elif key == "lens":
            spec[key] = [] if val == "[]" else [int(x) for x in val.split(",")]
        else:
            spec[key] = val
    return spec


# --------------------------------------------------------------------------------------------
# Inputs in a memory layout (NumPy or PyTorch CUDA)
# --------------------------------------------------------------------------------------------
def _np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def make_array(values: np.ndarray, spec: dict, rng):
    """values (B, h, N, d) as spec's backend and dtype, in spec's layout; memory outside the view is NaN
    (a kernel that reads past a view's edges shows it)."""
    layout, dtype = spec["layout"], spec["dtype"]
    B, h, n, d = values.shape
    if spec["backend"] == "torch":
        x = torch.from_numpy(values).to("cuda", getattr(torch, dtype))
        full = lambda shape: torch.full(shape, float("nan"), dtype=x.dtype, device="cuda")  # noqa: E731
    else:
        x = values.astype(_np_dtype(dtype))
        full = lambda shape: np.full(shape, np.nan, dtype=x.dtype)  # noqa: E731
    if layout == "contiguous":
        return x
    if layout == "bnhd":  # (B, N, H, d) storage seen as (B, H, N, d)
        buf = full((B, n, h, d))
        view = buf.transpose(1, 2) if spec["backend"] == "torch" else buf.transpose(0, 2, 1, 3)
    elif layout == "slice_n":  # rows lo .. lo + N of a longer buffer
        lo, hi = (int(t) for t in rng.integers(1, 8, size=2))
        view = full((B, h, n + lo + hi, d))[:, :, lo:lo + n]
    elif layout == "slice_d":  # the first d columns of wider rows
        view = full((B, h, n, d + int(rng.integers(1, 9))))[..., :d]
    else:  # "offset": a contiguous view starting a few elements into its buffer (rows not 16-byte aligned)
        off, size = int(rng.integers(1, 8)), B * h * n * d
        view = full((size + off,))[off:off + size].reshape(B, h, n, d)
    view[...] = x
    return view


def to_f64(x) -> np.ndarray | object:
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().double()
    return np.asarray(x).astype(np.float64)


# --------------------------------------------------------------------------------------------
# References: float64, and the naive same-dtype implementation (S, softmax, P·V in the dtype)
# --------------------------------------------------------------------------------------------
def _limits(spec: dict, lens) -> tuple:
    """(lo, hi), each (B, Nq): query i of sequence b sees key j iff lo[b, i] <= j <= hi[b, i] (bottom-right
    alignment; the window's sides >= Nk are unbounded, as flash-attn's API makes them)."""
    n_q, n_k = spec["Nq"], spec["Nk"]
    i = np.arange(n_q)[None, :]
    if spec["family"] == "decode":
        length = np.full(spec["B"], n_k) if lens is None else np.asarray(lens)
        return np.zeros((spec["B"], n_q), np.int64), i + length[:, None] - n_q
    left, right = window_of(spec)
    left, right = (-1 if left >= n_k else left), (-1 if right >= n_k else right)
    diag = i + n_k - n_q
    hi = diag if spec["causal"] else (diag + right if right >= 0 else np.full_like(i, n_k - 1))
    lo = diag - left if left >= 0 else np.zeros_like(i)
    return np.broadcast_to(lo, (spec["B"], n_q)), np.broadcast_to(hi, (spec["B"], n_q))


class NumpyMath:
    """The references on the host (the simulator, or a GPU without PyTorch)."""

    @staticmethod
    def visible(spec, lens):
        lo, hi = _limits(spec, lens)
        j = np.arange(spec["Nk"])[None, None, None, :]
        return (j <= hi[:, None, :, None]) & (j >= lo[:, None, :, None])  # (B, 1, Nq, Nk)

    @staticmethod
    def zero_stale(x, vis):
        """Cache slots no query sees set to 0 (stale slots hold NaN, which 0·NaN would spread)."""
        seen = vis.any(axis=2)[..., None]  # (B, 1, Nk, 1)
        return np.where(seen, x, 0)

    @staticmethod
    def f64_forward(q, k, v, vis, scale):
        g = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.where(vis, (q @ k.swapaxes(-1, -2)) * scale, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - np.where(np.isfinite(m), m, 0))
        l = p.sum(axis=-1, keepdims=True)
        o = (p @ v) / np.where(l > 0, l, 1)
        with np.errstate(divide="ignore"):
            lse = np.where(l > 0, m + np.log(l), -np.inf)[..., 0]
        s_max = float(np.abs(np.where(vis, s, 0)).max(initial=0))
        return o, lse, s_max

    @staticmethod
    def f64_backward(q, k, v, o, lse, do, vis, scale):
        """reference.attention_backward's formulas, with the visibility mask of any family."""
        g = q.shape[1] // k.shape[1]
        kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.where(vis, (q @ kk.swapaxes(-1, -2)) * scale, -np.inf)
        p = np.exp(s - np.where(np.isfinite(lse), lse, np.inf)[..., None])
        dv = p.swapaxes(-1, -2) @ do
        ds = p * (do @ vv.swapaxes(-1, -2) - np.sum(do * o, axis=-1, keepdims=True))
        dq = (ds @ kk) * scale
        dk = (ds.swapaxes(-1, -2) @ q) * scale
        fold = lambda x: x.reshape(x.shape[0], -1, g, *x.shape[2:]).sum(axis=2)  # noqa: E731
        return dq, fold(dk), fold(dv)

    @staticmethod
    def _mm(a, b, dt):
        """A GEMM as cuBLAS does it for 16-bit inputs: fp32 accumulation, the result rounded to dt."""
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(dt)

    @classmethod
    def _naive_parts(cls, q, k, v, vis, scale):
        dt, g = q.dtype, q.shape[1] // k.shape[1]
        kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = (cls._mm(q, kk.swapaxes(-1, -2), np.float32).astype(dt).astype(np.float32) * scale).astype(dt)
        s32 = np.where(vis, s.astype(np.float32), -np.inf)
        m = s32.max(axis=-1, keepdims=True)
        e = np.exp(s32 - np.where(np.isfinite(m), m, 0))
        l = e.sum(axis=-1, keepdims=True)
        p32 = e / np.where(l > 0, l, 1)  # a row that sees nothing: P = 0 (torch: NaN, then nan_to_num)
        return kk, vv, p32

    @classmethod
    def naive_forward(cls, q, k, v, vis, scale):
        kk, vv, p32 = cls._naive_parts(q, k, v, vis, scale)
        return cls._mm(p32.astype(q.dtype), vv, q.dtype)

    @classmethod
    def naive_backward(cls, q, k, v, do, vis, scale):
        """torch autograd of the naive forward in the dtype, written out."""
        dt, g = q.dtype, q.shape[1] // k.shape[1]
        kk, vv, p32 = cls._naive_parts(q, k, v, vis, scale)
        p = p32.astype(dt)
        dv = cls._mm(p.swapaxes(-1, -2), do, dt)
        dp32 = cls._mm(do, vv.swapaxes(-1, -2), dt).astype(np.float32)
        ds = (p32 * (dp32 - np.sum(dp32 * p32, axis=-1, keepdims=True))).astype(dt)
        ds = (ds.astype(np.float32) * scale).astype(dt)
        dq = cls._mm(ds, kk, dt)
        dk = cls._mm(ds.swapaxes(-1, -2), q, dt)
        fold = lambda x: x.astype(np.float32).reshape(x.shape[0], -1, g, *x.shape[2:]).sum(axis=2).astype(dt)  # noqa: E731
        return dq, fold(dk), fold(dv)


class TorchMath:
    """The same references on the GPU (float64 and the inputs' dtype, by PyTorch)."""

    @staticmethod
    def visible(spec, lens):
        lo, hi = (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in _limits(spec, lens))
        j = torch.arange(spec["Nk"], device="cuda")[None, None, None, :]
        return (j <= hi[:, None, :, None]) & (j >= lo[:, None, :, None])

    @staticmethod
    def zero_stale(x, vis):
        return torch.where(vis.any(dim=2)[..., None], x, 0)

    @staticmethod
    def _scores(q, k, v, vis, scale):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return ((q @ k.transpose(-1, -2)) * scale).masked_fill(~vis, -math.inf), k, v

    @classmethod
    def f64_forward(cls, q, k, v, vis, scale):
        s, k, v = cls._scores(q, k, v, vis, scale)
        lse = torch.logsumexp(s, dim=-1)
        o = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)[..., None]) @ v
        s_max = s.masked_fill(~vis, 0).abs().max().item() if s.numel() else 0.0
        return o, lse, s_max

    @classmethod
    def f64_backward(cls, q, k, v, o, lse, do, vis, scale):
        g = q.shape[1] // k.shape[1]
        s, kk, vv = cls._scores(q, k, v, vis, scale)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, math.inf)[..., None])
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ vv.transpose(-1, -2) - (do * o).sum(dim=-1, keepdim=True))
        dq = (ds @ kk) * scale
        dk = (ds.transpose(-1, -2) @ q) * scale
        fold = lambda x: x.reshape(x.shape[0], -1, g, *x.shape[2:]).sum(dim=2)  # noqa: E731
        return dq, fold(dk), fold(dv)

    @classmethod
    def _naive(cls, q, k, v, vis, scale):  # tests/gpu_helpers.attention_naive_same_dtype, any mask
        s, k, v = cls._scores(q, k, v, vis, scale)
        p = torch.nan_to_num(torch.softmax(s.float(), dim=-1)).to(q.dtype)
        return p @ v

    @classmethod
    def naive_forward(cls, q, k, v, vis, scale):
        return cls._naive(q, k, v, vis, scale)

    @classmethod
    def naive_backward(cls, q, k, v, do, vis, scale):
        leaves = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
        cls._naive(*leaves, vis, scale).backward(do)
        return tuple(x.grad for x in leaves)


# --------------------------------------------------------------------------------------------
# One problem: inputs, our call, the references, the check
# --------------------------------------------------------------------------------------------
def _max_abs(x) -> float:
    if torch is not None and isinstance(x, torch.Tensor):
        return float(x.abs().max().item()) if x.numel() else 0.0
    return float(np.abs(x).max(initial=0))


def _isfinite(x):
    return torch.isfinite(x) if torch is not None and isinstance(x, torch.Tensor) else np.isfinite(x)


def _all(x) -> bool:
    return bool(x.all().item()) if torch is not None and isinstance(x, torch.Tensor) else bool(np.all(x))


def bound_for(dtype: str, name: str, ref_max: float, naive_err: float | None, c_s: float) -> float:
    if name == "lse":
        return 1e-4 * max(1.0, ref_max)
    if dtype == "float32":
        return (2e-5 * max(1.0, ref_max) if name == "out" else 1e-4 * ref_max) * c_s + ABS_FLOOR
    return 2 * naive_err + EPS[dtype] * ref_max + ABS_FLOOR


def run_problem(spec: dict, inject: bool = False) -> dict:
    """Check one problem; returns a record (spec, errors, bounds, verdict, message)."""
    t0 = time.perf_counter()
    rec = {"spec": spec, "errors": {}, "bounds": {}, "verdict": None, "message": ""}
    rng = np.random.default_rng([spec["seed"], spec["idx"], 1])
    fam, dtype = spec["family"], spec["dtype"]
    B, H, Hkv, n_q, n_k, d = (spec[k] for k in ("B", "H", "Hkv", "Nq", "Nk", "d"))
    M = TorchMath if spec["backend"] == "torch" else NumpyMath
    normal = lambda h, n: rng.standard_normal((B, h, n, d), dtype=np.float32)  # noqa: E731
    q, k, v = make_array(normal(H, n_q), spec, rng), make_array(normal(Hkv, n_k), spec, rng), \
        make_array(normal(Hkv, n_k), spec, rng)
    do = make_array(normal(H, n_q), spec, rng) if fam == "backward" else None
    lens = spec.get("lens")
    vis = M.visible(spec, lens)
    if fam == "decode":
        for b, length in enumerate(lens if lens is not None else []):  # stale slots: never read into the result
            k[b, :, length:] = float("nan")
            v[b, :, length:] = float("nan")
    scale = spec["scale"] if spec["scale"] is not None else 1.0 / math.sqrt(d)

    # ours
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = call_ours(spec, q, k, v, do, lens)
    except Exception as e:  # noqa: BLE001 (any exception but a plain refusal is a failure of ours)
        if type(e) in (ValueError, TypeError):  # the API's refusals; numba's own subclasses are failures
            rec.update(verdict="refused", message=f"{type(e).__name__}: {e}")
            rec["time_s"] = time.perf_counter() - t0
            return rec
        rec.update(verdict="failed", message=f"{type(e).__name__}: {e}".splitlines()[0],
                   traceback=traceback.format_exc())
        rec["time_s"] = time.perf_counter() - t0
        return rec

    # references on the dtype-rounded inputs (stale cache slots zeroed)
    q64, k64, v64 = to_f64(q), M.zero_stale(to_f64(k), vis), M.zero_stale(to_f64(v), vis)
    qn, kn, vn = q, M.zero_stale(k, vis), M.zero_stale(v, vis)
    if spec["backend"] == "numpy":
        qn, kn, vn = (np.ascontiguousarray(x) for x in (qn, kn, vn))
    o64, lse64, s_max = M.f64_forward(q64, k64, v64, vis, scale)
    c_s = max(1.0, s_max / SCORE_SCALE)
    rec["s_max"] = s_max
    problems = []
    if fam == "backward":
        refs = M.f64_backward(q64, k64, v64, o64, lse64, to_f64(do), vis, scale)
        naive = M.naive_backward(qn, kn, vn, do, vis, scale) if dtype != "float32" else (None,) * 3
        named = zip(("dq", "dk", "dv"), ours, refs, naive)
        # one scale for the three gradients: with one key dQ = dK = 0 exactly (P = 1, dS = 0), and what
        # ours and naive give there is rounding in dP - D, of the size of dV's
        grad_scale = max(_max_abs(r) for r in refs)
    else:
        naive = M.naive_forward(qn, kn, vn, vis, scale) if dtype != "float32" else None
        out, lse = ours
        named = [("out", out, o64, naive), ("lse", lse, lse64, None)]
        lse_t = to_f64(lse)
        fin = _isfinite(lse64)
        if not (_all(_isfinite(lse_t) == fin) and _all(lse_t[~fin] == -math.inf)):
            problems.append("lse is not -inf exactly on the rows that see no key")
        if not _all(to_f64(out)[~fin] == 0):
            problems.append("out is not 0 on the rows that see no key")
    for name, x, ref, nv in named:
        x64 = to_f64(x)
        if name == "lse":
            fin = _isfinite(ref)
            x64, ref = x64[fin], ref[fin]
        elif inject:
            x64 = x64 * (1 + INJECT)
        if not _all(_isfinite(x64)):
            problems.append(f"{name} has non-finite entries")
            rec["errors"][name] = math.inf
            continue
        if tuple(x64.shape) != tuple(ref.shape):
            problems.append(f"{name} has shape {tuple(x64.shape)}, expected {tuple(ref.shape)}")
            continue
        err, ref_max = _max_abs(x64 - ref), (grad_scale if fam == "backward" else _max_abs(ref))
        naive_err = _max_abs(to_f64(nv) - ref) if nv is not None else None
        bound = bound_for(dtype, name, ref_max, naive_err, c_s)
        rec["errors"][name], rec["bounds"][name] = err, bound
        if naive_err is not None:
            rec.setdefault("naive_errors", {})[name] = naive_err
        if not err <= bound:
            problems.append(f"{name} err {err:.3g} > bound {bound:.3g}")
    rec["verdict"] = "failed" if problems else "passed"
    rec["message"] = "; ".join(problems)
    rec["time_s"] = time.perf_counter() - t0
    return rec


def call_ours(spec, q, k, v, do, lens):
    """The public API on these inputs; results as given (NumPy or torch)."""
    fam, causal, scale, window = spec["family"], spec["causal"], spec["scale"], window_of(spec)
    if fam == "forward":
        res = numba_flash.forward(q, k, v, causal=causal, softmax_scale=scale, window_size=window)
    elif fam == "decode":
        seqlens = None
        if lens is not None:
            seqlens = np.asarray(lens, dtype=np.int32)
            if spec.get("lens_on") == "device":
                seqlens = torch.from_numpy(seqlens).cuda()
        res = numba_flash.decode(q, k, v, cache_seqlens=seqlens, softmax_scale=scale, num_splits=spec["splits"])
    elif spec.get("via") == "autograd":
        from numba_flash.torch import attention

        leaves = [x.detach().requires_grad_() for x in (q, k, v)]  # detach keeps the strides
        attention(*leaves, causal=causal, softmax_scale=scale, deterministic=spec["deterministic"],
                  window_size=window).backward(do)
        res = tuple(x.grad for x in leaves)
    else:
        out, lse = numba_flash.forward(q, k, v, causal=causal, softmax_scale=scale, window_size=window)
        res = numba_flash.backward(q, k, v, out, lse, do, causal=causal, softmax_scale=scale,
                                   deterministic=spec["deterministic"], window_size=window)
    if HAVE_TORCH_CUDA:
        torch.cuda.synchronize()
    return res


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
def device_name() -> str:
    if SIM:
        return "CUDA simulator"
    if HAVE_TORCH_CUDA:
        return torch.cuda.get_device_name()
    from numba import cuda

    if not cuda.is_available():
        return "none"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
           "numba_flash": numba_flash.__version__, "torch": getattr(torch, "__version__", None)}
    try:
        from importlib.metadata import version

        out["numba_cuda"] = version("numba-cuda")
    except Exception:  # noqa: BLE001 (not installed as a distribution)
        out["numba_cuda"] = None
    return out


VERDICTS = ("passed", "failed", "refused", "skipped")
WRITE_EVERY_S = 5.0  # the JSON is rewritten (atomically) at most this often while the draw runs, and at the end


class Stopped(BaseException):
    """SIGTERM (run.sh's time limit): stop drawing, write the summary and the JSON of what ran (a BaseException:
    run_problem's ``except Exception`` must not count it as a failure of ours)."""


SIGNALLED = []  # [True] once SIGTERM arrived


def _stop(signum, frame):
    first = not SIGNALLED
    SIGNALLED.append(True)
    if first:  # (timeout signals the process group: the parent can get it twice, the second while it merges)
        raise Stopped()


def summarize(records: list) -> dict:
    """{"family dtype": {"drawn": n, verdict: n, ...}} over the records."""
    table = defaultdict(Counter)
    for r in records:
        key = f"{r['spec']['family']} {r['spec']['dtype']}"
        table[key]["drawn"] += 1
        table[key][r["verdict"]] += 1
    return {key: {c: table[key][c] for c in ("drawn", *VERDICTS)} for key in sorted(table)}


def _counts_line(name: str, c) -> str:
    return f"  {name:18s} drawn {c['drawn']:4d}  " + "  ".join(f"{v} {c[v]:4d}" for v in VERDICTS)


def print_summary(records: list, wall: float, stopped: bool, jobs: int = 1) -> None:
    """Per family and dtype, per family, in total; then the refusal and skip reasons, and the remapped problems."""
    summary = summarize(records)
    how = ((f", {jobs} processes" if jobs > 1 else "") + (", time budget reached" if stopped else "")
           + (", stopped by SIGTERM" if SIGNALLED else ""))
    print(f"\nsummary ({len(records)} problems, {wall:.1f} s wall{how}):")
    for key, c in summary.items():
        print(_counts_line(key, c))
    for fam in FAMILIES:
        rows = [c for key, c in summary.items() if key.split()[0] == fam]
        if rows:
            print(_counts_line(f"{fam} (all)", Counter({k: sum(c[k] for c in rows) for k in ("drawn", *VERDICTS)})))
    totals = Counter(r["verdict"] for r in records)
    totals["drawn"] = len(records)
    print(_counts_line("total", totals))
    for verdict in ("refused", "skipped"):
        for msg, n in Counter(r["message"] for r in records if r["verdict"] == verdict).most_common():
            print(f"  {verdict} x{n}: {msg}")
    for msg, n in Counter(r["remapped"] for r in records if r.get("remapped")).most_common():
        print(f"  remapped x{n}: {msg}")


def json_doc(args, records: list, wall: float, stopped: bool, **extra) -> dict:
    return {"device": device_name(), "simulator": SIM, "versions": versions(),
            "commit": os.environ.get("NUMBA_FLASH_COMMIT"), "args": vars(args), "wall_s": wall,
            "time_budget_reached": stopped, "stopped_by_sigterm": bool(SIGNALLED), **extra, "summary": summarize(records),
            "problems": sorted(records, key=lambda r: r["spec"]["idx"])}


def write_json(path: str, doc: dict) -> None:
    """Write doc to path atomically (a temporary file beside it, then os.replace): a kill leaves the last whole file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def run_specs(args, specs, t_start: float, path: str | None) -> tuple[list, bool]:
    """(records, time budget reached): run the problems in turn, the JSON at path rewritten every WRITE_EVERY_S."""
    records, stopped, written = [], False, time.perf_counter()
    try:
        for drawn in specs:
            if args.time_budget_s is not None and time.perf_counter() - t_start > args.time_budget_s:
                stopped = True
                break
            spec, why = available(drawn)
            if why:
                rec = {"spec": spec, "errors": {}, "bounds": {}, "verdict": "skipped", "message": why, "time_s": 0.0}
            else:
                rec = run_problem(spec, inject=args.inject_error)
            if spec is not drawn:
                rec["remapped"] = "drawn for PyTorch CUDA, run on NumPy arrays (no PyTorch CUDA here)"
            records.append(rec)
            line = format_spec(spec)
            if rec["verdict"] == "failed":
                print(f"FAIL {line}: {rec['message']}", flush=True)
            elif not args.quiet:
                errs = " ".join(f"{n} {e:.2g}/{rec['bounds'].get(n, math.nan):.2g}" for n, e in rec["errors"].items())
                print(f"{rec['verdict']:7s} {line} ({rec['time_s']:.2f} s) {errs or rec['message']}", flush=True)
            if path and time.perf_counter() - written >= WRITE_EVERY_S:
                write_json(path, json_doc(args, records, time.perf_counter() - t_start, stopped, interrupted=True))
                written = time.perf_counter()
    except Stopped:
        print("stopped by SIGTERM: writing what ran", flush=True)
    return records, stopped


def _worker_argv(args, shard: str, part: str) -> list:
    """The command line of one --jobs worker: this run's draw, indices shard (I/N), its JSON at part."""
    argv = [sys.executable, os.path.abspath(__file__), "--problems", args.problems, "--seed", args.seed,
            "--families", *args.families, "--max-n", args.max_n, "--max-d", args.max_d, "--max-work", args.max_work,
            "--torch-fraction", args.torch_fraction, "--shard", shard, "--worker-json", part]
    if args.max_bh is not None:
        argv += ["--max-bh", args.max_bh]
    if args.time_budget_s is not None:
        argv += ["--time-budget-s", args.time_budget_s]
    argv += [flag for flag, on in (("--quiet", args.quiet), ("--inject-error", args.inject_error)) if on]
    return [str(a) for a in argv]


def _read_part(part: str) -> dict | None:
    try:
        with open(part) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_jobs(args, t_start: float, path: str | None) -> tuple[list, bool, list]:
    """(records, time budget reached, problems of the workers): args.jobs processes of this script, worker j
    drawing the indices j mod jobs, each with the whole time budget; their JSON merged every WRITE_EVERY_S."""
    parts_dir = tempfile.mkdtemp(prefix="fuzz-parts-", dir=args.out)
    parts = [os.path.join(parts_dir, f"part-{j}.json") for j in range(args.jobs)]
    procs = [subprocess.Popen(_worker_argv(args, f"{j}/{args.jobs}", part)) for j, part in enumerate(parts)]

    def merged():
        docs = [_read_part(part) for part in parts]
        records = [r for doc in docs if doc for r in doc["problems"]]
        return docs, records, any(doc and doc["time_budget_reached"] for doc in docs)

    written = time.perf_counter()
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            if path and time.perf_counter() - written >= WRITE_EVERY_S:
                _, records, stopped = merged()
                write_json(path, json_doc(args, records, time.perf_counter() - t_start, stopped, interrupted=True,
                                          jobs=args.jobs))
                written = time.perf_counter()
    except Stopped:  # the workers had the same signal (one process group): give them time to write their parts
        print("stopped by SIGTERM: merging what the workers ran", flush=True)
        deadline = time.perf_counter() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                p.kill()
    docs, records, stopped = merged()
    problems = []
    for j, (p, doc) in enumerate(zip(procs, docs)):
        rc = p.wait()
        if rc != 0 or doc is None or doc.get("interrupted"):
            problems.append(f"worker {j}/{args.jobs} exited with {rc} ({'no results' if doc is None else 'cut short'})")
    shutil.rmtree(parts_dir, ignore_errors=True)
    return records, stopped, problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--max-n", type=int, default=8192, help="longest Nq, Nk (decode: Nmax)")
    ap.add_argument("--max-d", type=int, default=256)
    ap.add_argument("--max-work", type=int, default=DEFAULT_WORK, help="cap on B·H·Nq·Nk·d per problem")
    ap.add_argument("--max-bh", type=int, default=DEFAULT_BH, help="cap on B·H per problem (simulator: 4)")
    ap.add_argument("--torch-fraction", type=float, default=0.7,
                    help="share of problems drawn for PyTorch CUDA tensors (the rest NumPy; without PyTorch CUDA "
                         "they run on NumPy arrays)")
    ap.add_argument("--out", help="write DIR/fuzz-<date>.json (rewritten as the draw runs)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="draw no new problem after this long (with --jobs: in each process)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes drawing at once (process j: the indices j mod N), merged into one summary and JSON")
    ap.add_argument("--shard", default=None, help="I/N: only the indices I mod N (what each --jobs process runs)")
    ap.add_argument("--only-index", type=int, default=None, help="run only problem N of the draw")
    ap.add_argument("--repro", default=None, help="run one problem from its FAIL line (or the spec part)")
    ap.add_argument("--quiet", action="store_true", help="print only failures and the summary")
    ap.add_argument("--inject-error", action="store_true", help=argparse.SUPPRESS)  # the fuzz's own test
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)  # a --jobs process: its results file
    ap.add_argument("--allow-refusals", action="store_true",
                    help="a ValueError / TypeError of the API does not fail the run (every draw is valid input)")
    args = ap.parse_args(argv)
    if not (1 <= args.max_d <= 256 and args.max_n >= 1 and args.problems >= 0 and args.jobs >= 1):
        ap.error("need 1 <= --max-d <= 256, --max-n >= 1, --problems >= 0, --jobs >= 1")
    shard, n_shards = 0, 1
    if args.shard is not None:
        try:
            shard, n_shards = (int(x) for x in args.shard.split("/"))
            assert 0 <= shard < n_shards
        except (ValueError, AssertionError):
            ap.error(f"--shard {args.shard!r}: I/N with 0 <= I < N")
    if args.jobs > 1 and (args.repro or args.only_index is not None or args.shard is not None):
        ap.error("--jobs draws the whole range: not with --repro, --only-index or --shard")

    signal.signal(signal.SIGTERM, _stop)
    t_start = time.perf_counter()
    if args.worker_json:  # one process of a --jobs run: no header or summary, its records in its own file
        specs = (draw(args.seed, i, args) for i in range(shard, args.problems, n_shards))
        records, stopped = run_specs(args, specs, t_start, args.worker_json)
        write_json(args.worker_json, json_doc(args, records, time.perf_counter() - t_start, stopped))
        return 0
    path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"fuzz-{time.strftime('%Y-%m-%d')}.json")
    print(f"fuzz on {device_name()}: seed {args.seed}, families {' '.join(args.families)}, max n {args.max_n}, "
          f"max d {args.max_d}, max work {args.max_work}" + (f", {args.jobs} processes" if args.jobs > 1 else ""),
          flush=True)
    problems = []
    if args.jobs > 1:
        records, stopped, problems = run_jobs(args, t_start, path)
    else:
        if args.repro:
            specs = iter([parse_spec(args.repro)])
        elif args.only_index is not None:
            specs = iter([draw(args.seed, args.only_index, args)])
        else:
            specs = (draw(args.seed, i, args) for i in range(shard, args.problems, n_shards))
        records, stopped = run_specs(args, specs, t_start, path)
    wall = time.perf_counter() - t_start
    print_summary(records, wall, stopped, args.jobs)
    for line in problems:
        print(f"  {line}")
    if path:
        write_json(path, json_doc(args, records, wall, stopped, **({"jobs": args.jobs} if args.jobs > 1 else {})))
        print(f"wrote {path}")
    totals = Counter(r["verdict"] for r in records)
    return 1 if totals["failed"] or (totals["refused"] and not args.allow_refusals) or problems else 0


if __name__ == "__main__":
    sys.exit(main())
