"""The sm_90 PTX of every kernel the library ships, by what each launcher launches.

Each *case* calls one family's launcher the way numba_flash's dispatch does (the configs' shipped tiles,
both dtypes, every dQ scheme, the sm_90 and the pre-sm_90 builds) on stand-in device arrays, with
``cuda.jit`` and the kernel launch recorded instead of run. Every kernel a case launches is compiled with
``cuda.compile_ptx(cc=(9, 0))`` and hashed after ``normalise`` (which renames Numba's mangled symbols in
order of first use, so moving a kernel or a helper to another module, or renaming it, keeps the hash; any
changed instruction, operand or constant changes it). The recorded hashes live in shipped_ptx.json: a
restructuring of the kernels must leave them as they are; a change to a shipped kernel's instructions
re-records them (``python tests/shipped_ptx.py record``), which says it needs the GPU tests again.

    python tests/shipped_ptx.py record [--jobs N]     # all cases -> tests/shipped_ptx.json
    python tests/shipped_ptx.py check [--jobs N] [--ci] [--only SUBSTRING]

Runs without a GPU (NVVM from the nvidia-cuda-nvrtc wheel) and without the simulator.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GOLDEN = HERE / "shipped_ptx.json"
VERSIONS = ("0.68.1", "0.30.4", [2, 0])  # numba, numba-cuda, NVVM the hashes were recorded with


def normalise(text: str) -> str:
    """PTX with what differs between two builds of the same instructions taken out: mangled names (module,
    qualname, per-process version counters) renamed by first use, shared-array counters, Numba's
    environment declarations (never read by these kernels), comments."""
    text = re.sub(r"_cudapy_smem_\d+", "_cudapy_smem", text)
    lines = [x for x in text.splitlines() if not (x.startswith(".common .global") and "NumbaEnv" in x)]
    lines = [x for x in lines if not x.lstrip().startswith("//")]
    text = "\n".join(lines)
    names: dict = {}

    def rename(m):
        return names.setdefault(m.group(0), f"_N{len(names)}")

    return re.sub(r"_ZN[0-9A-Za-z_$]+", rename, text)


def sha(text: str) -> str:
    return hashlib.sha256(normalise(text).encode()).hexdigest()


# --------------------------------------------------------------------------------------------
# The cases: name -> () -> None, each calling one launcher as the dispatch does
# --------------------------------------------------------------------------------------------
def _views():
    import numpy as np

    from numba_flash.launch import DeviceView, c_strides

    base = [1 << 20]

    def view(shape, dtype):
        dtype = np.dtype(dtype)
        ptr = base[0]
        base[0] += -(-int(np.prod(shape)) * dtype.itemsize // 4096) * 4096 + 4096
        return DeviceView(ptr, shape, c_strides(shape, dtype.itemsize), dtype)

    return view


def rel_bias(score, b, h, q_idx, kv_idx, table):
    """The user score mod of the recorded user-mod backward builds (a relative-position bias from a table)."""
    return score + table[h, q_idx - kv_idx + table.shape[1] // 2]


def rel_bias_grad(score, b, h, q_idx, kv_idx, table):
    return 1.0


def cases() -> dict:
    """Every shipped specialisation, as {name: call}. A name says the family, the tile's head dim, causal,
    dtype, the target ("sm90" or "sm80": the builds below sm_90) and what else picks the build."""
    out = {}
    from numba_flash import configs

    storage = {"float16": "float16", "bfloat16": "uint16", "float32": "float32"}
    B, H, Hkv, n_q, n_k = 1, 2, 1, 256, 512  # 512 keys: 4 or 8 key blocks, so the splits launch both builds

    def qkv(dtype, d, n_q=n_q, n_k=n_k):
        view = _views()
        st = storage[dtype]
        return view, view((B, H, n_q, d), st), view((B, Hkv, n_k, d), st), view((B, Hkv, n_k, d), st)

    # --- forward: mma (fp16 / bf16) --------------------------------------------------------
    for (hd, causal) in sorted(configs.MMA_TABLE):
        for dtype in ("float16", "bfloat16"):
            for d in (hd, hd - 4):  # d % 8 != 0: the part-data copies
                def call(hd=hd, causal=causal, dtype=dtype, d=d):
                    from numba_flash.kernels import mma_forward

                    view, q, k, v = qkv(dtype, d)
                    out_, lse = view(q.shape, storage[dtype]), view(q.shape[:3], "float32")
                    mma_forward.launch(q, k, v, out_, lse, configs.MMA_TABLE[hd, causal], causal=causal,
                                       softmax_scale=0.1, layout_checked=True)
                out[f"fwd-mma/d{hd}/{'causal' if causal else 'full'}/{dtype}/d{d}"] = call

    # --- forward: mma on GPUs with less shared memory per block (sm_80-89: MMA_SMALL_SMEM) ----------
    for (hd, causal) in sorted(configs.MMA_SMALL_SMEM):
        def call(hd=hd, causal=causal):
            from numba_flash.kernels import mma_forward

            view, q, k, v = qkv("float16", hd)
            out_, lse = view(q.shape, "float16"), view(q.shape[:3], "float32")
            mma_forward.launch(q, k, v, out_, lse, configs.MMA_SMALL_SMEM[hd, causal], causal=causal,
                               softmax_scale=0.1, layout_checked=True)
        out[f"fwd-mma-small/d{hd}/{'causal' if causal else 'full'}/float16/sm80"] = ("sm80", call)

    # --- forward: wgmma (fp16 / bf16 on sm_90) ---------------------------------------------
    for (hd, causal) in sorted(configs.MMA_WGMMA):
        for dtype in ("float16", "bfloat16"):
            for d in (hd, hd - 4):
                def call(hd=hd, causal=causal, dtype=dtype, d=d):
                    from numba_flash.kernels import wgmma_forward

                    view, q, k, v = qkv(dtype, d)
                    out_, lse = view(q.shape, storage[dtype]), view(q.shape[:3], "float32")
                    wgmma_forward.launch(q, k, v, out_, lse, configs.MMA_WGMMA[hd, causal], causal=causal,
                                         softmax_scale=0.1, layout_checked=True)
                out[f"fwd-wgmma/d{hd}/{'causal' if causal else 'full'}/{dtype}/d{d}"] = call

    # --- forward: warp-specialised TMA (fp16 / bf16 on sm_90) ----------------------------------
    def ws_launch(view, q, k, v, out_, lse, tile, **kw):
        from numba_flash.kernels import wgmma_ws_forward as ws

        real = ws.maps_view  # the maps need the driver: a stand-in array of their bytes
        ws.maps_view = lambda specs, stream=0: view((len(specs) * 128,), "uint8")
        try:
            ws.launch(q, k, v, out_, lse, tile, **kw)
        finally:
            ws.maps_view = real

    for (hd, causal) in sorted(configs.MMA_WGMMA_WS):
        for dtype in ("float16", "bfloat16"):
            def call(hd=hd, causal=causal, dtype=dtype):
                view, q, k, v = qkv(dtype, hd)
                out_, lse = view(q.shape, storage[dtype]), view(q.shape[:3], "float32")
                ws_launch(view, q, k, v, out_, lse, configs.MMA_WGMMA_WS[hd, causal], causal=causal,
                          softmax_scale=0.1)
            out[f"fwd-ws/d{hd}/{'causal' if causal else 'full'}/{dtype}"] = call

    # the built-in variants in it: a window (causal-aligned) with softcap and ALiBi
    def call():
        from numba_flash.blocks.mods import Mods

        view, q, k, v = qkv("bfloat16", 128)
        out_, lse = view(q.shape, "uint16"), view(q.shape[:3], "float32")
        ws_launch(view, q, k, v, out_, lse, configs.MMA_WGMMA_WS[128, True], causal=True, softmax_scale=0.1,
                  mods=Mods(window=True, softcap=True, alibi=True), window=(100, 0), softcap=30.0,
                  alibi=view((1, H), "float32"))
    out["fwd-ws/d128/causal/bfloat16/window-softcap-alibi"] = call

    # --- forward: the shipped user mod (numba_flash.mods.document_mask) on mma.sync, wgmma and ws --------------
    for family in ("mma", "wgmma", "ws"):
        for causal in (False, True):
            def call(family=family, causal=causal):
                from numba_flash.blocks.mods import Mods, UserMod
                from numba_flash.kernels import mma_forward, wgmma_forward
                from numba_flash.mods import same_document

                view, q, k, v = qkv("bfloat16", 128)
                out_, lse = view(q.shape, "uint16"), view(q.shape[:3], "float32")
                mods = Mods(mask_mod=UserMod(same_document, 4, (("int32", 2), ("int32", 2))))
                aux = (view((B, n_q), "int32"), view((B, n_k), "int32"))
                if family == "ws":
                    ws_launch(view, q, k, v, out_, lse, configs.MMA_WGMMA_WS[128, causal], causal=causal,
                              softmax_scale=0.1, mods=mods, aux=aux)
                    return
                kernel, table = ((wgmma_forward, configs.MMA_WGMMA) if family == "wgmma" else
                                 (mma_forward, configs.MMA_TABLE))
                kernel.launch(q, k, v, out_, lse, table[128, causal], causal=causal, softmax_scale=0.1,
                              layout_checked=True, mods=mods, aux=aux)
            out[f"fwd-{family}/d128/{'causal' if causal else 'full'}/bfloat16/docmask"] = call

    # --- forward: the document mask walking its BlockMask (Mods.block_sparse: the key-tile lists) ----------------
    for family in ("mma", "wgmma", "ws"):
        for causal in (False, True):
            def call(family=family, causal=causal):
                from numba_flash.blocks.mods import Mods, UserMod
                from numba_flash.kernels import mma_forward, wgmma_forward
                from numba_flash.mods import same_document

                view, q, k, v = qkv("bfloat16", 128)
                out_, lse = view(q.shape, "uint16"), view(q.shape[:3], "float32")
                mods = Mods(mask_mod=UserMod(same_document, 4, (("int32", 2), ("int32", 2))), block_sparse=True)
                kernel, table = {"wgmma": (wgmma_forward, configs.MMA_WGMMA), "mma": (mma_forward, configs.MMA_TABLE),
                                 "ws": (None, configs.MMA_WGMMA_WS)}[family]
                tile = table[128, causal]
                n_qt, n_kt = -(-n_q // tile.block_q), -(-n_k // tile.block_k)
                aux = (view((B, n_q), "int32"), view((B, n_k), "int32"), view((B, H, n_qt), "int32"),
                       view((B, H, n_qt, n_kt), "int32"))
                if family == "ws":
                    ws_launch(view, q, k, v, out_, lse, tile, causal=causal, softmax_scale=0.1, mods=mods, aux=aux)
                    return
                kernel.launch(q, k, v, out_, lse, tile, causal=causal, softmax_scale=0.1, layout_checked=True,
                              mods=mods, aux=aux)
            out[f"fwd-{family}/d128/{'causal' if causal else 'full'}/bfloat16/docmask-sparse"] = call

    # --- forward: tf32x3 and tf32 (fp32 on tensor cores) ------------------------------------
    for (hd, causal) in sorted(configs.TF32_TABLE):
        for passes in (3, 1):
            for rnd in ("rn", "rna"):
                def call(hd=hd, causal=causal, passes=passes, rnd=rnd):
                    from numba_flash import api
                    from numba_flash.kernels import tf32_forward

                    view, q, k, v = qkv("float32", hd)
                    out_, lse = view(q.shape, "float32"), view(q.shape[:3], "float32")
                    tf32_forward.launch(q, k, v, out_, lse, api.tf32_config(hd, causal), causal=causal,
                                        softmax_scale=0.1, layout_checked=True, passes=passes, split_round=rnd)
                out[f"fwd-tf32x{passes}/d{hd}/{'causal' if causal else 'full'}/float32/{rnd}"] = call

    # --- forward: SIMT (fp32 FMA; fp16 / bf16 widened) ------------------------------------------
    for hd in configs.HEAD_DIMS:
        for dtype in ("float32", "float16", "bfloat16"):
            for causal in (False, True):
                def call(hd=hd, causal=causal, dtype=dtype):
                    from numba_flash.kernels import simt_forward

                    view, q, k, v = qkv(dtype, hd)
                    out_, lse = view(q.shape, storage[dtype]), view(q.shape[:3], "float32")
                    simt_forward.launch(configs.simt_config(hd), q, k, v, out_, lse, causal=causal, softmax_scale=0.1,
                                        dtype=dtype, d=hd)
                out[f"fwd-simt/d{hd}/{'causal' if causal else 'full'}/{dtype}"] = call

    # --- backward: tensor cores, fp16 / bf16 (mma.sync below sm_90, wgmma dkdv on sm_90) ---------
    def bwd_arrays(dtype, d, hd, n_splits):
        from numba_flash.blocks.schedule import padded_rows

        view, q, k, v = qkv(dtype, d)
        st = storage[dtype]
        rows = padded_rows(n_q)
        arr = dict(out=view(q.shape, st), dout=view(q.shape, st), lse=view(q.shape[:3], "float32"),
                   l2=view((B * H, rows), "float32"), dd=view((B * H, rows), "float32"), dq=view(q.shape, st),
                   dk=view(k.shape, st), dv=view(v.shape, st),
                   dq_acc=view((max(n_splits, 1) * B * H, rows, hd), "float32"))
        return q, k, v, arr

    for target in ("sm90", "sm80"):
        for hd in sorted({hd for _, hd in configs.MMA_BWD_TABLE}):
            for causal in (False, True):
                for dtype in ("float16", "bfloat16"):
                    for d in (hd, hd - 4):
                        for scheme in ("kernel", "splits", "atomic"):
                            # above d = 128 both targets run the same mma.sync builds but the atomic one (scalar
                            # adds below sm_90), and the part-data chunk's builds are taken once (float16)
                            if hd > 128 and ((target == "sm80" and scheme != "atomic") or
                                             (d != hd and dtype != "float16")):
                                continue

                            def call(hd=hd, causal=causal, dtype=dtype, d=d, scheme=scheme):
                                import importlib

                                from numba_flash import backward_plan

                                cfg = importlib.import_module("numba_flash.backward").mma_config(hd)
                                n_splits = 2 if scheme == "splits" else 0
                                q, k, v, a = bwd_arrays(dtype, d, hd, n_splits)
                                backward_plan.launch_mma(q, k, v, a["out"], a["dout"], a["lse"], a["l2"], a["dd"],
                                                         a["dq"], a["dk"], a["dv"], causal=causal, softmax_scale=0.1,
                                                         dtype=dtype, d=d, config=cfg,
                                                         dq_acc=None if scheme == "kernel" else a["dq_acc"],
                                                         dq_splits=n_splits or None)
                            out[f"bwd-mma/d{hd}/{'causal' if causal else 'full'}/{dtype}/{target}/{scheme}/d{d}"] = \
                                (target, call)

    # --- varlen (packed sequences): the tensor-core forward and backward with the varlen entry -----------
    def varlen_arrays(dtype, hd, n_splits):
        from numba_flash.arrays import packed_as_batch
        from numba_flash.blocks.schedule import padded_rows

        view = _views()
        st, n_seq, total = storage[dtype], 3, 700
        pk = lambda heads, st=st: packed_as_batch(view((total, heads, hd), st), n_seq)  # noqa: E731
        rows = padded_rows(n_q)
        arr = dict(q=pk(H), k=pk(Hkv), v=pk(Hkv), out=pk(H), dout=pk(H), dq=pk(H), dk=pk(Hkv), dv=pk(Hkv),
                   lse=packed_as_batch(view((H, total), "float32"), n_seq),
                   l2=view((n_seq * H, rows), "float32"), dd=view((n_seq * H, rows), "float32"),
                   dq_acc=view((max(n_splits, 1) * n_seq * H, rows, hd), "float32"))
        cu = (view((n_seq + 1,), "int32"), view((n_seq + 1,), "int32"))
        return arr, (*cu, n_q, n_k)

    for (hd, causal) in sorted(configs.MMA_TABLE):
        dtype = "bfloat16" if causal else "float16"

        def call(hd=hd, causal=causal, dtype=dtype):
            from numba_flash.kernels import mma_forward

            a, varlen = varlen_arrays(dtype, hd, 0)
            mma_forward.launch(a["q"], a["k"], a["v"], a["out"], a["lse"], configs.MMA_TABLE[hd, causal],
                               causal=causal, softmax_scale=0.1, layout_checked=True, varlen=varlen)
        out[f"fwd-mma-varlen/d{hd}/{'causal' if causal else 'full'}/{dtype}"] = call

        def call(hd=hd, causal=causal, dtype=dtype):
            from numba_flash.kernels import wgmma_forward

            a, varlen = varlen_arrays(dtype, hd, 0)
            wgmma_forward.launch(a["q"], a["k"], a["v"], a["out"], a["lse"], configs.MMA_WGMMA[hd, causal],
                                 causal=causal, softmax_scale=0.1, layout_checked=True, varlen=varlen)
        out[f"fwd-wgmma-varlen/d{hd}/{'causal' if causal else 'full'}/{dtype}"] = call
    for (hd, causal) in sorted(configs.MMA_WGMMA_WS):  # sm_90's varlen forward: the ws tiles, tma_store dropped
        dtype = "bfloat16" if causal else "float16"

        def call(hd=hd, causal=causal, dtype=dtype):
            a, varlen = varlen_arrays(dtype, hd, 0)
            ws_launch(_views(), a["q"], a["k"], a["v"], a["out"], a["lse"], configs.MMA_WGMMA_WS[hd, causal],
                      causal=causal, softmax_scale=0.1, varlen=varlen)
        out[f"fwd-ws-varlen/d{hd}/{'causal' if causal else 'full'}/{dtype}"] = call
    for target, hd, causal, scheme in (("sm90", 128, True, "splits"), ("sm90", 128, True, "atomic"),
                                       ("sm90", 64, False, "kernel"), ("sm80", 128, True, "atomic"),
                                       ("sm90", 192, False, "splits"), ("sm90", 256, True, "kernel")):
        def call(hd=hd, causal=causal, scheme=scheme):
            import importlib

            from numba_flash import backward_plan

            cfg = importlib.import_module("numba_flash.backward").mma_config(hd)
            n_splits = 2 if scheme == "splits" else 0
            a, varlen = varlen_arrays("bfloat16", hd, n_splits)
            backward_plan.launch_mma(a["q"], a["k"], a["v"], a["out"], a["dout"], a["lse"], a["l2"], a["dd"], a["dq"],
                                     a["dk"], a["dv"], causal=causal, softmax_scale=0.1, dtype="bfloat16", d=hd,
                                     config=cfg, dq_acc=None if scheme == "kernel" else a["dq_acc"],
                                     dq_splits=n_splits or None, varlen=varlen)
        out[f"bwd-mma-varlen/d{hd}/{'causal' if causal else 'full'}/bfloat16/{target}/{scheme}"] = (target, call)

    # --- backward: user mods (the shipped document_mask; a score mod with its grad) -------------------------
    for target, hd, causal, scheme, which in (("sm90", 128, True, "atomic", "docmask"),
                                              ("sm80", 128, True, "atomic", "docmask"),
                                              ("sm90", 64, False, "kernel", "relbias")):
        def call(hd=hd, causal=causal, scheme=scheme, which=which):
            import importlib

            from numba_flash import backward_plan
            from numba_flash.blocks.mods import Mods, UserMod
            from numba_flash.mods import same_document

            cfg = importlib.import_module("numba_flash.backward").mma_config(hd)
            view, *_ = qkv("bfloat16", hd)
            q, k, v, a = bwd_arrays("bfloat16", hd, hd, 0)
            if which == "docmask":
                mods = Mods(mask_mod=UserMod(same_document, 4, (("int32", 2), ("int32", 2))))
                aux = (view((B, n_q), "int32"), view((B, n_k), "int32"))
            else:
                mods = Mods(score_mod=UserMod(rel_bias, 5, (("float32", 2),), grad=rel_bias_grad))
                aux = (view((H, n_q + n_k + 1), "float32"),)
            backward_plan.launch_mma(q, k, v, a["out"], a["dout"], a["lse"], a["l2"], a["dd"], a["dq"], a["dk"],
                                     a["dv"], causal=causal, softmax_scale=0.1, dtype="bfloat16", d=hd, config=cfg,
                                     dq_acc=None if scheme == "kernel" else a["dq_acc"], mods=mods, aux=aux)
        out[f"bwd-mma/d{hd}/{'causal' if causal else 'full'}/bfloat16/{target}/{scheme}/{which}"] = (target, call)

    # --- dropout: the mma.sync forward (sm_90 included), the mma.sync dK/dV + dq kernel (sm80) and the wgmma dK/dV
    # with both of its dQ schemes (sm90); the words (seed_lo, seed_hi, offset, keep16) are launch scalars
    words = (0x1234, 0x5678, 3, 58982)
    for hd, causal in ((64, True), (128, True), (256, False)):
        def call(hd=hd, causal=causal):
            from numba_flash.blocks.mods import Mods
            from numba_flash.kernels import mma_forward

            view, q, k, v = qkv("bfloat16", hd)
            out_, lse = view(q.shape, "uint16"), view(q.shape[:3], "float32")
            mma_forward.launch(q, k, v, out_, lse, configs.MMA_TABLE[hd, causal], causal=causal, softmax_scale=0.1,
                               layout_checked=True, mods=Mods(dropout=True), dropout=words)
        out[f"fwd-mma/d{hd}/{'causal' if causal else 'full'}/bfloat16/dropout"] = call
    for target, hd, causal, scheme in (("sm80", 128, True, "kernel"), ("sm80", 256, False, "kernel"),
                                       ("sm90", 128, True, "splits"), ("sm90", 64, False, "atomic")):
        def call(hd=hd, causal=causal, scheme=scheme):
            import importlib

            from numba_flash import backward_plan
            from numba_flash.blocks.mods import Mods

            cfg = importlib.import_module("numba_flash.backward").mma_config(hd)
            n_splits = 2 if scheme == "splits" else 0
            q, k, v, a = bwd_arrays("bfloat16", hd, hd, n_splits)
            backward_plan.launch_mma(q, k, v, a["out"], a["dout"], a["lse"], a["l2"], a["dd"], a["dq"], a["dk"],
                                     a["dv"], causal=causal, softmax_scale=0.1, dtype="bfloat16", d=hd, config=cfg,
                                     dq_acc=None if scheme == "kernel" else a["dq_acc"], dq_splits=n_splits or None,
                                     mods=Mods(dropout=True), aux=words)
        out[f"bwd-mma/d{hd}/{'causal' if causal else 'full'}/bfloat16/{target}/{scheme}/dropout"] = (target, call)

    # --- backward: tf32x3 (fp32 on tensor cores) ---------------------------------------------------
    for target in ("sm90", "sm80"):
        for (hd, causal) in sorted({key[1:] for key in configs.TF32_BWD_TABLE}):
            for scheme in ("kernel", "splits", "atomic"):
                def call(hd=hd, causal=causal, scheme=scheme, target=target):
                    from numba_flash import backward_plan

                    n_splits = 2 if scheme == "splits" else 0
                    q, k, v, a = bwd_arrays("float32", hd, hd, n_splits)
                    backward_plan.launch_tf32(q, k, v, a["out"], a["dout"], a["lse"], a["l2"], a["dd"], a["dq"],
                                              a["dk"], a["dv"], causal=causal, softmax_scale=0.1, d=hd,
                                              dq_acc=None if scheme == "kernel" else a["dq_acc"],
                                              dq_splits=n_splits or None,
                                              split_round="rn" if target == "sm90" else "rna")
                out[f"bwd-tf32x3/d{hd}/{'causal' if causal else 'full'}/float32/{target}/{scheme}"] = (target, call)

    # --- backward: SIMT ----------------------------------------------------------------------------
    for hd in configs.HEAD_DIMS:
        for dtype in ("float32", "float16", "bfloat16"):
            for causal in (False, True):
                def call(hd=hd, causal=causal, dtype=dtype):
                    from numba_flash.kernels import simt_backward

                    view, q, k, v = qkv(dtype, hd)
                    st = storage[dtype]
                    simt_backward.launch(simt_backward.backward_configs(hd), q, k, v, view(q.shape, st),
                                         view(q.shape, st), view(q.shape[:3], "float32"), view(q.shape[:3], "float32"),
                                         view(q.shape, st), view(k.shape, st), view(v.shape, st), causal=causal,
                                         softmax_scale=0.1, dtype=dtype, d=hd)
                out[f"bwd-simt/d{hd}/{'causal' if causal else 'full'}/{dtype}"] = call

    # --- decode: every distinct shipped config, contiguous (bulk / cp.async) or strided rows, 1 or 4 splits
    from numba_flash.kernels import decode as dk

    seen = set()  # every head dim at fp16, three at the other dtypes; one query row, a GQA group of 8, 128 rows
    for dtype in ("float16", "bfloat16", "float32"):
        for hd in configs.HEAD_DIMS if dtype == "float16" else (64, 128, 256):
            for rows in (1, 8, 128):
                cfg = dk.decode_config(hd, dtype, rows)
                if cfg in seen:
                    continue
                seen.add(cfg)
                for layout in ("contiguous", "strided"):
                    for splits in (1, 4):
                        for target in ("sm90", "sm80") if cfg.bulk else ("sm90",):
                            def call(cfg=cfg, layout=layout, splits=splits, dtype=dtype, hd=hd):
                                import numpy as np

                                from numba_flash.launch import DeviceView

                                view = _views()
                                st = "float32" if dtype == "float32" else "uint16"  # 16-bit caches as words
                                qst = storage[dtype]
                                group = max(cfg.rows, 1)
                                q = view((1, group, 1, hd), qst)
                                n_max = 512
                                if layout == "contiguous":
                                    k, v = view((1, 1, n_max, hd), st), view((1, 1, n_max, hd), st)
                                else:  # rows of an odd stride: neither bulk nor cp.async can fetch them
                                    item = np.dtype(st).itemsize
                                    base = view((1, 1, n_max, hd + 1), st)
                                    k = DeviceView(base.ptr, (1, 1, n_max, hd), (0, 0, (hd + 1) * item, item), st)
                                    v = DeviceView(base.ptr + item, (1, 1, n_max, hd), (0, 0, (hd + 1) * item, item),
                                                   st)
                                lens = view((1,), "int32")
                                out_, lse = view(q.shape, qst), view(q.shape[:3], "float32")
                                parts = None
                                if splits > 1:
                                    shapes = dk.scratch_shapes(1, group, 1, splits, hd)
                                    parts = tuple(view(s, "float32") for s in shapes)
                                dk.launch(cfg, q, k, v, lens, out_, lse, softmax_scale=0.1, d=hd, num_splits=splits,
                                          partials=parts)
                            name = (f"decode/d{hd}/{dtype}/rows{cfg.rows}-n{cfg.block_n}-s{cfg.stages}-w{cfg.warps}"
                                    f"{'-ws' if cfg.warp_split else ''}{'-bulk' if cfg.bulk else ''}/{layout}/"
                                    f"splits{splits}/{target}")
                            out[name] = (target, call)

    # --- decode from a paged cache (block_table): the shipped fp16 d128 tiles of one query row and a GQA group of
    # 4 (the paged benchmark's), pages of 64 keys
    for rows in (1, 4):
        cfg = dk.decode_config(128, "float16", rows)
        for splits in (1, 4):
            def call(cfg=cfg, splits=splits):
                view = _views()
                group, hd, page = max(cfg.rows, 1), 128, 64
                q = view((1, group, 1, hd), "float16")
                k, v = view((8, 1, page, hd), "uint16"), view((8, 1, page, hd), "uint16")
                lens, table = view((1,), "int32"), view((1, 8), "int32")
                out_, lse = view(q.shape, "float16"), view(q.shape[:3], "float32")
                parts = None
                if splits > 1:
                    parts = tuple(view(s, "float32") for s in dk.scratch_shapes(1, group, 1, splits, hd))
                dk.launch(cfg, q, k, v, lens, out_, lse, softmax_scale=0.1, d=hd, num_splits=splits, partials=parts,
                          block_table=table)
            out[f"decode-paged/d128/float16/rows{cfg.rows}-n{cfg.block_n}-s{cfg.stages}-w{cfg.warps}"
                f"{'-ws' if cfg.warp_split else ''}/splits{splits}"] = call
    # --- decode with flash-attn's variants (window + softcap + ALiBi in one build) and with the shipped user mod
    # (numba_flash.mods.document_mask): the same two shipped tiles
    def decode_mods(cfg, **mods):
        """One 4-split decode launch of cfg on a 512-key cache; mods: dk.launch's window / softcap / alibi / user, aux
        (an "alibi" or "aux" value is a list of (shape, dtype) views to make)."""
        view = _views()
        group, hd = max(cfg.rows, 1), 128
        q = view((1, group, 1, hd), "float16")
        k, v = view((1, 1, 512, hd), "uint16"), view((1, 1, 512, hd), "uint16")
        out_, lse = view(q.shape, "float16"), view(q.shape[:3], "float32")
        parts = tuple(view(s, "float32") for s in dk.scratch_shapes(1, group, 1, 4, hd))
        if "alibi" in mods:
            mods["alibi"] = view((1, group), "float32")
        if "aux" in mods:
            mods["aux"] = tuple(view(shape, dt) for shape, dt in mods["aux"])
        dk.launch(cfg, q, k, v, view((1,), "int32"), out_, lse, softmax_scale=0.1, d=hd, num_splits=4,
                  partials=parts, **mods)

    for rows in (1, 4):
        cfg = dk.decode_config(128, "float16", rows)
        name = (f"decode-mods/d128/float16/rows{cfg.rows}-n{cfg.block_n}-s{cfg.stages}-w{cfg.warps}"
                f"{'-ws' if cfg.warp_split else ''}")
        out[f"{name}/window-softcap-alibi"] = lambda cfg=cfg: decode_mods(cfg, window=(255, 0), softcap=30.0,
                                                                          alibi=True)

        def call(cfg=cfg):
            from numba_flash.blocks.mods import Mods, UserMod
            from numba_flash.mods import same_document

            user = Mods(mask_mod=UserMod(same_document, 4, (("int32", 2), ("int32", 2))))
            decode_mods(cfg, user=user, aux=[((1, 1), "int32"), ((1, 512), "int32")])
        out[f"{name}/docmask"] = call
    return {k: (v if isinstance(v, tuple) else ("sm90", v)) for k, v in out.items()}


# The CI subset: one or two cases of every family and build kind (the full set takes ~N minutes)
CI_PATTERNS = (
    r"^fwd-mma/d128/causal/float16/d128$", r"^fwd-mma/d128/causal/bfloat16/d124$", r"^fwd-mma/d256/causal/bfloat16/d256$",
    r"^fwd-mma-small/d256/full/", r"^fwd-wgmma/d128/causal/float16/d128$", r"^fwd-wgmma/d64/causal/bfloat16/d60$",
    r"^fwd-ws/d128/(full|causal)/float16$", r"^fwd-wgmma-varlen/d128/causal/bfloat16$",
    r"^fwd-ws-varlen/d128/causal/bfloat16$",
    r"^fwd-tf32x3/d128/causal/float32/rn$", r"^fwd-tf32x1/d128/full/float32/rn$", r"^fwd-tf32x3/d32/full/float32/rna$",
    r"^fwd-simt/d64/causal/float32$", r"^fwd-simt/d128/full/bfloat16$",
    r"^bwd-mma/d128/causal/float16/sm90/(kernel|splits|atomic)/d128$", r"^bwd-mma/d128/full/bfloat16/sm80/atomic/d124$",
    r"^bwd-tf32x3/d128/causal/float32/sm90/(kernel|splits|atomic)$", r"^bwd-tf32x3/d32/full/float32/sm80/atomic$",
    r"^bwd-simt/d64/causal/float32$", r"^bwd-simt/d128/full/float16$",
    r"^decode/d128/float16/.*/contiguous/splits4/sm90$", r"^decode/d64/float32/rows1-.*/splits4/sm80$",
    r"^decode/d256/bfloat16/rows1-.*/strided/splits1/sm90$", r"^decode-paged/d128/float16/rows4-.*/splits4$",
    r"^decode-mods/d128/float16/rows4-",
    r"^fwd-mma-varlen/d128/causal/bfloat16$", r"^bwd-mma-varlen/d128/causal/bfloat16/sm90/splits$",
    r"^fwd-wgmma/d128/causal/bfloat16/docmask$", r"^fwd-wgmma/d128/causal/bfloat16/docmask-sparse$",
    r"^fwd-ws/d128/causal/bfloat16/docmask-sparse$",
    r"^bwd-mma/d128/causal/bfloat16/sm90/atomic/docmask$",
    r"^fwd-mma/d128/causal/bfloat16/dropout$", r"^bwd-mma/d128/causal/bfloat16/sm(80/kernel|90/splits)/dropout$",
)


# --------------------------------------------------------------------------------------------
# Recording: what a case launches, by cuda.jit and launch stand-ins
# --------------------------------------------------------------------------------------------
class _Recorded:
    """A kernel cuda.jit was asked to compile: its Python function, signature and options."""

    def __init__(self, fn, sig, options):
        self.fn, self.sig, self.options = fn, sig, options
        self._ptx = None

    def ptx(self):
        from numba import cuda

        if self._ptx is None:
            fastmath = self.options.get("fastmath", False)
            text, _ = cuda.compile_ptx(self.fn, self.sig, cc=(9, 0), fastmath=fastmath)
            regs = self.options.get("max_registers")
            self._ptx = (f"// max_registers={regs}\n" if regs else "") + text
        return self._ptx

    def digest(self):
        regs = self.options.get("max_registers")
        return sha(self.ptx()) + (f"+maxreg{regs}" if regs else "")


# modules that need optional libraries (torch, matplotlib, transformers) or launch nothing
OPTIONAL_MODULES = ("torch", "flash_attn", "plots", "cli", "bench", "__main__")


def _install_recorders(target: str):
    """Patch cuda.jit (kernels only: device functions compile as before), the launch function wherever a
    numba_flash module holds it, and the device-capability questions, for ``target`` ("sm90" / "sm80")."""
    from numba import cuda

    os.environ["NUMBA_FLASH_CACHE"] = "0"  # kernels are recorded, never compiled for a device: no disk cache
    real_jit = cuda.jit
    launched: list = []

    def jit(*args, **kw):
        if kw.get("device") or (args and callable(args[0]) and not kw):
            return real_jit(*args, **kw)
        sig = args[0] if args else kw.pop("sig", None)

        def deco(fn):
            return _Recorded(fn, sig, {k: v for k, v in kw.items() if v is not None})
        return deco

    cuda.jit = jit
    import numba_flash.launch as nl

    real_launch = nl.launch

    def fake_launch(dispatcher, grid, block, stream, shared_bytes, *args):
        if not isinstance(dispatcher, _Recorded):
            raise TypeError(f"launched something cuda.jit did not record: {dispatcher!r}")
        launched.append(dispatcher)

    sm90 = target == "sm90"
    answers = {"current_wgmma": lambda: sm90, "current_sm90": lambda: sm90,
               "compute_capability": lambda: (9, 0) if sm90 else (8, 0)}
    import importlib
    import pkgutil

    import numba_flash

    for info in pkgutil.walk_packages(numba_flash.__path__, "numba_flash."):
        if info.name.endswith(OPTIONAL_MODULES) or ".integrations" in info.name:
            continue
        importlib.import_module(info.name)
    for name, mod in list(sys.modules.items()):
        if not name.startswith("numba_flash"):
            continue
        for attr, val in list(vars(mod).items()):
            if val is real_launch:
                setattr(mod, attr, fake_launch)
            elif attr in answers and callable(val):
                setattr(mod, attr, answers[attr])
    return launched


def _worker(args):
    names, target = args
    from numba_flash.cli import _compile_for_sm90_without_gpu

    launched = _install_recorders(target)
    all_cases = cases()
    out = {}
    with _compile_for_sm90_without_gpu():
        for name in names:
            launched.clear()
            all_cases[name][1]()
            out[name] = [k.digest() for k in launched]
    return out


SKIP = 3  # check's exit status where it cannot compare (other compiler versions, no NVVM)
CHUNK = 24  # cases per worker process (cases of one family share kernels: sorted names keep them together)


def run(names, jobs: int, progress=None) -> dict:
    """{case name: [digest of each launched kernel, in launch order]} for these cases."""
    import multiprocessing as mp

    everything = cases()
    by_target: dict = {}
    for n in names:
        by_target.setdefault(everything[n][0], []).append(n)
    work = []
    for target, ns in sorted(by_target.items()):
        per = max(1, min(CHUNK, -(-len(ns) // max(jobs, 1))))
        work += [(ns[i:i + per], target) for i in range(0, len(ns), per)]
    result: dict = {}
    if jobs <= 1 and len(work) == 1:
        result.update(_worker(work[0]))
    else:  # a fresh process per chunk: each target patches its own module state
        with mp.get_context("spawn").Pool(max(jobs, 1), maxtasksperchild=1) as pool:
            for part in pool.imap_unordered(_worker, work):
                result.update(part)
                if progress:
                    progress(result)
    return result


def versions():
    import numba
    import numba_cuda
    from numba.cuda.cudadrv import nvvm

    return [numba.__version__, numba_cuda.__version__, list(nvvm.NVVM().get_version())]


def selected(ci: bool = False, only: str | None = None) -> list:
    names = sorted(cases())
    if ci:
        names = [n for n in names if any(re.search(p, n) for p in CI_PATTERNS)]
    if only:
        names = [n for n in names if only in n]
    return names


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("record", "check", "list"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ci", action="store_true", help="only the CI subset")
    ap.add_argument("--only", default=None, help="only cases whose name contains this")
    ap.add_argument("--missing", action="store_true", help="record: only the cases the JSON lacks")
    a = ap.parse_args(argv)
    names = selected(a.ci, a.only)
    if a.missing and GOLDEN.exists():
        have = json.loads(GOLDEN.read_text())["cases"]
        names = [n for n in names if n not in have]
    if a.command == "list":
        print("\n".join(names))
        print(f"{len(names)} cases", file=sys.stderr)
        return 0
    old = json.loads(GOLDEN.read_text())["cases"] if GOLDEN.exists() and (a.ci or a.only or a.missing) else {}

    def write(got):
        GOLDEN.write_text(json.dumps({"versions": versions(), "cases": {**old, **got}}, indent=1, sort_keys=True)
                          + "\n")

    if a.command == "check":
        try:
            have, want_versions = versions(), json.loads(GOLDEN.read_text())["versions"]
        except Exception as e:  # no NVVM here (the nvidia-cuda-nvrtc wheel)
            print(f"SKIP: cannot compile PTX here: {type(e).__name__}: {e}")
            return SKIP
        if have != want_versions:
            print(f"SKIP: the hashes were recorded with numba, numba-cuda, NVVM {want_versions}; this is {have}")
            return SKIP
    got = run(names, a.jobs, progress=write if a.command == "record" else None)
    if a.command == "record":
        write(got)
        print(f"recorded {len(got)} cases, {len({d for v in got.values() for d in v})} distinct kernels")
        return 0
    want = json.loads(GOLDEN.read_text())
    bad = {n: (want["cases"].get(n), got[n]) for n in names if want["cases"].get(n) != got[n]}
    for n, (w, g) in sorted(bad.items()):
        print(f"CHANGED {n}:\n  recorded {w}\n  now      {g}")
    print(f"{len(names) - len(bad)} of {len(names)} cases unchanged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
