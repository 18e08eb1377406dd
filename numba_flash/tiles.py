"""The one tile/config type every kernel family takes.

A ``Tile`` says how one kernel specialisation cuts the problem: ``block_q`` query rows and ``block_k`` keys
per tile (in the dK/dV kernels the block owns block_k keys and streams block_q-row query tiles), the
compiled ``head_dim``, ``warps`` per block, ``stages`` (buffers of the streamed tiles in flight) and the
``flags`` a shipped config turns on (names from the kernel's builder, e.g. "smem_epilogue"). The tables
in configs.py hold Tiles only; each family's ``build(tile, ...)`` and ``smem_bytes(tile)`` read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Tile:
    block_q: int
    block_k: int
    head_dim: int = 0  # 0: the family's compiled head dim for the caller's d
    warps: int = 0  # 0: the family's rule (e.g. one warp per 16 query rows)
    stages: int = 1
    flags: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        object.__setattr__(self, "flags", frozenset(self.flags))
        for name in ("block_q", "block_k", "head_dim", "warps", "stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Tile.{name}={value!r}: a non-negative int")
        bad = [f for f in self.flags if not (isinstance(f, str) and f.isidentifier() and f.islower())]
        if bad:
            raise ValueError(f"Tile.flags {sorted(map(repr, bad))}: lower-case identifiers")

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def with_(self, **changes) -> "Tile":
        """This tile with some fields changed (flags: an iterable of names)."""
        return replace(self, **changes)

    def __str__(self) -> str:
        parts = [f"{self.block_q}x{self.block_k}"]
        if self.head_dim:
            parts.append(f"d{self.head_dim}")
        if self.warps:
            parts.append(f"{self.warps} warps")
        if self.stages != 1:
            parts.append(f"{self.stages} stages")
        parts += sorted(self.flags)
        return " ".join(parts)
