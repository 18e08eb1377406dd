"""Decode benchmark on the GPU: bandwidth of numba_flash.decode beside PyTorch SDPA and forward.

    python scripts/bench_decode.py            # full suite -> benchmarks/results/decode-<date>.{json,md}
    python scripts/bench_decode.py --quick    # fp16, Nk = 32768 only
    python scripts/bench_decode.py --sweep    # also time DecodeConfig candidates x num_splits at the targets
    python scripts/bench_decode.py --paged    # only the paged-cache rows -> decode-paged-<date>.{json,md}
    python scripts/bench_decode.py --mods     # flash-attn's variants in decode -> decode-mods-<date>.{json,md}

One decoding step, Nq = 1, B = 8, H = 32, Hkv in {32, 8}, Nk in {4096, 32768}, d = 128, every
cache full. GB/s = bytes of K and V actually read (2·B·Hkv·Nk·d·itemsize; q and out are < 0.1 %)
/ time; time = median of CUDA-event timings of single calls after warm-up (bench_forward's
``time_call``, from numba_flash.bench). Every K+V set is at least 134 MB, over twice the 60 MB L2.

Rows:
* ``numba_flash.decode``: the public call, num_splits chosen by the rule (host work included:
  validation, allocation, two Numba launches).
* ``decode kernels only``: the same launches on prepared Numba views and scratch, KERNEL_BURST of
  them back to back inside one event pair (time / KERNEL_BURST), so the GPU queue stays full and the
  Python of each launch hides behind the previous kernel: the kernels' own bandwidth. (Timed one
  launch per event pair it included that launch's Python, which since the launch plans is more
  than a planned ``decode`` call's: that row read below the end-to-end one.)
* ``numba_flash.forward``: the FA2 forward on the same inputs (one Q tile per head: no split).
* ``sdpa-flash`` / ``sdpa-efficient`` / ``sdpa-cudnn``: F.scaled_dot_product_attention with
  is_causal=False (Nq = 1 sees the whole cache) and enable_gqa when Hkv < H; a backend that
  refuses the case is recorded with its error.
* ``device copy``: torch copy of the K and V tensors; GB/s counts read + write, the roofline.

Paged rows (``--paged``; fp16 B8 H32 Hkv8 Nk32768 d128, every cache full): the same K and V cut into
pages of 64 and 256 keys, flash-attn's (num_pages, page_size, Hkv, d) layout viewed heads first, the pages
of all sequences in a random physical order, read through block_table by the kernels (no gather):
``paged-64`` / ``paged-256`` (public call) and ``paged-N kernels only``, beside the contiguous cache's
two rows and SDPA's backends on the contiguous cache (SDPA has no paged cache). flash-attn's
``flash_attn_with_kvcache`` is timed too where the ``flash_attn`` package imports (it is not installed
on the project's GPU host: the row then records that).

Variant rows (``--mods``; fp16 B8 H32 Hkv8 Nk32768 d128, Nq = 1, every cache full): numba_flash.decode plain, with a
sliding window of 4096 keys (window_size (4095, 0): the tiles left of it are never loaded), softcap 30, ALiBi, and
window + softcap; beside them SDPA's default backend with the window as a boolean mask (B, 1, 1, Nk) and ALiBi as a
float bias (B, H, 1, Nk) (SDPA cannot express softcap), and FlexAttention (torch.compile'd flex_attention, its
decoding path for one query: the window as a BlockMask, softcap and ALiBi as score_mods). GB/s counts the K and V
bytes the variant needs: a window's visible 4096 keys, else the whole cache. err: max |out - float64| over the first
sequence's heads (its float64 reference with the same variant).

``numba-flash bench`` runs this file's ``run_suite`` (numba_flash.bench's registry): the quick
cases on a GPU, or one tiny case on the CUDA simulator checked against reference.decode.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numba_flash  # noqa: E402
from numba_flash import arrays, bench  # noqa: E402
from numba_flash.decode import _kv_words, decode, plan  # noqa: E402
from numba_flash.kernels import decode as dk  # noqa: E402


time_call = bench.time_call


CASES = [(8, 32, hkv, nk, 128) for hkv in (32, 8) for nk in (4096, 32768)]  # (B, H, Hkv, Nk, d)
QUICK = [(8, 32, hkv, 32768, 128) for hkv in (32, 8)]
SWEEP_CONFIGS = [(bn, st, w) for bn in (32, 64, 128) for st in (2, 3, 4) for w in (4, 8)]  # block_n, stages, warps
SWEEP_SPLITS = (None, 1, 2, 4, 8, 16)


KERNEL_BURST = 8  # launches per timing of "decode kernels only"


def kv_bytes(B, Hkv, n_k, d, itemsize):
    return 2 * B * Hkv * n_k * d * itemsize


def kernel_only(q, k, v, cfg=None, num_splits=None, block_table=None):
    """A callable running just the two launches, on views and scratch prepared once."""
    import torch

    p, auto_cfg, n_splits, _ = plan(q, k, v, num_splits=num_splits, block_table=block_table)
    cfg = cfg or auto_cfg
    if num_splits is None:
        n_splits = plan(q, k, v, config=cfg, block_table=block_table)[2]
    stream = arrays.current_stream(q)
    qd = arrays.to_device_view(q, stream)
    kd, vd = (_kv_words(arrays.to_device_view(x, stream), p.dtype) for x in (k, v))
    from numba import cuda

    lens = cuda.device_array(0, dtype=np.int32)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    out_d, lse_d = arrays.to_device_view(out, stream), cuda.as_cuda_array(lse, sync=False)
    scratch = [torch.empty(s, device=q.device, dtype=torch.float32)
               for s in dk.scratch_shapes(p.B, p.H, p.n_q, n_splits, p.d)]
    partials = tuple(cuda.as_cuda_array(t, sync=False) for t in scratch) if n_splits > 1 else None

    table = None if block_table is None else arrays.to_device_view(block_table, stream, ndim=2)

    def run():
        dk.launch(cfg, qd, kd, vd, lens, out_d, lse_d, softmax_scale=p.softmax_scale, d=p.d,
                  num_splits=n_splits, partials=partials, stream=stream, block_table=table)

    run.keep = (out, lse, scratch)
    return run, cfg, n_splits


def registers(cfg, split, paged=False):
    kern = dk.make_split_kernel(cfg, True, split, "int32", dk.CacheMode(paged=paged))
    return next(iter(kern.overloads.values()))._codelibrary.get_cufunc().attrs.regs


def run_case(B, H, Hkv, n_k, d, dtype, sdpa_only=False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H * Hkv + n_k)
    q = torch.randn(B, H, 1, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(B, Hkv, n_k, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    nbytes = kv_bytes(B, Hkv, n_k, d, q.element_size())
    rows = []

    def record(name, fn, bytes_moved=nbytes, **extra):
        try:
            ms, reps = time_call(fn)
            rows.append({"impl": name, "ms": ms, "gbps": bytes_moved / ms / 1e6, "reps": reps, **extra})
        except Exception as e:  # an unsupported backend or an OOM is a result, not a crash
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            rows.append({"impl": name, "ms": None, "gbps": None, "error": msg, **extra})
        torch.cuda.empty_cache()

    _, cfg, n_splits, _ = plan(q, k, v)
    record("numba_flash.decode", lambda: decode(q, k, v), num_splits=n_splits,
           config=[cfg.block_n, cfg.stages, cfg.warps, cfg.rows])
    run, cfg, n_splits = kernel_only(q, k, v)

    def burst():
        for _ in range(KERNEL_BURST):
            run()

    record("decode kernels only", burst, bytes_moved=KERNEL_BURST * nbytes, num_splits=n_splits,
           regs=registers(cfg, n_splits > 1), burst=KERNEL_BURST)
    rows[-1]["ms"] = rows[-1]["ms"] / KERNEL_BURST if rows[-1]["ms"] is not None else None
    if not sdpa_only:
        record("numba_flash.forward", lambda: numba_flash.forward(q, k, v))
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                if Hkv == H:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=False)
                return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
        record(name, sdpa)
    k2, v2 = torch.empty_like(k), torch.empty_like(v)

    def copy():
        k2.copy_(k)
        v2.copy_(v)

    record("device copy", copy, bytes_moved=2 * nbytes)
    del k2, v2
    for r in rows:
        r.update(B=B, H=H, Hkv=Hkv, Nk=n_k, d=d, dtype=dtype)
    return rows


MODS_CASE = (8, 32, 8, 32768, 128)  # (B, H, Hkv, Nk, d), fp16
MODS_WINDOW = 4096  # keys a window row sees: window_size (MODS_WINDOW - 1, 0)
MODS = {"plain": {}, "window": {"window_size": (MODS_WINDOW - 1, 0)}, "softcap": {"softcap": 30.0},
        "alibi": {"alibi": True}, "window+softcap": {"window_size": (MODS_WINDOW - 1, 0), "softcap": 30.0}}


def run_mods_case(B, H, Hkv, n_k, d, dtype="float16"):
    """numba_flash.decode with each variant beside SDPA (mask / bias) and FlexAttention (module docstring)."""
    import torch
    import torch.nn.functional as F

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H + n_k)
    q = torch.randn(B, H, 1, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(B, Hkv, n_k, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    slopes = torch.rand(H, device="cuda", generator=g) * 2 ** -8  # a few units of bias over the whole cache
    scale = 1 / d ** 0.5
    j = torch.arange(n_k, device="cuda")
    flex = _flex()
    rows = []
    for name, mod in MODS.items():
        window = mod.get("window_size", (-1, -1))
        cap = mod.get("softcap", 0.0)
        alibi = slopes if mod.get("alibi") else None
        seen = min(n_k, window[0] + 1) if window[0] >= 0 else n_k
        nbytes = kv_bytes(B, Hkv, seen, d, q.element_size())
        # the float64 truth for sequence 0: its final logits as reference.attention's rule makes them
        s = (q[0].double() @ k[0].repeat_interleave(H // Hkv, 0).double().transpose(-1, -2)).squeeze(1) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        if alibi is not None:
            s = s - alibi.double()[:, None] * (n_k - 1 - j).double()
        if window[0] >= 0:
            s = s.masked_fill(j < n_k - 1 - window[0], float("-inf"))
        ref = torch.softmax(s, -1) @ v[0].repeat_interleave(H // Hkv, 0).double()

        def err(out):
            return float((out[0, :, 0].double() - ref).abs().max())

        kw = dict(window_size=window, softcap=cap, alibi_slopes=alibi)
        out, _ = decode(q, k, v, **kw)
        rows.append(_timed(f"numba_flash.decode {name}", lambda: decode(q, k, v, **kw), nbytes, err=err(out),
                           num_splits=plan(q, k, v, **kw)[2]))
        if not cap:  # SDPA's default backend: the window as a mask, ALiBi as a bias
            mask = None
            if window[0] >= 0:
                mask = (j >= n_k - 1 - window[0]).view(1, 1, 1, n_k).expand(B, 1, 1, n_k)
            if alibi is not None:
                mask = (-(alibi[:, None] * (n_k - 1 - j)).view(1, H, 1, n_k)).to(tdt).expand(B, H, 1, n_k)
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            try:
                out = sdpa()
                rows.append(_timed(f"sdpa default {name}" + (" (mask / bias)" if mask is not None else ""), sdpa,
                                   nbytes, err=err(out)))
            except Exception as e:  # a backend that refuses the case is a result
                rows.append({"impl": f"sdpa default {name}", "ms": None, "gbps": None, "error": str(e)[:160]})
        if flex is None:
            rows.append({"impl": f"flex_attention {name}", "ms": None, "gbps": None,
                         "error": "torch.nn.attention.flex_attention not importable"})
            continue
        try:
            fn = flex.call(B, H, n_k, window, cap, alibi, scale)
            out = fn(q, k, v)
            rows.append(_timed(f"flex_attention {name}", lambda: fn(q, k, v), nbytes, err=err(out)))
        except Exception as e:
            rows.append({"impl": f"flex_attention {name}", "ms": None, "gbps": None, "error": str(e)[:160]})
        torch.cuda.empty_cache()
    for r in rows:
        r.update(B=B, H=H, Hkv=Hkv, Nk=n_k, d=d, dtype=dtype)
    return rows


def _flex():
    """A maker of compiled FlexAttention decode calls, or None where flex_attention does not import."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)

    class Flex:
        @staticmethod
        def call(B, H, n_k, window, cap, alibi, scale):
            block_mask = None
            if window[0] >= 0:
                left = window[0]
                block_mask = create_block_mask(lambda b, h, qi, kv: kv >= n_k - 1 - left + qi, None, None, 1, n_k,
                                               device="cuda")

            def score_mod(score, b, h, qi, kv):
                if cap:
                    score = cap * torch.tanh(score / cap)
                if alibi is not None:
                    score = score - alibi[h] * (n_k - 1 + qi - kv)
                return score

            mod = score_mod if (cap or alibi is not None) else None
            return lambda q, k, v: compiled(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale,
                                            enable_gqa=True)

    return Flex()


