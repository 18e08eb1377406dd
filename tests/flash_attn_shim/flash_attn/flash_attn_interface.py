"""The names the suite imports from flash_attn.flash_attn_interface."""
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """flash-attn's key-block size, used only to decode its dropout mask (S_dmask); numba_flash has no dropout,
    so a call that would need it has raised NotImplementedError before."""
    return 128 if head_dim <= 64 else 64
