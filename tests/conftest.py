"""Shared test fixtures (generic only)."""

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng():
    """A NumPy Generator with a fresh seed per test; the seed is printed, so a failure shows it.

    Set NUMBA_FLASH_TEST_SEED=<int> to replay a failing run.
    """
    seed = int(os.environ.get("NUMBA_FLASH_TEST_SEED") or secrets.randbits(63))
    print(f"rng seed: {seed} (replay with NUMBA_FLASH_TEST_SEED={seed})")
    return np.random.default_rng(seed)
