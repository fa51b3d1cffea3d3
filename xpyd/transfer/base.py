"""Transfer engine interface: move byte regions of a registered KV pool to a peer.

(Helper A fills in the rest of this module: states, CompletionToken, descriptor, Protocol.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous byte range inside a registered buffer (the KV pool)."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"invalid region offset={self.offset} length={self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length
