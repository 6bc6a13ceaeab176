"""The fixed shape of an attention layer, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv._core import Attention
from pagedkv.kv_cache import FP8_DTYPES
from pagedkv.kv_layout import KVLayout


@dataclass(frozen=True)
class AttentionSpec:
    """Heads, sizes, scaling, KV layout, and the q and KV dtypes and device one
    `PagedAttention` is built for.

    With the MLA layout, `num_kv_heads` is 1 and `head_dim` is the latent width: `q` is
    `[tokens, num_qo_heads, head_dim + rope_dim]` and the output `[tokens, num_qo_heads,
    head_dim]`.

    `attention` is the attention every plan will carry (None: whatever each plan carries) and
    `sinks` whether `run` takes a learned sink logit per query head.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sm_scale: float
    logits_soft_cap: float | None
    dtype: torch.dtype
    device: torch.device
    kv_dtype: torch.dtype
    layout: KVLayout
    attention: Attention | None = None
    sinks: bool = False

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA); query head `h` reads KV head `h // group_size`."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def qk_dim(self) -> int:
        """Width of the q . k dot product: `head_dim`, plus the rope part for MLA."""
        return self.head_dim + self.layout.rope_dim

    @property
    def kv_fp8(self) -> bool:
        """True when the cache stores float8 with scales."""
        return self.kv_dtype in FP8_DTYPES

    def describe(self) -> str:
        """The layout, dtypes, attention and sinks in words, as errors and `backend_reason`
        name them."""
        kv = str(self.kv_dtype).removeprefix("torch.")
        q = str(self.dtype).removeprefix("torch.")
        what = "" if self.attention is None else f", {self.attention!r}"
        sinks = ", with attention sinks" if self.sinks else ""
        return f"{self.layout.name} layout with {kv} KV and {q} queries{what}{sinks}"
