"""Benchmark of the attention variants (sliding window, softcap, ALiBi) on the GPU, in one run:
numba_flash beside FlexAttention (torch.compile'd, the same masks and score mods) and PyTorch SDPA (its
default backend, cuDNN on an H200, and each other backend) with an explicit boolean mask or float bias where
SDPA can express the case.

    python scripts/bench_mods.py                # bf16 d128 B1 H16: the issue's shapes (N 16384 window, N 8192 mods)
    python scripts/bench_mods.py --quick        # N 4096
    python scripts/bench_mods.py --out DIR      # results: DIR/mods-<date>.{json,md} (default benchmarks/results)

Each row: forward ("fwd") and forward + backward through autograd ("fwd+bwd"), median of CUDA-event timings
(numba_flash.bench.time_call), TFLOP/s over the *visible* scores only (forward 4·d per visible (query, key)
pair and head, fwd+bwd 3.5x that), and the error of O and of dq, dk, dv against float64 on head 0
(materialised, on the GPU). An implementation that cannot run a case (SDPA's flash backend with a mask, an OOM)
is recorded with its error message, not dropped. A row's "vs dense" is its TFLOP/s over the dense causal
kernel's of the same length (the issue's targets: window >= 0.9, softcap / ALiBi >= 0.9).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from numba_flash import bench  # noqa: E402

FULL = {"window_n": 16384, "mods_n": 8192}
QUICK = {"window_n": 4096, "mods_n": 4096}


def visible_pairs(n_q, n_k, causal, window):
    """(query, key) pairs a row sees, summed over the rows (FLOPs count only these)."""
    import numpy as np

    left, right = window
    right = 0 if causal else right
    i = np.arange(n_q, dtype=np.int64)
    diag = i + n_k - n_q
    lo = np.zeros_like(i) if left < 0 else np.maximum(diag - left, 0)
    hi = np.full_like(i, n_k - 1) if right < 0 else np.minimum(diag + right, n_k - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def cases(shapes):
    n_w, n_m = shapes["window_n"], shapes["mods_n"]
    return [  # (label, N, causal, window, softcap, alibi)
        ("dense causal", n_w, True, (-1, -1), 0.0, False),
        ("window 1024 causal", n_w, True, (1024, 0), 0.0, False),
        ("dense causal", n_m, True, (-1, -1), 0.0, False),
        ("softcap 50 causal", n_m, True, (-1, -1), 50.0, False),
        ("alibi causal", n_m, True, (-1, -1), 0.0, True),
        ("window 1024 + softcap 50 causal", n_m, True, (1024, 0), 50.0, False),
    ]


def flex_mods(left, cap, slopes):
    """FlexAttention's mask_mod and score_mod of a case (Nq = Nk, causal): closures over plain values, as
    FlexAttention traces them with the four (five) index arguments only."""
    import torch

    def mask_mod(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx
        return (seen & (kv_idx >= q_idx - left)) if left >= 0 else seen

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    return mask_mod, score_mod


def run(shapes, B=1, H=16, d=128, dtype="bfloat16", progress=True):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from numba_flash.torch import attention

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from gpu_helpers import attention_mods_torch

    tdt = getattr(torch, dtype)
    import torch._dynamo

    # every case's mods are new closures: a recompile each (past the default limit of 8 dynamo runs it eagerly)
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    flex = torch.compile(flex_attention)
    rows = []
    for label, N, causal, window, cap, alibi in cases(shapes):
        g = torch.Generator(device="cuda").manual_seed(N + len(label))
        q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", generator=g).to(tdt) for _ in range(4))
        slopes = (torch.rand(H, device="cuda", generator=g) * 0.1 + 0.001) if alibi else None
        mods = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
        pairs = visible_pairs(N, N, causal, window) * B * H
        fwd_flops = 4 * d * pairs
        left = window[0]
        mask_mod, score_mod = flex_mods(left, cap, slopes)
        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=N, device="cuda")
        has_score_mod = bool(cap) or alibi

        impls = {"numba_flash": lambda a, b_, c: attention(a, b_, c, **mods)}
        impls["flex_attention"] = lambda a, b_, c: flex(a, b_, c, block_mask=block_mask,
                                                        score_mod=score_mod if has_score_mod else None)
        sdpa_mask = None
        if not cap:  # softcap is not a bias: SDPA cannot express it
            i = torch.arange(N, device="cuda")[:, None]
            j = torch.arange(N, device="cuda")[None, :]
            seen = j <= i
            if left >= 0:
                seen &= j >= i - left
            if alibi:
                sdpa_mask = (-slopes[:, None, None] * (i - j).abs()).masked_fill(~seen, -math.inf)[None].to(tdt)
            elif left >= 0:
                sdpa_mask = seen
        plain = left < 0 and not alibi and not cap
        for name, backend in [("sdpa-default", None), *bench.sdpa_backends().items()]:
            if name == "sdpa-math" or (cap and name != "sdpa-default"):
                continue

            def sdpa(a, b_, c, backend=backend):
                kw = dict(is_causal=True) if plain else dict(attn_mask=sdpa_mask)
                if cap:
                    raise NotImplementedError("SDPA has no softcap (a score modification, not a bias)")
                if backend is None:
                    return F.scaled_dot_product_attention(a, b_, c, **kw)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(a, b_, c, **kw)

            impls[name] = sdpa

        # float64 truth on head 0 (heads are independent)
        leaves64 = [x[:, :1].detach().double().requires_grad_() for x in (q, k, v)]
        o64 = attention_mods_torch(*leaves64, **{**mods, "alibi_slopes": None if slopes is None else slopes[:1]})
        o64.backward(dout[:, :1].double())
        exact = (o64.detach(), *(x.grad for x in leaves64))
        del leaves64, o64
        dense_key = ("dense causal", N)
        for name, fn in impls.items():
            row = {"case": label, "impl": name, "B": B, "H": H, "N": N, "d": d, "dtype": dtype, "causal": causal,
                   "window": list(window), "softcap": cap, "alibi": alibi, "visible_pairs": pairs}
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            try:
                out = fn(*leaves)
                out.backward(dout)
                errs = [(a[:, :1].double() - b).abs().max().item() for a, b in
                        zip((out.detach(), *(x.grad for x in leaves)), exact)]
                row.update(err_out=errs[0], err_dq=errs[1], err_dk=errs[2], err_dv=errs[3])
                with torch.no_grad():
                    ms_f, _ = bench.time_call(lambda: fn(q, k, v))

                def fwd_bwd(leaves=leaves):
                    for x in leaves:
                        x.grad = None
                    fn(*leaves).backward(dout)

                ms_fb, _ = bench.time_call(fwd_bwd)
                row.update(fwd_ms=ms_f, fwd_tflops=fwd_flops / ms_f / 1e9, fwd_bwd_ms=ms_fb,
                           fwd_bwd_tflops=3.5 * fwd_flops / ms_fb / 1e9)
            except Exception as e:  # an implementation that cannot run the case is a result
                row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:200]
            leaves = None
            torch.cuda.empty_cache()
            if name == "numba_flash":
                base = next((r for r in rows if (r["case"], r["N"]) == dense_key and r["impl"] == name), None)
                if base and "fwd_tflops" in row and "fwd_tflops" in base:
                    row["fwd_vs_dense"] = row["fwd_tflops"] / base["fwd_tflops"]
                    row["fwd_bwd_vs_dense"] = row["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
            rows.append(row)
            if progress:
                print(_line(row), flush=True)
    return rows


def _line(r):
    if "error" in r:
        return f"{r['case']:34s} N{r['N']:<6d} {r['impl']:16s} error: {r['error']}"
    vs = f"  vs dense {r['fwd_vs_dense']:.2f} / {r['fwd_bwd_vs_dense']:.2f}" if "fwd_vs_dense" in r else ""
    return (f"{r['case']:34s} N{r['N']:<6d} {r['impl']:16s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s  "
            f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms {r['fwd_bwd_tflops']:6.1f} TF/s  err O {r['err_out']:.1e} "
            f"dq {r['err_dq']:.1e} dk {r['err_dk']:.1e} dv {r['err_dv']:.1e}{vs}")


def markdown(meta, rows):
    md = [f"# Attention variants: {meta['gpu']}, {meta['date']}", "",
          f"Command: `{meta['command']}`, commit {meta['commit']}, torch {meta['torch']}. TFLOP/s over visible "
          "scores (fwd 4·d per pair, fwd+bwd 3.5x); errors: max |x − fp64| on head 0.", "",
          "| case | N | impl | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | err O | err dq | err dk | err dv | "
          "vs dense (fwd / fwd+bwd) |", "|" + "---|" * 12]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['case']} | {r['N']} | {r['impl']} | " + " | ".join(["—"] * 8) + f" | {r['error']} |")
            continue
        vs = f"{r['fwd_vs_dense']:.2f} / {r['fwd_bwd_vs_dense']:.2f}" if "fwd_vs_dense" in r else ""
        md.append(f"| {r['case']} | {r['N']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | "
                  f"{r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.1f} | {r['err_out']:.1e} | {r['err_dq']:.1e} | "
                  f"{r['err_dk']:.1e} | {r['err_dv']:.1e} | {vs} |")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)
    if not bench.gpu_available():
        print("bench_mods: needs a CUDA GPU (and PyTorch); nothing to measure on the simulator", file=sys.stderr)
        return 2
    command = "python scripts/bench_mods.py" + (" --quick" if args.quick else "")
    meta = bench.metadata(command, simulator=False)
    rows = run(QUICK if args.quick else FULL)
    stem = os.path.join(args.out, f"mods-{dt.date.today().isoformat()}" + ("-quick" if args.quick else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(f"wrote {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
