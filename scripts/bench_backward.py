"""Backward benchmark on the GPU: numba_flash beside PyTorch SDPA (each backend) and naive autograd.

    python scripts/bench_backward.py              # B4 H16 N {1024, 4096} d {64, 128}, fp32 + fp16, causal and not
    python scripts/bench_backward.py --quick      # N 4096 d 128 only
    python scripts/bench_backward.py --sweep      # also time candidate backward tile configs (B4 H16 N4096 d128)
    python scripts/bench_backward.py --sweep-mma  # time the tensor-core kernels' candidate tiles one by one
    python scripts/bench_backward.py --big-d --dtypes float16 bfloat16
                                                  # B2 H16 N4096 d {192, 256}, causal and not, beside SDPA
    python scripts/bench_backward.py --sweep-mma --sweep-d 192 256 --sweep-only
                                                  # the d 192 / 256 candidate tiles (MMA_SWEEP), causal and not
    python scripts/bench_backward.py --tf32 --sweep-only
                                                  # fp32: backward(kernel="tf32x3") vs "simt" vs SDPA efficient

Writes benchmarks/results/backward-<date>.{json,md} (GPU, date, command, commit). ``numba-flash bench``
also runs it as the "backward" suite through ``run_suite``.

Two passes per implementation, both through torch autograd so that every implementation pays the
same engine overhead: "bwd" is torch.autograd.grad of a retained graph (the forward is not timed),
"fwd+bwd" is a forward followed by that grad. Implementations: numba_flash (numba_flash.torch),
SDPA with its flash, memory-efficient and cuDNN backends (each in try/except: an unsupported
dtype or an OOM is recorded as a result), and naive attention (S and P materialised, autograd).

FLOPs: forward F = 4·B·H·N²·d (half for causal); backward = 2.5·F (five N×N×d products against the
forward's two); fwd+bwd = 3.5·F. Where numba_flash's deterministic backward takes the separate dQ kernel
(fp16/bf16 d64), it recomputes S and dP (seven products in all) but is credited with 2.5·F like everyone
else. Time: median of CUDA-event timings
of single calls after warm-up (numba_flash.bench.time_call).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numba_flash  # noqa: E402
from numba_flash import bench  # noqa: E402

SHAPES = [(4, 16, 1024, 64), (4, 16, 4096, 64), (4, 16, 1024, 128), (4, 16, 4096, 128)]  # (B, H, N, d)
QUICK = [(4, 16, 4096, 128)]
BIG_D = [(2, 16, 4096, 192), (2, 16, 4096, 256)]  # --big-d: the split-layout dkdv's head dims (B2 as issue 29's row)
SIMULATOR_SHAPES = [(1, 1, 32, 16)]
BWD, FWD_BWD = "bwd", "fwd+bwd"
FLOP_FACTOR = {BWD: 2.5, FWD_BWD: 3.5}

# head_dim -> [(dkdv (block_q, block_k, row_threads, col_threads[, max_registers]), dq (...)), ...];
# the first of each list is the shipped pair. A register cap of 128 lets two 256-thread blocks
# share an SM where shared memory allows it (d = 64, and dq at d = 128 with 32-row K tiles).
SWEEP_CANDIDATES = {
    64: [
        ((64, 64, 16, 16, 128), (64, 64, 16, 16, 128)),
        ((64, 64, 16, 16), (64, 64, 16, 16)),
        ((64, 64, 32, 8, 128), (64, 64, 32, 8, 128)),
        ((64, 64, 16, 16), (128, 64, 32, 8)),
        ((32, 64, 16, 16), (64, 32, 16, 16, 128)),
    ],
    128: [  # (block_q, block_k, row_threads, col_threads[, max_registers[, stage_trips]])
        ((64, 64, 16, 16, None, 4), (64, 64, 16, 16, None, 4)),  # shipped
        ((64, 64, 16, 16), (64, 64, 16, 16)),  # before staged tile loads
        ((64, 64, 16, 16, None, 4), (64, 32, 16, 16, 128)),  # dq: 2 blocks per SM
        ((64, 64, 32, 8, None, 4), (64, 64, 32, 8, None, 4)),
        ((32, 64, 16, 16), (64, 32, 16, 16)),
        ((64, 64, 16, 16, None, 4), (128, 32, 16, 16)),
    ],
}


def naive_attention(q, k, v, causal, scale):
    """Materialised attention (3.6.2) in q's dtype, softmax in fp32: what autograd sees naively."""
    import torch

    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        mask = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
        s = s.masked_fill(mask, -math.inf)
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def implementations(causal, scale):
    """name -> forward function of (q, k, v), each differentiable by torch autograd."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from numba_flash.torch import attention

    impls = {"numba_flash": lambda q, k, v: attention(q, k, v, causal=causal)}
    # deterministic=False: FA2's atomic dQ on the tensor-core paths (fp16/bf16 mma, fp32 tf32x3)
    impls["numba_flash-atomic"] = lambda q, k, v: attention(q, k, v, causal=causal, deterministic=False)
    for name, backend in bench.sdpa_backends().items():
        if name == "sdpa-math":
            continue  # the naive row below is the materialising baseline

        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        impls[name] = sdpa
    impls["naive-torch"] = lambda q, k, v: naive_attention(q, k, v, causal, scale)
    return impls


def run_case(B, H, N, d, dtype, causal, budget_s=1.0):
    """Rows for one shape: every implementation, both passes, on the same inputs."""
    import torch

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H * N * d + causal)
    q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", generator=g).to(tdt) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fwd_flops = bench.flops(B, H, N, N, d, causal)
    rows = []
    for name, fn in implementations(causal, 1 / math.sqrt(d)).items():
        for pas in (BWD, FWD_BWD):
            row = {"impl": f"{name} [{pas}]", "implementation": name, "pass": pas, "B": B, "H": H, "N": N, "d": d,
                   "dtype": dtype, "causal": causal, "flops": FLOP_FACTOR[pas] * fwd_flops}
            try:
                if pas == BWD:
                    out = fn(q, k, v)
                    call = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                else:
                    call = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)  # noqa: E731
                ms, reps = bench.time_call(call, budget_s=budget_s)
                row.update(ms=ms, tflops=row["flops"] / ms / 1e9, reps=reps)
            except Exception as e:  # an unsupported backend or an OOM is a result, not a crash
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                row.update(ms=None, tflops=None, error=msg)
            out = call = None
            torch.cuda.empty_cache()
            rows.append(row)
    return rows


def run_case_simulator(B, H, N, d, dtype, causal):
    """The CUDA simulator: numba_flash.backward once, checked against reference, beside the reference."""
    import numpy as np

    import reference

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, N, d)).astype(np.float32) for _ in range(4))
    out, lse = (x.astype(np.float32) for x in reference.standard_attention(q, k, v, causal=causal))
    from numba_flash.backward import backward

    ms, grads = bench._wall_ms(lambda: backward(q, k, v, out, lse, dout, causal=causal))
    ref_ms, refs = bench._wall_ms(lambda: reference.attention_backward(q, k, v, out, lse, dout, causal=causal))
    err = max(float(np.abs(g - r).max()) for g, r in zip(grads, refs))
    fl = FLOP_FACTOR[BWD] * bench.flops(B, H, N, N, d, causal)
    base = {"pass": BWD, "B": B, "H": H, "N": N, "d": d, "dtype": dtype, "causal": causal, "flops": fl}
    return [{**base, "impl": f"{bench.SIMULATOR_IMPL} [bwd]", "implementation": bench.SIMULATOR_IMPL, "ms": ms,
             "tflops": fl / ms / 1e9, "max_err": err},
            {**base, "impl": f"{bench.REFERENCE_IMPL} [bwd]", "implementation": bench.REFERENCE_IMPL, "ms": ref_ms,
             "tflops": fl / ref_ms / 1e9}]


def sweep(B=4, H=16, N=4096, d=128, dtype="float32", causal=False, budget_s=1.0):
    """Time each candidate (dkdv, dq) config pair on the kernels directly (no autograd)."""
    import torch
    from numba import cuda

    from numba_flash.kernels import simt_backward
    from numba_flash.kernels.simt_backward import BackwardConfig

    from numba_flash.arrays import to_device_view

    tdt = getattr(torch, dtype)
    q, k, v, dout = (torch.randn(B, H, N, d, device="cuda").to(tdt) for _ in range(4))
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    delta = torch.empty_like(lse)
    views = ([to_device_view(t, 0) for t in (q, k, v, out, dout)]
             + [to_device_view(t, 0, ndim=3) for t in (lse, delta)]
             + [to_device_view(t, 0) for t in grads])
    rows = []
    for kv_t, q_t in SWEEP_CANDIDATES[d]:
        cfgs = tuple(BackwardConfig(kern, *t[:4], d, *t[4:]) for kern, t in (("dkdv", kv_t), ("dq", q_t)))
        row = {"dkdv": list(kv_t), "dq": list(q_t), "d": d, "dtype": dtype, "causal": causal,
               "smem": [c.smem_bytes for c in cfgs]}
        problems = [p for c in cfgs for p in c.problems()]
        if problems:
            rows.append({**row, "error": "; ".join(problems)})
            continue
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        run = lambda: simt_backward.launch(cfgs, *views, causal=causal, softmax_scale=d ** -0.5,  # noqa: E731
                                           dtype=dtype, d=d, stream=stream)
        try:
            ms, _ = bench.time_call(run, budget_s=budget_s)
        except Exception as e:  # a launch failure (too many resources) is a result
            rows.append({**row, "error": str(e).strip().splitlines()[0][:160]})
            continue
        regs = [next(iter(simt_backward.make_backward_kernel(c, causal, dtype).overloads.values()))
                ._codelibrary.get_cufunc().attrs.regs for c in cfgs]
        row.update(ms=ms, tflops=FLOP_FACTOR[BWD] * bench.flops(B, H, N, N, d, causal) / ms / 1e9, regs=regs)
        rows.append(row)
        print(f"  d{d} {dtype} dkdv {kv_t} dq {q_t}: {row['tflops']:.1f} TFLOP/s, regs {regs}, smem {row['smem']}",
              flush=True)
    return rows


def tf32_rows(B=4, H=16, N=4096, budget_s=1.0):
    """fp32 backward (no autograd, the forward not timed): numba_flash.backward with kernel="tf32x3"
    (what auto runs for fp32) and "simt", beside SDPA memory-efficient's backward (autograd.grad of a
    retained graph, itself 3xTF32), d 64 and 128, causal and not; tf32x3's max |difference| to simt."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from numba_flash.backward import backward

    rows = []
    for d in (64, 128):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(d + causal)
            q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(4))
            out, lse = numba_flash.forward(q, k, v, causal=causal)
            fl = FLOP_FACTOR[BWD] * bench.flops(B, H, N, N, d, causal)
            base = {"B": B, "H": H, "N": N, "d": d, "dtype": "float32", "causal": causal, "flops": fl}
            grads = {}
            for kernel in ("tf32x3", "simt"):
                def call(kernel=kernel):
                    return backward(q, k, v, out, lse, dout, causal=causal, kernel=kernel)
                grads[kernel] = call()
                ms, reps = bench.time_call(call, budget_s=budget_s)
                rows.append({**base, "impl": f"numba_flash-{kernel}", "ms": ms, "tflops": fl / ms / 1e9, "reps": reps})
            rows[-2]["max_diff_vs_simt"] = max((a - b).abs().max().item() for a, b in zip(grads["tf32x3"],
                                                                                         grads["simt"]))
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            ms, reps = bench.time_call(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True),
                                       budget_s=budget_s)
            rows.append({**base, "impl": "sdpa-efficient", "ms": ms, "tflops": fl / ms / 1e9, "reps": reps})
            for r in rows[-3:]:
                print(f"  fp32 d{d} causal={causal} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s"
                      + (f", max |tf32x3 - simt| {r['max_diff_vs_simt']:.2e}" if "max_diff_vs_simt" in r else ""),
                      flush=True)
            o = leaves = grads = None
            torch.cuda.empty_cache()
    return rows


