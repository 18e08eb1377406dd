"""numba_flash.block_mask (numba_flash/sparsity.py): a user mask's EMPTY / FULL / PARTIAL class per (b, h, query
tile, key tile), computed by a kernel that calls the mask_mod, against reference.block_mask; the compacted lists;
BlockMask.check's errors; explain's counts; the classify kernel's sm_90 build spills nothing.

Tiny problems on the simulator (``anywhere``: the GPU suite runs them too); one larger document mask on the GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_flash
import reference
from gpu_helpers import needs_gpu
from numba_flash.mods import MaskMod, document_mask
from numba_flash.sparsity import EMPTY, FULL, PARTIAL, BlockMask

pytestmark = pytest.mark.anywhere


def _documents(rng, B, n, n_docs):
    """Sorted segment ids (B, n) of n_docs documents of random lengths (packed batch)."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=(B, n_docs - 1), replace=True), axis=1)
    return (np.arange(n)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)


def _agrees(bm: BlockMask, fn, B, H, n_q, n_k, bq, bk, aux=()):
    classes, num, idx = reference.block_mask(fn, B, H, n_q, n_k, bq, bk, mask_aux=aux)
    np.testing.assert_array_equal(bm.classes, classes)
    np.testing.assert_array_equal(bm.kv_num_blocks, num)
    np.testing.assert_array_equal(bm.kv_indices, idx)
    full = classes == FULL
    np.testing.assert_array_equal(bm.full_kv_num_blocks, full.sum(-1))
    for at in np.ndindex(*classes.shape[:3]):
        want = np.flatnonzero(full[at])
        np.testing.assert_array_equal(bm.full_kv_indices[at][: want.size], want)
        assert (bm.full_kv_indices[at][want.size:] == -1).all()
    return classes


def test_document_mask_classes_agree_with_the_reference(rng):
    B, H, n_q, n_k, bq, bk = 2, 1, 40, 56, 16, 16  # Nq != Nk, ragged last tiles
    q_seg = _documents(rng, B, n_q, 3)
    k_seg = np.sort(np.concatenate([q_seg, q_seg[:, -1:].repeat(n_k - n_q, 1)], 1), 1)  # the last document longer
    m = document_mask(q_seg, k_seg)
    bm = numba_flash.block_mask(m, B, H, n_q, n_k, bq, bk)
    classes = _agrees(bm, m.fn, B, H, n_q, n_k, bq, bk, m.aux)
    assert bm.counts() == {n: int((classes == c).sum()) for n, c in (("EMPTY", EMPTY), ("PARTIAL", PARTIAL),
                                                                     ("FULL", FULL))}
    assert sum(bm.counts().values()) == classes.size


def test_fixed_documents_have_every_class():
    # documents [0, 20), [20, 48): 8x8 tiles inside one document are FULL, across the cut PARTIAL, apart EMPTY
    seg = np.repeat(np.int32([[0, 1]]), [20, 28], axis=1)
    m = document_mask(seg)
    bm = numba_flash.block_mask(m, 1, 1, 48, 48, 8, 8)
    _agrees(bm, m.fn, 1, 1, 48, 48, 8, 8, m.aux)
    c = bm.classes[0, 0]
    assert c[0, 0] == FULL and c[0, 5] == EMPTY and c[2, 2] == PARTIAL and c[5, 3] == FULL
    assert bm.kv_indices[0, 0, 0].tolist() == [0, 1, 2, -1, -1, -1]
    assert bm.full_kv_indices[0, 0, 0].tolist() == [0, 1, -1, -1, -1, -1]


def late_queries(b, h, q_idx, kv_idx):
    """Queries of the first 16 rows see no key; head 1 sees only even keys."""
    return q_idx >= 16 and (h == 0 or kv_idx % 2 == 0)


def test_query_tile_without_a_visible_key():
    B, H, n_q, n_k, bq, bk = 1, 2, 36, 24, 16, 8
    bm = numba_flash.block_mask(late_queries, B, H, n_q, n_k, bq, bk)  # a bare function: a MaskMod without aux
    _agrees(bm, late_queries, B, H, n_q, n_k, bq, bk)
    assert (bm.kv_num_blocks[:, :, 0] == 0).all() and (bm.kv_indices[:, :, 0] == -1).all()
    assert (bm.classes[0, 0, 1:] == FULL).all() and (bm.classes[0, 1, 1:] == PARTIAL).all()


