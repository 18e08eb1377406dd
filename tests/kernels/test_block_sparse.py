"""The block-sparse forward: numba_flash.forward(..., block_mask=) walks a BlockMask's key-tile lists in the
tensor-core forwards (blocks/sparsity.py), calling the mask_mod only on PARTIAL tiles.

Simulator: both kernels at tiny tiles (the forward's tile monkeypatched: 16x16 mma.sync, 64x16 wgmma) with a
BlockMask that has EMPTY, FULL and PARTIAL tiles, causal off and on, against the float64 reference. A doctored
BlockMask (a PARTIAL tile marked FULL, a visible one marked EMPTY) shows the kernel follows the lists: it equals
reference.block_sparse_attention on the same lists, not the dense masked attention. Bad inputs are refused with
errors naming the tile. The reference's walk equals dense masked attention (hypothesis). GPU cases (marked gpu)
use the shipped tiles.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
import reference
from gpu_helpers import needs_gpu
from numba_flash.mods import MaskMod, document_mask
from numba_flash.sparsity import EMPTY, FULL, PARTIAL, BlockMask, forward_tile
from numba_flash.tiles import Tile
from test_mods import _bound, _inputs

TINY = {"mma": Tile(16, 16, 64, warps=1, stages=2), "wgmma": Tile(64, 16, 64, warps=4, stages=2, flags={"wgmma"})}


@pytest.fixture
def tiny_tile(monkeypatch):
    """The forward's tile replaced by a tiny one of the asked family (returns a setter)."""
    def use(family):
        monkeypatch.setattr(numba_flash.api, "mma_config", lambda d, causal, plain=False: TINY[family])
        return TINY[family]
    return use


def _segments(B, n, cuts):
    """Sorted document ids (B, n) with documents starting at ``cuts`` (every batch row the same)."""
    return np.broadcast_to((np.arange(n)[:, None] >= np.asarray(cuts)[None, :]).sum(-1), (B, n)).astype(np.int32)


def _check(out, lse, o64, l64, o16):
    _bound(out.astype(np.float64), o64, o16.astype(np.float64), 1e-3)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(l64))
    fin = np.isfinite(l64)
    np.testing.assert_allclose(lse[fin], l64[fin], atol=1e-4 * max(1.0, np.abs(l64[fin]).max(initial=0)), rtol=0)
    assert (out[~fin] == 0).all(), "a row that sees no key must have O = 0"


def _same_doc(b, h, i, j, seg):
    return seg[b, i] == seg[b, j]