# head_dim -> candidate tiles of the tensor-core kernels, each timed on its own (prep once):
# dkdv (BLOCK_N keys, BLOCK_M queries), dq (BLOCK_M queries, BLOCK_N keys); first = shipped.
MMA_SWEEP = {
    128: {"dkdv": [(64, 32), (128, 32), (64, 16), (64, 64)], "dq": [(64, 64), (64, 32), (128, 64), (128, 32)]},
    64: {"dkdv": [(64, 64), (128, 64), (64, 32), (128, 32)], "dq": [(64, 64), (128, 64), (64, 32), (128, 32)]},
    # d 192 / 256: the dkdv split layout takes 64-query tiles (2 warps per 16 keys: 64 keys = 8 warps, 32 = 4); dq's
    # accumulators are d / 2 fp32 a lane, so few keys per tile (ptxas sm_90 regs / spill bytes in DESIGN.md)
    192: {"dkdv": [(64, 64), (32, 64)], "dq": [(64, 32), (64, 16), (128, 32), (64, 64)]},
    256: {"dkdv": [(64, 64), (32, 64)], "dq": [(64, 32), (64, 16), (128, 32), (128, 16)]},
}
MMA_SWEEP_ATOMIC = {64: [(64, 64), (128, 64)], 128: [(64, 64), (128, 64)], 192: [(64, 64), (32, 64)],
                    256: [(64, 64), (32, 64)]}  # the dkdv tiles timed with atomic dQ


