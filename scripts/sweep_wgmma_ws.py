"""Time the warp-specialised TMA forward (kernels/wgmma_ws_forward.py) beside the shipped wgmma forward and SDPA's
cuDNN and FlashAttention-2 backends, in one process, on a GPU; or smoke-test it (--check).

    python3 scripts/sweep_wgmma_ws.py --check --precompile-jobs 9  # ~1 min: intrinsics + 9 builds vs float64, exit 1 on a miss
    python3 scripts/sweep_wgmma_ws.py --precompile-jobs 12         # the sweep (< 5 min on an H200, compiles included)
    python3 scripts/sweep_wgmma_ws.py --shapes 'd128$' --variants 'pp'   # a subset (regexes)

Sweep: for each shape every variant of its head dim is launched once into torch-allocated tensors and checked,
then timed (CUDA events around single calls, median of --iters after --warmup; numba_flash.bench.time_call).
TFLOP/s = 4·B·H·N²·d / t (half for causal). Errors on the first batch entry's first HEADS_CHECKED heads: max |O -
O_fp64| of each kernel and of the naive same-dtype attention (P rounded to the dtype before P·V), so the table
shows the flash-attn rule (ours <= 2 x naive + small) directly. Writes $OUT/sweep_wgmma_ws.json when $OUT is set.

Variant names: "ws BQxBK sN" + flags: "nreg" setmaxnreg, "pp" pingpong, "ovl" overlap, "tst" the TMA store of O,
"grid" grid_bh_x, "pers" persistent (one block per SM walking the work items; causal shapes order them heaviest
first themselves, so they take no grid_bh_x).
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
from numba import cuda  # noqa: E402

from numba_flash.kernels import wgmma_forward, wgmma_ws_forward as ws  # noqa: E402
from numba_flash.ptx import WGMMA_ALIGN  # noqa: E402
from numba_flash.tiles import Tile  # noqa: E402

WORDS = {"nreg": "setmaxnreg", "pp": "pingpong", "tst": "tma_store", "grid": "grid_bh_x", "ovl": "overlap",
         "pers": "persistent"}
HEADS_CHECKED = 2
N_SM = None  # main sets it: the GPU's SM count (a persistent tile's grid)


def wst(hd, bk, stages=2, flags=""):
    """A wgmma_ws_forward Tile: 128 rows (two consumer warpgroups), bk keys, flags by short names ("nreg+pp")."""
    return Tile(128, bk, hd, warps=12, stages=stages, flags={WORDS[f] for f in flags.split("+") if f})


def name_of(t: Tile) -> str:
    short = {v: k for k, v in WORDS.items()}
    return " ".join([f"ws {t.block_q}x{t.block_k} s{t.stages}"] + sorted(short[f] for f in t.flags))


# per head dim, in priority order (the first few are the most likely to win: a deadline skips the tail)
VARIANTS = {
    64: [wst(64, 192, 2, "nreg+pp+ovl+tst"), wst(64, 192, 2, "nreg+pp+ovl+tst+pers"), wst(64, 128, 2, "nreg+pp+ovl+tst"), wst(64, 192, 2, "nreg+pp+ovl"),
         wst(64, 128, 2, "nreg+pp+ovl"), wst(64, 128, 2), wst(64, 128, 3, "nreg+pp+ovl+tst")],
    128: [wst(128, 128, 2, "nreg+pp+ovl+tst"), wst(128, 128, 2, "nreg+pp+ovl+tst+pers"), wst(128, 176, 2, "nreg+pp+ovl+tst"), wst(128, 128, 2, "nreg+pp+ovl"),
          wst(128, 128, 2), wst(128, 128, 2, "nreg"), wst(128, 128, 2, "nreg+pp"), wst(128, 128, 2, "nreg+ovl"),
          wst(128, 176, 2, "nreg+pp+ovl"), wst(128, 128, 3, "nreg+pp+ovl")],
    192: [wst(192, 112, 2, "nreg+pp+ovl+tst"), wst(192, 96, 2, "nreg+pp+ovl+tst"),
          wst(192, 112, 2, "nreg+pp+ovl+tst+pers"), wst(192, 96, 2, "nreg+pp+ovl+tst+pers"), wst(192, 80, 2, "nreg+pp+ovl+tst"),
          wst(192, 112, 2, "nreg+pp+ovl")],
    256: [wst(256, 80, 2, "nreg+pp+ovl+tst"), wst(256, 64, 2, "nreg+pp+ovl+tst"), wst(256, 80, 2, "nreg+pp+ovl"),
          wst(256, 80, 2, "nreg+pp+ovl+pers"), wst(256, 64, 2, "nreg+pp+ovl+tst+pers"),
          wst(256, 64, 2, "nreg"), wst(256, 64, 2, "nreg+pp"), wst(256, 80, 2, "nreg+pp")],
}
VARIANTS[96] = VARIANTS[128]  # d 96 runs the 128-column tiles (TMA zero-fills the missing columns)


def padded(d):
    """The head dim of the tiles a problem of head dim d runs (the shipped table's and VARIANTS's keys)."""
    return next(hd for hd in (64, 128, 192, 256) if hd >= d)


def shapes():
    """(label, dtype, B, H, Hkv, N, d, causal): the issue's forward table and the head dims of the tiles."""
    out = []
    for dt in ("float16", "bfloat16"):
        for d in (64, 96, 128, 192, 256):
            if dt == "bfloat16" and d in (96, 192):
                continue
            for causal in (False, True):
                out.append((f"{'f16' if dt == 'float16' else 'bf16'} B4H16 N4096 d{d}{' causal' if causal else ''}",
                            dt, 4, 16, 16, 4096, d, causal))
    out.append(("bf16 B1H16 N16384 d128", "bfloat16", 1, 16, 16, 16384, 128, False))
    out.append(("bf16 B4H32/8 N4096 d128 causal", "bfloat16", 4, 32, 8, 4096, 128, True))
    out.append(("bf16 Llama B4H16/4 N2048 d128 causal", "bfloat16", 4, 16, 4, 2048, 128, True))
    return out


