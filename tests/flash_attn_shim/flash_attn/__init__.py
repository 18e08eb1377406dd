"""``flash_attn`` resolving to numba_flash: flash-attention's own test suite imports this package unmodified.

The functions are numba_flash.flash_attn's; bert_padding, flash_attn_interface and layers.rotary hold the helpers
the suite imports besides them, written here in plain PyTorch (scripts/flash_attn_suite.py puts this directory
first on the path).
"""
from numba_flash.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
