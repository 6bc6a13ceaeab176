"""An external KV tier: computed blocks outlive the GPU pool and are shared across machines.

`KVTier` saves each computed block to a `Store` in the background and, at admission, loads the
blocks of a prompt that the store holds; for a hybrid model, every KV-cache group's blocks, each
group in a key space of its own (`GroupKey`). `RedisStore` speaks to Redis (or Valkey, or any server
of its protocol; needs `pagedkv[redis]`); `MemoryStore` is an in-process store for tests.
`KVTier` needs torch, `RedisStore` redis-py; both are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from pagedkv.tier.codec import BlockSpec, CorruptValue
from pagedkv.tier.namespace import GroupKey, Namespace
from pagedkv.tier.store import MemoryStore, Store, StoreError, StoreTimeout

if TYPE_CHECKING:
    from pagedkv.tier.offload import KVTier, TierStats
    from pagedkv.tier.redis_store import RedisStore

__all__ = [
    "BlockSpec",
    "CorruptValue",
    "GroupKey",
    "KVTier",
    "MemoryStore",
    "Namespace",
    "RedisStore",
    "Store",
    "StoreError",
    "StoreTimeout",
    "TierStats",
]


def __getattr__(name: str) -> Any:
    """Imports the torch- and redis-based parts on first use."""
    if name in ("KVTier", "TierStats"):
        from pagedkv.tier import offload

        return getattr(offload, name)
    if name == "RedisStore":
        from pagedkv.tier.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module 'pagedkv.tier' has no attribute {name!r}")