BF16_VARIANTS = 3  # bf16 shapes time only the first few (the fp16 rows rank the rest)


def variants_for(d, causal, dtype="float16"):
    """The ws variants of a shape (causal ones add grid_bh_x, as the shipped causal tiles do)."""
    tiles = VARIANTS[padded(d)][:BF16_VARIANTS] if dtype == "bfloat16" else VARIANTS[padded(d)]
    return [t.with_(flags=t.flags | {"grid_bh_x"}) if causal and not t.has("persistent") else t for t in tiles]


# --------------------------------------------------------------------------------------------
# --check: intrinsics and a few kernel builds against float64, NumPy only
# --------------------------------------------------------------------------------------------
def _bits(x, dtype):
    if dtype == "float16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    u = x.astype(np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _values(o, dtype):
    return o.astype(np.float64) if dtype == "float16" else (o.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _reference(q, k, v, causal, scale, dtype=np.float64):
    """(O, L) in float64, or O with S, P and P·V in ``dtype`` (the naive same-dtype attention; float32 softmax)."""
    H, Hkv = q.shape[1], k.shape[1]
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q.astype(dtype), k.astype(dtype)).astype(np.float64) * scale
    n_q, n_k = s.shape[-2:]
    if causal:
        s = np.where(np.arange(n_k)[None, :] > np.arange(n_q)[:, None] + n_k - n_q, -np.inf, s)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    p = np.where(l_ > 0, p / np.where(l_ > 0, l_, 1.0), 0.0)
    o = np.einsum("bhij,bhjd->bhid", p.astype(dtype), v.astype(dtype)).astype(np.float64)
    lse = np.where(l_[..., 0] > 0, m[..., 0] + np.log(np.where(l_[..., 0] > 0, l_[..., 0], 1.0)), -np.inf)
    return o, lse


