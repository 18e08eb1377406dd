"""placeholder"""
from ..ptx import inline_device


@inline_device
def atom_offset(row, chunk, rows):
    """Word offset of 16-byte chunk ``chunk`` of row ``row`` in a tile of ``rows`` rows stored as column
    atoms for wgmma's 128-byte swizzle: atom chunk // 8 (64 columns) holds rows x 128 B, chunk j of row r
    at chunk j ^ (r % 8) of its row."""
    return (chunk >> 3) * rows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3)
