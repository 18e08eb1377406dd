"""Sweep the tensor-core forward's configs on a GPU: correctness once, then time, per variant x shape.

    python3 scripts/sweep_mma.py                  # the whole sweep (< 3 min on an H200, compiles included)
    python3 scripts/sweep_mma.py --max-seconds 90 # stop starting new variants after 90 s
    python3 scripts/sweep_mma.py --shapes 'N4096' --variants '^(128x64 mt2|64x64)( |$)'  # a subset (regexes)

For each shape, every variant of the same head dim is launched through its kernel module's ``launch``
(``mma_forward``, or ``wgmma_forward`` for the "wg" variants) on
torch-allocated CUDA tensors (Numba views made once, outside the timed region), its O compared
once with torch SDPA (max |O - O_sdpa|), then timed: CUDA events around single calls, median of
--iters after --warmup. TFLOP/s = 4·B·H·N²·d / t (half for causal). For the default config the
host overhead is quantified three ways: the compiled kernel called directly (kernel[grid, block]),
mma_forward.launch (layout checks + dispatch) and numba_flash.forward on the torch tensors
(validation, views, allocation). Prints a table; writes $OUT/sweep_mma.json when $OUT is set.

Variants (see benchmarks/DESIGN.md, the tensor-core forward): BQxBK, warps = BQ / 16, MAX_REGS = ptxas
-maxrregcount (blocks/SM from registers: 64K / (regs rounded up to 8 x 32 x warps)).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from numba import cuda, float32  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash import bench  # noqa: E402
from numba_flash.kernels import mma_forward, wgmma_forward  # noqa: E402
from numba_flash.tiles import Tile  # noqa: E402

# (name, Tile for mma_forward.launch[, the only shapes: a label or a tuple of labels]); order = priority (a
# deadline skips the tail). Every tile double-buffers K/V and rescales lazily. "mt2" = 2 m-tiles per warp (32
# query rows per warp, warps = BQ / 32); "8w" = 8 warps of 16 rows; flags (mma_forward's docstring): "grid" =
# grid_bh_x, "epi" = smem_epilogue, "skip" = warp_skip. The shipped tile comes first, then its variants. The
# variants that did not ship and are gone (MAX_REGS, Q_IN_REGS, PROLOGUE_V, one K/V stage, eager rescale,
# SPLIT_TAIL): benchmarks/DESIGN.md.
D128_FIRST = "f16 B4H16 N4096 d128"
D128C = "f16 B4H16 N4096 d128 causal"
D64 = "f16 B4H16 N4096 d64"
D64C = "f16 B4H16 N4096 d64 causal"
BF16 = "bf16 B1H16 N16384 d128"
D192, D192C = "f16 B4H16 N4096 d192", "f16 B4H16 N4096 d192 causal"
D256, D256C = "f16 B4H16 N4096 d256", "f16 B4H16 N4096 d256 causal"
BF16_256 = "bf16 B4H16 N4096 d256"
WORDS = {"grid": "grid_bh_x", "epi": "smem_epilogue", "skip": "warp_skip"}


def family(cfg):
    """The kernel module of a variant: kernels/wgmma_forward.py for the "wg" ones (flag wgmma), else mma_forward."""
    return wgmma_forward if cfg.has("wgmma") else mma_forward


def wg(hd, bq, bk, flags=""):
    """A wgmma_forward Tile: bq / 64 warpgroups of 64 rows, bk keys, flags as tile()'s."""
    return Tile(bq, bk, hd, warps=bq // 16, stages=wgmma_forward.STAGES,
                flags={"wgmma"} | {WORDS[f] for f in flags.split("+") if f})


def tile(hd, bq, bk, mt=1, flags=""):
    """The Tile of bq x bk at head dim hd, mt m-tiles per warp, flags by their short names ("grid+epi")."""
    return Tile(bq, bk, hd, warps=bq // (16 * mt), stages=mma_forward.STAGES,
                flags={WORDS[f] for f in flags.split("+") if f})


