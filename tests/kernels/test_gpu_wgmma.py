"""numba_flash.ptx.wgmma on an sm_90 GPU: the simulator test's check (tests/kernels/test_wgmma.py) on the hardware.

    python -m pytest -m gpu tests/kernels/test_gpu_wgmma.py
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


@pytest.mark.parametrize(
    "B,H,Hkv,n_q,n_k,d,causal,dtype,splits,defer",
    [
        (1, 2, 1, 70, 150, 64, True, "float16", None, True),
        (1, 1, 1, 80, 40, 128, True, "bfloat16", None, True),
        (1, 1, 1, 66, 300, 100, False, "float16", 2, True),
        (2, 4, 2, 1000, 1100, 128, True, "float16", 3, True),     # GQA 2, many steps, both buffers, 3 splits of 9
        (1, 4, 4, 700, 700, 128, False, "bfloat16", None, True),
        (2, 2, 1, 513, 900, 64, False, "float16", 4, True),
        (2, 4, 2, 1000, 1100, 128, True, "float16", 3, False),    # DEFER_DQ off
        (1, 4, 4, 700, 700, 64, False, "bfloat16", None, False),
    ],
)
def test_wgmma_dkdv_gpu(B, H, Hkv, n_q, n_k, d, causal, dtype, splits, defer):
    if compute_capability()[0] != 9:
        pytest.skip("wgmma is sm_90a only")
    from test_wgmma import test_wgmma_dkdv_sim

    test_wgmma_dkdv_sim.__wrapped__(B, H, Hkv, n_q, n_k, d, causal, dtype, splits, defer)


def test_wgmma_splits_repeat_bitwise_gpu():
    """The deterministic splits through the wgmma dkdv: the same bits over 20 runs."""
    if compute_capability()[0] != 9:
        pytest.skip("wgmma is sm_90a only")
    import numpy as np

    from test_mma_backward import problem, run_backward
    from test_wgmma import wgmma_config

    _, stored = problem(5, 1, 4, 2, 600, 700, 128, True, "float16")
    first = run_backward(stored, 128, True, "float16", wgmma_config(128), splits=3)
    for _ in range(19):
        again = run_backward(stored, 128, True, "float16", wgmma_config(128), splits=3)
        for a, b in zip(first, again):
            assert np.array_equal(a, b)
