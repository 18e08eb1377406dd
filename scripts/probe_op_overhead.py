"""What a PyTorch custom op costs per call on the host, beside a plain function (CPU; no GPU needed).

numba_flash::fwd's schema (three tensors, the scalars, an optional tensor) on a stand-in body that allocates
out and lse and computes nothing: microseconds per call through torch.library.custom_op (with its fake and
autograd registrations, as numba_flash.torch registers them), through a torch.autograd.Function, and through
the same body called directly, with and without inputs that require grad.

Then numba_flash.torch itself with its launches stubbed (numba_flash.forward / backward / decode replaced by
stand-ins that allocate the outputs): the host time the PyTorch layer adds to numba_flash.forward's own
(scripts/host_overhead.py --no-gpu measures that part) per eager call. ``--old DIR`` (a folder holding an
older ``numba_flash/``) measures that package the same way in a subprocess, for a before / after.

    python scripts/probe_op_overhead.py [--out DIR] [--old DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
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


def per_call_us(fn, x):
    args = (x, x, x, True, None, -1, -1, 0.0, None, True)
    return per_call_us_of(lambda: fn(*args), n=5000)


class Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        output = body(*inputs)
        ctx.save_for_backward(*inputs[:3], *output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, _, _ = ctx.saved_tensors
        return q, k, v, None, None, None, None, None, None, None


def measure_package() -> dict:
    """Microseconds per eager call of numba_flash.torch's functions, its launches replaced by stand-ins that only
    allocate (the package imported is whichever is first on sys.path)."""
    import numba_flash.torch as nft

    def forward(q, k, v, **kw):
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    def backward(q, k, v, out, lse, dout, **kw):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    nft.forward, nft.backward, nft._decode = forward, backward, forward
    x = torch.randn(1, 1, 64, 64, dtype=torch.float16)
    xg = x.clone().requires_grad_()
    gout = torch.ones_like(x)

    def fwd_bwd():
        nft.attention(xg, xg, xg, causal=True).backward(gout)

    cases = {"attention, no grad": lambda: nft.attention(x, x, x, causal=True),
             "attention, inputs require grad (forward)": lambda: nft.attention(xg, xg, xg, causal=True),
             "attention forward + backward": fwd_bwd,
             "decode": lambda: nft.decode(x, x, x)}
    return {"numba_flash": nft.__file__, "us": {k: per_call_us_of(fn) for k, fn in cases.items()}}


def per_call_us_of(fn, n=3000, reps=5):
    """Best of reps: mean microseconds per call over n calls, in CPU time of this process (on a shared machine,
    other processes' time is not ours)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host_overhead import python_us

    return python_us(fn, n=n, reps=reps, clock=time.process_time)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--old", help="folder holding an older numba_flash package, measured in a subprocess")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.child:
        print(json.dumps(measure_package()))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    x = torch.randn(1, 1, 8, 8)
    lines = [f"# {datetime.date.today().isoformat()}; CPU: {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}; command: python3 {' '.join(sys.argv)}; commit "
             f"{os.environ.get('NUMBA_FLASH_COMMIT', 'unknown')}; load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPUs; CPU time of this process per call",
             "| inputs | custom op µs | autograd.Function µs | plain call µs | op cost µs |", "|---|---|---|---|---|"]
    for grad in (False, True):
        xi = x.clone().requires_grad_(grad)
        c, f, p = per_call_us(op, xi), per_call_us(Function.apply, xi), per_call_us(body, xi)
        lines.append(f"| requires_grad={grad} | {c:.1f} | {f:.1f} | {p:.1f} | {c - p:.1f} |")
    runs = [("this tree", measure_package())]
    if a.old:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(a.old))
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              cwd=os.path.abspath(a.old))
        try:
            runs.append((f"--old {a.old}", json.loads(proc.stdout.strip().splitlines()[-1])))
        except (ValueError, IndexError):
            lines.append("old package failed: " + (proc.stdout + proc.stderr)[-2000:])
    lines += ["", "numba_flash.torch per eager call, launches stubbed (µs; the PyTorch layer without "
              "numba_flash.forward's own host time)", "| call | " + " | ".join(name for name, _ in runs) + " |",
              "|---" * (len(runs) + 1) + "|"]
    for key in runs[0][1]["us"]:
        lines.append(f"| {key} | " + " | ".join(f"{r['us'].get(key, float('nan')):.1f}" for _, r in runs) + " |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        path = Path(a.out) / f"op-overhead-{datetime.date.today().isoformat()}-cpu.txt"
        path.write_text(text + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