PAGED_CASE = (8, 32, 8, 32768, 128)  # (B, H, Hkv, Nk, d), fp16
PAGE_SIZES = (64, 256)


def paged_copy(k, v, page, seed=0):
    """(k_pages, v_pages, block_table): (B, Hkv, Nk, d) caches cut into pages of flash-attn's layout
    (num_pages, page, Hkv, d), every sequence's pages at random physical places; the pages are returned
    heads first ((num_pages, Hkv, page, d) views), as numba_flash.decode takes them."""
    import torch

    B, Hkv, n_k, d = k.shape
    per = n_k // page
    g = torch.Generator(device="cpu").manual_seed(seed)
    where = torch.randperm(B * per, generator=g).view(B, per)
    pages = []
    for x in (k, v):
        flat = torch.empty(B * per, page, Hkv, d, device=x.device, dtype=x.dtype)
        flat[where.reshape(-1).to(x.device)] = x.transpose(1, 2).reshape(B * per, page, Hkv, d)
        pages.append(flat)
    return pages[0].transpose(1, 2), pages[1].transpose(1, 2), where.to(torch.int32).to(k.device)


def run_paged_case(B, H, Hkv, n_k, d, dtype="float16"):
    """Contiguous vs paged decode (public call and kernels only), SDPA's backends, flash-attn's kvcache if present."""
    import torch

    rows = run_case(B, H, Hkv, n_k, d, dtype, sdpa_only=True)
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(B * H * Hkv + n_k)
    q = torch.randn(B, H, 1, d, device="cuda", generator=g).to(tdt)
    k, v = (torch.randn(B, Hkv, n_k, d, device="cuda", generator=g).to(tdt) for _ in range(2))
    nbytes = kv_bytes(B, Hkv, n_k, d, q.element_size())
    ref, _ = decode(q, k, v)
    for page in PAGE_SIZES:
        kp, vp, table = paged_copy(k, v, page)
        out, _ = decode(q, kp, vp, block_table=table)
        same = bool(torch.equal(out, ref))  # the same tiles in the same order as the contiguous cache
        _, cfg, n_splits, _ = plan(q, kp, vp, block_table=table)
        rows.append(_timed(f"paged-{page}", lambda: decode(q, kp, vp, block_table=table), nbytes,
                           num_splits=n_splits, page_size=page, equal_to_contiguous=same))
        run, cfg, n_splits = kernel_only(q, kp, vp, block_table=table)
        rows.append(_burst(f"paged-{page} kernels only", run, nbytes, num_splits=n_splits, page_size=page,
                           regs=registers(cfg, n_splits > 1, paged=True)))
        try:
            from flash_attn import flash_attn_with_kvcache  # noqa: F401  (the real package, not numba_flash's)
        except ImportError as e:
            rows.append({"impl": f"flash-attn kvcache paged-{page}", "ms": None, "gbps": None,
                         "error": f"flash_attn not importable here ({e})"})
        else:
            qf, kf, vf = q.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2)
            lens = torch.full((B,), n_k, dtype=torch.int32, device=q.device)
            rows.append(_timed(f"flash-attn kvcache paged-{page}", lambda: flash_attn_with_kvcache(
                qf, kf, vf, cache_seqlens=lens, block_table=table), nbytes, page_size=page))
        del kp, vp
        torch.cuda.empty_cache()
    for r in rows:
        r.update(B=B, H=H, Hkv=Hkv, Nk=n_k, d=d, dtype=dtype)
    return rows


