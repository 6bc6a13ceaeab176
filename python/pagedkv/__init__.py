"""pagedkv: a paged KV-cache memory manager for LLM servers.

The KV cache is cut into fixed-size blocks stored anywhere in a pool; each sequence's block
table maps its logical positions to physical blocks (PagedAttention). `BlockManager` is the
lock-free Rust allocator; `KVCache`, `PagedAttention` and `StateCache` (which need torch, loaded
on first use) turn its plans into attention and recurrent states.
"""

from typing import TYPE_CHECKING, Any

from pagedkv._core import (
    Attention,
    Batch,
    BlockManager,
    Event,
    HybridManager,
    OutOfBlocks,
    Plan,
    Registration,
    StateConfig,
    StateStats,
    Stats,
)

if TYPE_CHECKING:
    from pagedkv.attention import PagedAttention
    from pagedkv.kv_cache import KVCache
    from pagedkv.state_cache import StateCache

__all__ = [
    "Attention",
    "Batch",
    "BlockManager",
    "Event",
    "HybridManager",
    "KVCache",
    "OutOfBlocks",
    "PagedAttention",
    "Plan",
    "Registration",
    "StateCache",
    "StateConfig",
    "StateStats",
    "Stats",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Imports the torch-based parts on first use, so the allocator alone needs no torch."""
    if name == "KVCache":
        from pagedkv.kv_cache import KVCache

        return KVCache
    if name == "PagedAttention":
        from pagedkv.attention import PagedAttention

        return PagedAttention
    if name == "StateCache":
        from pagedkv.state_cache import StateCache

        return StateCache
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
