"""numba_flash.ptx: each simulator twin against NumPy, and each intrinsic through NVVM + ptxas.

How these tests run anywhere:

* ``check_*`` functions jit a small kernel, launch it on host arrays and compare with NumPy. They
  run unchanged on the CUDA simulator (here, via ``in_simulator``) and on a real GPU
  (tests/kernels/test_gpu_ptx.py imports them).
* ``in_simulator``: when this pytest process already has ``NUMBA_ENABLE_CUDASIM=1`` the test runs
  in-process; otherwise it re-runs its own node id in a subprocess with the simulator on
  (NUMBA_ENABLE_CUDASIM must be set before numba is imported, so it cannot be switched here).
* ``compile_in_subprocess``: ``cuda.compile_ptx(..., cc=(9, 0))`` always runs in a subprocess with
  the simulator variable removed, so it works from a simulator run too; ptxas (if on PATH or in
  /usr/local/cuda*/bin) then assembles the PTX for sm_90 and reports spills.
"""
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from numba import config, cuda

from numba_flash import ptx
from numba_flash.ptx import SMEM_ALIGN

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# Running in the simulator / compiling without it
# --------------------------------------------------------------------------------------------
def in_simulator(test):
    """Run test under the CUDA simulator: in-process if it is on, else in a child pytest."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if config.ENABLE_CUDASIM:
            return test(*args, **kwargs)
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": _pythonpath()}
        env.pop("PYTEST_CURRENT_TEST", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", nodeid]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"simulator run of {nodeid} failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"

    return wrapper


def _pythonpath():
    return os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def find_ptxas():
    found = shutil.which("ptxas")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))
    return candidates[-1] if candidates else None


# numba-cuda asks the current device for its compute capability whenever it compiles a device
# function (including register_jitable helpers), even inside compile_ptx(cc=...). Without a GPU,
# answer sm_90, the cc the PTX is compiled for anyway.
NO_GPU_PATCH = """
from numba import cuda as _cuda
if not _cuda.is_available():
    import numba.cuda.dispatcher as _dispatcher

    class _Sm90:
        compute_capability = (9, 0)

    _dispatcher.get_current_device = lambda: _Sm90()
"""


def compile_in_subprocess(source, sig, name, tmp_path):
    """PTX (sm_90) of ``name`` defined in ``source``, compiled by a child without the simulator."""
    script = tmp_path / "compile_me.py"
    out = tmp_path / f"{name}.ptx"
    script.write_text(
        NO_GPU_PATCH
        + textwrap.dedent(source)
        + f"\nfrom numba import cuda as _cuda\n_p, _ = _cuda.compile_ptx({name}, {sig}, cc=(9, 0))\n"
        + f"open({str(out)!r}, 'w').write(_p)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = _pythonpath()
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and re.search(r"libNVVM|NVVM.*not found|nvrtc|CudaSupportError", r.stderr, re.I):
        pytest.skip(f"no NVVM/NVRTC to compile with: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-4000:]
    return out.read_text()


def run_compile_child(source, argv, tmp_path):
    """Run ``source`` (a script that compiles kernels and prints one JSON line) in a child without
    the simulator, with ptxas as its last argument; return the parsed JSON. Skips without ptxas/NVVM."""
    import json

    exe = find_ptxas()
    if exe is None:
        pytest.skip("ptxas not found (CUDA toolkit not installed)")
    script = tmp_path / "child.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = _pythonpath()
    r = subprocess.run([sys.executable, str(script), *argv, exe], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    if r.returncode and re.search(r"libNVVM|NVVM.*not found|nvrtc", r.stderr, re.I):
        pytest.skip(f"no NVVM/NVRTC: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def ptxas_report(ptx_text, tmp_path):
    """ptxas -v for sm_90: dict(registers, spill_stores, spill_loads, stack); skip if no ptxas."""
    exe = find_ptxas()
    if exe is None:
        pytest.skip("ptxas not found")
    src = tmp_path / "k.ptx"
    src.write_text(ptx_text)
    r = subprocess.run([exe, "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = r.stderr + r.stdout
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    regs = re.search(r"Used (\d+) registers", report)
    return {
        "registers": int(regs.group(1)),
        "stack": int(spills.group(1)),
        "spill_stores": int(spills.group(2)),
        "spill_loads": int(spills.group(3)),
        "text": report,
    }


# --------------------------------------------------------------------------------------------
# Host-side helpers (independent of the module under test where that matters)
# --------------------------------------------------------------------------------------------
def rand16(shape, dtype, rng):
    """Random values exactly representable in dtype ('f16' or 'bf16'), as float64 and as bits."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "f16":
        bits = x.astype(np.float16).view(np.uint16)
        return bits.view(np.float16).astype(np.float64), bits
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation: still a valid bf16 value
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64), bits