def _timed(name, fn, nbytes, **extra):
    try:
        ms, reps = time_call(fn)
        return {"impl": name, "ms": ms, "gbps": nbytes / ms / 1e6, "reps": reps, **extra}
    except Exception as e:  # an unsupported case is a result, not a crash
        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return {"impl": name, "ms": None, "gbps": None, "error": msg, **extra}


def _burst(name, run, nbytes, **extra):
    """KERNEL_BURST launches inside one timing: the kernels' own bandwidth (module docstring)."""
    def burst():
        for _ in range(KERNEL_BURST):
            run()

    row = _timed(name, burst, KERNEL_BURST * nbytes, burst=KERNEL_BURST, **extra)
    if row["ms"] is not None:
        row["ms"] /= KERNEL_BURST
    return row


def sweep(B, H, Hkv, n_k, d, dtype="float16"):
    """Kernel-only GB/s of each candidate config x num_splits at one shape (tuning is recorded)."""
    import torch

    tdt = getattr(torch, dtype)
    q = torch.randn(B, H, 1, d, device="cuda").to(tdt)
    k, v = (torch.randn(B, Hkv, n_k, d, device="cuda").to(tdt) for _ in range(2))
    nbytes = kv_bytes(B, Hkv, n_k, d, q.element_size())
    rows_needed = H // Hkv
    out = []
    for block_n, stages, warps in SWEEP_CONFIGS:
        rows = 1 << max(0, (rows_needed - 1).bit_length())
        cfg = dk.DecodeConfig(128, dtype, rows, block_n=block_n, stages=stages, warps=warps)
        if cfg.problems():
            continue
        for n_splits in SWEEP_SPLITS:
            try:
                run, cfg, s = kernel_only(q, k, v, cfg=cfg, num_splits=n_splits)
                ms, _ = time_call(run)
                row = {"config": [block_n, stages, warps, rows], "num_splits": s, "auto": n_splits is None,
                       "ms": ms, "gbps": nbytes / ms / 1e6, "regs": registers(cfg, s > 1),
                       "smem": cfg.smem_bytes, "blocks_per_sm": cfg.blocks_per_sm}
            except Exception as e:
                row = {"config": [block_n, stages, warps, rows], "num_splits": n_splits, "error": str(e)[:160]}
            out.append({**row, "B": B, "H": H, "Hkv": Hkv, "Nk": n_k, "dtype": dtype})
            if "gbps" in row:
                print(f"  sweep Hkv{Hkv} bn{block_n} st{stages} w{warps} splits {row['num_splits']}"
                      f"{' (auto)' if n_splits is None else ''}: {row['gbps']:.0f} GB/s, {row['regs']} regs",
                      flush=True)
    return out


