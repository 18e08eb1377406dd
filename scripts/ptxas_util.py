"""ptxas -v for sm_90 without a GPU: shared by the sweep scripts' --ptxas modes."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile


def sm90_ptxas() -> str:
    """Path of ptxas; without a GPU, makes numba-cuda's compile_ptx answer sm_90 for the current
    device (it asks for the device's cc even under compile_ptx(cc=...))."""
    from numba import cuda

    if not cuda.is_available():
        import numba.cuda.dispatcher as dispatcher

        class _Sm90:
            compute_capability = (9, 0)

        dispatcher.get_current_device = lambda: _Sm90()
    found = shutil.which("ptxas") or (sorted(glob.glob("/usr/local/cuda*/bin/ptxas")) or [None])[-1]
    if found is None:
        raise SystemExit("ptxas not found (CUDA toolkit not installed)")
    return found


def ptxas_v(ptx: str, ptxas: str = "ptxas", flags=(), cubin: str = "/dev/null") -> dict:
    """registers, stack, spill_stores, spill_loads of one kernel's PTX built for sm_90 (the cubin written to
    ``cubin`` for a caller that disassembles it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([ptxas, "-arch=sm_90", "-v", *flags, f.name, "-o", cubin],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    rep = r.stderr + r.stdout
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", rep)
    return dict(registers=int(re.search(r"Used (\d+) registers", rep).group(1)), stack=int(m.group(1)),
                spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))


def blocks_per_sm(registers: int, threads: int, smem: int) -> int:
    """Resident blocks per H100/H200 SM by registers (allocated per warp in units of 256) and shared memory."""
    per_warp = (registers * 32 + 255) // 256 * 256
    return min(65536 // (per_warp * (threads // 32)), (228 * 1024) // (smem + 1024))
