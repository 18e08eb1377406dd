"""numba_flash.ptx intrinsics on a real GPU: the same check_* kernels as the simulator tests.

Run on a machine with a CUDA GPU (sm_80 or newer) and the simulator off:

    python -m pytest -m gpu tests/kernels/test_gpu_ptx.py
"""
import pytest

from gpu_helpers import needs_gpu
from test_ptx import (
    check_bulk_copy_ring,
    check_cp_async_groups,
    check_cp_async_zfill,
    check_ldmatrix,
    check_mma_from_registers,
    check_pack_and_ex2,
    check_pv_tile,
    check_qk_tile,
    check_shfl_xor_quad_reduce,
)

from test_tf32_forward import check_mma_tf32, check_tf32_round  # noqa: E402

from numba_flash.ptx import compute_capability  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_tf32_gpu(seed):
    check_mma_tf32(seed)


@pytest.mark.parametrize("rn", [False, True])
def test_tf32_round_gpu(rn):
    if rn and compute_capability() < (9, 0):
        pytest.skip("cvt.rn.tf32.f32 needs sm_90")
    check_tf32_round(rn=rn)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_from_registers_gpu(dtype, seed):
    check_mma_from_registers(dtype, seed)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_gpu(trans):
    check_ldmatrix(trans, warps=4)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_qk_tile_gpu(dtype):
    check_qk_tile(dtype)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_pv_tile_gpu(dtype):
    check_pv_tile(dtype)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_by_address_gpu(trans):
    check_ldmatrix(trans, warps=4, by_address=True)


def test_cp_async_zfill_gpu():
    check_cp_async_zfill()


def test_cp_async_zero_if_gpu():
    check_cp_async_zfill(zero_if=True)


def test_cp_async_groups_gpu():
    check_cp_async_groups()


def test_pack_and_ex2_gpu():
    check_pack_and_ex2()


def test_shfl_xor_quad_reduce_gpu():
    check_shfl_xor_quad_reduce()


def test_bulk_copy_ring_gpu():
    check_bulk_copy_ring(tiles=9)