def test_fragment_coords_cover_each_matrix_once():
    a = [rc for lane in range(32) for rc in ptx.a_fragment_coords(lane)]
    b = [rc for lane in range(32) for rc in ptx.b_fragment_coords(lane)]
    c = [rc for lane in range(32) for rc in ptx.c_fragment_coords(lane)]
    assert sorted(a) == [(r, k) for r in range(16) for k in range(16)]
    assert sorted(b) == [(k, n) for k in range(16) for n in range(8)]
    assert sorted(c) == [(r, n) for r in range(16) for n in range(8)]
    # Spot values straight from the PTX ISA figures (lane 5: groupID 1, threadID_in_group 1).
    assert ptx.a_fragment_coords(5) == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert ptx.b_fragment_coords(5) == [(2, 1), (3, 1), (10, 1), (11, 1)]
    assert ptx.c_fragment_coords(5) == [(1, 2), (1, 3), (9, 2), (9, 3)]


def test_bit_conversions_round_to_nearest_even():
    assert ptx.f16_bits(1.0) == 0x3C00 and ptx.f16_bits(-2.0) == 0xC000
    assert ptx.f16_bits(1e6) == 0x7C00  # overflow to +inf, as cvt.rn without .satfinite
    assert ptx.bf16_bits(1.0) == 0x3F80
    assert ptx.bf16_bits(1.0 + 2.0**-8) == 0x3F80  # tie -> even
    assert ptx.bf16_bits(1.0 + 3 * 2.0**-8) == 0x3F82  # tie -> even (up)
    assert ptx.bf16_bits(float("nan")) == 0x7FFF
    rng = np.random.default_rng(1)
    for x in rng.standard_normal(200).astype(np.float32) * 100:
        assert abs(ptx.bf16_value(ptx.bf16_bits(x)) - x) <= abs(x) * 2.0**-8
        assert ptx.f16_value(ptx.f16_bits(x)) == float(np.float16(x))


# --------------------------------------------------------------------------------------------
# check_* : one kernel each, shared with tests/kernels/test_gpu_ptx.py
# --------------------------------------------------------------------------------------------
def check_mma_from_registers(dtype, seed=0):
    """mma with fragments built by each lane from global memory (explicit g/t indexing) + pack."""
    rng = np.random.default_rng(seed)
    A, _ = rand16((16, 16), dtype, rng)
    B, _ = rand16((16, 8), dtype, rng)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    mma = ptx.mma_m16n8k16_f16 if dtype == "f16" else ptx.mma_m16n8k16_bf16
    pack = ptx.pack_f16x2 if dtype == "f16" else ptx.pack_bf16x2

    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane & 3
        a0 = pack(a[g, 2 * t], a[g, 2 * t + 1])
        a1 = pack(a[g + 8, 2 * t], a[g + 8, 2 * t + 1])
        a2 = pack(a[g, 2 * t + 8], a[g, 2 * t + 9])
        a3 = pack(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9])
        b0 = pack(b[2 * t, g], b[2 * t + 1, g])
        b1 = pack(b[2 * t + 8, g], b[2 * t + 9, g])
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t] = d0
        d[g, 2 * t + 1] = d1
        d[g + 8, 2 * t] = d2
        d[g + 8, 2 * t + 1] = d3

    D = np.zeros((16, 8), np.float32)
    kernel[1, 32](A.astype(np.float32), B.astype(np.float32), C, D)
    expect = A @ B + C
    np.testing.assert_allclose(D, expect, rtol=0, atol=1e-5 * (1 + np.abs(expect).max()))


