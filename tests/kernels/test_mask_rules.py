"""The kernels' window rules (blocks/mask.py, blocks/dkdv.py) against the reference's tile plan, in plain Python.

The device functions are ordinary Python functions too (register_jitable), so the tile ranges, the edge tests
and the per-score rule the kernels run are checked here against reference.kv_block_range, q_block_range and
visible_mask on random windows, lengths and tiles: the tiles a kernel visits are exactly those with a visible
score, an edge test never skips a tile that holds a hidden score, and the per-score rule is the mask.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from numba_flash.blocks.dkdv import window_schedule
from numba_flash.blocks.mask import WINDOW_OPEN, window_bounds, window_kind, window_rules


@st.composite
def plans(draw):
    n_q, n_k = draw(st.integers(1, 90)), draw(st.integers(1, 90))
    causal = draw(st.booleans())
    left = draw(st.one_of(st.just(-1), st.integers(0, n_k - 1)))
    right = 0 if causal else draw(st.one_of(st.just(-1), st.integers(0, n_k - 1)))
    block = draw(st.sampled_from([8, 16, 32]))
    rows = draw(st.sampled_from([8, 16, 32]))
    return n_q, n_k, causal, (left, right), block, rows


@settings(max_examples=300, deadline=None)
@given(plans())
def test_window_rules_are_the_reference_tile_plan(plan):
    n_q, n_k, causal, window, block, rows = plan
    if window_kind(causal, window) != "window":
        return  # (-1, 0) and (-1, -1) take the causal and no-mask kernels
    left, right = window_bounds(causal, window)
    kv_range, needs_mask, hidden = window_rules(block, rows)
    shift = n_k - n_q
    seen = reference.visible_mask(0, n_q, 0, n_k, n_q, n_k, causal, window)
    for q0 in range(0, n_q, rows):  # a Q tile of `rows` rows (the forward's block; its warps' edge tests)
        q1 = min(q0 + rows, n_q)
        first, stop = kv_range(q0, q1, n_k, shift, left, right)
        ref_first, ref_stop = reference.kv_block_range(q0, q1, n_q, n_k, block, causal, window)
        assert set(range(first, stop)) == set(range(ref_first, ref_stop)), (q0, first, stop, ref_first, ref_stop)
        for j in range(first, stop):
            k0, k1 = j * block, (j + 1) * block
            tile = seen[q0:q1, k0:min(k1, n_k)]
            if not needs_mask(k0, k1, q0, n_k, shift, left, right):
                assert tile.all() and k1 <= n_k, f"tile {j} of rows {q0}.. holds a hidden score but is not masked"
            for i in range(q0, q1):
                for col in range(k0, k1):
                    assert hidden(i, col, n_k, shift, left, right) == (col >= n_k or not seen[i, col])


@settings(max_examples=300, deadline=None)
@given(plans())
def test_window_schedule_is_the_reference_q_block_range(plan):
    """The dK/dV kernels' Q tiles for a key block: the reference's q_block_range (as a set of tiles)."""
    n_q, n_k, causal, window, block, rows = plan
    if window_kind(causal, window) != "window":
        return
    left, right = window_bounds(causal, window)
    schedule = window_schedule(block, rows)  # BLOCK_N keys, BLOCK_M-row Q tiles
    for k0 in range(0, n_k, block):
        qt0, per_head, steps = schedule(k0, n_q, n_k, n_k - n_q, 3, left, right)
        ref_first, ref_stop = reference.q_block_range(k0, min(k0 + block, n_k), n_q, n_k, rows, causal, window)
        assert set(range(qt0, qt0 + per_head)) == set(range(ref_first, ref_stop)), (k0, qt0, per_head)
        assert steps == 3 * per_head


def test_window_bounds_open_sides():
    assert window_bounds(False, (-1, 5)) == (WINDOW_OPEN, 5)
    assert window_bounds(True, (7, -1)) == (7, 0)
    assert window_kind(False, (-1, 0)) == "causal" and window_kind(True, (-1, -1)) == "causal"
    assert window_kind(False, (-1, -1)) == "none" and window_kind(True, (3, 0)) == "window"
    assert np.array_equal(reference.visible_mask(0, 2, 0, 3, 2, 3, False, (0, 0)),
                          np.array([[False, True, False], [False, False, True]]))