VARIANTS = {
    128: [
        ("128x64 mt2 epi", tile(128, 128, 64, 2, "epi"), (D128_FIRST, BF16)),  # shipped
        ("128x64 mt2 grid+epi", tile(128, 128, 64, 2, "grid+epi"), D128C),  # shipped causal
        ("128x64 mt2", tile(128, 128, 64, 2)),
        ("128x64 mt2 grid", tile(128, 128, 64, 2, "grid"), (D128C, D128_FIRST)),
        ("128x64 mt2 skip", tile(128, 128, 64, 2, "skip"), D128C),
        ("128x64 mt2 grid+skip+epi", tile(128, 128, 64, 2, "grid+skip+epi"), D128C),
        ("64x32 mt2", tile(128, 64, 32, 2)),
        ("64x64", tile(128, 64, 64)),
        ("128x64 8w", tile(128, 128, 64)),
        ("128x32 mt2", tile(128, 128, 32, 2)),
        ("64x64 mt2", tile(128, 64, 64, 2)),
        ("64x32", tile(128, 64, 32), D128_FIRST),
        ("wg 128x128", wg(128, 128, 128), (D128_FIRST, BF16)),
        ("wg 128x64", wg(128, 128, 64), (D128_FIRST, BF16)),
        ("wg 128x176", wg(128, 128, 176), D128_FIRST),
        ("wg 64x128", wg(128, 64, 128), D128_FIRST),
        ("wg 128x128 grid", wg(128, 128, 128, "grid"), D128C),
        ("wg 128x64 grid", wg(128, 128, 64, "grid"), D128C),
    ],
    # "wg": kernels/wgmma_forward.py (sm_90), two warpgroups of 64 rows unless 64 rows
    # d = 192 and 256: one m-tile per warp (acc alone is d / 2 fp32 per lane); "pad256" runs d = 192 on the d = 256 build
    192: [
        ("128x64 8w epi", tile(192, 128, 64, 1, "epi"), D192),
        ("128x64 8w grid+epi", tile(192, 128, 64, 1, "grid+epi"), D192C),
        ("128x64 8w grid+skip+epi", tile(192, 128, 64, 1, "grid+skip+epi"), D192C),
        ("128x64 8w", tile(192, 128, 64)),
        ("64x64 epi", tile(192, 64, 64, 1, "epi")),
        ("128x32 8w epi", tile(192, 128, 32, 1, "epi")),
        ("64x32 epi", tile(192, 64, 32, 1, "epi")),
        ("64x32 grid+epi", tile(192, 64, 32, 1, "grid+epi"), D192C),
        ("pad256 128x64 8w epi", tile(256, 128, 64, 1, "epi"), D192),
        ("pad256 128x64 8w grid+epi", tile(256, 128, 64, 1, "grid+epi"), D192C),
        ("wg 128x96", wg(192, 128, 96), D192),
        ("wg 128x64", wg(192, 128, 64), D192),
        ("wg 128x96 grid", wg(192, 128, 96, "grid"), D192C),
        ("wg 128x64 grid", wg(192, 128, 64, "grid"), D192C),
    ],
    256: [
        ("128x64 8w epi", tile(256, 128, 64, 1, "epi"), (D256, BF16_256)),
        ("128x64 8w grid+epi", tile(256, 128, 64, 1, "grid+epi"), D256C),
        ("128x64 8w grid+skip+epi", tile(256, 128, 64, 1, "grid+skip+epi"), D256C),
        ("128x64 8w", tile(256, 128, 64)),
        ("64x64 epi", tile(256, 64, 64, 1, "epi")),
        ("128x32 8w epi", tile(256, 128, 32, 1, "epi")),
        ("64x32 epi", tile(256, 64, 32, 1, "epi")),
        ("64x32 grid+epi", tile(256, 64, 32, 1, "grid+epi"), D256C),
        ("128x32 8w grid+epi", tile(256, 128, 32, 1, "grid+epi"), D256C),
        ("wg 128x64", wg(256, 128, 64), (D256, BF16_256)),
        ("wg 128x80", wg(256, 128, 80), D256),
        ("wg 128x32", wg(256, 128, 32), D256),
        ("wg 64x64", wg(256, 64, 64), D256),
        ("wg 128x64 grid", wg(256, 128, 64, "grid"), D256C),
        ("wg 128x80 grid", wg(256, 128, 80, "grid"), D256C),
    ],
    64: [
        ("128x64 mt2 epi", tile(64, 128, 64, 2, "epi"), D64),  # shipped non-causal
        ("128x64 mt2 grid+skip+epi", tile(64, 128, 64, 2, "grid+skip+epi"), D64C),  # shipped causal
        ("128x64 mt2", tile(64, 128, 64, 2)),
        ("64x64", tile(64, 64, 64)),
        ("128x64 mt2 grid", tile(64, 128, 64, 2, "grid"), D64C),
        ("64x64 grid", tile(64, 64, 64, 1, "grid"), D64C),
        ("128x64 mt2 skip", tile(64, 128, 64, 2, "skip"), D64C),
        ("128x128 mt2", tile(64, 128, 128, 2)),
        ("256x64 mt2", tile(64, 256, 64, 2)),
        ("64x64 mt2", tile(64, 64, 64, 2)),
        ("128x64 8w", tile(64, 128, 64)),
        ("64x128", tile(64, 64, 128)),
        ("wg 128x128", wg(64, 128, 128), D64),
        ("wg 128x192", wg(64, 128, 192), D64),
        ("wg 128x64", wg(64, 128, 64), D64),
        ("wg 128x128 grid", wg(64, 128, 128, "grid"), D64C),
        ("wg 128x64 grid", wg(64, 128, 64, "grid"), D64C),
    ],
}

