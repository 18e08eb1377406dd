"""What a PyTorch custom op costs per call on the host, beside a plain function (CPU; no GPU needed).

    python scripts/probe_op_overhead.py [--out DIR]

numba_flash::fwd's schema (three tensors, the scalars, an optional tensor) on a stand-in body that allocates
out and lse and computes nothing: microseconds per call through torch.library.custom_op (with its fake and
autograd registrations, as numba_flash.torch registers them) and through the same body called directly, with
and without inputs that require grad. The difference is the dispatcher's Python path, which every eager
numba_flash.torch.attention call pays on top of the launch.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

Tensor = torch.Tensor


def body(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], window_left: int,
         window_right: int, softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


op = torch.library.custom_op("numba_flash_probe::fwd", mutates_args=())(body)
op.register_fake(lambda q, *rest: (torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], output[0], output[1])


def _backward(ctx, dout, dlse):
    q, k, v, _, _ = ctx.saved_tensors
    return q, k, v, None, None, None, None, None, None, None


op.register_autograd(_backward, setup_context=_setup)


def per_call_us(fn, x, n=5000, reps=5):
    args = (x, x, x, True, None, -1, -1, 0.0, None, True)
    for _ in range(200):
        fn(*args)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    x = torch.randn(1, 1, 8, 8)
    lines = [f"# {datetime.date.today().isoformat()}; CPU: {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}; command: python3 {' '.join(sys.argv)}; commit "
             f"{os.environ.get('NUMBA_FLASH_COMMIT', 'unknown')}", "| inputs | custom op µs | plain call µs | op cost µs |",
             "|---|---|---|---|"]
    for grad in (False, True):
        xi = x.clone().requires_grad_(grad)
        c, p = per_call_us(op, xi), per_call_us(body, xi)
        lines.append(f"| requires_grad={grad} | {c:.1f} | {p:.1f} | {c - p:.1f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        path = Path(a.out) / f"op-overhead-{datetime.date.today().isoformat()}-cpu.txt"
        path.write_text(text + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
