"""Wave quantisation of the non-causal tensor-core forward (GPU): time vs number of Q tiles.

    python scripts/probe_waves.py [--out FILE.json]

With 128-row Q tiles and 2 blocks per SM, an H200 (132 SMs) holds 264 blocks at once. B4 H16 N4096
is 2048 tiles = 7.76 such waves, B1 H16 N16384 8192 = 31.03: if blocks run in lock-step waves, the
last wave is 76 % (3 %) full and the kernel takes as long as 8 (32) full waves. This script times
numba_flash.forward and SDPA's flash backend at N=4096, B=1, H from 56 to 68 (32 Q tiles per head),
so the time per tile can be read off: flat within a wave count, a step at each multiple of 264
tiles if the tail is lost, a straight line if it is not.
"""
import argparse
import json
import math

import torch

import numba_flash
from numba_flash.bench import time_call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--heads", default="56,57,58,60,62,64,66,67,68")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    slots = 2 * props.multi_processor_count
    rows = []
    for d in (64, 128):
        for H in map(int, args.heads.split(",")):
            N = 4096
            q, k, v = (torch.randn(1, H, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
            tiles = H * math.ceil(N / 128)
            flops = 4 * H * N * N * d
            row = {"d": d, "H": H, "tiles": tiles, "waves": tiles / slots}
            ours, _ = time_call(lambda: numba_flash.forward(q, k, v), reps=30)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                fa2, _ = time_call(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), reps=30)
            row.update(ours_ms=ours, fa2_ms=fa2, ours_tflops=flops / ours * 1e-9, fa2_tflops=flops / fa2 * 1e-9,
                       ours_us_per_tile=ours * 1e3 / tiles, fa2_us_per_tile=fa2 * 1e3 / tiles)
            rows.append(row)
            print(f"d{d} H{H:3d} tiles {tiles:5d} waves {tiles / slots:5.2f}  ours {ours:.3f} ms "
                  f"{row['ours_tflops']:6.1f} TF/s {row['ours_us_per_tile']:.3f} us/tile   "
                  f"fa2 {fa2:.3f} ms {row['fa2_tflops']:6.1f} TF/s", flush=True)
            del q, k, v
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": props.name, "slots": slots, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