# (family, B, H, Hkv, Nq = Nk, document starts, causal): every case has EMPTY, FULL and PARTIAL tiles
CASES = [
    ("mma", 1, 2, 1, 40, (20, 26), False),  # 3 query tiles, 3 key tiles; GQA
    ("mma", 1, 1, 1, 40, (20, 26), True),
    ("wgmma", 1, 1, 1, 72, (24, 58), True),  # 2 query tiles, 5 key tiles
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-N{c[4]}{'-causal' if c[6] else ''}")
def test_block_sparse_forward_matches_the_dense_mask(case, rng, tiny_tile):
    family, B, H, Hkv, n, cuts, causal = case
    tile = tiny_tile(family)
    q, k, v, _ = _inputs(int(rng.integers(2**31)), B, H, Hkv, n, n, 64)
    seg = _segments(B, n, cuts)
    bm = numba_flash.block_mask(document_mask(seg), B, H, n, n, *forward_tile(64, causal))
    assert (bm.block_q, bm.block_k) == (tile.block_q, tile.block_k)
    classes = set(np.unique(bm.lists(causal)[1][bm.lists(causal)[1] >= 0] & 1)) | set(np.unique(bm.classes))
    assert {EMPTY, PARTIAL, FULL} <= classes
    out, lse = numba_flash.forward(q, k, v, causal=causal, block_mask=bm)  # the BlockMask carries its mask_mod
    ref = dict(mask_mod=_same_doc, mask_aux=(seg,))
    o64, l64 = reference.standard_attention(q, k, v, causal=causal, **ref)
    o16, _ = reference.standard_attention(q, k, v, causal=causal, dtype=np.float16, **ref)
    _check(out, lse, o64, l64, o16)


@pytest.mark.slow
def test_the_kernel_walks_the_lists_it_is_given(rng, tiny_tile):
    """A BlockMask whose classes lie: a PARTIAL tile marked FULL gets no mask_mod call, a visible tile marked
    EMPTY is never visited; the mma.sync kernel then equals the reference walk of the same lists."""
    tile = tiny_tile("mma")
    B, H, n = 1, 1, 40
    q, k, v, _ = _inputs(int(rng.integers(2**31)), B, H, H, n, n, 64)
    seg = _segments(B, n, (20, 26))
    m = document_mask(seg)
    bm = numba_flash.block_mask(m, B, H, n, n, tile.block_q, tile.block_k)
    classes = bm.classes.copy()
    assert classes[0, 0, 1, 1] == PARTIAL and classes[0, 0, 2, 2] == FULL
    classes[0, 0, 1, 1] = FULL  # rows 16..31 see keys 16..31 of every document
    classes[0, 0, 2, 2] = EMPTY  # rows 32..39 lose their own keys 32..39
    lying = BlockMask(classes, n, n, tile.block_q, tile.block_k, bm.mod_key, m)
    out, lse = numba_flash.forward(q, k, v, block_mask=lying)
    counts, entries = reference.host_lists(classes, n, n, tile.block_q, tile.block_k)
    walk = dict(block_q=tile.block_q, block_k=tile.block_k, mask_mod=_same_doc, mask_aux=(seg,))
    o64, l64 = reference.block_sparse_attention(q, k, v, counts, entries, **walk)
    o16, _ = reference.block_sparse_attention(q, k, v, counts, entries, dtype=np.float16, **walk)
    _check(out, lse, o64, l64, o16)
    dense, _ = reference.standard_attention(q, k, v, mask_mod=_same_doc, mask_aux=(seg,))
    assert np.abs(o64 - dense).max() > 0.1  # the lie shows


def test_host_lists_agree_with_the_reference_and_drop_tiles_outside_causal(rng):
    from numba_flash.blocks.sparsity import host_lists

    classes = rng.integers(0, 3, (2, 3, 5, 7)).astype(np.int8)
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (9, 4)), (True, (20, -1))):
        got = host_lists(classes, 37, 50, 8, 8, causal, window)
        want = reference.host_lists(classes, 37, 50, 8, 8, causal, window)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    counts, entries = host_lists(np.full((1, 1, 2, 2), FULL, np.int8), 16, 16, 8, 8, causal=True)
    assert counts.tolist() == [[[1, 2]]] and entries.tolist() == [[[[1, -1], [1, 3]]]]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 12), st.integers(1, 12), st.booleans(),
       st.integers(-1, 10), st.integers(0, 2**31 - 1))