def _bench_row(r):
    """A row in numba_flash.bench's keys too (N = Nq, N_k, tflops), so its tables can show it."""
    r.setdefault("N", 1)
    r.setdefault("N_k", r.get("Nk"))
    r.setdefault("causal", False)
    if r.get("ms"):
        r["tflops"] = bench.flops(r["B"], r["H"], 1, r["Nk"], r["d"], False) / r["ms"] / 1e9
    return r


def run_suite(*, quick: bool, simulator: bool, progress: bool = True) -> dict:
    """For numba_flash.bench: the quick (or full) cases on a GPU; one checked tiny case on the simulator."""
    if simulator:
        import time

        from reference.decode import decode_attention

        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
        k, v = (rng.standard_normal((1, 1, 64, 16)).astype(np.float32) for _ in range(2))
        cfg = dk.DecodeConfig(16, "float32", 4, block_n=8, stages=2, warps=1)
        t0 = time.perf_counter()
        out, _ = decode(q, k, v, num_splits=3, config=cfg)
        ms = (time.perf_counter() - t0) * 1e3
        err = float(np.abs(out - decode_attention(q, k, v)[0]).max())
        row = {"impl": "numba_flash.decode (simulator)", "ms": ms, "B": 1, "H": 4, "Hkv": 1, "Nk": 64, "d": 16,
               "dtype": "float32", "num_splits": 3, "max_err": err}
        return {"rows": [_bench_row(row)], "note": "CUDA simulator: times are not performance figures"}
    rows = []
    for (B, H, Hkv, n_k, d) in (QUICK if quick else CASES):
        for dtype in (["float16"] if quick else ["float16", "float32"]):
            rows.extend(_bench_row(r) for r in run_case(B, H, Hkv, n_k, d, dtype))
            if progress:
                print(f"decode {dtype} B{B} H{H} Hkv{Hkv} Nk{n_k}: done", flush=True)
    return {"rows": rows}