# (label, dtype, B, H, N, d, causal); the last one only measures host overhead (default config).
SHAPES = [
    ("f16 B4H16 N4096 d128", torch.float16, 4, 16, 4096, 128, False),
    ("f16 B4H16 N4096 d128 causal", torch.float16, 4, 16, 4096, 128, True),
    ("f16 B4H16 N4096 d64", torch.float16, 4, 16, 4096, 64, False),
    ("f16 B4H16 N4096 d64 causal", torch.float16, 4, 16, 4096, 64, True),
    ("bf16 B1H16 N16384 d128", torch.bfloat16, 1, 16, 16384, 128, False),
    (D192, torch.float16, 4, 16, 4096, 192, False),
    (D192C, torch.float16, 4, 16, 4096, 192, True),
    (D256, torch.float16, 4, 16, 4096, 256, False),
    (D256C, torch.float16, 4, 16, 4096, 256, True),
    (BF16_256, torch.bfloat16, 4, 16, 4096, 256, False),
    ("f16 B4H16 N1024 d64 (overhead)", torch.float16, 4, 16, 1024, 64, False),
]
OVERHEAD_ONLY = {"f16 B4H16 N1024 d64 (overhead)"}


def kernel_for(cfg, head_dim, causal, dtype):
    """The compiled kernel launch() uses for the tile cfg (the same key as launch's call, so the lru_cache hits)."""
    return family(cfg).build(cfg, bool(causal), "bfloat16" if dtype == torch.bfloat16 else "float16")


def as_numba(t):
    """Numba device-array view of a torch CUDA tensor (bf16 as uint16 bits, which selects bf16)."""
    if t.dtype == torch.bfloat16:
        return cuda.as_cuda_array(t.view(torch.int16), sync=False).view(np.uint16)
    return cuda.as_cuda_array(t, sync=False)


def shape_inputs(B, H, N, d, dtype, causal):
    """Fresh random q, k, v and empty out, lse for one shape (torch), their Numba views, the scale and the
    FLOPs (halved causal)."""
    q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
    tensors = (q, k, v, out, lse)
    return tensors, tuple(as_numba(x) for x in tensors), 1.0 / math.sqrt(d), \
        4.0 * B * H * N * N * d * (0.5 if causal else 1.0)


def launch_and_check(views, out, ref, dtype, causal, scale, cfg):
    """One launch of cfg into out (views: Numba q, k, v, out, lse); (max |O - ref|, within tolerance)."""
    out.zero_()
    family(cfg).launch(*views, cfg, causal=causal, softmax_scale=scale)
    torch.cuda.synchronize()
    err = (out.float() - ref).abs().max().item()
    return err, bool(math.isfinite(err) and err < (2e-2 if dtype == torch.float16 else 6e-2))


