"""Small cases for compute-sanitizer (GPU): every kernel family once, checked against float64.

    compute-sanitizer --tool memcheck  python scripts/sanitize_case.py
    compute-sanitizer --tool racecheck python scripts/sanitize_case.py
    compute-sanitizer --tool synccheck python scripts/sanitize_case.py
    compute-sanitizer --tool racecheck python scripts/sanitize_case.py decode   # one family

Shapes cut tiles at odd places (N not a tile multiple, Nq != Nk, padded head dims) so that
out-of-bounds loads and stores would show; exits non-zero if any result is wrong.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numba_flash  # noqa: E402
import reference  # noqa: E402

CASES = [  # (B, H, Hkv, Nq, Nk, d, dtype, causal)
    (1, 2, 1, 70, 133, 40, "float32", True),
    (1, 2, 2, 129, 65, 128, "float32", False),
    (1, 2, 1, 70, 133, 40, "float16", True),
    (1, 2, 2, 129, 65, 128, "float16", False),
    (1, 2, 1, 300, 260, 64, "float16", False),  # d = 64 non-causal: two K/V stages, O through shared memory
    (1, 1, 1, 33, 20, 200, "float16", True),   # d > 128: SIMT
    (1, 2, 1, 150, 200, 96, "float16", True),  # d = 96 padded to 128: 128x64 tiles, 64 KiB dynamic smem
    (1, 2, 1, 150, 200, 128, "float32", True),  # tf32x3 causal: 128x32 tiles, K/V split in shared memory
]


def main() -> int:
    only = sys.argv[1] if len(sys.argv) > 1 else None  # forward | backward | decode: one family
    rng = np.random.default_rng(0)
    bad = 0
    for B, H, Hkv, n_q, n_k, d, dtype, causal in (CASES if only in (None, "forward") else []):
        q = rng.standard_normal((B, H, n_q, d)).astype(dtype)
        k = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
        v = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", numba_flash.PerformanceWarning)
            out, lse = numba_flash.forward(q, k, v, causal=causal)
            kernel = numba_flash.explain(q, k, v, causal=causal).split(":")[0]
        ref, _ = reference.standard_attention(q, k, v, causal=causal)
        err = float(np.abs(out.astype(np.float64) - ref).max())
        ok = err < (2e-5 if dtype == "float32" else 5e-3)
        bad += not ok
        print(f"forward {kernel:5s} {dtype} B{B} H{H}/{Hkv} Nq{n_q} Nk{n_k} d{d} causal={causal}: "
              f"max err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    bwd_cases = CASES[:2] + CASES[3:4] + CASES[6:7] + [(1, 2, 1, 50, 90, 24, "float32", True)]  # fp32: tf32x3
    for B, H, Hkv, n_q, n_k, d, dtype, causal in (bwd_cases if only in (None, "backward") else []):
        q = rng.standard_normal((B, H, n_q, d)).astype(dtype)
        k = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
        v = rng.standard_normal((B, Hkv, n_k, d)).astype(dtype)
        do = rng.standard_normal((B, H, n_q, d)).astype(dtype)
        out, lse = reference.standard_attention(q, k, v, causal=causal)
        out = out.astype(dtype)
        lse = lse.astype(np.float32)
        refs = reference.attention_backward(q, k, v, out, lse, do, causal=causal)
        for det in (True, False):  # the dQ paths: dq kernel or deterministic splits, and the atomic grid
            grads = numba_flash.backward(q, k, v, out, lse, do, causal=causal, deterministic=det)
            err = max(float(np.abs(g.astype(np.float64) - r).max() / max(1.0, np.abs(r).max()))
                      for g, r in zip(grads, refs))
            ok = err < (1e-4 if dtype == "float32" else 2e-2)
            bad += not ok
            family = numba_flash.explain_backward(q, k, v, causal=causal).split(" ")[0]
            print(f"backward {family:6s} {dtype} B{B} H{H}/{Hkv} Nq{n_q} Nk{n_k} d{d} causal={causal} "
                  f"deterministic={det}: max rel err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for dtype in (("float32", "float16") if only in (None, "decode") else ()):  # decode: ragged, GQA 4, 2 queries
        q = rng.standard_normal((2, 8, 2, 128)).astype(dtype)
        kc = rng.standard_normal((2, 2, 300, 128)).astype(dtype)
        vc = rng.standard_normal((2, 2, 300, 128)).astype(dtype)
        lens = np.array([300, 77], np.int32)
        out, lse = numba_flash.decode(q, kc, vc, cache_seqlens=lens, num_splits=3)
        err = 0.0
        for b in range(2):
            ref, _ = reference.standard_attention(q[b], kc[b, :, :lens[b]], vc[b, :, :lens[b]], causal=True)
            err = max(err, float(np.abs(out[b].astype(np.float64) - ref).max()))
        ok = err < (2e-5 if dtype == "float32" else 5e-3)
        bad += not ok
        print(f"decode {dtype} B2 H8/2 Nq2 Nmax300 lens {lens.tolist()} splits 3: max err {err:.2e} "
              f"{'ok' if ok else 'WRONG'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