def test_check_names_what_differs():
    seg = np.zeros((1, 32), np.int32)
    m = document_mask(seg)
    bm = numba_flash.block_mask(m, 1, 1, 32, 32, 16, 16)
    bm.check(document_mask(seg.copy()), 1, 1, 32, 32, 16, 16)  # the same code and aux types: accepted
    with pytest.raises(ValueError, match="another mask_mod"):
        bm.check(late_queries, 1, 1, 32, 32, 16, 16)
    with pytest.raises(ValueError, match=r"built for \(B, H, Nq, Nk\) = \(1, 1, 32, 32\)"):
        bm.check(m, 1, 2, 32, 32, 16, 16)
    with pytest.raises(ValueError, match="16x16 tiles; the forward's tile is 64x64"):
        bm.check(m, 1, 1, 32, 32, 64, 64)


@pytest.mark.parametrize("args, err, match", [
    ((None, 1, 1, 8, 8), TypeError, "needs a mask_mod"),
    ((late_queries, 1, 0, 8, 8), ValueError, "H must be a positive int; got 0"),
    ((late_queries, 1, 1, 8, 8.0), ValueError, "n_k must be a positive int"),
    ((MaskMod(late_queries), 1, 1, 8, 8, 16, True), ValueError, "block_k must be a positive int"),
    ((document_mask(np.zeros((1, 9), np.int32)), 1, 1, 8, 8), ValueError, r"aux\[0\] has shape \(1, 9\)"),
])
def test_bad_arguments_are_refused(args, err, match):
    with pytest.raises(err, match=match):
        numba_flash.block_mask(*args)


def test_explain_reports_the_counts(rng):
    seg = np.repeat(np.int32([[0, 1, 2]]), [40, 50, 38], axis=1)  # 128 tokens, 3 documents
    q = rng.standard_normal((1, 1, 128, 64)).astype(np.float16)
    text = numba_flash.explain(q, q, q, mask_mod=document_mask(seg))
    cfg = [line for line in text.splitlines() if line.startswith("block mask at ")]
    assert len(cfg) == 1, text
    bq, bk = (int(x) for x in cfg[0].split()[3].split("x"))
    want = reference.block_mask(document_mask(seg).fn, 1, 1, 128, 128, bq, bk, mask_aux=(seg, seg))[0]
    assert (f"{(want == EMPTY).sum()} EMPTY, {(want == FULL).sum()} FULL, {(want == PARTIAL).sum()} PARTIAL of "
            f"{want.size}") in cfg[0]


def _classify_compile_source():
    from test_ptx import NO_GPU_PATCH

    return NO_GPU_PATCH + """
import json, re, subprocess, sys, tempfile
from numba import cuda
from numba_flash.blocks.mods import UserMod
from numba_flash.mods import same_document
from numba_flash.sparsity import classify_source

fn, sig = classify_source(UserMod(same_document, 4, (("int32", 2), ("int32", 2))))
ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(ptx)
r = subprocess.run([sys.argv[-1], "-arch=sm_90", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
rep = r.stderr + r.stdout
m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
print(json.dumps(dict(rc=r.returncode, stack=int(m.group(1)) if m else -1,
                      spills=int(m.group(2)) + int(m.group(3)) if m else -1, log=rep[-600:])))
"""


@pytest.mark.slow
def test_classify_kernel_builds_for_sm90_without_spills(tmp_path):
    from test_ptx import run_compile_child

    r = run_compile_child(_classify_compile_source(), [], tmp_path)
    assert r["rc"] == 0, r["log"]
    assert (r["stack"], r["spills"]) == (0, 0), r


@pytest.mark.gpu
@needs_gpu
def test_gpu_document_mask_at_n_4096(rng):
    """8 documents in 4096 tokens at the forward's 128x128 tiles (the benchmark's shape, smaller for the
    reference's dense mask), 2 heads."""
    seg = _documents(rng, 1, 4096, 8)
    m = document_mask(seg)
    bm = numba_flash.block_mask(m, 1, 2, 4096, 4096, 128, 128)
    _agrees(bm, m.fn, 1, 2, 4096, 4096, 128, 128, m.aux)
    assert bm.counts()["EMPTY"] > 0 and bm.counts()["FULL"] > 0