def test_reference_walk_equals_dense_masked_attention(n_q, n_k, block_q, block_k, causal, left, seed):
    """Block-order independence under a mask: walking only the listed blocks (FULL ones without the mask_mod)
    gives the dense masked result, for any sizes, blocks, causal and window."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, n, 4)) for n in (n_q, n_k, n_k))
    seg = np.sort(rng.integers(0, 3, (1, max(n_q, n_k))), axis=1).astype(np.int32)
    window = (left, -1)
    classes, _, _ = reference.block_mask(_same_doc, 1, 2, n_q, n_k, block_q, block_k, mask_aux=(seg,))
    counts, entries = reference.host_lists(classes, n_q, n_k, block_q, block_k, causal, window)
    kw = dict(causal=causal, window_size=window, mask_mod=_same_doc, mask_aux=(seg,))
    o, lse = reference.block_sparse_attention(q, k, v, counts, entries, block_q=block_q, block_k=block_k, **kw)
    o_ref, lse_ref = reference.standard_attention(q, k, v, **kw)
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-12)


def test_bad_block_masks_are_refused(tiny_tile):
    tile = tiny_tile("mma")
    q = np.ones((1, 1, 32, 64), np.float16)
    seg = _segments(1, 32, (10,))
    m = document_mask(seg)
    wrong_tile = numba_flash.block_mask(m, 1, 1, 32, 32, 32, 32)
    with pytest.raises(ValueError, match=r"32x32 tiles; the forward's tile is 16x16.*block_q=16, block_k=16"):
        numba_flash.forward(q, q, q, block_mask=wrong_tile)
    bm = numba_flash.block_mask(m, 1, 1, 32, 32, tile.block_q, tile.block_k)
    with pytest.raises(ValueError, match="another mask_mod"):
        numba_flash.forward(q, q, q, block_mask=bm, mask_mod=lambda b, h, i, j: i >= j)
    with pytest.raises(ValueError, match=r"\(B, H, Nq, Nk\) = \(1, 1, 32, 32\)"):
        numba_flash.forward(q[:, :, :16], q, q, block_mask=bm, mask_mod=document_mask(seg[:, :16], seg))
    with pytest.raises(TypeError, match="block_mask must be a numba_flash.BlockMask"):
        numba_flash.forward(q, q, q, block_mask=bm.classes)
    with pytest.raises(NotImplementedError, match="mask_mod"):
        numba_flash.forward(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32), block_mask=bm,
                            kernel="simt")


def test_explain_counts_the_walked_tiles(tiny_tile):
    tile = tiny_tile("mma")
    q = np.ones((1, 1, 40, 64), np.float16)
    seg = _segments(1, 40, (20, 26))
    bm = numba_flash.block_mask(document_mask(seg), 1, 1, 40, 40, tile.block_q, tile.block_k)
    text = numba_flash.explain(q, q, q, causal=True, block_mask=bm)
    counts, entries = bm.lists(True)
    full = int((entries[entries >= 0] & 1).sum())
    assert f"{full} FULL" in text and f"{int(counts.sum()) - full} PARTIAL" in text and "never loaded" in text


# ---------------------------------------------------------------------------------------------------------
# GPU: the shipped tiles, document mask (+ causal), GQA, both kernels where the GPU has them
# ---------------------------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma_sync"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_document_mask_block_sparse(wgmma, causal, rng, monkeypatch):
    if not wgmma:
        monkeypatch.setattr(numba_flash.api, "_wgmma_here", lambda: False)
    elif not numba_flash.api._wgmma_here():
        pytest.skip("no warpgroup MMA on this GPU")
    B, H, Hkv, n, d = 2, 4, 2, 1000, 128
    q, k, v, _ = _inputs(int(rng.integers(2**31)), B, H, Hkv, n, n, d)
    cuts = np.sort(rng.choice(np.arange(1, n), size=(B, 5), replace=False), axis=1)
    seg = (np.arange(n)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
    bm = numba_flash.block_mask(document_mask(seg), B, H, n, n, *forward_tile(d, causal))
    assert bm.counts()["EMPTY"] and bm.counts()["FULL"]
    from numba_flash.sparsity import document_mask_blocks

    np.testing.assert_array_equal(document_mask_blocks(seg, None, H, bm.block_q, bm.block_k).classes, bm.classes)
    out, lse = numba_flash.forward(q, k, v, causal=causal, block_mask=bm)
    ref = dict(mask_mod=lambda b, h, i, j, s: s[b, i] == s[b, j], mask_aux=(seg,))
    o64, l64 = reference.standard_attention(q, k, v, causal=causal, **ref)
    o16, _ = reference.standard_attention(q, k, v, causal=causal, dtype=np.float16, **ref)
    _check(out, lse, o64, l64, o16)
    # the same call without the BlockMask: the dense walk, to rounding
    out_dense, _ = numba_flash.forward(q, k, v, causal=causal, mask_mod=document_mask(seg))
    assert np.abs(out.astype(np.float64) - out_dense.astype(np.float64)).max() <= 2e-3


# ---------------------------------------------------------------------------------------------------------
# ptxas -v of the shipped block-sparse builds (document mask, d128 bf16): spills and registers
# ---------------------------------------------------------------------------------------------------------
def _sparse_compile_source():
    from test_ptx import NO_GPU_PATCH

    return NO_GPU_PATCH + """
import json, re, subprocess, sys, tempfile
from numba import cuda
from numba_flash.blocks.mods import Mods, UserMod
from numba_flash.configs import MMA_TABLE, MMA_WGMMA
from numba_flash.kernels import mma_forward, wgmma_forward
from numba_flash.mods import same_document

