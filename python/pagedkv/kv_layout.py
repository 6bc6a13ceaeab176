"""How a page of one layer holds its tokens' KV, and how many bytes a token takes.

Three layouts, each a FlashInfer paged-KV format:

- `NHD`: `[2, block_size, num_kv_heads, head_dim]` per page (K at index 0, V at 1).
- `HND`: `[2, num_kv_heads, block_size, head_dim]`, heads before tokens.
- `MLA`: `[block_size, head_dim + rope_dim]`: one compressed latent (`head_dim` wide, which
  serves as K and V) and its rope part per token, no per-head K and V (DeepSeek V2/V3, Kimi K2).

This module needs no torch, so the simulator sizes memory with it too.

>>> KVLayout("MLA", 1, 512, 64).bytes_per_token(num_layers=61, dtype_bytes=2)
70272
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Layout = Literal["NHD", "HND", "MLA"]
LAYOUTS: tuple[Layout, ...] = ("NHD", "HND", "MLA")


@dataclass(frozen=True)
class KVLayout:
    """A layout with the per-token sizes it stores; `rope_dim` is MLA's rope part (else 0)."""

    name: Layout
    num_kv_heads: int
    head_dim: int
    rope_dim: int = 0

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.name!r}")
        if self.num_kv_heads < 1 or self.head_dim < 1 or self.rope_dim < 0:
            raise ValueError(
                "num_kv_heads and head_dim must be >= 1 and rope_dim >= 0, got "
                f"{self.num_kv_heads}, {self.head_dim}, {self.rope_dim}"
            )
        if self.name == "MLA" and self.num_kv_heads != 1:
            raise ValueError(f"the MLA layout has one latent per token, not {self.num_kv_heads}")
        if self.name != "MLA" and self.rope_dim:
            raise ValueError(f"rope_dim is the MLA latent's rope part; {self.name} has none")

    @property
    def is_mla(self) -> bool:
        """True for the compressed-latent layout (K only; V is the latent's first `head_dim`)."""
        return self.name == "MLA"

    def page_shape(self, block_size: int) -> tuple[int, ...]:
        """The shape of one page (block) of one layer."""
        if self.name == "NHD":
            return (2, block_size, self.num_kv_heads, self.head_dim)
        if self.name == "HND":
            return (2, self.num_kv_heads, block_size, self.head_dim)
        return (block_size, self.head_dim + self.rope_dim)

    @property
    def elements_per_token(self) -> int:
        """Elements one token stores in one layer."""
        return math.prod(self.page_shape(1))

    def bytes_per_token(self, num_layers: int, dtype_bytes: int) -> int:
        """Bytes one token stores over `num_layers` layers at `dtype_bytes` per element."""
        return num_layers * self.elements_per_token * dtype_bytes
