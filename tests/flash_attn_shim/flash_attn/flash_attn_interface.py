"""The names the suite imports from flash_attn.flash_attn_interface."""
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """flash-attn's key-block size, used only to decode its dropout mask (S_dmask): numba_flash.flash_attn's S_dmask
    is one block as wide as the row (exp(s - the row's max)), so every row is a single block."""
    return 2**31 - 1


class _Internal:
    """flash-attn internals a few tests call directly (the CUDA extension's ops): numba_flash has none."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"numba_flash: flash-attn's internal {self.name} (its CUDA extension's op)")

    def __getattr__(self, attr):
        raise NotImplementedError(f"numba_flash: flash-attn's internal {self.name}.{attr} (its CUDA extension)")


_flash_attn_varlen_forward = _Internal("_flash_attn_varlen_forward")
flash_attn_gpu = _Internal("flash_attn_gpu")