def check_intrinsics():
    """A TMA box half outside the tensor, through an mbarrier, and stored back by the TMA store."""
    from numba_flash import ptx
    from numba_flash.blocks.tensor_maps import device_maps
    from numba_flash.ptx import tma

    rng = np.random.default_rng(0)
    N, d, ROWS = 12, 56, 16
    x = rng.integers(1, 60000, size=(1, 2, N, d)).astype(np.uint16)
    dx, dy = cuda.to_device(x), cuda.to_device(np.full_like(x, 7))
    maps = device_maps([(dx, ROWS), (dy, ROWS)])
    seen = cuda.to_device(np.zeros((ROWS, 64), np.uint16))
    load, store, wait_read = tma.tma_load(4), tma.tma_store(4), tma.bulk_wait_read(0)
    sync = tma.named_barrier_sync(5, 64)
    @cuda.jit
    def kernel(maps, seen):
        smem = cuda.shared.array(0, np.uint16, alignment=WGMMA_ALIGN)  # dynamic: closure ints are not literals
        tid = cuda.threadIdx.x
        BAR = ROWS * 64 + 512
        if tid == 0:
            ptx.mbarrier_init(smem, BAR, 1)
            ptx.mbarrier_init(smem, BAR + 4, 2)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            ptx.mbarrier_arrive_expect_tx(smem, BAR, ROWS * 128)
            load(smem, 0, maps, 0, smem, BAR, 0, 4, 1, 0)
        while ptx.mbarrier_try_wait_parity(smem, BAR, 0) == 0:
            pass
        for i in range(tid, ROWS * 64, 64):
            seen[i // 64, i % 64] = smem[i]
        if tid % 32 == 0:
            tma.mbarrier_arrive(smem, BAR + 4)
        while ptx.mbarrier_try_wait_parity(smem, BAR + 4, 0) == 0:
            pass
        sync()
        if tid == 0:
            store(maps, 128, smem, 0, 0, 4, 1, 0)
            tma.bulk_commit()
            wait_read()

    kernel[1, 64, 0, 2 * (ROWS * 64 + 512 + 16)](maps, seen)
    box = np.zeros((ROWS, 64), np.uint16)
    box[:N - 4, :d] = x[0, 1, 4:]
    want = np.empty_like(box)
    for r in range(ROWS):
        for j in range(8):
            want[r, 8 * (j ^ (r % 8)):8 * (j ^ (r % 8)) + 8] = box[r, 8 * j:8 * j + 8]
    got_y = dy.copy_to_host()
    want_y = np.full_like(x, 7)
    want_y[0, 1, 4:] = x[0, 1, 4:]
    ok_load = np.array_equal(seen.copy_to_host(), want)
    ok_store = np.array_equal(got_y, want_y)
    print(f"intrinsics: TMA load (swizzled, zero fill) {'ok' if ok_load else 'WRONG'}, TMA store "
          f"{'ok' if ok_store else 'WRONG'}", flush=True)
    return ok_load and ok_store


CHECK_CASES = [  # (B, H, Hkv, n_q, n_k, d, causal, dtype, tile)
    (1, 2, 1, 300, 300, 128, False, "float16", Tile(128, 128, 128, warps=12, stages=2)),
    (1, 2, 1, 300, 517, 128, True, "bfloat16", Tile(64, 64, 128, warps=8, stages=3)),
    (1, 2, 2, 517, 129, 64, True, "float16", wst(64, 128, 2, "nreg+pp+grid")),
    (2, 2, 1, 300, 300, 128, True, "float16", wst(128, 128, 2, "nreg+pp+tst")),
    (1, 2, 1, 129, 300, 256, False, "bfloat16", wst(256, 80, 2, "nreg+pp+tst")),
    (1, 2, 2, 200, 200, 96, True, "float16", wst(128, 128, 2, "nreg+tst")),
    (1, 2, 1, 300, 517, 128, True, "float16", wst(128, 128, 2, "nreg+pp+ovl+grid")),
    (1, 2, 2, 300, 300, 64, False, "bfloat16", wst(64, 128, 3, "nreg+pp+ovl+tst")),
    (1, 2, 1, 129, 300, 256, True, "float16", wst(256, 80, 2, "nreg+pp+ovl")),
    (2, 4, 2, 517, 300, 128, True, "bfloat16", wst(128, 128, 2, "nreg+pp+ovl+tst+pers")),
    (1, 3, 1, 300, 517, 64, False, "float16", wst(64, 192, 2, "nreg+pp+ovl+tst+pers")),
]


def check():
    ok = check_intrinsics()
    for B, H, Hkv, n_q, n_k, d, causal, dtype, tile in CHECK_CASES:
        rng = np.random.default_rng(n_q + d)
        raw = [rng.standard_normal((B, h, n, d)).astype(np.float32) for h, n in ((H, n_q), (Hkv, n_k), (Hkv, n_k))]
        words, vals = zip(*(_bits(x, dtype) for x in raw))
        scale = 1.0 / math.sqrt(d)
        out = cuda.to_device(np.zeros_like(words[0]))
        lse = cuda.to_device(np.zeros((B, H, n_q), np.float32))
        t0 = time.time()
        try:
            ws.launch(*(cuda.to_device(w) for w in words), out, lse, tile, causal=causal, softmax_scale=scale, n_sm=N_SM)
            cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"kernel {tile} d{d} causal={causal} {dtype}: FAILED {e!r}", flush=True)
            ok = False
            continue
        o = _values(out.copy_to_host(), dtype)
        o_ref, l_ref = _reference(*vals, causal, scale)
        naive_dt = np.float16 if dtype == "float16" else np.float32  # NumPy has no bf16: float32 stands in
        o_naive, _ = _reference(*vals, causal, scale, naive_dt)
        err, naive_err = np.abs(o - o_ref).max(), np.abs(o_naive - o_ref).max()
        ulp = 2.0**-10 if dtype == "float16" else 2.0**-7
        good = err <= max(2 * naive_err, 0) + 4 * ulp * max(1.0, np.abs(o_ref).max())
        lse_h = lse.copy_to_host().astype(np.float64)
        fin = np.isfinite(l_ref)
        good = good and np.array_equal(np.isfinite(lse_h), fin) and (
            np.abs(lse_h[fin] - l_ref[fin]).max(initial=0) <= 1e-4 * max(1.0, np.abs(l_ref[fin]).max(initial=0)))
        print(f"kernel {str(tile):50s} B{B} H{H}/{Hkv} {n_q}x{n_k} d{d} causal={causal} {dtype}: err {err:.2e} "
              f"(naive {naive_err:.2e}) {'ok' if good else 'WRONG'}  ({time.time() - t0:.1f} s incl. compile)",
              flush=True)
        ok = ok and bool(good)
    print("CHECK PASSED" if ok else "CHECK FAILED", flush=True)
    return ok


