"""wgmma.mma_async intrinsics (numba_flash.ptx.wgmma): the twin in the simulator and the instruction on an
sm_90 GPU (tests/kernels/test_gpu_wgmma.py runs the same check) against NumPy, for the three operand forms the
wgmma backward uses: both operands K-major (Sᵀ = K Qᵀ), A from registers with B MN-major (dV = Pᵀ dO) and
both MN-major (dQ = dS K from the stored dSᵀ)."""
import numpy as np
import pytest
from numba import cuda, float32, uint16

from numba_flash import ptx
from numba_flash.ptx import WGMMA_ALIGN
from numba_flash.blocks.copies import atom_offset
from test_ptx import NO_GPU_PATCH, in_simulator, rand16, run_compile_child

KR, QR, TR = 128, 64, 128  # rows of the three tiles: K-like (128 x 128), Q-like (64 x 128), dSᵀ-like (128 x 64)
SK, SQ, ST = 0, KR * 128, KR * 128 + QR * 128  # word offsets (each a multiple of 512 words: 1024 B)
SMEM_WORDS = ST + TR * 64


def wgmma_forms_kernel(dtype):
    """The Python kernel of check_wgmma_forms (before cuda.jit: the compile test builds it too)."""
    name = "float16" if dtype == "f16" else "bfloat16"
    pack = ptx.pack_f16x2 if dtype == "f16" else ptx.pack_bf16x2
    mma_kk = ptx.wgmma(64, name)
    mma_rs = ptx.wgmma(128, name, trans_b=True, a_regs=True)
    mma_mn = ptx.wgmma(64, name, trans_a=True, trans_b=True)
    hold64, hold128 = ptx.wgmma_hold(64), ptx.wgmma_hold(128)
    wait0 = ptx.wgmma_wait(0)
    k_major = ptx.wgmma_desc_bits(16)  # LBO unused by K-major 128-byte swizzled operands
    q_mn = ptx.wgmma_desc_bits(QR * 128)  # dO-like B: n columns 64a.. one atom (QR rows x 128 B) further
    k_mn = ptx.wgmma_desc_bits(KR * 128)

    def kernel(kt, qt, tt, x, s_out, r_out, u_out):
        smem = cuda.shared.array(SMEM_WORDS, uint16, alignment=WGMMA_ALIGN)
        tid = cuda.threadIdx.x
        for i in range(tid, KR * 128, 128):
            r, c = i // 128, i % 128
            smem[SK + atom_offset(r, c >> 3, KR) + (c & 7)] = kt[r, c]
        for i in range(tid, QR * 128, 128):
            r, c = i // 128, i % 128
            smem[SQ + atom_offset(r, c >> 3, QR) + (c & 7)] = qt[r, c]
        for i in range(tid, TR * 64, 128):
            r, c = i // 64, i % 64
            smem[ST + atom_offset(r, c >> 3, TR) + (c & 7)] = tt[r, c]
        ptx.fence_proxy_async()
        cuda.syncthreads()
        base = ptx.shared_base(smem) >> 4
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        s = cuda.local.array(32, float32)
        r = cuda.local.array(64, float32)
        u = cuda.local.array(32, float32)
        for i in range(32):
            s[i] = float32(0.0)
            u[i] = float32(0.0)
        for i in range(64):
            r[i] = float32(1.0)  # scale_d = 0 on the first k-step must ignore these
        row = 16 * warp + g
        ptx.wgmma_fence()
        for kk in range(8):  # K-major: k slice kk at atom kk // 4, + 32 B per slice inside it
            a = k_major + base + ((2 * SK + (kk >> 2) * KR * 128 + (kk & 3) * 32) >> 4)
            b = k_major + base + ((2 * SQ + (kk >> 2) * QR * 128 + (kk & 3) * 32) >> 4)
            mma_kk(smem, s, a, b, 1)
        for kk in range(4):  # A from registers: rows 16w + g (+8), k 16kk + 2t (+1, +8, +9)
            c0 = 16 * kk + 2 * t
            a0 = pack(x[row, c0], x[row, c0 + 1])
            a1 = pack(x[row + 8, c0], x[row + 8, c0 + 1])
            a2 = pack(x[row, c0 + 8], x[row, c0 + 9])
            a3 = pack(x[row + 8, c0 + 8], x[row + 8, c0 + 9])
            b = q_mn + base + ((2 * SQ + kk * 16 * 128) >> 4)  # k rows 16kk..: 16 rows of 128 B
            mma_rs(smem, r, a0, a1, a2, a3, b, 1 if kk > 0 else 0)
        for kk in range(8):  # both MN-major: k rows 16kk.. of Tt and of Kt (its second atom: columns 64..)
            a = q_mn + base + ((2 * ST + kk * 16 * 128) >> 4)
            b = k_mn + base + ((2 * SK + KR * 128 + kk * 16 * 128) >> 4)
            mma_mn(smem, u, a, b, 1)
        ptx.wgmma_commit()
        wait0()
        hold64(s)
        hold128(r)
        hold64(u)
        for i in range(64):
            rr = 16 * warp + g + 8 * ((i % 4) // 2)
            cc = 8 * (i // 4) + 2 * t + (i % 2)
            r_out[rr, cc] = r[i]
            if i < 32:
                s_out[rr, cc] = s[i]
                u_out[rr, cc] = u[i]

    return kernel


def check_wgmma_forms(dtype, seed=0):
    """One warpgroup: S = Kt[:64] Qtᵀ (SS, K-major, n64, 8 k-steps), R = X Qt (RS, B MN-major, n128,
    4 k-steps), U = Tᵀ Kt[:, 64:] (SS, both MN-major, n64, 8 k-steps); tiles stored by atom_offset."""
    rng = np.random.default_rng(seed)
    Kt, kt_bits = rand16((KR, 128), dtype, rng)
    Qt, qt_bits = rand16((QR, 128), dtype, rng)
    T, t_bits = rand16((TR, 64), dtype, rng)
    X, _ = rand16((64, 64), dtype, rng)
    kernel = cuda.jit(wgmma_forms_kernel(dtype))
    S = np.zeros((64, 64), np.float32)
    R = np.zeros((64, 128), np.float32)
    U = np.zeros((64, 64), np.float32)
    kernel[1, 128](kt_bits, qt_bits, t_bits, X.astype(np.float32), S, R, U)
    for got, expect in ((S, Kt[:64] @ Qt.T), (R, X @ Qt), (U, T.T @ Kt[:, 64:])):
        np.testing.assert_allclose(got, expect, rtol=0, atol=2e-5 * (1 + np.abs(expect).max()))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@in_simulator
def test_wgmma_forms_sim(dtype):
    check_wgmma_forms(dtype, seed=3)


# --------------------------------------------------------------------------------------------
# The wgmma dK/dV/dQ kernel (kernels/wgmma_backward.py) through backward_plan.launch_mma
# --------------------------------------------------------------------------------------------
def wgmma_config(head_dim, **change):
    """The shipped sm_90 config (MMA_BWD_TABLE with MMA_BWD_WGMMA's overrides), with ``change``."""
    from numba_flash.backward_plan import config_from_tiles, table_tiles
    from numba_flash.configs import MMA_BWD_TABLE, MMA_BWD_WGMMA

    tiles = {**table_tiles(MMA_BWD_TABLE, head_dim), **table_tiles(MMA_BWD_WGMMA, head_dim)}
    return dict(config_from_tiles(tiles, head_dim), **change)


@in_simulator
@pytest.mark.parametrize(
    "B,H,Hkv,n_q,n_k,d,causal,dtype,splits,defer",
    [
        (1, 2, 1, 70, 150, 64, True, "float16", None, True),   # GQA 2, 2 key blocks (the second partial), Nq < Nk
        (1, 1, 1, 80, 40, 128, True, "bfloat16", None, True),  # Nq > Nk: rows that see no key; 2 Q tiles
        (1, 1, 1, 66, 300, 100, False, "float16", 2, True),    # the deterministic splits (3 key blocks: a storing
                                                                # launch, then an adding one); d 100 (part-data
                                                                # chunk, NaN row padding) padded to 128
        (1, 2, 1, 70, 150, 128, True, "float16", 2, False),    # dQ added in its own step (DEFER_DQ off)
    ],
)
def test_wgmma_dkdv_sim(B, H, Hkv, n_q, n_k, d, causal, dtype, splits, defer):
    """The wgmma dkdv with its dQ (one plane of adds, or the splits) against the float64 reference, by
    the flash-attention error rule; NaN-filled outputs show anything left unwritten."""
    from test_mma_backward import check_error_rule, problem, run_backward

    config = wgmma_config(64 if d <= 64 else 128, dkdv_wgmma_defer_dq=("atomic", "splits") if defer else ())
    vals, stored = problem(3 + n_q + n_k, B, H, Hkv, n_q, n_k, d, causal, dtype)
    grads = run_backward(stored, d, causal, dtype, config, atomic=splits is None, splits=splits,
                         pad_to=-(-d // 8) * 8 + 8 if d % 8 else None)
    check_error_rule(grads, vals, causal, dtype)
    if n_q > n_k and causal:  # rows that see no key: dQ exactly zero
        assert np.all(grads[0][:, :, : n_q - n_k] == 0)


WGMMA_COMPILE = NO_GPU_PATCH + """
import json, re, subprocess, sys, tempfile
from numba import cuda
from numba_flash.configs import MMA_BWD_WGMMA
from numba_flash.blocks.entry import kernel_signature
from numba_flash.kernels import wgmma_backward
out = {}
for hd, causal, splits in [(128, False, 0), (128, True, 2), (128, False, 1), (64, True, 1)]:
    defer = MMA_BWD_WGMMA["dkdv_atomic", hd].has("defer_dq_" + ("splits" if splits else "atomic"))  # as launch() builds
    src = wgmma_backward.source(hd, causal, "float16", False, splits, DEFER_DQ=defer)
    ptx, _ = cuda.compile_ptx(src, kernel_signature("dkdv", True, bool(splits)), cc=(9, 0, "a"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([sys.argv[-1], "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    rep = r.stderr + r.stdout
    m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
    out[f"{hd}-{causal}-{splits}"] = dict(rc=r.returncode, stack=int(m.group(1)) if m else -1,
                                          spills=int(m.group(2)) + int(m.group(3)) if m else -1,
                                          registers=int(re.search(r"Used (\\d+) registers", rep).group(1)) if m else -1,
                                          mma=len(re.findall(r"wgmma.mma_async", ptx)),
                                          serialized="serialized" in rep, arrive_injected="C7519" in rep,
                                          log=rep[-600:])
print(json.dumps(out))
"""


@pytest.mark.heavy  # CI checks these builds' PTX hashes (tests/shipped_ptx.py)
def test_wgmma_dkdv_builds_for_sm90a(tmp_path):
    """ptxas -arch=sm_90a takes the shipped builds (the atomic grid's d128, the splits' first launch causal
    d128 and an adding one, an adding split causal d64; DEFER_DQ as MMA_BWD_WGMMA says for each) without
    spills or a stack, within 255 registers, with every wgmma in the PTX (d128: 16 Sᵀ/dPᵀ + 8 dV/dK + 8 dQ
    per step; d64: 8 + 8 + 8) and none of them serialized by ptxas, nor a wgmma.fence injected by it
    (C7519: a register the products read written after the fence)."""
    got = run_compile_child(WGMMA_COMPILE, [], tmp_path)
    for key, r in got.items():
        assert r["rc"] == 0, (key, r["log"])
        assert (r["stack"], r["spills"]) == (0, 0), (key, r)
        assert r["registers"] <= 255, (key, r)
        assert not r["serialized"] and not r["arrive_injected"], (key, r["log"])
        assert r["mma"] == (32 if key.startswith("128") else 24), (key, r["mma"])


@in_simulator
@pytest.mark.parametrize("head_dim,splits,want_defer", [(128, None, True), (128, 2, False), (64, None, True),
                                                         (64, 2, True)])
def test_shipped_defer_dq_per_scheme(monkeypatch, head_dim, splits, want_defer):
    """backward_plan.launch_mma builds the wgmma dkdv with DEFER_DQ for the schemes MMA_BWD_WGMMA lists (timed
    faster there) and without it for the others (d128's splits), with the matching shared memory."""
    from numba_flash import backward_plan
    from numba_flash.blocks import entry, schedule
    from numba_flash.kernels import wgmma_backward

    from test_mma_backward import problem

    built, launched = [], []
    monkeypatch.setattr(wgmma_backward, "build", lambda *a: built.append(a) or "kernel")
    monkeypatch.setattr(entry, "launch_kernel", lambda kernel, grid, threads, stream, smem, *args:
                        launched.append((kernel, smem)))
    _, stored = problem(1, 1, 1, 1, 70, 300, head_dim, False, "float16")
    q, k, v, o, lse, do = (cuda.to_device(x) for x in stored)
    rows = (1, schedule.padded_rows(70))
    l2, dd = cuda.device_array(rows, np.float32), cuda.device_array(rows, np.float32)
    dq_acc = cuda.device_array(((splits or 1) * rows[0], rows[1], head_dim), np.float32)
    grads = [cuda.device_array_like(x) for x in (q, k, v)]
    backward_plan.launch_mma(q, k, v, o, do, lse, l2, dd, *grads, causal=False, softmax_scale=0.1,
                             dtype="float16", d=head_dim, config=wgmma_config(head_dim), kernels=("dkdv",),
                             dq_acc=dq_acc, dq_splits=splits)
    assert built and all(a[-1] is want_defer for a in built), built
    assert {s for kern, s in launched if kern == "kernel"} == {wgmma_backward.smem_bytes(head_dim, want_defer)}


def _twin_probe(overwrite):
    """One m64n64k16 product of the K-like and Q-like tiles; reads its accumulator before and after the
    wait; with ``overwrite`` a thread rewrites part of the B tile while the product is in flight."""
    mma = ptx.wgmma(64, "float16")
    wait0 = ptx.wgmma_wait(0)
    k_major = ptx.wgmma_desc_bits(16)

    @cuda.jit
    def kernel(early, late):
        smem = cuda.shared.array(SMEM_WORDS, uint16, alignment=WGMMA_ALIGN)
        tid = cuda.threadIdx.x
        for i in range(tid, SMEM_WORDS, 128):
            smem[i] = 0x3C00  # 1.0
        cuda.syncthreads()
        base = ptx.shared_base(smem) >> 4
        s = cuda.local.array(32, float32)
        ptx.wgmma_fence()
        mma(smem, s, k_major + base + (2 * SK >> 4), k_major + base + (2 * SQ >> 4), 0)
        ptx.wgmma_commit()
        early[tid] = s[0]
        if overwrite and tid == 0:  # after its own issue (the lane whose view the twin keeps)
            smem[SQ] = 0x4000  # 2.0, in the B operand's first row
        wait0()
        late[tid] = s[0]

    early, late = np.zeros(128, np.float32), np.zeros(128, np.float32)
    kernel[1, 128](early, late)
    return early, late


@in_simulator
def test_wgmma_twin_retires_at_the_wait():
    """The twin's product runs at the wait: its accumulators read NaN before (as a read the hardware leaves
    undefined), the sum of 16 ones after; rewriting an operand tile in between is refused as a race."""
    early, late = _twin_probe(False)
    assert np.all(np.isnan(early))
    assert np.all(late == 16.0)
    with pytest.raises(Exception, match="changed between the product's issue and the wait"):
        _twin_probe(True)