def table(rows):
    lines = ["| dtype | B | H | Hkv | Nk | d | impl | ms | GB/s | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        val = f"{r['gbps']:.0f}" if r.get("gbps") else "—"
        ms = f"{r['ms']:.4f}" if r.get("ms") else "—"
        note = r.get("error", "")[:70]
        if "num_splits" in r:
            note = f"{r['num_splits']} splits" + (f", {r['regs']} regs" if "regs" in r else "") + note
        lines.append(f"| {r['dtype']} | {r['B']} | {r['H']} | {r['Hkv']} | {r['Nk']} | {r['d']} | {r['impl']} "
                     f"| {ms} | {val} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--paged", action="store_true", help="only the paged-cache rows (module docstring)")
    ap.add_argument("--mods", action="store_true", help="only the variant rows (module docstring)")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "benchmarks", "results"))
    args = ap.parse_args(argv)

    if not bench.gpu_available():
        ap.exit(2, "bench_decode.py: no usable GPU here (or NUMBA_ENABLE_CUDASIM is set); "
                   "numba-flash bench --quick runs a tiny decode case on the CUDA simulator\n")
    import torch

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/bench_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__, "python": platform.python_version(),
        "numba_flash": numba_flash.__version__,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "commit": os.environ.get("NUMBA_FLASH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip(),
    }
    if args.paged:
        return paged_main(args, meta)
    if args.mods:
        return mods_main(args, meta)
    result = {"meta": meta, "decode": [], "sweep": None}
    dtypes = ["float16"] if args.quick else args.dtypes
    for (B, H, Hkv, n_k, d) in (QUICK if args.quick else CASES):
        for dtype in dtypes:
            rows = run_case(B, H, Hkv, n_k, d, dtype)
            result["decode"].extend(rows)
            print(f"{dtype:8s} B{B} H{H} Hkv{Hkv} Nk{n_k} d{d}: " + ", ".join(
                f"{r['impl']} {r['gbps']:.0f}" if r.get("gbps") else f"{r['impl']} —" for r in rows), flush=True)
    if args.sweep:
        result["sweep"] = []
        for Hkv in (32, 8):
            result["sweep"].extend(sweep(8, 32, Hkv, 32768, 128))
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"decode-{meta['date'][:10]}" + ("-quick" if args.quick else ""))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = [f"# Decode benchmark (Nq = 1)\n\nGPU: {meta['gpu']} ({meta['sms']} SMs); date: {meta['date']}; "
          f"command: `{meta['command']}`; commit {meta['commit']}; torch {meta['torch']}.\n\n"
          "GB/s = bytes of K and V read / median time (device copy: read + write).\n", table(result["decode"])]
    if result["sweep"]:
        md.append("\n## Config x num_splits sweep, fp16 B8 H32 Nk32768 d128, kernels only\n\n"
                  "| Hkv | block_n, stages, warps, rows | splits | GB/s | regs | smem B | blocks/SM |\n|---|---|---|---|---|---|---|")
        for r in result["sweep"]:
            if "gbps" in r:
                md.append(f"| {r['Hkv']} | {r['config']} | {r['num_splits']}{' (auto)' if r['auto'] else ''} "
                          f"| {r['gbps']:.0f} | {r['regs']} | {r['smem']} | {r['blocks_per_sm']} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {stem}.json and {stem}.md")


