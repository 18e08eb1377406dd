"""The cost models of reference/costs.py against brute-force counts."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import causal_mask, costs, kv_blocks_to_visit


@settings(max_examples=100, deadline=None)
@given(n_q=st.integers(1, 70), n_k=st.integers(1, 70), causal=st.booleans())
def test_visible_pairs_counts_the_unmasked_entries(n_q, n_k, causal):
    mask = causal_mask(0, n_q, 0, n_k, n_q, n_k) if causal else np.zeros((n_q, n_k), bool)
    assert costs.visible_pairs(n_q, n_k, causal) == int((~mask).sum())


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), d=st.integers(1, 64), block_q=st.integers(1, 64), block_k=st.integers(1, 64), causal=st.booleans())
def test_flash_bytes_follow_the_tile_plan(n, d, block_q, block_k, causal):
    b = costs.flash_attention_hbm_bytes(n, n, d, block_q=block_q, block_k=block_k, bytes_per_element=2, causal=causal)
    keys = sum(
        min(n, kv_blocks_to_visit(qs, min(qs + block_q, n), n, n, block_k, causal) * block_k) for qs in range(0, n, block_q)
    )
    assert b["read K"] == b["read V"] == 2 * keys * d
    if not causal:
        assert keys == n * math.ceil(n / block_q)
    assert b["total"] == sum(b[k] for k in ("read Q", "read K", "read V", "write O", "write L"))
    assert b["ideal"] <= b["total"]


def test_roofline_and_grid():
    r = costs.roofline(2e12, 1e10)
    assert r["intensity_flop_per_byte"] == 200 and r["bound"] == "memory"
    assert r["t_min_s"] == pytest.approx(1e10 / 4.8e12)
    assert costs.roofline(1e13, 1e10)["bound"] == "compute"
    assert costs.q_tile_grid(1000, block_q=128, batch=2, heads=3) == 8 * 6
    plan = costs.split_kv_plan(1, 10, heads=4)
    assert plan["splits"] == 10 and plan["keys_per_split"] == 1  # never more splits than keys
    with pytest.raises(ValueError, match="n_q must be an int >= 1, got 0"):
        costs.attention_flops(0, 4, 4)
    with pytest.raises(ValueError, match="bytes_moved must be > 0"):
        costs.arithmetic_intensity(1.0, 0)
