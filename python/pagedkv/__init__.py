"""pagedkv: a paged KV-cache memory manager for LLM servers.

The KV cache is cut into fixed-size blocks stored anywhere in a pool; each sequence's block
table maps its logical positions to physical blocks (PagedAttention). `BlockManager` is the
lock-free Rust allocator; `KVCache` and `PagedAttention` turn its plans into attention.
"""

from pagedkv._core import BlockManager, Event, OutOfBlocks, Plan, Stats

__all__ = ["BlockManager", "Event", "OutOfBlocks", "Plan", "Stats"]
__version__ = "0.1.0"