# sweep_mma's kernel names: the config key its tile replaces, the layout flags it sets, TFLOP/s credit
# (x F: dkdv 4 of the 5 products, dq 3, the atomic dkdv all 5 with the dq conversion)
MMA_SWEEP_KINDS = {
    "dkdv": ("dkdv", {}, 2.0), "dkdv-shipped": ("dkdv", {}, 2.0), "dq": ("dq", {}, 1.5),
    "dkdv-atomic": ("dkdv_atomic", {}, 2.5),
}


def sweep_mma_case(kernel, tile, shipped):
    """(launch config, kernels to launch, the kernel's name and build's keyword arguments, TFLOP/s
    credit) of one sweep_mma entry; "prep" has no tile (and no credit). The atomic path launches dkdv
    with dq_acc, then the dq conversion. The keyword arguments are backward_plan.launch_mma's, so that
    asking build for the registers hits its cache instead of compiling again."""
    if kernel == "prep":
        return dict(shipped), ("prep",), ("prep", {}), None
    key, flags, credit = MMA_SWEEP_KINDS[kernel]
    config = dict(shipped, **flags, **{key: tuple(tile)})
    if key == "dq":
        return config, ("dq",), ("dq", {}), credit
    atomic = key == "dkdv_atomic"
    make = {"atomic_dq": True} if atomic else {}
    return config, ("dkdv", "dq") if atomic else ("dkdv",), ("dkdv", make), credit