def check_ldmatrix(trans, warps=1, by_address=False):
    """Each lane's 4 registers after ldmatrix.x4 of a 16x16 tile whose element (r, c) has bits 256r+c;
    by_address: the *_at form, given shared_base(tile) + 2·offset + 2·16·16 (the tile's second copy, an
    immediate ptxas may fold) instead of the element offset. Two shared arrays: at most one of them sits
    at .shared address 0, so a shared_base that ignored its array would read the other one's decoys."""
    tile = (np.arange(16)[:, None] * 256 + np.arange(16)[None, :]).astype(np.uint16)
    load = ptx.ldmatrix_x4_trans if trans else ptx.ldmatrix_x4
    load_at = ptx.ldmatrix_x4_trans_at if trans else ptx.ldmatrix_x4_at

    @cuda.jit
    def kernel(src, out):
        tid = cuda.threadIdx.x
        lane = tid & 31
        decoy = cuda.shared.array((32, 16), np.uint16, alignment=SMEM_ALIGN)
        sm = cuda.shared.array((32, 16), np.uint16, alignment=SMEM_ALIGN)
        for i in range(tid, 512, cuda.blockDim.x):
            decoy[i // 16, i % 16] = 0xBEEF
        for i in range(tid, 256, cuda.blockDim.x):
            sm[i // 16, i % 16] = 0xDEAD  # the first copy is a decoy for the address form
            sm[16 + i // 16, i % 16] = src[i // 16, i % 16]
        cuda.syncthreads()
        # Matrix j = quarter (j & 1, j >> 1) of the tile: rows 8(j&1).., cols 8(j>>1)..
        j = lane >> 3
        row = (j & 1) * 8 + (lane & 7)
        col = (j >> 1) * 8
        if by_address:
            r0, r1, r2, r3 = load_at(sm, ptx.shared_base(sm) + 2 * (row * 16 + col) + 2 * 256)
        else:
            r0, r1, r2, r3 = load(sm, 256 + row * 16 + col)
        out[tid, 0] = r0
        out[tid, 1] = r1
        out[tid, 2] = r2
        out[tid, 3] = r3 if decoy[lane, 0] == 0xBEEF else 0  # (keeps the decoy array alive)

    out = np.zeros((32 * warps, 4), np.uint32)
    kernel[1, 32 * warps](tile, out)
    expect = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            M = tile[8 * (j & 1): 8 * (j & 1) + 8, 8 * (j >> 1): 8 * (j >> 1) + 8]
            lo, hi = (M[2 * t, g], M[2 * t + 1, g]) if trans else (M[g, 2 * t], M[g, 2 * t + 1])
            expect[lane, j] = int(lo) | (int(hi) << 16)
    np.testing.assert_array_equal(out, np.tile(expect, (warps, 1)))


def check_qk_tile(dtype, seed=0):
    """S = Q Kᵀ for a 16x16 Q tile and 16 keys: cp.async -> ldmatrix (K: non-trans) -> 2 mma."""
    rng = np.random.default_rng(seed)
    Q, Qb = rand16((16, 16), dtype, rng)
    K, Kb = rand16((16, 16), dtype, rng)
    mma = ptx.mma_m16n8k16_f16 if dtype == "f16" else ptx.mma_m16n8k16_bf16

    @cuda.jit
    def kernel(q, k, s):
        lane = cuda.threadIdx.x
        sq = cuda.shared.array((16, 16), np.uint16, alignment=SMEM_ALIGN)
        sk = cuda.shared.array((16, 16), np.uint16, alignment=SMEM_ALIGN)
        r = lane >> 1
        c = (lane & 1) * 8
        ptx.cp_async_16(sq, r * 16 + c, q[r], c)  # a row view + element offset: 16 bytes
        ptx.cp_async_16(sk, r * 16 + c, k[r], c)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        a0, a1, a2, a3 = ptx.ldmatrix_x4(sq, (lane & 15) * 16 + (lane >> 4) * 8)
        # K rows n, 16-byte chunks along d: matrices (n 0-7, d 0-7), (n 0-7, d 8-15), (n 8-15, ...)
        j = lane >> 3
        b00, b01, b10, b11 = ptx.ldmatrix_x4(sk, ((j >> 1) * 8 + (lane & 7)) * 16 + (j & 1) * 8)
        g = lane >> 2
        t = lane & 3
        zero = np.float32(0.0)
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b00, b01, zero, zero, zero, zero)
        e0, e1, e2, e3 = mma(a0, a1, a2, a3, b10, b11, zero, zero, zero, zero)
        s[g, 2 * t] = d0
        s[g, 2 * t + 1] = d1
        s[g + 8, 2 * t] = d2
        s[g + 8, 2 * t + 1] = d3
        s[g, 8 + 2 * t] = e0
        s[g, 8 + 2 * t + 1] = e1
        s[g + 8, 8 + 2 * t] = e2
        s[g + 8, 8 + 2 * t + 1] = e3

    S = np.zeros((16, 16), np.float32)
    kernel[1, 32](Qb, Kb, S)
    np.testing.assert_allclose(S, Q @ K.T, rtol=0, atol=1e-5 * (1 + np.abs(Q @ K.T).max()))


def check_pv_tile(dtype, seed=0):
    """O = P V with P (16x16) as the A operand and V (16 keys x 16 dims) through ldmatrix.trans."""
    rng = np.random.default_rng(seed)
    P, Pb = rand16((16, 16), dtype, rng)
    V, Vb = rand16((16, 16), dtype, rng)
    mma = ptx.mma_m16n8k16_f16 if dtype == "f16" else ptx.mma_m16n8k16_bf16

    @cuda.jit
    def kernel(p, v, o):
        lane = cuda.threadIdx.x
        sp = cuda.shared.array((16, 16), np.uint16, alignment=SMEM_ALIGN)
        sv = cuda.shared.array((16, 16), np.uint16, alignment=SMEM_ALIGN)
        r = lane >> 1
        c = (lane & 1) * 8
        ptx.cp_async_16(sp, r * 16 + c, p[r], c)
        ptx.cp_async_16(sv, r * 16 + c, v[r], c)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        a0, a1, a2, a3 = ptx.ldmatrix_x4(sp, (lane & 15) * 16 + (lane >> 4) * 8)
        # V rows are keys (k); .trans gives B fragments: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15) ...
        j = lane >> 3
        b00, b01, b10, b11 = ptx.ldmatrix_x4_trans(sv, ((j & 1) * 8 + (lane & 7)) * 16 + (j >> 1) * 8)
        g = lane >> 2
        t = lane & 3
        zero = np.float32(0.0)
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b00, b01, zero, zero, zero, zero)
        e0, e1, e2, e3 = mma(a0, a1, a2, a3, b10, b11, zero, zero, zero, zero)
        o[g, 2 * t] = d0
        o[g, 2 * t + 1] = d1
        o[g + 8, 2 * t] = d2
        o[g + 8, 2 * t + 1] = d3
        o[g, 8 + 2 * t] = e0
        o[g, 8 + 2 * t + 1] = e1
        o[g + 8, 8 + 2 * t] = e2
        o[g + 8, 8 + 2 * t + 1] = e3

    O = np.zeros((16, 16), np.float32)
    kernel[1, 32](Pb, Vb, O)
    np.testing.assert_allclose(O, P @ V, rtol=0, atol=1e-5 * (1 + np.abs(P @ V).max()))


def check_cp_async_zfill(zero_if=False):
    """16-byte copies with src-size 16, 6 and 0: bytes past src-size are zero. zero_if: rows 0-3 and 6-7 by
    cp_async_16_zero_if (a copy, or 16 zero bytes), rows 4-5 as before."""
    src = np.arange(1, 8 * 8 + 1, dtype=np.uint16).reshape(8, 8)

    @cuda.jit
    def kernel(src, out):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array((8, 8), np.uint16, alignment=SMEM_ALIGN)
        if tid < 8:
            nbytes = 16 if tid < 4 else (6 if tid < 6 else 0)
            if zero_if and nbytes != 6:
                ptx.cp_async_16_zero_if(sm, tid * 8, src[tid], 0, nbytes == 0)
            else:
                ptx.cp_async_16_zfill(sm, tid * 8, src[tid], 0, nbytes)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        for i in range(tid, 64, cuda.blockDim.x):
            out[i // 8, i % 8] = sm[i // 8, i % 8]

    out = np.full((8, 8), 0xABCD, np.uint16)
    kernel[1, 32](src, out)
    expect = src.copy()
    expect[4:6, 3:] = 0
    expect[6:] = 0
    np.testing.assert_array_equal(out, expect)


def check_cp_async_groups():
    """wait_group 1 retires the older of two committed groups only; wait_group 0 both."""
    src = np.arange(1, 33, dtype=np.uint16).reshape(4, 8)

    @cuda.jit
    def kernel(src, first, second):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array((4, 8), np.uint16, alignment=SMEM_ALIGN)
        if tid < 2:
            ptx.cp_async_16(sm, tid * 8, src[tid], 0)
        ptx.cp_async_commit()
        if tid < 2:
            ptx.cp_async_16(sm, (tid + 2) * 8, src[tid + 2], 0)
        ptx.cp_async_commit()
        ptx.cp_async_wait(1)
        cuda.syncthreads()
        if tid < 16:
            first[tid // 8, tid % 8] = sm[tid // 8, tid % 8]
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        second[tid // 8, tid % 8] = sm[tid // 8, tid % 8]

    first = np.zeros((2, 8), np.uint16)
    second = np.zeros((4, 8), np.uint16)
    kernel[1, 32](src, first, second)
    np.testing.assert_array_equal(first, src[:2])
    np.testing.assert_array_equal(second, src)


def check_pack_and_ex2():
    xs = np.array([0.0, 1.0, -2.5, 1e-3, 65504.0, 1e6, 3.14159, -7e-8], np.float32)  # 1e6: f16 inf
    ys = xs[::-1].copy()

    @cuda.jit
    def kernel(x, y, packed_f16, packed_bf16, e):
        i = cuda.threadIdx.x
        if i < x.size:
            packed_f16[i] = ptx.pack_f16x2(x[i], y[i])
            packed_bf16[i] = ptx.pack_bf16x2(x[i], y[i])
            e[i] = ptx.ex2_approx(x[i])

    pf, pb, e = np.zeros(8, np.uint32), np.zeros(8, np.uint32), np.zeros(8, np.float32)
    kernel[1, 32](xs, ys, pf, pb, e)

    def f16(a):
        with np.errstate(over="ignore"):
            return a.astype(np.float16).view(np.uint16).astype(np.uint32)

    np.testing.assert_array_equal(pf, f16(xs) | (f16(ys) << 16))  # first argument in the low half
    bf = np.array([ptx.bf16_bits(x) | (ptx.bf16_bits(y) << 16) for x, y in zip(xs, ys)], np.uint32)
    np.testing.assert_array_equal(pb, bf)
    small = xs < 100
    np.testing.assert_allclose(e[small], np.exp2(xs[small].astype(np.float64)), rtol=1e-6)
    assert np.isinf(e[~small]).all()


def check_shfl_xor_quad_reduce():
    """The softmax's quad reduction: xor 1 then xor 2 gives each lane its quad's max and sum."""

    @cuda.jit
    def kernel(x, mx, sm):
        lane = cuda.threadIdx.x
        v = x[lane]
        m = max(v, ptx.shfl_xor_sync(ptx.FULL_MASK, v, 1))
        m = max(m, ptx.shfl_xor_sync(ptx.FULL_MASK, m, 2))
        s = v + ptx.shfl_xor_sync(ptx.FULL_MASK, v, 1)
        s = s + ptx.shfl_xor_sync(ptx.FULL_MASK, s, 2)
        mx[lane] = m
        sm[lane] = s

    x = np.random.default_rng(3).standard_normal(32).astype(np.float32)
    mx, sm = np.zeros(32, np.float32), np.zeros(32, np.float32)
    kernel[1, 32](x, mx, sm)
    quads = x.reshape(8, 4)
    np.testing.assert_array_equal(mx, np.repeat(quads.max(axis=1), 4))
    np.testing.assert_allclose(sm, np.repeat(quads.sum(axis=1), 4), rtol=1e-6)


def check_bulk_copy_ring(tiles=5):
    """A 2-stage ring of 64-element uint16 tiles filled by cp.async.bulk: thread 0 arms each stage's
    mbarrier (arrive.expect_tx) and issues the copy; every thread waits on the stage's parity
    (flipping per reuse) and reads its element; a block barrier before each refill orders the reads
    of the stage's previous tile before its overwrite."""
    src = (np.arange(tiles * 64, dtype=np.uint16) * 7 + 3).reshape(tiles * 8, 8)

    @cuda.jit
    def kernel(src, out):
        tid = cuda.threadIdx.x
        ring = cuda.shared.array(128, np.uint16, alignment=SMEM_ALIGN)
        bars = cuda.shared.array(2, np.uint64, alignment=SMEM_ALIGN)
        if tid == 0:
            ptx.mbarrier_init(bars, 0, 1)
            ptx.mbarrier_init(bars, 1, 1)
            ptx.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            ptx.mbarrier_arrive_expect_tx(bars, 0, 128)
            ptx.cp_async_bulk(ring, 0, src, 0, 128, bars, 0)
        for t in range(tiles):
            cuda.syncthreads()  # everyone is done with tile t - 1, whose stage is refilled next
            if tid == 0 and t + 1 < tiles:
                nxt = (t + 1) % 2
                ptx.mbarrier_arrive_expect_tx(bars, nxt, 128)  # arm (the bytes to expect), then copy
                ptx.cp_async_bulk(ring, nxt * 64, src, (t + 1) * 64, 128, bars, nxt)
            st = t % 2
            while ptx.mbarrier_try_wait_parity(bars, st, (t // 2) % 2) == 0:
                pass
            out[t, tid] = ring[st * 64 + tid]

    out = np.zeros((tiles, 64), np.uint16)
    kernel[1, 64](src, out)
    np.testing.assert_array_equal(out, src.reshape(tiles, 64))


# --------------------------------------------------------------------------------------------
# Simulator runs of the checks
# --------------------------------------------------------------------------------------------
@in_simulator
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mma_from_registers_sim(dtype):
    check_mma_from_registers(dtype)


@in_simulator
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_by_address_sim(trans):
    check_ldmatrix(trans, warps=2, by_address=True)


@in_simulator
def test_cp_async_zero_if_sim():
    check_cp_async_zfill(zero_if=True)


@in_simulator
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_sim(trans):
    check_ldmatrix(trans, warps=2)  # two warps: each has its own rendezvous


@in_simulator
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_qk_tile_sim(dtype):
    check_qk_tile(dtype)


@in_simulator
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_pv_tile_sim(dtype):
    check_pv_tile(dtype)


@in_simulator
def test_cp_async_zfill_sim():
    check_cp_async_zfill()


@in_simulator
def test_cp_async_groups_sim():
    check_cp_async_groups()


@in_simulator
def test_pack_and_ex2_sim():
    check_pack_and_ex2()


@in_simulator
def test_shfl_xor_quad_reduce_sim():
    check_shfl_xor_quad_reduce()


def test_red_add_twins(rng):
    """The atomic-add twins add into the array (the v2 one into two adjacent elements) and refuse a
    misaligned vector address, as the GPU would fault on it."""
    acc = np.zeros(8, np.float32)
    x, y, z = (np.float32(v) for v in rng.standard_normal(3))
    ptx.mem._red_add_twin(acc, 2, x, y)
    ptx.mem._red_add_twin(acc, 2, y, x)
    ptx.mem._red_add_twin(acc, 7, z)
    np.testing.assert_array_equal(acc, [0, 0, x + y, y + x, 0, 0, 0, z])
    with pytest.raises(ValueError, match="offset 3 is not 8-byte aligned"):
        ptx.mem._red_add_twin(acc, 3, x, y)


@in_simulator
def test_cp_async_read_before_wait_is_poisoned_sim():
    """The twin's fidelity feature: a tile read before its wait_group shows NaN bits, not data."""
    src = np.ones((4, 8), np.uint16)

    @cuda.jit
    def kernel(src, early):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array((4, 8), np.uint16)
        if tid < 4:
            ptx.cp_async_16(sm, tid * 8, src[tid], 0)
        ptx.cp_async_commit()
        cuda.syncthreads()  # forgot cp_async_wait
        early[tid] = sm[tid // 8, tid % 8]
        cuda.syncthreads()  # nobody's copy may land while others still read
        ptx.cp_async_wait(0)

    early = np.zeros(32, np.uint16)
    kernel[1, 32](src, early)
    assert (early == 0xFFFF).all()


@in_simulator
def test_bulk_copy_ring_sim():
    check_bulk_copy_ring()


@in_simulator
def test_bulk_copy_read_before_wait_is_poisoned_sim():
    """The bulk-copy twin lands at the first try_wait on its barrier: a read before it sees 0xFF."""
    src = np.ones(32, np.uint16)

    @cuda.jit
    def kernel(src, early, late):
        tid = cuda.threadIdx.x
        sm = cuda.shared.array(32, np.uint16)
        bar = cuda.shared.array(1, np.uint64)
        if tid == 0:
            ptx.mbarrier_init(bar, 0, 1)
            ptx.fence_mbarrier_init()
            ptx.mbarrier_arrive_expect_tx(bar, 0, 64)
            ptx.cp_async_bulk(sm, 0, src, 0, 64, bar, 0)
        cuda.syncthreads()  # forgot the wait
        early[tid] = sm[tid]
        cuda.syncthreads()
        while ptx.mbarrier_try_wait_parity(bar, 0, 0) == 0:
            pass
        late[tid] = sm[tid]

    early, late = np.zeros(32, np.uint16), np.zeros(32, np.uint16)
    kernel[1, 32](src, early, late)
    assert (early == 0xFFFF).all() and (late == 1).all()


@in_simulator
def test_mbarrier_wait_on_a_phase_that_never_ends_raises_sim(monkeypatch):
    """Waiting for parity 1 before phase 0 is over (or without an arrive) would hang a GPU; the
    twin raises after MBARRIER_WAIT_LIMIT_S. Bad sizes are refused at issue."""
    monkeypatch.setattr(ptx.sim, "MBARRIER_WAIT_LIMIT_S", 0.2)

    @cuda.jit
    def wrong_parity(src):
        sm = cuda.shared.array(32, np.uint16)
        bar = cuda.shared.array(1, np.uint64)
        ptx.mbarrier_init(bar, 0, 1)
        ptx.cp_async_bulk(sm, 0, src, 0, 64, bar, 0)  # no arrive.expect_tx: phase 0 never ends
        while ptx.mbarrier_try_wait_parity(bar, 0, 0) == 0:
            pass

    with pytest.raises(RuntimeError, match="phase never completed"):
        wrong_parity[1, 1](np.ones(32, np.uint16))

    @cuda.jit
    def odd_size(src):
        sm = cuda.shared.array(32, np.uint16)
        bar = cuda.shared.array(1, np.uint64)
        ptx.mbarrier_init(bar, 0, 1)
        ptx.cp_async_bulk(sm, 0, src, 0, 24, bar, 0)

    with pytest.raises(ValueError, match="multiple of 16"):
        odd_size[1, 1](np.ones(32, np.uint16))


@in_simulator
def test_warp_divergence_is_reported_sim():
    @cuda.jit
    def kernel(x):
        lane = cuda.threadIdx.x
        if lane < 16:
            x[lane] = ptx.shfl_xor_sync(ptx.FULL_MASK, x[lane], 1)
        else:
            x[lane] = ptx.pack_f16x2(1.0, 2.0) + ptx.mma_m16n8k16_f16(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)[0]

    with pytest.raises(RuntimeError, match="divergence"):
        kernel[1, 32](np.zeros(32, np.float32))


@in_simulator
def test_misaligned_address_is_reported_sim():
    @cuda.jit
    def kernel(out):
        sm = cuda.shared.array((16, 16), np.uint16)
        r0, r1, r2, r3 = ptx.ldmatrix_x4(sm, cuda.threadIdx.x * 16 + 4)
        out[cuda.threadIdx.x] = r0

    with pytest.raises(ValueError, match="16-byte aligned"):
        kernel[1, 32](np.zeros(32, np.uint32))


# --------------------------------------------------------------------------------------------
# Real compilation: NVVM -> PTX for sm_90 -> ptxas
# --------------------------------------------------------------------------------------------
EVERY_INTRINSIC = """
import numpy as np
from numba import cuda, types
from numba_flash import ptx
from numba_flash.ptx import SMEM_ALIGN

def every_intrinsic(out, a, b, acc):
    lane = cuda.threadIdx.x
    sa = cuda.shared.array((16, 16), np.float16, alignment=SMEM_ALIGN)
    sb = cuda.shared.array((16, 8), np.float16, alignment=SMEM_ALIGN)
    ptx.cp_async_16(sa, (lane & 15) * 16 + (lane >> 4) * 8, a, (lane & 15) * 16 + (lane >> 4) * 8)
    if lane < 8:
        ptx.cp_async_16_zfill(sb, lane * 8, b, lane * 8, 16)
    elif lane < 16:  # rows 12..15 zeros
        ptx.cp_async_16_zero_if(sb, lane * 8, b, lane * 8, lane >= 12)
    ptx.cp_async_commit()
    ptx.cp_async_wait(0)
    cuda.syncthreads()
    a0, a1, a2, a3 = ptx.ldmatrix_x4(sa, (lane & 15) * 16 + (lane >> 4) * 8)
    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(sb, ((lane >> 3) & 1) * 64 + (lane & 7) * 8)
    c0, c1, c2, c3 = ptx.ldmatrix_x4_at(sa, ptx.shared_base(sa) + 2 * ((lane & 15) * 16 + (lane >> 4) * 8))
    f0, f1, f2, f3 = ptx.ldmatrix_x4_trans_at(sb, ptx.shared_base(sb) + 2 * ((lane & 7) * 8) + 128)
    a0 ^= c0 ^ f0
    b1 ^= c3 ^ f3
    d0, d1, d2, d3 = ptx.mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0)
    e0, e1, e2, e3 = ptx.mma_m16n8k16_bf16(a0, a1, a2, a3, b2, b3, d0, d1, d2, d3)
    p = ptx.pack_f16x2(e0, e1) ^ ptx.pack_bf16x2(e2, ptx.ex2_approx(e3))
    out[lane] = p + ptx.shfl_xor_sync(ptx.FULL_MASK, e0, 1)
    ptx.red_add_f32(acc, lane, e0)
    ptx.red_add_v2_f32(acc, 2 * lane, e1, e2)

SIG = (types.uint32[::1], types.float16[::1], types.float16[::1], types.float32[::1])
"""


def test_every_intrinsic_compiles_for_sm90(tmp_path):
    text = compile_in_subprocess(EVERY_INTRINSIC, "SIG", "every_intrinsic", tmp_path)
    for instr in [
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
        "cp.async.cg.shared.global",
        ", 16, p;",  # cp_async_16_zero_if's ignore-src predicate
        "cp.async.commit_group",
        "cp.async.wait_group 0",
        "cvt.rn.f16x2.f32",
        "cvt.rn.bf16x2.f32",
        "ex2.approx.ftz.f32",
        "shfl.sync.bfly",
        "red.global.add.f32",
        "red.global.add.v2.f32",
    ]:
        assert instr in text, instr
    # The shared operand is a 32-bit .shared address taken straight from the array symbol.
    assert re.search(r"ldmatrix[^\n]*\[%r\d+\]", text)
    report = ptxas_report(text, tmp_path)
    assert report["spill_stores"] == 0 and report["stack"] == 0, report["text"]


# --------------------------------------------------------------------------------------------
# st.shared.b32, ld.shared.v4, st.global.v4 (the forward's epilogue through shared memory)
# --------------------------------------------------------------------------------------------
def check_shared_and_global_vectors():
    """Lane l stores word l * 0x00010001 + 0x00020001 at words 2l of a 16-bit tile, then lanes 0..7 read
    16-byte chunk (l + 3) % 8 and store it at chunk l of out (flat element offsets)."""

    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        tile = cuda.shared.array(64, np.uint16, alignment=SMEM_ALIGN)
        ptx.st_shared_b32(tile, 2 * lane, np.uint32(lane * 0x00010001 + 0x00020001))
        ptx.syncwarp()
        if lane < 8:
            w0, w1, w2, w3 = ptx.ld_shared_v4(tile, ((lane + 3) % 8) * 8)
            ptx.st_global_v4(out, lane * 8, w0, w1, w2, w3)

    out = np.zeros(64, np.uint16)
    kernel[1, 32](out)
    words = np.array([lane * 0x00010001 + 0x00020001 for lane in range(32)], np.uint32).view(np.uint16)
    want = np.concatenate([words[((c + 3) % 8) * 8:((c + 3) % 8) * 8 + 8] for c in range(8)])
    np.testing.assert_array_equal(out, want)


@in_simulator
def test_shared_and_global_vectors_sim():
    check_shared_and_global_vectors()


VECTORS = """
import numpy as np
from numba import cuda, types
from numba_flash import ptx
from numba_flash.ptx import SMEM_ALIGN

def vectors(out):
    lane = cuda.threadIdx.x
    tile = cuda.shared.array(64, np.uint16, alignment=SMEM_ALIGN)
    ptx.st_shared_b32(tile, 2 * lane, np.uint32(lane))
    ptx.syncwarp()
    w0, w1, w2, w3 = ptx.ld_shared_v4(tile, (lane % 8) * 8)
    ptx.st_global_v4(out, lane * 8, w0, w1, w2, w3)

SIG = (types.uint16[::1],)
"""


def test_shared_and_global_vectors_compile_for_sm90(tmp_path):
    text = compile_in_subprocess(VECTORS, "SIG", "vectors", tmp_path)
    for instr in ("st.shared.b32", "ld.shared.v4.b32", "st.global.v4.b32"):
        assert instr in text, instr
    report = ptxas_report(text, tmp_path)
    assert report["spill_stores"] == 0, report["text"]


BULK_INTRINSICS = """
import numpy as np
from numba import cuda, types
from numba_flash import ptx
from numba_flash.ptx import SMEM_ALIGN

def bulk_ring(src, out):
    tid = cuda.threadIdx.x
    ring = cuda.shared.array(2048, np.uint32, alignment=SMEM_ALIGN)
    bars = cuda.shared.array(2, np.uint64, alignment=SMEM_ALIGN)
    if tid == 0:
        ptx.mbarrier_init(bars, 0, 1)
        ptx.mbarrier_init(bars, 1, 1)
        ptx.fence_mbarrier_init()
    cuda.syncthreads()
    acc = np.float32(0.0)
    for t in range(src.shape[0] // 1024):
        cuda.syncthreads()
        st = t % 2
        if tid == 0:
            ptx.mbarrier_arrive_expect_tx(bars, st, 4096)
            ptx.cp_async_bulk(ring, st * 1024, src, t * 1024, 4096, bars, st)
        while ptx.mbarrier_try_wait_parity(bars, st, (t // 2) % 2) == 0:
            pass
        acc += ring[st * 1024 + tid]
    out[tid] = acc

SIG = (types.uint32[::1], types.float32[::1])
"""


def test_bulk_intrinsics_compile_for_sm90(tmp_path):
    """The bulk copy and mbarrier PTX assembles for sm_90 (NVVM's .version must be >= 8.0)."""
    text = compile_in_subprocess(BULK_INTRINSICS, "SIG", "bulk_ring", tmp_path)
    version = re.search(r"^\.version (\d+)\.(\d+)", text, re.M)
    assert version and (int(version.group(1)), int(version.group(2))) >= (8, 0), version
    for instr in [
        "mbarrier.init.shared.b64",
        "fence.mbarrier_init.release.cluster",
        "fence.proxy.async.shared::cta",
        "mbarrier.arrive.expect_tx.shared.b64",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
        "mbarrier.try_wait.parity.shared.b64",
    ]:
        assert instr in text, instr
    report = ptxas_report(text, tmp_path)
    assert report["spill_stores"] == 0 and report["stack"] == 0, report["text"]
