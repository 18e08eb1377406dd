"""numba_flash.ptx.wgmma on an sm_90 GPU: the simulator test's check (tests/test_wgmma.py) on the hardware.

    python -m pytest -m gpu tests/test_gpu_wgmma.py
"""
import pytest

from gpu_helpers import needs_gpu
from test_wgmma import check_wgmma_forms

from numba_flash.ptx import compute_capability  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_wgmma_forms_gpu(dtype, seed):
    if compute_capability()[0] != 9:
        pytest.skip("wgmma is sm_90a only")
    check_wgmma_forms(dtype, seed)
