"""Static SASS of a tensor-core kernel's main loop, without a GPU: what an instruction diet is measured by.

    python scripts/sass_loop.py forward 128 64 64 False float16 M_TILES=2 KV_STAGES=2 SMEM_EPILOGUE=True
    python scripts/sass_loop.py dkdv 128 64 128 False float16 atomic_dq=True
    python scripts/sass_loop.py dkdv 128 32 128 False float32 atomic_dq=True split_round="'rna'"   (the 3xTF32 one)
    python scripts/sass_loop.py --package .ab/old forward ...     (another version of numba_flash)

Compiles the kernel's sm_90 PTX (cuda.compile_ptx), assembles it with ptxas -v (registers, spills),
disassembles it with nvdisasm (``pip download --no-deps nvidia-cuda-nvdisasm`` and unzip, or a CUDA toolkit;
$NVDISASM names the binary) and walks the main loop's common path: from the loop's label (the target of
the longest backward branch) straight through, taking unconditional branches, falling through conditional
ones except a forward branch over masking code (FSEL ... -INF in the instructions it skips), until the
back branch. So the count is one K/V tile (one step) of whole, unmasked tiles: the slow paths (a sequence's
last, clamped tile; causal masks) are left out, but a block behind a conditional branch that usually is not
run counts as run (LAZY_RESCALE's rescale of acc). Prints the opcode counts on the
path, the integer/address instructions among them, and the whole loop's static count.
"""
from __future__ import annotations

import argparse
import ast
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# tensor-core, floating-point, shared-memory, copy and barrier work: everything else is integer/address/control
WORK = {"HMMA", "FMNMX", "FFMA", "MUFU", "FADD", "FMUL", "F2FP", "FSEL", "FSETP", "SHFL", "LDSM", "LDGSTS",
        "BAR", "DEPBAR", "LDGDEPBAR", "STS", "LDS", "REDG", "RED", "STG"}


def parse_sass(text):
    """[(opcode, text)] of the instructions and {label: index} of nvdisasm -c output."""
    ins, labels = [], {}
    for line in text.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            txt = m.group(2).strip()
            words = txt.split()
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            ins.append((op.split(".")[0], txt))
    return ins, labels


def main_loop_path(ins, labels):
    """(first, last, path): the main loop's bounds and its common path as instruction indices. The main loop
    is the longest loop that does not hold another loop with at least half its HMMAs: a loop around the
    main loop (a kernel walking several key blocks, as an early build of the backward's deterministic
    splits did) is not it."""
    loops = []
    for i, (op, txt) in enumerate(ins):
        m = re.search(r"\((\.L_x_\d+)\)", txt)
        if op == "BRA" and m and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i))
    if not loops:
        raise ValueError("no backward branch: no loop in this SASS")

    def hmma(lo, hi):
        return sum(1 for op, _ in ins[lo:hi + 1] if op == "HMMA")

    inner = [(a, b) for a, b in loops
             if not any((c, e) != (a, b) and a <= c and e <= b and 2 * hmma(c, e) >= max(hmma(a, b), 1)
                        for c, e in loops)]
    first, last = max(inner, key=lambda ab: ab[1] - ab[0])
    i, path = first, []
    while first <= i <= last and len(path) < 100000:
        op, txt = ins[i]
        path.append(i)
        m = re.search(r"\((\.L_x_\d+)\)", txt)
        if op == "BRA" and m:
            if i == last:
                break
            target = labels[m.group(1)]  # a forward branch over masking code (FSEL ... -INF) is taken
            skips_mask = target > i and any(o == "FSEL" and "-INF" in t for o, t in ins[i + 1:target])
            if not txt.startswith("@") or skips_mask:
                i = labels[m.group(1)]
                continue
        i += 1
    return first, last, path


def hmma_chained(texts):
    """How many of these HMMAs (instruction texts, in issue order) take as accumulator the result of the HMMA
    just before them (307 of 456 in the tf32 dK/dV step, whose 3xTF32 chains three products
    and the k-steps on one accumulator; 0 in the fp16 kernels). What that costs is not measured: given source
    that alternates two tiles' HMMAs, ptxas put each tile's back to back again, which suggests the dependency
    is cheap for it (an accumulator forwarded from one HMMA to the next)."""
    chained, prev = 0, None
    for txt in texts:
        m = re.search(r"HMMA\.\S+\s+(R\d+)[^,]*,\s*\S+,\s*\S+,\s*(R\d+|RZ)", txt)
        if not m:
            continue
        d, c = m.groups()
        chained += c == prev
        prev = d
    return chained


