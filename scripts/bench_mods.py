"""Benchmark of the attention variants (sliding window, softcap, ALiBi) on the GPU, in one run:
numba_flash beside FlexAttention (torch.compile'd, the same masks and score mods) and PyTorch SDPA (its
default backend, cuDNN on an H200, and each other backend) with an explicit boolean mask or float bias where
SDPA can express the case.

    python scripts/bench_mods.py                # bf16 d128 B1 H16: the issue's shapes (N 16384 window, N 8192 mods)
    python scripts/bench_mods.py --quick        # N 4096
    python scripts/bench_mods.py --out DIR      # results: DIR/mods-<date>.{json,md} (default benchmarks/results)
    python scripts/bench_mods.py --user         # user mods (numba_flash.mods) at N 16384: a relative-position
                                                # bias from a table (score_mod), 8 causal documents (document_mask),
                                                # causal and a 1024 sliding window written as mask_mods; beside
                                                # the dense causal kernel. Mask rows also run numba_flash with the
                                                # mask's BlockMask ("numba_flash+block_mask": the kernel walks
                                                # its key-tile lists), Flex with its own from the same mask

User-mod rows: numba_flash runs them forward and backward (the score mod with its grad, ScoreMod(fn, grad=)),
through numba_flash.torch.attention's autograd; FlexAttention gets the same functions (its block mask from the
same mask; its score mod's gradient by autograd), SDPA an explicit float bias (H, N, N) or boolean mask (N, N).

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


def cases(shapes, user=False):
    n_w, n_m = shapes["window_n"], shapes["mods_n"]
    if user:  # (label, N, causal, window, softcap, alibi, user mod)
        return [
            ("dense causal", n_w, True, (-1, -1), 0.0, False, None),
            ("rel-bias table causal (score_mod)", n_w, True, (-1, -1), 0.0, False, "relbias"),
            ("8 documents causal (mask_mod)", n_w, True, (-1, -1), 0.0, False, "document"),
            ("causal as a mask_mod", n_w, False, (-1, -1), 0.0, False, "causal"),
            ("window 1024 causal as a mask_mod", n_w, False, (-1, -1), 0.0, False, "window"),
        ]
    return [  # (label, N, causal, window, softcap, alibi, user mod)
        ("dense causal", n_w, True, (-1, -1), 0.0, False, None),
        ("window 1024 causal", n_w, True, (1024, 0), 0.0, False, None),
        ("dense causal", n_m, True, (-1, -1), 0.0, False, None),
        ("softcap 50 causal", n_m, True, (-1, -1), 50.0, False, None),
        ("alibi causal", n_m, True, (-1, -1), 0.0, True, None),
        ("window 1024 + softcap 50 causal", n_m, True, (1024, 0), 50.0, False, None),
    ]


N_DOCS = 8


def document_ids(N):
    """8 documents of unequal lengths (a fixed draw), as int32 segment ids (1, N)."""
    import numpy as np

    cuts = np.sort(np.random.default_rng(8).choice(np.arange(1, N), N_DOCS - 1, replace=False))
    return np.repeat(np.arange(N_DOCS, dtype=np.int32), np.diff(np.r_[0, cuts, N]))[None]


def user_case(kind, N, H, g):
    """(numba_flash kwargs, flex mask_mod, flex score_mod, SDPA attn_mask or None, visible pairs per head) of a
    user-mod case; the numba_flash mods are the plain Python functions of numba_flash.mods."""
    import numpy as np
    import torch

    from numba_flash.mods import MaskMod, ScoreMod, document_mask

    i = torch.arange(N, device="cuda")[:, None]
    j = torch.arange(N, device="cuda")[None, :]
    causal_pairs = N * (N + 1) // 2
    if kind == "relbias":
        table = torch.randn(H, 2 * N, device="cuda", generator=g) * 0.5  # bias by (h, q_idx - kv_idx + N)

        def rel_bias(score, b, h, q_idx, kv_idx, table):
            return score + table[h, q_idx - kv_idx + table.shape[1] // 2]

        def rel_bias_grad(score, b, h, q_idx, kv_idx, table):
            return 1.0

        def flex_score(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + N]

        bias = table[:, (i - j + N)].masked_fill(~(j <= i), -math.inf)  # (H, N, N)
        return (dict(score_mod=ScoreMod(rel_bias, grad=rel_bias_grad, aux=(table,))), lambda b, h, q, k: k <= q,
                flex_score, bias, causal_pairs)
    if kind == "document":
        ids = document_ids(N)
        ids_t = torch.from_numpy(ids).cuda()
        lengths = np.bincount(ids[0])

        def flex_mask(b, h, q_idx, kv_idx):
            return (ids_t[0, q_idx] == ids_t[0, kv_idx]) & (kv_idx <= q_idx)

        seen = (ids_t[0][:, None] == ids_t[0][None, :]) & (j <= i)
        return (dict(mask_mod=document_mask(ids_t)), flex_mask, None, seen,
                int((lengths * (lengths + 1) // 2).sum()))
    if kind == "causal":
        def causal_mask(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        return dict(mask_mod=MaskMod(causal_mask)), causal_mask, None, j <= i, causal_pairs
    if kind == "window":
        def window_mask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - 1024)

        return (dict(mask_mod=MaskMod(window_mask)), window_mask, None, (j <= i) & (j >= i - 1024),
                visible_pairs(N, N, True, (1024, 0)))
    raise ValueError(kind)


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


def run(shapes, B=1, H=16, d=128, dtype="bfloat16", progress=True, user=False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import numba_flash
    from numba_flash.sparsity import forward_tile
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
    for label, N, causal, window, cap, alibi, user_kind in cases(shapes, user):
        g = torch.Generator(device="cuda").manual_seed(N + len(label))
        q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", generator=g).to(tdt) for _ in range(4))
        slopes = (torch.rand(H, device="cuda", generator=g) * 0.1 + 0.001) if alibi else None
        mods = dict(causal=causal, window_size=window, softcap=cap, alibi_slopes=slopes)
        pairs = visible_pairs(N, N, causal, window) * B * H
        left = window[0]
        mask_mod, score_mod = flex_mods(left, cap, slopes)
        has_score_mod = bool(cap) or alibi
        if user_kind:
            user_kw, mask_mod, score_mod, user_sdpa, per_head = user_case(user_kind, N, H, g)
            has_score_mod = score_mod is not None
            pairs = per_head * B * H
            mods.update(user_kw)
        fwd_flops = 4 * d * pairs
        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=N, KV_LEN=N, device="cuda")

        impls = {"numba_flash": lambda a, b_, c: attention(a, b_, c, **mods)}
        if user_kind and "mask_mod" in mods:  # the same mask walked through its BlockMask (built once, untimed)
            nf_block_mask = numba_flash.block_mask(mods["mask_mod"], B, H, N, N, *forward_tile(d, causal))
            sparse_kw = {**{n: x for n, x in mods.items() if n != "mask_mod"}, "block_mask": nf_block_mask}
            impls["numba_flash+block_mask"] = lambda a, b_, c, kw=sparse_kw: attention(a, b_, c, **kw)
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
        if user_kind:
            sdpa_mask = user_sdpa.to(tdt) if user_sdpa.dtype != torch.bool else user_sdpa
        plain = left < 0 and not alibi and not cap and not user_kind
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

        # float64 truth on head 0 (heads are independent); a user mod's: SDPA's mask / bias in float64
        leaves64 = [x[:, :1].detach().double().requires_grad_() for x in (q, k, v)]
        if user_kind:
            m64 = sdpa_mask[:1] if sdpa_mask.dtype != torch.bool else sdpa_mask
            o64 = F.scaled_dot_product_attention(*leaves64, attn_mask=m64 if m64.dtype == torch.bool else m64.double())
        else:
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
                with torch.no_grad():
                    row["err_out"] = (fn(q, k, v)[:, :1].double() - exact[0]).abs().max().item()
                    ms_f, _ = bench.time_call(lambda: fn(q, k, v))
                row.update(fwd_ms=ms_f, fwd_tflops=fwd_flops / ms_f / 1e9)
                out = fn(*leaves)
                out.backward(dout)
                errs = [(a[:, :1].double() - b).abs().max().item() for a, b in
                        zip((x.grad for x in leaves), exact[1:])]
                row.update(err_dq=errs[0], err_dk=errs[1], err_dv=errs[2])

                def fwd_bwd(leaves=leaves):
                    for x in leaves:
                        x.grad = None
                    fn(*leaves).backward(dout)

                ms_fb, _ = bench.time_call(fwd_bwd)
                row.update(fwd_bwd_ms=ms_fb, fwd_bwd_tflops=3.5 * fwd_flops / ms_fb / 1e9)
            except Exception as e:  # an implementation that cannot run the case (or its backward) is a result
                row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:200]
            leaves = None
            torch.cuda.empty_cache()
            if name.startswith("numba_flash"):
                base = next((r for r in rows if (r["case"], r["N"]) == dense_key and r["impl"] == "numba_flash"), None)
                if base and "fwd_tflops" in row and "fwd_tflops" in base:
                    row["fwd_vs_dense"] = row["fwd_tflops"] / base["fwd_tflops"]
                if base and "fwd_bwd_tflops" in row and "fwd_bwd_tflops" in base:
                    row["fwd_bwd_vs_dense"] = row["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
            rows.append(row)
            if progress:
                print(_line(row), flush=True)
    return rows


def _f(r, key, fmt):
    return format(r[key], fmt) if key in r else "—"


def _line(r):
    if "fwd_ms" not in r:
        return f"{r['case']:34s} N{r['N']:<6d} {r['impl']:16s} error: {r['error']}"
    vs = f"  vs dense {_f(r, 'fwd_vs_dense', '.2f')} / {_f(r, 'fwd_bwd_vs_dense', '.2f')}"
    tail = f"  (fwd+bwd: {r['error']})" if "error" in r else ""
    return (f"{r['case']:34s} N{r['N']:<6d} {r['impl']:16s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s  "
            f"fwd+bwd {_f(r, 'fwd_bwd_ms', '8.3f')} ms {_f(r, 'fwd_bwd_tflops', '6.1f')} TF/s  err O "
            f"{r['err_out']:.1e} dq {_f(r, 'err_dq', '.1e')} dk {_f(r, 'err_dk', '.1e')} dv {_f(r, 'err_dv', '.1e')}"
            f"{vs}{tail}")


def markdown(meta, rows):
    md = [f"# Attention variants: {meta['gpu']}, {meta['date']}", "",
          f"Command: `{meta['command']}`, commit {meta['commit']}, torch {meta['torch']}. TFLOP/s over visible "
          "scores (fwd 4·d per pair, fwd+bwd 3.5x); errors: max |x − fp64| on head 0.", "",
          "| case | N | impl | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s | err O | err dq | err dk | err dv | "
          "vs dense (fwd / fwd+bwd) |", "|" + "---|" * 12]
    for r in rows:
        if "fwd_ms" not in r:
            md.append(f"| {r['case']} | {r['N']} | {r['impl']} | " + " | ".join(["—"] * 8) + f" | {r['error']} |")
            continue
        vs = f"{_f(r, 'fwd_vs_dense', '.2f')} / {_f(r, 'fwd_bwd_vs_dense', '.2f')}"
        if "error" in r:
            vs += f" (fwd+bwd: {r['error']})"
        md.append(f"| {r['case']} | {r['N']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | "
                  f"{_f(r, 'fwd_bwd_ms', '.3f')} | {_f(r, 'fwd_bwd_tflops', '.1f')} | {r['err_out']:.1e} | "
                  f"{_f(r, 'err_dq', '.1e')} | {_f(r, 'err_dk', '.1e')} | {_f(r, 'err_dv', '.1e')} | {vs} |")
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--user", action="store_true", help="the user-mod cases (numba_flash.mods) instead")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    args = ap.parse_args(argv)
    if not bench.gpu_available():
        print("bench_mods: needs a CUDA GPU (and PyTorch); nothing to measure on the simulator", file=sys.stderr)
        return 2
    command = "python scripts/bench_mods.py" + (" --quick" if args.quick else "") + (" --user" if args.user else "")
    meta = bench.metadata(command, simulator=False)
    rows = run(QUICK if args.quick else FULL, user=args.user)
    stem = os.path.join(args.out, f"mods-{'user-' if args.user else ''}{dt.date.today().isoformat()}"
                        + ("-quick" if args.quick else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(f"wrote {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