# --------------------------------------------------------------------------------------------
# The sweep (torch)
# --------------------------------------------------------------------------------------------
def _build(spec):
    tile, causal, dtype = spec
    t0 = time.time()
    try:
        (wgmma_forward if tile.has("wgmma") else ws).build(tile, causal, dtype)
    except ValueError as e:
        return f"{tile} causal={causal} {dtype}: not built ({e})"
    return f"{tile} causal={causal} {dtype}: {time.time() - t0:.1f} s"


def selected(args):
    from numba_flash.configs import MMA_WGMMA

    builds = set()
    for label, dtype, B, H, Hkv, N, d, causal in shapes():
        if args.shapes and not re.search(args.shapes, label):
            continue
        builds.add((MMA_WGMMA[(padded(d), causal)], causal, dtype))
        for t in variants_for(d, causal, dtype):
            if not args.variants or re.search(args.variants, name_of(t)):
                builds.add((t, causal, dtype))
    return sorted(builds, key=str)


def precompile(builds, jobs):
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(_build, builds):
            print(f"# compiled {line}", flush=True)


def sweep(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from numba_flash import bench
    from numba_flash.configs import MMA_WGMMA

    t_start = time.time()
    if args.precompile_jobs:
        precompile(selected(args), args.precompile_jobs)
        print(f"# precompiled in {time.time() - t_start:.1f} s", flush=True)
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    print(f"# sweep_wgmma_ws on {gpu}, torch {torch.__version__}")

    def as_numba(t):
        if t.dtype == torch.bfloat16:
            return cuda.as_cuda_array(t.view(torch.int16), sync=False).view(np.uint16)
        return cuda.as_cuda_array(t, sync=False)

    def timed(fn):
        return bench.time_call(fn, warmup=args.warmup, reps=args.iters)[0]

    rows = []
    for label, dtype, B, H, Hkv, N, d, causal in shapes():
        if args.shapes and not re.search(args.shapes, label):
            continue
        tdt = torch.float16 if dtype == "float16" else torch.bfloat16
        q = torch.randn(B, H, N, d, device="cuda", dtype=tdt)
        k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=tdt) for _ in range(2))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        views = tuple(as_numba(x) for x in (q, k, v, out, lse))
        scale = 1.0 / math.sqrt(d)
        flops = 4.0 * B * H * N * N * d * (0.5 if causal else 1.0)
        hc = slice(0, HEADS_CHECKED)
        qs = q[:1, hc]
        ks, vs = (x[:1].repeat_interleave(H // Hkv, 1)[:, hc] for x in (k, v))
        o64 = F.scaled_dot_product_attention(qs.double(), ks.double(), vs.double(), is_causal=causal, scale=scale)
        s = (qs @ ks.transpose(-1, -2)).float() * scale  # the naive same-dtype attention: S, P, P·V in the dtype
        if causal:
            s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        naive = torch.softmax(s.to(tdt).float(), -1).to(tdt) @ vs
        naive_err = (naive.double() - o64).abs().max().item()

        def error(o):
            return (o[:1, hc].double() - o64).abs().max().item()

        def registers(build):
            """(registers, local bytes) a thread of the compiled kernel, or None where the getters fail."""
            try:
                kern = build()
                regs, local = kern.get_regs_per_thread(), kern.get_local_mem_per_thread()
                one = (lambda x: next(iter(x.values())) if isinstance(x, dict) else x)
                return one(regs), one(local)
            except Exception:  # noqa: BLE001 - best effort
                return None

        def record(name, fn, config="", build=None):
            row = dict(shape=label, variant=name, config=config, naive_err=naive_err)
            if time.time() - t_start > args.max_seconds:
                row["skipped"] = "deadline"
                print(f"{label:30s} {name:28s} skipped (deadline)", flush=True)
                rows.append(row)
                return
            try:
                out.zero_()
                o = fn()
                torch.cuda.synchronize()
                row["err"] = error(out if o is None else o)
                row["ok"] = bool(math.isfinite(row["err"]) and row["err"] <= 2 * naive_err + 1e-3)
                row["ms"] = timed(fn)
                row["tflops"] = flops / row["ms"] / 1e9
                info = registers(build) if build else None
                if info:
                    row["regs"], row["local_bytes"] = info
                print(f"{label:30s} {name:28s} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s  err {row['err']:.2e} "
                      f"(naive {naive_err:.2e}){'' if row['ok'] else ' BAD'}"
                      f"{f'  regs {info[0]} local {info[1]}' if info else ''}", flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)
                print(f"{label:30s} {name:28s} FAILED {e!r}", flush=True)
            rows.append(row)

        for backend, bname in ((SDPBackend.CUDNN_ATTENTION, "SDPA cuDNN"), (SDPBackend.FLASH_ATTENTION, "SDPA FA2")):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                          enable_gqa=Hkv != H)
            record(bname, sdpa)
        shipped = MMA_WGMMA[(padded(d), causal)]
        record("wgmma_forward (shipped)",
               lambda: wgmma_forward.launch(*views, shipped, causal=causal, softmax_scale=scale), str(shipped),
               lambda: wgmma_forward.build(shipped, causal, dtype))
        for t in variants_for(d, causal, dtype):
            if args.variants and not re.search(args.variants, name_of(t)):
                continue
            record(name_of(t), lambda t=t: ws.launch(*views, t, causal=causal, softmax_scale=scale, n_sm=N_SM), str(t),
                   lambda t=t: ws.build(t, causal, dtype))
        del q, k, v, out, lse, views
        torch.cuda.empty_cache()

    print("\n# table: TFLOP/s (err vs fp64 / naive same-dtype err)")
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(r["shape"], []).append(r)
    for shape, rs in by_shape.items():
        print(f"## {shape}  (naive err {rs[0]['naive_err']:.2e})")
        for r in sorted(rs, key=lambda r: -r.get("tflops", 0)):
            what = f"{r['tflops']:7.1f}  err {r['err']:.2e}{'' if r['ok'] else ' BAD'}" if "tflops" in r else \
                r.get("error", r.get("skipped", "?"))
            print(f"   {r['variant']:28s} {what}")
    print(f"# total {time.time() - t_start:.1f} s")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "sweep_wgmma_ws.json")
        with open(path, "w") as f:
            json.dump(dict(gpu=gpu, rows=rows, total_s=time.time() - t_start), f, indent=1, default=str)
        print(f"# wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="the smoke test: intrinsics and a few builds vs float64")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=270.0, help="start no new measurement after this")
    ap.add_argument("--shapes", default=None, help="regex: only shapes whose label matches (re.search)")
    ap.add_argument("--variants", default=None, help="regex: only ws variants whose name matches")
    ap.add_argument("--precompile-jobs", type=int, default=0,
                    help="compile every selected build first in this many processes (into the on-disk kernel cache)")
    args = ap.parse_args(argv)
    global N_SM
    N_SM = cuda.get_current_device().MULTIPROCESSOR_COUNT
    if args.check:
        if args.precompile_jobs:
            precompile(sorted({(t, c, dt) for *_, c, dt, t in CHECK_CASES}, key=str), args.precompile_jobs)
        sys.exit(0 if check() else 1)
    sweep(args)


if __name__ == "__main__":
    main()
