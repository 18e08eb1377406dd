"""Decode tile-config sweep on the GPU: K/V bandwidth of numba_flash.decode per DecodeConfig.

For each case (fp16, B8 H32, Hkv 32 or 8, Nk 32768, d 128: the decode issue's target shapes) and each
candidate (block_n, stages, warps, warp_split) x num_splits, times ``numba_flash.decode(...,
config=cfg, num_splits=s)`` (median of CUDA events) and reports GB/s of K and V read, with the
shipped choice (config=None, num_splits=None) first; ``splits=auto`` rows are what
``choose_num_splits`` would pick for that config, where it is not already among SPLITS. Checks
every result against the shipped one (max |diff|). Writes JSON to ``--json``. warp_split
candidates (split-in-block, see numba_flash/kernels/decode.py) take block_n as one warp's tile;
bulk candidates (a fifth element True) are block-wide kernels whose K/V tiles arrive by one sm_90
cp.async.bulk each, completing its own mbarrier (DecodeConfig.bulk).
About 60-90 s on an H200 without the bulk candidates, most of it compiling (2 kernels per config
and case); the seven bulk candidates add about as much again.

    python scripts/sweep_decode.py [--json PATH] [--budget-s 0.25] [--only warp|block|bulk]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CASES = [(8, 32, 32, 32768, 128), (8, 32, 8, 32768, 128)]
CANDIDATES = [  # (block_n, stages, warps, warp_split); the block-wide (32, *, 4), (64, 4, 4), (64, 3, 8)
    # were timed in results/sweep-decode-2026-11-29.txt and lost to (64, 2, 4)
    (64, 3, 4, False), (64, 2, 4, False),
    (16, 2, 4, True),   # 4 warps x 16-key rings, 74 KiB: 3 blocks/SM, 12 warps, 32 KiB in flight per block
    (16, 3, 4, True),   # 111 KiB: 2 blocks/SM, 64 KiB in flight per block
    (32, 2, 2, True),   # one lane per key, 70 KiB: 3 blocks/SM, 6 warps
    (32, 3, 2, True),   # 104 KiB: 2 blocks/SM, 64 KiB in flight per block
    # bulk (block-wide, one cp.async.bulk per K or V tile into unpadded rows, each with its mbarrier):
    # (block_n, stages, warps, False, True); shared memory at fp16 d128 and blocks/SM by it,
    # K+V bytes in flight per block = (stages - 1) tiles
    (64, 2, 4, False, True),  # 65 KiB: 3 blocks/SM, 32 KiB in flight per block (the shipped tile, bulk)
    (64, 3, 4, False, True),  # 97 KiB: 2 blocks/SM, 64 KiB
    (64, 4, 4, False, True),  # 129 KiB: 1 block/SM, 96 KiB
    (32, 4, 4, False, True),  # 65 KiB: 3 blocks/SM, 48 KiB
    (32, 6, 4, False, True),  # 97 KiB: 2 blocks/SM, 80 KiB
    (32, 8, 4, False, True),  # 129 KiB: 1 block/SM, 112 KiB
    (64, 3, 8, False, True),  # 97 KiB, 8 warps: 2 blocks/SM (16 warps), half the per-thread work of a tile
]
SPLITS = (1, 2, 4, 8)


def kind(cand) -> str:
    """'warp' (warp_split), 'bulk' (block-wide, bulk-copied tiles) or 'block' (block-wide, cp.async)."""
    return "warp" if cand[3] else ("bulk" if len(cand) > 4 and cand[4] else "block")


def candidate_config(cand, d: int, rows: int, dtype: str = "float16"):
    """The DecodeConfig of a CANDIDATES entry for head dim d and the shipped config's rows."""
    from numba_flash.kernels.decode import DecodeConfig

    return DecodeConfig(d, dtype, rows, *cand[:3], warp_split=cand[3], bulk=kind(cand) == "bulk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--budget-s", type=float, default=0.25)
    ap.add_argument("--only", choices=("warp", "block", "bulk"),
                    help="time only warp_split, only block-wide (cp.async) or only bulk candidates")
    args = ap.parse_args()
    import torch

    import numba_flash
    from numba_flash import bench
    from numba_flash.decode import choose_num_splits
    from numba_flash.kernels.decode import decode_config, n_row_chunks

    rows = []
    for B, H, Hkv, n_k, d in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, 1, d, device="cuda", generator=g).half()
        k, v = (torch.randn(B, Hkv, n_k, d, device="cuda", generator=g).half() for _ in range(2))
        kv_bytes = 2 * k.numel() * k.element_size()
        ref, _ = numba_flash.decode(q, k, v)
        shipped = decode_config(d, "float16", H // Hkv)
        cands = [c for c in CANDIDATES if args.only is None or kind(c) == args.only]
        for cand in [None] + cands:
            cfg = None if cand is None else candidate_config(cand, d, shipped.rows)
            if cfg is not None and cfg.problems():
                rows.append(dict(case=[B, H, Hkv, n_k, d], config=cand, error="; ".join(cfg.problems())))
                continue
            splits_list = (None,)
            if cfg is not None:
                auto = choose_num_splits(B * Hkv * n_row_chunks(cfg, H // Hkv, 1), n_k, cfg)
                splits_list = SPLITS + ((auto,) if auto not in SPLITS else ())
            for splits in splits_list:
                run = lambda: numba_flash.decode(q, k, v, config=cfg, num_splits=splits)  # noqa: E731
                try:
                    out, _ = run()
                    err = (out.float() - ref.float()).abs().max().item()
                    ms, _ = bench.time_call(run, budget_s=args.budget_s)
                except Exception as e:  # noqa: BLE001  (a config that cannot launch is a result too)
                    rows.append(dict(case=[B, H, Hkv, n_k, d], config=cand, splits=splits, error=repr(e)[:200]))
                    print(f"B{B} H{H} Hkv{Hkv} {cand} splits={splits}: {e!r}"[:160], flush=True)
                    continue
                gbs = kv_bytes / ms / 1e6
                rows.append(dict(case=[B, H, Hkv, n_k, d], config=cand or "shipped", splits=splits, ms=ms,
                                 gbs=gbs, max_diff=err, smem=(cfg or shipped).smem_bytes,
                                 blocks_per_sm=(cfg or shipped).blocks_per_sm))
                print(f"B{B} H{H} Hkv{Hkv} Nk{n_k} {str(cand or 'shipped'):22s} splits={splits}: "
                      f"{ms:.4f} ms {gbs:7.0f} GB/s  diff {err:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
