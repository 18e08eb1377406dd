"""Shared test fixtures (generic only)."""

import os
import secrets

import numpy as np
import pytest

# Where there is no GPU driver, kernels run on Numba's CUDA simulator. This must be decided
# before numba is first imported, which is why it lives here. Set NUMBA_ENABLE_CUDASIM=0 to
# force real-GPU mode (tests marked gpu still skip without a device).
if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and os.environ.get("NUMBA_FLASH_SIM_SPEEDUP", "1") == "1":
    import sim_speed  # the simulator's block manager without its busy loop (NUMBA_FLASH_SIM_SPEEDUP=0: off)

    sim_speed.install()


VARIANT_TESTS = os.environ.get("NUMBA_FLASH_VARIANT_TESTS", "0") == "1"
HEAVY_TESTS = os.environ.get("NUMBA_FLASH_HEAVY_TESTS", "0") == "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked `variant` cover kernel variants that are not shipped (sweep candidates); they
    are skipped unless NUMBA_FLASH_VARIANT_TESTS=1, to keep CI (2 cores, no GPU) under 20 minutes.
    Every shipped kernel and every public option stays covered without them."""
    skip = pytest.mark.skip(reason="not-shipped kernel variant: set NUMBA_FLASH_VARIANT_TESTS=1 to run")
    heavy = pytest.mark.skip(reason="a minute or more of NVVM or simulator time: set NUMBA_FLASH_HEAVY_TESTS=1 to run")
    for item in items:
        if "variant" in item.keywords and not VARIANT_TESTS:
            item.add_marker(skip)
        if "heavy" in item.keywords and not HEAVY_TESTS:  # a lighter case of the same kernel stays in CI
            item.add_marker(heavy)


@pytest.fixture
def rng():
    """A NumPy Generator with a fresh seed per test; the seed is printed, so a failure shows it.

    Set NUMBA_FLASH_TEST_SEED=<int> to replay a failing run.
    """
    seed = int(os.environ.get("NUMBA_FLASH_TEST_SEED") or secrets.randbits(63))
    print(f"rng seed: {seed} (replay with NUMBA_FLASH_TEST_SEED={seed})")
    return np.random.default_rng(seed)
