"""Kernel compile time per family, cold and from the on-disk cache, and the first call of a fresh process (GPU).

    python3 scripts/bench_jit.py [--out DIR] [--d 128]

Runs one child process twice on the same empty NUMBA_FLASH_CACHE_DIR (a temporary folder): the first compiles
every kernel (cold), the second loads them (warm). Each child makes the first call of each entry point on
PyTorch CUDA tensors (B2 H8 N512, head dim --d, causal):
- forward float16 (mma: wgmma on sm_90, mma.sync on sm_80-89) and float32 (tf32x3),
- backward float16 (the prep / dK,dV / dQ kernels) and float32,
- decode float16 (split and merge kernels).
Per kernel specialisation: its family, seconds in numba_flash.jit_cache.compile_kernel, compiled or loaded; per
entry point: the wall time of its first call (synchronised). A warm specialisation is PASS at <= 0.5 s (the
target of issue 25). Writes jit-DATE.json (date, GPU, command, commit) with --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_TARGET_S = 0.5

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import numba_flash
from numba_flash import jit_cache
d = int(sys.argv[1])
calls = {"import": time.perf_counter() - t0}
torch.cuda.init()
g = torch.Generator(device="cuda").manual_seed(0)
def rnd(*s, dt):
    return torch.randn(*s, device="cuda", generator=g).to(dt)
def first(name, fn):
    torch.cuda.synchronize()
    n, t = len(jit_cache.log()), time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls[name] = time.perf_counter() - t
    return [(name, fam, s, how) for fam, s, how in jit_cache.log()[n:]]
kernels = []
for dt in (torch.float16, torch.float32):
    q, k, v, do = (rnd(2, 8, 512, d, dt=dt) for _ in range(4))
    tag = str(dt).replace("torch.", "")
    res = {}
    kernels += first(f"forward {tag}", lambda: res.update(o=numba_flash.forward(q, k, v, causal=True)))
    out, lse = res["o"]
    kernels += first(f"backward {tag}", lambda: numba_flash.backward(q, k, v, out, lse, do, causal=True))
q, kc, vc = rnd(2, 8, 1, d, dt=torch.float16), rnd(2, 8, 4096, d, dt=torch.float16), rnd(2, 8, 4096, d, dt=torch.float16)
kernels += first("decode float16", lambda: numba_flash.decode(q, kc, vc))
print(json.dumps(dict(calls=calls, kernels=kernels, info=jit_cache.info())))
"""


def child(cache_dir: str, d: int) -> dict:
    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=cache_dir, NUMBA_FLASH_CACHE="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    r = subprocess.run([sys.executable, "-c", CHILD, str(d)], env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--d", type=int, default=128)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="numba_flash_cache_") as tmp:
        cold, warm = child(tmp, a.d), child(tmp, a.d)
    ok = True
    print(f"{'call':18s} {'kernel family':24s} {'cold s':>8s} {'warm s':>8s}  warm how")
    for (call, fam, s_cold, how_cold), (_, fam_w, s_warm, how_warm) in zip(cold["kernels"], warm["kernels"]):
        good = how_cold == "compiled" and how_warm == "loaded" and s_warm <= WARM_TARGET_S and fam == fam_w
        ok &= good
        print(f"{call:18s} {fam:24s} {s_cold:8.2f} {s_warm:8.3f}  {how_warm:8s} {'PASS' if good else 'FAIL'}")
    if len(cold["kernels"]) != len(warm["kernels"]):
        ok = False
        print(f"FAIL the warm process built {len(warm['kernels'])} specialisations, the cold one {len(cold['kernels'])}")
    print("first call of each entry point in a fresh process (s, synchronised):")
    for name in cold["calls"]:
        print(f"  {name:18s} cold {cold['calls'][name]:8.2f}   warm {warm['calls'][name]:8.3f}")
    print(f"warm cache: {warm['info']['hits']} loaded, {warm['info']['misses']} compiled; "
          f"{'PASS' if ok else 'FAIL'} (every specialisation loaded in <= {WARM_TARGET_S} s)")
    if a.out:
        import torch

        date = datetime.date.today().isoformat()
        path = Path(a.out) / f"jit-{date}.json"
        path.write_text(json.dumps(dict(date=date, gpu=torch.cuda.get_device_name(), command=" ".join(sys.argv),
                                        commit=os.environ.get("NUMBA_FLASH_COMMIT", "unknown"), head_dim=a.d,
                                        cold=cold, warm=warm, passed=ok), indent=1))
        print("wrote", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
