"""Small varlen packs for compute-sanitizer (GPU): every varlen build, checked against float64.

    compute-sanitizer --tool memcheck python3 scripts/sanitize_varlen.py
    compute-sanitizer --tool synccheck python3 scripts/sanitize_varlen.py

The packs hold the sequences that reach the edges: no queries, no keys, fewer keys than queries (rows that see
nothing under causal), lengths that cut tiles anywhere, GQA, d = 64 and 128 (d = 40: part-data copies). Each
runs varlen_forward and varlen_backward with each dQ scheme (the deterministic splits, the atomic plane, the dq
kernel) and is compared per sequence with reference.varlen_attention(_backward) within a loose bound (the
error rule itself is tests/kernels/test_varlen.py's). One line per case; exits 1 if any is wrong.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numba_flash  # noqa: E402
import reference  # noqa: E402
from numba_flash import varlen as nf_varlen  # noqa: E402

PACKS = [  # (lens_q, lens_k, H, Hkv, d, causal, mods)
    ([5, 0, 130, 33, 9], [9, 4, 130, 20, 0], 4, 2, 64, True, {}),
    ([70, 200], [300, 200], 2, 1, 128, False, {}),
    ([64, 17, 129], [64, 40, 129], 2, 2, 40, True, dict(window_size=(20, 0), softcap=5.0)),
]
SCHEMES = ("splits", "atomic", "kernel")


def main() -> int:
    rng = np.random.default_rng(0)
    real = nf_varlen.dq_for_pack
    bad = 0
    for i, (lens_q, lens_k, H, Hkv, d, causal, mods) in enumerate(PACKS):
        cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
        q = rng.standard_normal((cu_q[-1], H, d)).astype(np.float16)
        k, v = (rng.standard_normal((cu_k[-1], Hkv, d)).astype(np.float16) for _ in range(2))
        do = rng.standard_normal(q.shape).astype(np.float16)
        kw = dict(causal=causal, **mods)
        args = (cu_q, cu_k, max(lens_q), max(lens_k))
        out, lse = numba_flash.varlen_forward(q, k, v, *args, **kw)
        o64, l64 = reference.varlen_attention(q, k, v, cu_q, cu_k, **kw)
        exact = reference.varlen_attention_backward(q, k, v, o64, l64, do, cu_q, cu_k, **kw)
        err_o = np.abs(out - o64).max()
        for scheme in SCHEMES:
            det = scheme != "atomic"
            forced = {"splits": ("splits", 2, "forced"), "kernel": ("kernel", None, "forced")}.get(scheme)
            nf_varlen.dq_for_pack = real if forced is None else (lambda p, cfg, d_, f=forced: f)
            grads = numba_flash.varlen_backward(q, k, v, out, lse, do, *args, deterministic=det, **kw)
            err = max(np.abs(g.astype(np.float64) - x).max() / max(1.0, np.abs(x).max()) for g, x in zip(grads, exact))
            ok = err_o < 1e-2 and err < 2e-2 and np.isfinite(out).all()
            bad += not ok
            print(f"{'ok' if ok else 'WRONG'} varlen pack {i} H{H}/{Hkv} d{d} causal={causal} {mods} dQ {scheme}: "
                  f"|out - fp64| {err_o:.2e}, grads (relative) {err:.2e}", flush=True)
    nf_varlen.dq_for_pack = real
    print(f"{len(PACKS) * len(SCHEMES)} cases, {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
