"""The fixed shape of an attention layer, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Heads, sizes, scaling and the q/KV dtype and device one `PagedAttention` is built for."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sm_scale: float
    logits_soft_cap: float | None
    dtype: torch.dtype
    device: torch.device

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA); query head `h` reads KV head `h // group_size`."""
        return self.num_qo_heads // self.num_kv_heads