def _write_result(args, meta, name, rows, lines):
    """benchmarks/results/NAME-DATE.{json,md}: the rows with meta, and lines (a title, then text) as markdown."""
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{name}-{meta['date'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "decode": rows}, f, indent=1)
    lines[0] = (f"# {lines[0]}\n\nGPU: {meta['gpu']} ({meta['sms']} SMs); date: {meta['date']}; command: "
                f"`{meta['command']}`; commit {meta['commit']}; torch {meta['torch']}.\n")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json and {stem}.md")


def mods_main(args, meta):
    rows = run_mods_case(*MODS_CASE)
    lines = ["Decode with flash-attn's variants (Nq = 1)",
             f"GB/s = bytes of the K and V each variant needs (a window's {MODS_WINDOW} keys, else the cache) / median "
             "time; err = max |out - float64| over the first sequence.\n",
             "| impl | ms | GB/s | err |\n|---|---|---|---|"]
    for r in rows:
        if r.get("gbps"):
            lines.append(f"| {r['impl']} | {r['ms']:.4f} | {r['gbps']:.0f} | {r.get('err', float('nan')):.1e} |")
        else:
            lines.append(f"| {r['impl']} | — | — | {r.get('error', '')} |")
    _write_result(args, meta, "decode-mods", rows, lines)


def paged_main(args, meta):
    rows = run_paged_case(*PAGED_CASE)
    contiguous = {r["impl"]: r["gbps"] for r in rows}
    for r in rows:  # the target: paged >= 90 % of the contiguous cache's GB/s, public call and kernels alike
        base = contiguous.get("decode kernels only" if "kernels only" in r["impl"] else "numba_flash.decode")
        if r["impl"].startswith("paged-") and r.get("gbps") and base:
            r["vs_contiguous"] = r["gbps"] / base
    lines = ["Paged decode benchmark (Nq = 1)",
             "GB/s = bytes of K and V read / median time (device copy: read + write). paged rows: the ratio to the "
             "contiguous cache's row of the same kind (target >= 0.90); bitwise equal to the contiguous output.\n",
             table(rows)]
    for r in rows:
        if "vs_contiguous" in r:
            lines.append(f"- {r['impl']}: {r['vs_contiguous']:.3f} of contiguous"
                         + (f", output bitwise equal to contiguous: {r['equal_to_contiguous']}"
                            if "equal_to_contiguous" in r else ""))
    _write_result(args, meta, "decode-paged", rows, lines)


if __name__ == "__main__":
    main()