def summarise(text):
    """Opcode counts on the main loop's common path, its integer/address share, the loop's static size, and
    its HMMAs chained to the one before (hmma_chained)."""
    ins, labels = parse_sass(text)
    first, last, path = main_loop_path(ins, labels)
    counts = collections.Counter(ins[i][0] for i in path)
    return dict(path=len(path), other=sum(n for op, n in counts.items() if op not in WORK),
                loop=last - first + 1, counts=dict(counts.most_common()),
                chained=hmma_chained(ins[i][1] for i in path if ins[i][0] == "HMMA"))


def find_nvdisasm():
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not found:
        hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "bin",
                                             "nvdisasm")) + glob.glob("/usr/local/cuda*/bin/nvdisasm"))
        found = hits[-1] if hits else None
    if not found:
        raise SystemExit("nvdisasm not found: set NVDISASM (pip download --no-deps nvidia-cuda-nvdisasm; unzip)")
    return found


def kernel_ptx(kind, args, extra):
    """The sm_90 PTX of a forward (mma_forward.kernel_source) or backward kernel (mma_dkdv.source, mma_dq.source;
    tf32_backward.source for DTYPE float32)."""
    from numba import cuda

    if kind == "forward":
        from numba_flash.kernels import mma_forward as m

        from numba_flash.tiles import Tile

        bq, bk, d, causal, dtype = int(args[0]), int(args[1]), int(args[2]), args[3] == "True", args[4]
        mt = int(extra.pop("M_TILES", 1))  # the other keys: the tile's flags (mma_forward.FLAGS), e.g. grid_bh_x=True
        tile = Tile(bq, bk, d, warps=bq // (16 * mt), stages=m.STAGES, flags={k.lower() for k, on in extra.items() if on})
        return cuda.compile_ptx(m.kernel_source(tile, causal, dtype), m.kernel_signature(), cc=(9, 0))[0]
    from numba_flash.blocks.entry import kernel_signature
    from numba_flash.kernels import mma_dkdv, mma_dq, tf32_backward

    own, streamed, d, causal, dtype = int(args[0]), int(args[1]), int(args[2]), args[3] == "True", args[4]
    if dtype == "float32":  # the 3xTF32 backward
        fn = tf32_backward.source(kind, own, streamed, d, causal, **extra)
        sig = tf32_backward.kernel_signature(kind, extra.get("atomic_dq", False), extra.get("dq_splits", False))
    else:
        flags = {k.upper(): v for k, v in extra.items()}  # the source's flags: ATOMIC_DQ, VECTOR_RED, DQ_SPLITS ...
        fn = (mma_dkdv if kind == "dkdv" else mma_dq).source(own, streamed, d, causal, dtype, **flags)
        sig = kernel_signature(kind, flags.get("ATOMIC_DQ", False), flags.get("DQ_SPLITS", False))
    return cuda.compile_ptx(fn, sig, cc=(9, 0))[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", help="directory holding the numba_flash to compile (default: this checkout)")
    ap.add_argument("kind", choices=["forward", "dkdv", "dq"])
    ap.add_argument("args", nargs=5, help="forward: BLOCK_Q BLOCK_K HEAD_DIM CAUSAL DTYPE; "
                                          "dkdv/dq: own streamed HEAD_DIM CAUSAL DTYPE")
    ap.add_argument("extra", nargs="*", help="KEY=VALUE keyword arguments of the source (atomic_dq=True ...)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.package or os.path.join(HERE, "..")))
    sys.path.insert(0, HERE)
    from ptxas_util import ptxas_v, sm90_ptxas

    ptxas = sm90_ptxas()
    extra = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in args.extra)}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        report = ptxas_v(kernel_ptx(args.kind, args.args, extra), ptxas, cubin=cubin)
        sass = subprocess.run([find_nvdisasm(), "-c", cubin], capture_output=True, text=True, check=True).stdout
    s = summarise(sass)
    print(f"{args.kind} {' '.join(args.args)} {' '.join(args.extra)}")
    print(f"  ptxas: {report['registers']} registers, {report['stack']} B stack, {report['spill_stores']} / "
          f"{report['spill_loads']} B spill stores / loads")
    print(f"  common path: {s['path']} instructions per trip, {s['other']} integer/address/control; "
          f"whole loop {s['loop']} static; {s['chained']} of {s['counts'].get('HMMA', 0)} HMMA take the previous "
          f"HMMA's result as accumulator")
    print("  " + ", ".join(f"{op} {n}" for op, n in s["counts"].items()))


if __name__ == "__main__":
    main()