def sweep_mma(B=4, H=16, N=4096, d=128, dtype="float16", causal=False, budget_s=0.5, kernels=None):
    """Time prep, then each candidate dkdv and dq tile of the tensor-core backward, kernel by kernel.

    TFLOP/s credit each kernel with its own products: dkdv 4 of the 5 backward GEMMs (Sᵀ, dPᵀ, dV,
    dK: 2·F), dq 3 (S, dP, dQ: 1.5·F), where F = 4·B·H·N²·d/2 per GEMM pair (halved for causal).
    kernels: the names to time (prep, dkdv, dq, dkdv-atomic, dkdv-shipped), default all; dkdv-shipped: the
    shipped dkdv tile alone (a baseline without the dkdv candidates)."""
    import torch
    from numba import cuda

    from numba_flash.arrays import to_device_view
    from numba_flash.configs import MMA_BWD_TABLE
    from numba_flash import backward_plan
    from numba_flash.blocks.schedule import padded_rows
    from numba_flash.kernels import mma_dkdv, mma_dq

    tdt = getattr(torch, dtype)
    q, k, v, dout = (torch.randn(B, H, N, d, device="cuda").to(tdt) for _ in range(4))
    out, lse = numba_flash.forward(q, k, v, causal=causal)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    rows_shape = (B * H, padded_rows(N))
    l2, dd = (torch.empty(rows_shape, device="cuda", dtype=torch.float32) for _ in range(2))
    views = [to_device_view(t, 0) for t in (q, k, v, out, dout)] + [to_device_view(lse, 0, ndim=3)]
    views += [to_device_view(t, 0, ndim=2) for t in (l2, dd)] + [to_device_view(t, 0) for t in grads]
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    f = bench.flops(B, H, N, N, d, causal)  # the forward's two GEMMs
    shipped = backward_plan.config_from_tiles(backward_plan.table_tiles(MMA_BWD_TABLE, d), d)
    rows = []
    dq_acc = torch.zeros((*rows_shape, d), device="cuda", dtype=torch.float32)
    acc_view = to_device_view(dq_acc, 0, ndim=3)
    # atomic dQ (deterministic=False) with 64 or 128 keys per block
    extra = [("dkdv-atomic", MMA_SWEEP_ATOMIC[d]), ("dkdv-shipped", [tuple(shipped["dkdv"])])]
    for kernel, tiles in [("prep", [None])] + list(MMA_SWEEP[d].items()) + extra:
        if kernels is not None and kernel not in kernels:
            continue
        for tile in tiles:
            config, launched, (name, make), credit = sweep_mma_case(kernel, tile, shipped)
            atomic = make.get("atomic_dq", False)
            row = {"kernel": kernel, "tile": list(tile) if tile else None, "d": d, "dtype": dtype, "causal": causal,
                   "B": B, "H": H, "N": N, "shipped": credit is not None and config == shipped}
            run = lambda: backward_plan.launch_mma(*views, causal=causal, softmax_scale=d ** -0.5,  # noqa: E731
                                                   dtype=dtype, d=d, config=config, stream=stream, kernels=launched,
                                                   dq_acc=acc_view if atomic else None)
            try:
                ms, _ = bench.time_call(run, budget_s=budget_s)
            except Exception as e:  # a launch failure (too many resources) is a result
                rows.append({**row, "error": str(e).strip().splitlines()[0][:160]})
                continue
            row["ms"] = ms
            if tile:  # dkdv-atomic: its 5 products (2.5·F) and the dq conversion, timed together
                fn = (mma_dkdv if name == "dkdv" else mma_dq).build(*tile, d, causal, dtype, **make)
                row["regs"] = next(iter(fn.overloads.values()))._codelibrary.get_cufunc().attrs.regs
                row["tflops"] = credit * f / ms / 1e9
            rows.append(row)
            print(f"  mma {dtype} d{d} causal={causal} {kernel} {tile}: {ms:.3f} ms"
                  + (f", {row['tflops']:.1f} TFLOP/s, regs {row['regs']}" if tile else ""), flush=True)
    return rows