out = {}
for family, kernel, table, cc, arch in (("wgmma", wgmma_forward, MMA_WGMMA, (9, 0, "a"), "sm_90a"),
                                        ("mma", mma_forward, MMA_TABLE, (9, 0), "sm_90")):
    for causal in (False, True):
        for sparse in (False, True):
            mods = Mods(mask_mod=UserMod(same_document, 4, (("int32", 2), ("int32", 2))), block_sparse=sparse)
            ptx, _ = cuda.compile_ptx(kernel.kernel_source(table[128, causal], causal, "bfloat16", False, mods),
                                      kernel.kernel_signature(mods), cc=cc)
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(ptx)
            r = subprocess.run([sys.argv[-1], f"-arch={arch}", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                               text=True)
            rep = r.stderr + r.stdout
            m = re.search(r"(\\d+) bytes stack frame, (\\d+) bytes spill stores, (\\d+) bytes spill loads", rep)
            regs = re.search(r"Used (\\d+) registers", rep)
            name = f"{family}-{'causal' if causal else 'full'}-{'sparse' if sparse else 'dense'}"
            out[name] = dict(rc=r.returncode, stack=int(m.group(1)) if m else -1,
                             spills=int(m.group(2)) + int(m.group(3)) if m else -1,
                             registers=int(regs.group(1)) if regs else -1, log=rep[-600:])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_block_sparse_builds_spill_no_more_than_the_dense_walk(tmp_path):
    """The document mask's block-sparse builds (wgmma sm_90a, mma.sync sm_90) against the same mask's dense
    builds: no spill where the dense build has none, and no more bytes where it has some."""
    from test_ptx import run_compile_child

    got = run_compile_child(_sparse_compile_source(), [], tmp_path)
    print({n: (r["registers"], r["stack"], r["spills"]) for n, r in got.items()})
    for name, r in got.items():
        assert r["rc"] == 0, (name, r["log"])
        if name.endswith("sparse"):
            dense = got[name.replace("sparse", "dense")]
            assert r["spills"] <= dense["spills"] and r["stack"] <= dense["stack"], (name, r, dense)


def test_document_mask_blocks_equal_the_classify_kernel(rng):
    from numba_flash.sparsity import document_mask_blocks

    B, H, n_q, n_k, bq, bk = 2, 2, 45, 61, 8, 16
    q_seg = np.sort(rng.integers(0, 6, (B, n_q)), axis=1).astype(np.int32)
    k_seg = np.sort(rng.integers(0, 6, (B, n_k)), axis=1).astype(np.int32)
    got = document_mask_blocks(q_seg, k_seg, H, bq, bk)
    want = numba_flash.block_mask(document_mask(q_seg, k_seg), B, H, n_q, n_k, bq, bk)
    np.testing.assert_array_equal(got.classes, want.classes)
    assert got.mod_key == want.mod_key
    with pytest.raises(ValueError, match="sorted along each batch row"):
        document_mask_blocks(q_seg[:, ::-1].copy(), k_seg)


@needs_gpu
@pytest.mark.gpu
def test_gpu_torch_attention_takes_a_block_mask(rng):
    torch = pytest.importorskip("torch")
    from numba_flash.sparsity import document_mask_blocks

    B, H, n, d = 1, 2, 700, 64
    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    seg = torch.from_numpy(np.repeat(np.arange(3, dtype=np.int32), [200, 350, 150])[None]).cuda()
    bm = document_mask_blocks(seg, None, H, *forward_tile(d, True))
    import numba_flash.torch as nft

    with torch.no_grad():
        out = nft.attention(q, k, v, causal=True, block_mask=bm)
        dense = nft.attention(q, k, v, causal=True, mask_mod=document_mask(seg))
    assert (out.float() - dense.float()).abs().max().item() <= 2e-2
    with pytest.raises(NotImplementedError, match="block_mask with gradients"):
        nft.attention(q.requires_grad_(), k, v, causal=True, block_mask=bm)


@pytest.mark.parametrize("family", ["mma", "wgmma"])
def test_block_sparse_causal_with_empty_query_tiles_and_nq_ne_nk(family, rng, tiny_tile):
    """Causal walks the shipped causal tiles take (grid_bh_x): Nq > Nk, so the first query tiles list no key
    tile (count 0: no K/V load, no barrier, O = 0, L = -inf), and Nq < Nk with a query document no key shares."""
    tile = tiny_tile(family)
    tiny_tile_bh = tile.with_(flags=tile.flags | {"grid_bh_x"})
    numba_flash.api.mma_config = lambda d, causal, plain=False: tiny_tile_bh  # (monkeypatch undoes tiny_tile's setattr)
    for n_q, n_k, q_docs, k_docs in ((150, 40, (0, 0), (0, 0)), (40, 70, (0, 5), (0, 2))):
        q, k, v, _ = _inputs(int(rng.integers(2**31)), 1, 2, 1, n_q, n_k, 64)
        q_seg = np.repeat(np.asarray(q_docs, np.int32), [n_q // 2, n_q - n_q // 2])[None]
        k_seg = np.repeat(np.asarray(k_docs, np.int32), [n_k // 3, n_k - n_k // 3])[None]
        bm = numba_flash.block_mask(document_mask(q_seg, k_seg), 1, 2, n_q, n_k, tile.block_q, tile.block_k)
        if n_q > n_k:
            assert (bm.lists(True)[0] == 0).any()
        out, lse = numba_flash.forward(q, k, v, causal=True, block_mask=bm)
        ref = dict(mask_mod=lambda b, h, i, j, a, c: a[b, i] == c[b, j], mask_aux=(q_seg, k_seg))
        o64, l64 = reference.standard_attention(q, k, v, causal=True, **ref)
        o16, _ = reference.standard_attention(q, k, v, causal=True, dtype=np.float16, **ref)
        _check(out, lse, o64, l64, o16)
