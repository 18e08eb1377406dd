"""Varlen (packed sequences) on the GPU: numba_flash beside flash-attn 2's varlen (through PyTorch) and SDPA.

    python3 scripts/bench_varlen.py [--out DIR] [--quick]

The pack: 64 sequences with lengths drawn uniformly from 128 to 8192 (seed 0; --quick: 16 from 128 to 2048),
H = Hkv = 16, d = 128, bf16, causal. TFLOP/s count the visible scores only: Σ_b 4·H·d·Nb(Nb + 1)/2 for the
forward (the backward credited with 2.5x that), so a varlen call and a dense call of other lengths compare.
Rows, each forward and forward+backward (autograd), with the error against a float64 reference of three
sequences (the shortest, the longest, one between):

  numba_flash varlen      numba_flash.torch.varlen_attention (deterministic=True, the default; and False)
  FA2 varlen              torch.ops.aten._flash_attention_forward / _backward with cum_seq_q / cum_seq_k
                          (flash-attn 2's varlen kernels inside PyTorch), where that op runs
  SDPA per sequence       torch.nn.functional.scaled_dot_product_attention on each sequence in a Python loop
                          (PyTorch's default backend: cuDNN on an H200)
  numba_flash dense       numba_flash.torch.attention on one dense causal batch of the same visible FLOPs
                          (B = 16, N = 4096 or --quick B = 4, N = 2048): the target is varlen >= 95 % of it

Writes varlen-DATE.json (date, GPU, command, commit) with --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from numba_flash.bench import metadata, time_call  # noqa: E402
from numba_flash.torch import attention, varlen_attention  # noqa: E402


def pack(n_seq, lo, hi, H, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n_seq,), generator=g)
    cu = torch.zeros(n_seq + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    gd = torch.Generator("cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(total, H, d, device="cuda", generator=gd, dtype=dtype) for _ in range(4))
    return lens.tolist(), cu.cuda(), q, k, v, do


def visible_flops(lens, H, d):
    return sum(4 * H * d * n * (n + 1) / 2 for n in lens)


def fa2_varlen(q, k, v, cu, max_len, scale):
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                  scale=scale)
    return out[0]


class FA2Varlen(torch.autograd.Function):
    """flash-attn 2's varlen kernels as PyTorch ships them, with their backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0,
                                                                            True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.args = (max_len, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        max_len, scale = ctx.args
        dq, dk, dv = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0,
                                                              True, seed, offset, scale=scale)
        return dq, dk, dv, None, None, None


def per_sequence_sdpa(q, k, v, cu, lens):
    outs = []
    for b in range(len(lens)):
        s = slice(int(cu[b]), int(cu[b + 1]))
        q_b, k_b, v_b = (x[s].transpose(0, 1)[None] for x in (q, k, v))  # (1, H, Nb, d) views
        outs.append(F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True)[0].transpose(0, 1))
    return torch.cat(outs)