def _line(rows):
    r0 = rows[0]
    head = f"{r0['dtype']:8s} causal={r0['causal']!s:5s} B{r0['B']} H{r0['H']} N{r0['N']} d{r0['d']}: "
    if "max_err" in r0:  # the simulator: an interpreter's TFLOP/s mean nothing; the time and the check do
        return head + ", ".join(f"{r['impl']} {r['ms']:.0f} ms" for r in rows) + f"; max err {r0['max_err']:.1e}"
    return head + ", ".join(f"{r['impl']} {r['tflops']:.1f}" if r.get("tflops") else f"{r['impl']} —" for r in rows)


def run_suite(*, quick: bool = False, simulator: bool = False, progress: bool = True,
              dtypes=("float32", "float16"), budget_s: float = 1.0, big_d: bool = False) -> dict:
    """The backward suite for numba_flash.bench: {"rows": [...]} (TFLOP/s with 2.5x / 3.5x FLOPs)."""
    if simulator:
        cases = [(B, H, N, d, "float32", c) for (B, H, N, d) in SIMULATOR_SHAPES for c in (False, True)]
        run = run_case_simulator
    else:
        if not bench.gpu_available():
            raise bench.SuiteError("the backward suite needs a GPU (or run it on the simulator with --quick)")
        cases = [(B, H, N, d, dt, c) for (B, H, N, d) in (BIG_D if big_d else QUICK if quick else SHAPES) for dt in dtypes
                 for c in (False, True)]
        run = lambda *case: run_case(*case, budget_s=budget_s)  # noqa: E731
    rows = []
    bar = bench.Progress(len(cases), "backward", enabled=progress)
    try:
        for case in cases:
            case_rows = run(*case)
            rows.extend(case_rows)
            bar.step(_line(case_rows))
    finally:
        bar.close()
    return {"rows": rows, "flops": "bwd = 2.5 x 4·B·H·N²·d (half for causal), fwd+bwd = 3.5 x"}


