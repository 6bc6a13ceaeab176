"""The KV-cache groups an external tier serves: one `Lane` per group, each with its own cache
view, block spec, key space and attention (a plain `BlockManager` is one full lane, keyed as it
always was).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv._core import Attention, BlockManager, HybridManager
from pagedkv.grouped_cache import GroupedKVCache
from pagedkv.kv_cache import KVCache
from pagedkv.tier.codec import BlockSpec
from pagedkv.tier.namespace import GroupKey, Namespace


@dataclass(frozen=True)
class Lane:
    """One KV-cache group's blocks (the only one of a plain manager): the cache its pages are
    read and written through, their spec and key space, and the group's attention."""

    cache: KVCache
    spec: BlockSpec
    namespace: Namespace
    attention: Attention

    def reads_from(self, hit: int, end: int, block_size: int) -> int:
        """The first block past a hit of `hit` blocks that a query at block `end` reads."""
        return max(hit, self.attention.first_key(end * block_size) // block_size)


def block_spec(cache: KVCache) -> BlockSpec:
    """The `BlockSpec` of one block of `cache`: its shape, dtype, layout and scales."""
    dtype = str(cache.dtype).removeprefix("torch.")
    scales = tuple(s for layer in range(cache.num_layers) if (s := cache.scales(layer)))
    return BlockSpec(
        cache.num_layers,
        cache.block_size,
        cache.num_kv_heads,
        cache.head_dim,
        dtype,
        cache.layout,
        cache.rope_dim,
        scales,
    )


def cache_block_size(cache: KVCache | GroupedKVCache) -> int:
    """Token slots per block of a cache or a grouped cache's pool."""
    return cache.pool.block_size if isinstance(cache, GroupedKVCache) else cache.block_size


def lanes_of(
    model_id: str,
    manager: BlockManager | HybridManager,
    cache: KVCache | GroupedKVCache,
    fingerprint: str,
) -> list[Lane]:
    """One lane per KV-cache group (one for a plain manager, keyed as it always was)."""
    if not isinstance(manager, HybridManager):
        if not isinstance(cache, KVCache):
            raise ValueError("a BlockManager's tier takes a KVCache")
        spec = block_spec(cache)
        return [Lane(cache, spec, Namespace(model_id, spec, fingerprint), manager.attention)]
    if manager.has_state:
        raise ValueError(
            "an external KV tier does not serve a HybridManager with a state group: recurrent "
            "states are not stored externally"
        )
    if not manager.block_feed:
        raise ValueError(
            "an external KV tier needs a HybridManager built with block_feed=True (it saves "
            "every group's blocks from its registrations)"
        )
    if not isinstance(cache, GroupedKVCache) or list(cache.groups.attention) != manager.groups:
        raise ValueError("a HybridManager's tier takes the GroupedKVCache of the same groups")
    lanes = []
    for g, attention in enumerate(manager.groups):
        group_cache = cache.group_cache(g)
        spec = block_spec(group_cache)
        key = GroupKey(g, repr(attention), cache.groups.layers[g])
        lanes.append(
            Lane(group_cache, spec, Namespace(model_id, spec, fingerprint, key), attention)
        )
    return lanes
