"""A/B timing of tensor-core forward variants on a GPU: interleaved rounds, so slow drift (clocks,
temperature) falls on every variant alike.

    python3 scripts/ab_mma.py --shape 'N4096 d128$' --variants '128x64 mt2 epi' '128x64 mt2 epi lazy' --rounds 5

Variants and shapes are sweep_mma.py's (names exactly as there). Each variant is checked once against
torch SDPA (max |O - O_sdpa|), then every round times each variant in turn (CUDA events around single
launch calls of the variant's kernel module, median of --iters); the figure is the median over rounds, with the
spread (min-max over rounds). SDPA's flash backend is timed in the same rounds as a yardstick.
Writes $OUT/ab_mma.json when $OUT is set.

--old DIR adds, for each variant, the same config built by another version of the package (a directory
holding ``numba_flash``, e.g. ``git archive <commit> numba_flash | tar x -C DIR``, imported as
``numba_flash_old``), named ``old:<variant>``, and reports whether its O and L are bitwise equal to this
version's (expected where only address arithmetic or scheduling changed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sweep_mma import (SHAPES, VARIANTS, family, kernel_for, kernel_info, launch_and_check,  # noqa: E402
                       shape_inputs, time_ms)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, help="regex on sweep_mma's shape labels (repeatable)")
    ap.add_argument("--variants", nargs="+", required=True, help="variant names (exact) of sweep_mma.VARIANTS")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also list each variant's kernels (torch.profiler)")
    ap.add_argument("--old", help="directory holding another numba_flash package to time beside this one")
    args = ap.parse_args(argv)
    old = None
    if args.old:
        from ab_backward import load_old
        load_old(args.old)
        import numba_flash_old.kernels.mma_forward as old  # noqa: E402
    torch.manual_seed(0)
    results = []
    for label, dtype, B, H, N, d, causal in SHAPES:
        if not any(re.search(p, label) for p in args.shape) or "overhead" in label:
            continue
        hd = min(h for h in VARIANTS if h >= d)
        table = {name: cfg for name, cfg, *_ in VARIANTS[hd]}
        names = [n for n in args.variants if n in table]
        (q, k, v, out, lse), (qn, kn, vn, on, ln), scale, flops = shape_inputs(B, H, N, d, dtype, causal)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).float()
        calls, info = {}, {}
        for name in names:
            cfg = table[name]
            err, ok = launch_and_check((qn, kn, vn, on, ln), out, ref, dtype, causal, scale, cfg)
            info[name] = dict(max_abs_err=err, ok=ok, **kernel_info(kernel_for(cfg, hd, causal, dtype), cfg, hd))
            calls[name] = (lambda cfg=cfg: family(cfg).launch(qn, kn, vn, on, ln, cfg, causal=causal, softmax_scale=scale))
            if old is not None:
                calls[f"old:{name}"] = (lambda cfg=cfg: old.launch(qn, kn, vn, on, ln, cfg, causal=causal,
                                                                   softmax_scale=scale))
                same = []
                for fn in (calls[name], calls[f"old:{name}"]):
                    out.zero_()
                    lse.zero_()
                    fn()
                    torch.cuda.synchronize()
                    same.append((out.clone(), lse.clone()))
                info[f"old:{name}"] = dict(bitwise_equal=bool(torch.equal(same[0][0], same[1][0])
                                                              and torch.equal(same[0][1], same[1][1])))

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        calls["sdpa-flash"] = sdpa
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(time_ms(fn, 2, args.iters))
        if args.profile:  # which kernels a call runs and how long each takes (e.g. SPLIT_TAIL's merge)
            from torch.profiler import ProfilerActivity, profile
            for name, fn in calls.items():
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                for ev in prof.key_averages():
                    if ev.device_time_total > 0:
                        print(f"{label:30s} {name:36s} kernel {ev.key[:60]:60s} {ev.device_time_total / ev.count / 1e3:.3f} ms x{ev.count}")
        for name, ts in times.items():
            ms = float(np.median(ts))
            row = dict(shape=label, variant=name, ms=ms, tflops=flops / ms / 1e9, rounds_ms=ts,
                       spread_pct=100 * (max(ts) - min(ts)) / ms, **info.get(name, {}))
            results.append(row)
            extra = (f"err {row['max_abs_err']:.1e}{'' if row['ok'] else ' BAD'} regs {row['regs']} "
                     f"local {row['local_bytes']}") if "max_abs_err" in info.get(name, {}) else ""
            if "bitwise_equal" in info.get(name, {}):
                extra = f"bitwise equal to this version's: {info[name]['bitwise_equal']}"
            print(f"{label:30s} {name:36s} {ms:7.3f} ms {row['tflops']:6.1f} TFLOP/s "
                  f"(rounds {min(ts):.3f}-{max(ts):.3f}) {extra}", flush=True)
        del q, k, v, out, lse, ref
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ab_mma.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rounds=args.rounds, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