def markdown(result: dict) -> str:
    meta = result["meta"]
    md = [f"# Backward benchmark\n\nGPU: {meta['gpu']}; date: {meta['date']}; command: `{meta['command']}`; "
          f"commit {meta['commit']}; torch {meta['torch']}.\n",
          "TFLOP/s: backward credited with 2.5 x the forward's 4·B·H·N²·d (half for causal), forward+backward "
          "with 3.5 x. Median of CUDA-event timings after warm-up; both passes through torch autograd.\n"]
    suite_rows = result.get("backward", {"rows": []})["rows"]  # none with --sweep-only
    impls = list(dict.fromkeys(r["implementation"] for r in suite_rows))
    for pas in (BWD, FWD_BWD) if suite_rows else ():
        md.append(f"\n## {pas} (TFLOP/s)\n")
        md.append("| dtype | causal | B | H | N | d | " + " | ".join(impls) + " |")
        md.append("|---" * (6 + len(impls)) + "|")
        cases = dict.fromkeys((r["dtype"], r["causal"], r["B"], r["H"], r["N"], r["d"]) for r in suite_rows)
        for case in cases:
            cells = []
            for impl in impls:
                r = next((r for r in suite_rows if r["implementation"] == impl and r["pass"] == pas
                          and (r["dtype"], r["causal"], r["B"], r["H"], r["N"], r["d"]) == case), None)
                cells.append("" if r is None else f"{r['tflops']:.1f}" if r.get("tflops") else "—")
            md.append("| " + " | ".join(str(c) for c in case) + " | " + " | ".join(cells) + " |")
    errors = {(r["implementation"], r["dtype"]): r["error"] for r in suite_rows if r.get("error")}
    if errors:
        md.append("\n— : not run; first error per implementation and dtype:\n")
        md.extend(f"- {impl}, {dtype}: {msg}" for (impl, dtype), msg in errors.items())
    if result.get("sweep"):
        md.append("\n## Config sweep (B4 H16 N4096, kernels launched directly; the first per d is shipped)\n")
        md.append("| d | dtype | causal | dkdv (bq, bk, rt, ct[, maxreg]) | dq (...) | TFLOP/s | regs | smem B |")
        md.append("|---|---|---|---|---|---|---|---|")
        for r in result["sweep"]:
            val = f"{r['tflops']:.1f}" if r.get("tflops") else r.get("error", "")
            md.append(f"| {r['d']} | {r['dtype']} | {r['causal']} | {r['dkdv']} | {r['dq']} | {val} | "
                      f"{r.get('regs', '')} | {r['smem']} |")
    if result.get("sweep_mma"):
        md.append("\n## Tensor-core tiles (B4 H16 N4096 fp16, each kernel alone; dkdv credited 2·F, dq 1.5·F, "
                  "dkdv-atomic with the dq conversion 2.5·F)\n")
        md.append("| d | causal | kernel | tile | shipped | ms | TFLOP/s | regs | vs shipped (dq / dk / dv) |")
        md.append("|---|---|---|---|---|---|---|---|---|")
        for r in result["sweep_mma"]:
            val = f"{r['tflops']:.1f}" if r.get("tflops") else r.get("error", "")
            ms = f"{r['ms']:.3f}" if r.get("ms") else ""
            c = r.get("check")
            check = "" if c is None else c.get("error") or (f"{c['dq']:.1e} / {c['dk']:.1e} / {c['dv']:.1e}"
                                                             + ("" if c["ok"] else " FAILED"))
            md.append(f"| {r['d']} | {r['causal']} | {r['kernel']} | {r['tile']} | {'yes' if r.get('shipped') else ''} "
                      f"| {ms} | {val} | {r.get('regs', '')} | {check} |")
    if result.get("tf32"):
        md.append("\n## fp32 backward on tensor cores (kernel='tf32x3', auto for fp32; bwd only, numba_flash without "
                  "autograd)\n")
        md.append("| d | causal | impl | ms | TFLOP/s | max abs diff vs simt |")
        md.append("|---|---|---|---|---|---|")
        for r in result["tf32"]:
            diff = f"{r['max_diff_vs_simt']:.2e}" if "max_diff_vs_simt" in r else ""
            md.append(f"| {r['d']} | {r['causal']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | {diff} |")
    return "\n".join(md)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--big-d", action="store_true", help="the suite on BIG_D's shapes (d 192, 256) instead")
    ap.add_argument("--sweep", action="store_true", help="also time the candidate tile configs (fp32 and fp16)")
    ap.add_argument("--sweep-mma", action="store_true", help="time the tensor-core kernels' candidate tiles (fp16)")
    ap.add_argument("--sweep-kernels", nargs="+", default=None,
                    help="with --sweep-mma: only these (prep dkdv dq dkdv-atomic dkdv-shipped)")
    ap.add_argument("--sweep-d", nargs="+", type=int, default=None, help="with --sweep-mma: only these head dims")
    ap.add_argument("--sweep-causal", nargs="+", default=None, choices=["False", "True"],
                    help="with --sweep-mma: only these causal settings (d64 sweeps only non-causal)")
    ap.add_argument("--sweep-only", action="store_true", help="skip the autograd suite: only the sweeps asked for")
    ap.add_argument("--tf32", action="store_true", help="time the fp32 backward kernel='tf32x3' vs simt, SDPA")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    ap.add_argument("--budget-s", type=float, default=1.0, help="timing budget per measurement (s)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)

    if not bench.gpu_available():
        ap.exit(2, "bench_backward.py: no usable GPU here (or NUMBA_ENABLE_CUDASIM is set)\n")
    try:
        import torch  # noqa: F401
    except ImportError:
        ap.exit(2, "bench_backward.py: needs PyTorch (pip install torch) for SDPA, autograd and CUDA events\n")
    command = " ".join(["python", "scripts/bench_backward.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"meta": bench.metadata(command, simulator=False)}
    t0 = time.perf_counter()
    if args.sweep:
        print("backward config sweep (B4 H16 N4096, not causal):", flush=True)
        result["sweep"] = [r for d in SWEEP_CANDIDATES for dt in args.dtypes
                           for r in sweep(d=d, dtype=dt, budget_s=args.budget_s)]
    if args.sweep_mma:
        print("tensor-core backward tiles (B4 H16 N4096 fp16), kernel by kernel:", flush=True)
        result["sweep_mma"] = [r for d in MMA_SWEEP if args.sweep_d is None or d in args.sweep_d
                               for causal in ((False, True) if d >= 128 else (False,))
                               if args.sweep_causal is None or str(causal) in args.sweep_causal
                               for r in sweep_mma(d=d, causal=causal, budget_s=min(args.budget_s, 0.5),
                                                  kernels=args.sweep_kernels)]
    if args.tf32:
        print("fp32 backward: tf32x3 (auto) vs simt vs SDPA efficient (B4 H16 N4096, bwd only):", flush=True)
        result["tf32"] = tf32_rows(budget_s=args.budget_s)
    if not args.sweep_only:
        result["backward"] = run_suite(quick=args.quick, dtypes=args.dtypes, budget_s=args.budget_s, big_d=args.big_d)
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    stem = os.path.join(args.out, f"backward-{result['meta']['date'][:10]}" + ("-quick" if args.quick else "")
                        + ("-big-d" if args.big_d else "")
                        + ("-sweep" if args.sweep_only else ""))
    os.makedirs(args.out, exist_ok=True)
    import json

    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    print(markdown(result))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