def error_vs_fp64(out, q, k, v, cu, lens):
    """max |out - fp64| over three sequences (shortest, longest, middle), each against its own dense fp64."""
    order = sorted(range(len(lens)), key=lambda b: lens[b])
    err = 0.0
    for b in {order[0], order[-1], order[len(order) // 2]}:
        s = slice(int(cu[b]), int(cu[b + 1]))
        ref = F.scaled_dot_product_attention(*(x[s].transpose(0, 1).double() for x in (q, k, v)),
                                             is_causal=True).transpose(0, 1)
        err = max(err, (out[s].double() - ref).abs().max().item())
    return err


def _run(backward, leaves0, dout, f):
    if not backward:
        with torch.no_grad():
            return f(*leaves0)
    leaves = [x.detach().requires_grad_() for x in leaves0]
    out = f(*leaves)
    out.backward(dout)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--probe", action="store_true", help="also the rows that split the gap to dense into causes")
    ap.add_argument("--ab", type=int, default=0, help="interleaved rounds of the forward: dense, token-major, varlen")
    args = ap.parse_args()
    H, d, dtype = 16, 128, torch.bfloat16
    n_seq, lo, hi = (16, 128, 2048) if args.quick else (64, 128, 8192)
    lens, cu, q, k, v, do = pack(n_seq, lo, hi, H, d, dtype)
    max_len, scale = max(lens), d ** -0.5
    flops = visible_flops(lens, H, d)
    rows = []

    def measure(name, fn, flop, on_pack=True):
        row = {"case": name}
        try:
            out = fn(False)
            row["error_vs_fp64"] = error_vs_fp64(out, q, k, v, cu, lens) if on_pack else None
            row["forward_ms"] = time_call(lambda: fn(False))[0]
            row["forward_tflops"] = flop / row["forward_ms"] / 1e9
            row["fwd_bwd_ms"] = time_call(lambda: fn(True))[0]
            row["fwd_bwd_tflops"] = 3.5 * flop / row["fwd_bwd_ms"] / 1e9
        except Exception as e:  # a backend that cannot run here is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

    def with_grad(f):
        return lambda backward: _run(backward, (q, k, v), do, f)

    measure("numba_flash varlen", with_grad(lambda a, b, c: varlen_attention(a, b, c, cu, cu, max_len, max_len,
                                                                             causal=True)), flops)
    measure("numba_flash varlen deterministic=False",
            with_grad(lambda a, b, c: varlen_attention(a, b, c, cu, cu, max_len, max_len, causal=True,
                                                       deterministic=False)), flops)
    measure("FA2 varlen (aten._flash_attention_forward)",
            with_grad(lambda a, b, c: FA2Varlen.apply(a, b, c, cu, max_len, scale)), flops)
    measure("SDPA per sequence (default backend)", with_grad(lambda a, b, c: per_sequence_sdpa(a, b, c, cu, lens)),
            flops)
    B, N = (4, 2048) if args.quick else (16, 4096)
    gd = torch.Generator("cuda").manual_seed(1)
    qd, kd, vd, dod = (torch.randn(B, H, N, d, device="cuda", generator=gd, dtype=dtype) for _ in range(4))

    def causal_attention(a, b, c):
        return attention(a, b, c, causal=True)

    def dense(backward):
        return _run(backward, (qd, kd, vd), dod, causal_attention)

    dense_flops = B * 4 * H * d * N * (N + 1) / 2
    measure("numba_flash dense", dense, dense_flops, on_pack=False)
    ours, ref = rows[0], rows[-1]
    if args.ab:  # interleaved rounds in this process: the forward's cost of the varlen entry and of the op
        import numpy as np

        import numba_flash

        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (qd, kd, vd))  # (B, N, H, d) memory
        pk = [x.reshape(B * N, H, d) for x in (qt, kt, vt)]
        cu_eq = torch.arange(0, B * N + 1, N, dtype=torch.int32, device="cuda")
        variants = {
            "dense (B, H, N, d), numba_flash.forward": lambda: numba_flash.forward(qd, kd, vd, causal=True),
            "dense token-major views, numba_flash.forward":
                lambda: numba_flash.forward(*(x.transpose(1, 2) for x in (qt, kt, vt)), causal=True),
            f"varlen {B} x {N}, numba_flash.varlen_forward (no offset check)":
                lambda: numba_flash.varlen_forward(*pk, cu_eq, cu_eq, N, N, causal=True, check_seqlens=False),
            f"varlen {B} x {N}, numba_flash.torch.varlen_attention":
                lambda: varlen_attention(*pk, cu_eq, cu_eq, N, N, causal=True),
        }
        times = {name: [] for name in variants}
        with torch.no_grad():
            for _ in range(args.ab):
                for name, fn in variants.items():
                    times[name].append(time_call(fn, reps=5)[0])
        ab = {name: {"ms": float(np.median(t)), "tflops": dense_flops / float(np.median(t)) / 1e9}
              for name, t in times.items()}
        for name, r in ab.items():
            print(f"A/B {name}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s", flush=True)
        rows.append({"case": f"A/B forward, {args.ab} interleaved rounds", "variants": ab})
    if args.probe:  # what the gap to dense is made of: the packed layout, the varlen entry, the dQ scheme
        qt, kt, vt, dot = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (qd, kd, vd, dod))  # (B, N, H, d)

        def dense_token_major(backward):
            return _run(backward, (qt, kt, vt), dot, causal_attention)

        measure("numba_flash dense, token-major (B, N, H, d) layout", dense_token_major, dense_flops, on_pack=False)
        cu_eq = torch.arange(0, B * N + 1, N, dtype=torch.int32, device="cuda")
        pk = [x.transpose(1, 2).reshape(B * N, H, d) for x in (qd, kd, vd)]
        measure(f"numba_flash varlen, {B} sequences of {N}",
                lambda bw: _run(bw, pk, dod.transpose(1, 2).reshape(B * N, H, d),
                                lambda a, b, c: varlen_attention(a, b, c, cu_eq, cu_eq, N, N, causal=True)),
                dense_flops, on_pack=False)
        from numba_flash import varlen as nf_varlen
        real = nf_varlen.dq_for_pack
        for splits in (1, 2, 4):
            nf_varlen.dq_for_pack = lambda p, cfg, det, s=splits: ("splits", s, "forced")
            measure(f"numba_flash varlen, dQ by {splits} deterministic splits (forced)",
                    with_grad(lambda a, b, c: varlen_attention(a, b, c, cu, cu, max_len, max_len, causal=True)),
                    flops)
        nf_varlen.dq_for_pack = real
    ratios = {k: ours[k] / ref[k] for k in ("forward_tflops", "fwd_bwd_tflops") if k in ours and k in ref}
    print("varlen / dense TFLOP/s:", json.dumps(ratios))
    result = {"meta": metadata(" ".join(["python3", "scripts/bench_varlen.py"] + sys.argv[1:]), simulator=False),
              "pack": {"sequences": n_seq, "lengths": [lo, hi], "total_tokens": int(cu[-1]), "max_seqlen": max_len,
                       "H": H, "d": d, "dtype": "bfloat16", "causal": True, "visible_gflop_forward": flops / 1e9},
              "dense": {"B": B, "N": N}, "rows": rows, "varlen_over_dense": ratios}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"varlen-{datetime.date.today().isoformat()}.json"
        path.write_text(json.dumps(result, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()
