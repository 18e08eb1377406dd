"""Adapters to other libraries (each imports its library on import; numba_flash itself does not)."""