def time_ms(fn, warmup, iters):
    """Median ms of ``iters`` single calls between CUDA events (numba_flash.bench.time_call)."""
    return bench.time_call(fn, warmup=warmup, reps=iters)[0]


def kernel_info(kernel, cfg, head_dim):
    """Registers, local (spill) bytes, static shared bytes and blocks/SM from registers and smem."""
    def one(getter):
        try:
            x = getter()
            return next(iter(x.values())) if isinstance(x, dict) else x
        except Exception:  # noqa: BLE001 - best effort; older Numba lacks some getters
            return None
    regs = one(lambda: kernel.get_regs_per_thread())
    local = one(lambda: kernel.get_local_mem_per_thread())
    smem = one(lambda: kernel.get_shared_mem_per_block())
    # the tiles live in dynamic shared memory, which the getter does not count
    smem = (smem or 0) + family(cfg).smem_bytes(cfg)
    warps = cfg.warps
    blocks = None
    if regs:
        per_warp = math.ceil(regs * 32 / 256) * 256
        blocks = (65536 // per_warp) // warps
        if smem:
            blocks = min(blocks, (228 * 1024) // (smem + 1024))
        blocks = min(blocks, 32, 64 // warps)
    return dict(regs=regs, local_bytes=local, smem_bytes=smem, blocks_per_sm=blocks, warps_per_sm=(blocks or 0) * warps)


def selected(args):
    """(tile, causal, dtype name) of every variant the shape and variant regexes select."""
    builds = set()
    for label, dtype, B, H, N, d, causal in SHAPES:
        if label in OVERHEAD_ONLY or (args.shapes and not re.search(args.shapes, label)):
            continue
        for name, cfg, *only in VARIANTS[min(h for h in VARIANTS if h >= d)]:
            if only and label not in ((only[0],) if isinstance(only[0], str) else only[0]):
                continue
            if not args.variants or re.search(args.variants, name):
                builds.add((cfg, bool(causal), "bfloat16" if dtype == torch.bfloat16 else "float16"))
    return sorted(builds, key=str)


def _build(spec):
    cfg, causal, dtype = spec
    t0 = time.time()
    try:
        family(cfg).build(cfg, causal, dtype)
    except ValueError as e:  # a variant that cannot be built: the sweep records its error when it gets there
        return f"{cfg} causal={causal} {dtype}: not built ({e})"
    return f"{cfg} causal={causal} {dtype}: {time.time() - t0:.1f} s"


def precompile(builds, jobs):
    """Compile the builds in ``jobs`` spawned processes (each its own CUDA context); the sweep's own build() calls
    then load them from numba_flash's kernel cache."""
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(_build, builds):
            print(f"# compiled {line}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=150.0, help="start no new variant after this")
    ap.add_argument("--shapes", default=None, help="regex: only shapes whose label matches (re.search)")
    ap.add_argument("--variants", default=None, help="regex: only variants whose name matches (re.search)")
    ap.add_argument("--precompile-jobs", type=int, default=0,
                    help="compile every selected variant first in this many processes (into the on-disk kernel cache)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sweep_mma.py needs a CUDA GPU with torch")
    t_start = time.time()
    if args.precompile_jobs:
        precompile(selected(args), args.precompile_jobs)
        print(f"# precompiled in {time.time() - t_start:.1f} s", flush=True)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"# sweep_mma on {gpu}, torch {torch.__version__}, numba_flash at {numba_flash.__file__}")
    rows, overhead = [], []

    for label, dtype, B, H, N, d, causal in SHAPES:
        if args.shapes and not re.search(args.shapes, label):
            continue
        (q, k, v, out, lse), (qn, kn, vn, on, ln), scale, flops = shape_inputs(B, H, N, d, dtype, causal)
        ref = None
        if label not in OVERHEAD_ONLY:
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).float()
            t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),
                             args.warmup, args.iters)
            rows.append(dict(shape=label, variant="torch SDPA (default backend)", ms=t_sdpa,
                             tflops=flops / t_sdpa / 1e9, max_abs_err=0.0))
            print(f"{label:34s} {'torch SDPA':18s} {t_sdpa:8.3f} ms {flops / t_sdpa / 1e9:7.1f} TFLOP/s", flush=True)

        # Host overhead of the default config (d <= 128): direct kernel call vs launch vs numba_flash.forward.
        if d <= 128:
            try:
                hd = 64 if d <= 64 else 128
                cfg0 = tile(hd, 64, 64)
                kern = kernel_for(cfg0, hd, causal, dtype)
                grid = ((N + 63) // 64, B * H)
                words = [x if x.dtype == np.uint16 else x.view(np.uint16) for x in (qn, kn, vn, on)]
                sl2 = float32(scale * mma_forward.LOG2E)
                t_kernel = time_ms(lambda: kern[grid, 128, 0, mma_forward.smem_bytes(cfg0)](*words, ln, N, N, d, 1, sl2), args.warmup, args.iters)
                t_launch = time_ms(lambda: mma_forward.launch(qn, kn, vn, on, ln, cfg0, causal=causal, softmax_scale=scale),
                                   args.warmup, args.iters)
                t_fwd = time_ms(lambda: numba_flash.forward(q, k, v, causal=causal, softmax_scale=scale),
                                args.warmup, args.iters)
                overhead.append(dict(shape=label, kernel_ms=t_kernel, launch_ms=t_launch, forward_ms=t_fwd,
                                     tflops_kernel=flops / t_kernel / 1e9, tflops_forward=flops / t_fwd / 1e9))
                print(f"{label:34s} overhead: kernel[] {t_kernel:.3f} ms, launch {t_launch:.3f} ms, "
                      f"forward {t_fwd:.3f} ms ({flops / t_kernel / 1e9:.1f} vs {flops / t_fwd / 1e9:.1f} TFLOP/s)",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                overhead.append(dict(shape=label, error=repr(e)))
                print(f"{label:34s} overhead: FAILED {e!r}", flush=True)
        if label in OVERHEAD_ONLY:
            continue

        for name, cfg, *only in VARIANTS[min(h for h in VARIANTS if h >= d)]:
            if only and label not in ((only[0],) if isinstance(only[0], str) else only[0]):
                continue
            if args.variants and not re.search(args.variants, name):
                continue
            if time.time() - t_start > args.max_seconds:
                rows.append(dict(shape=label, variant=name, config=str(cfg), skipped="deadline"))
                print(f"{label:34s} {name:18s} skipped (deadline)", flush=True)
                continue
            row = dict(shape=label, variant=name, config=str(cfg))
            try:
                t0 = time.time()
                err, row["ok"] = launch_and_check((qn, kn, vn, on, ln), out, ref, dtype, causal, scale, cfg)
                row["compile_s"] = time.time() - t0
                row["max_abs_err"] = err
                ms = time_ms(lambda: family(cfg).launch(qn, kn, vn, on, ln, cfg, causal=causal, softmax_scale=scale),
                             args.warmup, args.iters)
                row.update(ms=ms, tflops=flops / ms / 1e9)
                kern = kernel_for(cfg, cfg.head_dim, causal, dtype)
                row.update(kernel_info(kern, cfg, cfg.head_dim))
                print(f"{label:34s} {name:18s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  err {err:.2e}"
                      f"{'' if row['ok'] else ' BAD'}  regs {row['regs']} local {row['local_bytes']} "
                      f"blocks/SM {row['blocks_per_sm']}  (compile+1st {row['compile_s']:.1f}s)", flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)
                print(f"{label:34s} {name:18s} FAILED {e!r}", flush=True)
            rows.append(row)
        del q, k, v, out, lse, ref
        torch.cuda.empty_cache()

    # Best variant per shape.
    print("\n# best per shape")
    best = {}
    for r in rows:
        if r.get("ok") and (r["shape"] not in best or r["tflops"] > best[r["shape"]]["tflops"]):
            best[r["shape"]] = r
    for shape, r in best.items():
        print(f"{shape:34s} {r['variant']:18s} {r['tflops']:7.1f} TFLOP/s  config {r['config']}")
    print(f"# total {time.time() - t_start:.1f} s")
    result = dict(gpu=gpu, rows=rows, overhead=overhead, best={s: r["variant"] for s, r in best.items()},
                  total_s=time.time() - t_start)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "sweep_mma.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"# wrote {path}")


if __name__ == "__main__":
    main()
