"""A/B of the 3xTF32 split's roundings (tf32_forward.SPLIT_ROUNDS) on a GPU: time and accuracy, one process.

    python3 scripts/ab_split_round.py --rounds 3          (writes $OUT/ab_split_round.json when $OUT is set)

Every fp32 product of the tf32 kernels splits its operands x = hi + lo. "rna" rounds both parts with
cvt.rna.tf32.f32 (what sm_80 has; four SASS instructions each on sm_90), "rn" with cvt.rn (sm_90: one
F2FP), "rn_raw" rounds hi only and leaves lo to the tensor core's truncation. Per mode the public
``numba_flash.forward`` / ``backward`` (kernel="tf32x3", deterministic) run with the mode forced (the
modules' ``split_round_for_device`` replaced; plans off, so nothing recorded under one mode replays in
another). Timing: interleaved rounds, the modes' order rotating, the median over rounds (until 2026-12-02:
the upper middle one, i.e. the slower of 2 rounds) of each round's median of --iters CUDA-event timings
per call, SDPA memory-efficient's backward and forward as yardsticks. Accuracy: max |x - float64| of O
and of each gradient on B1 H4 problems, beside the SIMT kernels' (the fp32 error rule's yardstick).
--dq-kernel times the backward's other plan, the dkdv kernel and the separate dq kernel (what dq_scheme
falls back to: the tile config's dQ-in-dkdv entries removed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash import plans  # noqa: E402
from numba_flash.bench import time_call  # noqa: E402
from numba_flash import backward_plan  # noqa: E402
from numba_flash.kernels import tf32_forward  # noqa: E402

MODES = tf32_forward.SPLIT_ROUNDS
TIMED = {  # label: (B, H, N, d, causal)
    "N4096 d128": (4, 16, 4096, 128, False),
    "N4096 d128 causal": (4, 16, 4096, 128, True),
    "N4096 d64": (4, 16, 4096, 64, False),
    "N4096 d64 causal": (4, 16, 4096, 64, True),
    "N4096 d32": (4, 16, 4096, 32, False),
}
ACCURACY = {  # label: (N, d, causal), B1 H4 (tiles of the timed shapes: no extra builds)
    "N4096 d128": (4096, 128, False),
    "N2048 d128 causal": (2048, 128, True),
}


def force(mode):
    fixed = lambda split_round=None: mode  # noqa: E731
    tf32_forward.split_round_for_device = fixed
    backward_plan.split_round_for_device = fixed


def inputs(B, H, N, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, N, d, device="cuda", generator=g) for _ in range(4)]  # q, k, v, dout


def f64_reference(q, k, v, dout, causal):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:  # bottom-right aligned; Nq == Nk here
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ leaves[2]
    out.backward(dout.double())
    return [out.detach()] + [x.grad for x in leaves]


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", nargs="+", default=list(TIMED), choices=list(TIMED))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--dq-kernel", action="store_true", help="the dkdv + dq kernels plan, not dQ in dkdv")
    args = ap.parse_args(argv)
    plans.set_enabled(False)
    if args.dq_kernel:
        config_for = backward_plan.tf32_config
        backward_plan.tf32_config = lambda d, causal: {k: v for k, v in config_for(d, causal).items()
                                                       if k not in ("dkdv_atomic", "deterministic_dq")}
    result = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("NUMBA_FLASH_COMMIT", "?"),
              "modes": args.modes, "dq_kernel": args.dq_kernel, "accuracy": {}, "timing": {}}

    for label, (N, d, causal) in ({} if args.no_accuracy else ACCURACY).items():
        q, k, v, dout = inputs(1, 4, N, d, seed=N + d)
        ref = f64_reference(q, k, v, dout, causal)
        row = {}
        out, lse = numba_flash.forward(q, k, v, causal=causal, kernel="simt")
        simt = [out, *numba_flash.backward(q, k, v, out, lse, dout, causal=causal, kernel="simt")]
        row["simt"] = [max_err(a, r) for a, r in zip(simt, ref)]
        for mode in args.modes:
            force(mode)
            o, lse = numba_flash.forward(q, k, v, causal=causal, kernel="tf32x3")
            grads = numba_flash.backward(q, k, v, o, lse, dout, causal=causal, kernel="tf32x3")
            row[mode] = [max_err(a, r) for a, r in zip([o, *grads], ref)]
        result["accuracy"][label] = row
        print(f"accuracy {label} (max |x - f64| of O, dq, dk, dv):")
        for name, errs in row.items():
            print(f"  {name:7s} " + "  ".join(f"{e:.3e}" for e in errs))

    for label in args.shapes:
        B, H, N, d, causal = TIMED[label]
        q, k, v, dout = inputs(B, H, N, d, seed=1)
        out, lse = numba_flash.forward(q, k, v, causal=causal, kernel="tf32x3")
        calls = {}
        for mode in args.modes:
            calls[f"{mode} fwd"] = (mode, lambda: numba_flash.forward(q, k, v, causal=causal, kernel="tf32x3"))
            calls[f"{mode} bwd"] = (mode, lambda: numba_flash.backward(q, k, v, out, lse, dout, causal=causal,
                                                                         kernel="tf32x3"))
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            o_sdpa = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            calls["sdpa eff fwd"] = (None, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            calls["sdpa eff bwd"] = (None, lambda: torch.autograd.grad(o_sdpa, (qg, kg, vg), dout, retain_graph=True))
            times = {name: [] for name in calls}
            names = list(calls)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
                    mode, fn = calls[name]
                    if mode:
                        force(mode)
                    times[name].append(time_call(fn, reps=args.iters)[0])
        result["timing"][label] = {name: statistics.median(ts) for name, ts in times.items()}
        result["timing"][label + " spread"] = {name: [min(ts), max(ts)] for name, ts in times.items()}
        print(f"{label}: " + ", ".join(f"{n} {t:.3f}" for n, t in result["timing"][label].items()), flush=True)

    if os.environ.get("OUT"):
        name = "ab_split_round_dq_kernel.json" if args.dq_kernel else "ab_split_round.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
