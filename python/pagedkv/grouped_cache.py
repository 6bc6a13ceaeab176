"""KV tensors of a hybrid model: every KV-cache group's layers in one pool of pages.

A `HybridManager` hands each group its blocks out of one pool of pages of equal bytes; a page of
group `g` holds `block_size` tokens of `g`'s `layers_per_group` layers (see
`pagedkv.groups.KVGroups`). The pool is therefore one `KVCache` of `layers_per_group` layers:
model layer `L` lives in pool layer `slot_of(L)`, in the blocks of group `group_of(L)`. The
groups' blocks are disjoint, so copying or swapping a block moves every slot of it (a padding
slot holds nothing). Each group's plan drives its own layers: `write` and `slot_tensors` take
the step's plans in group order, `copy_blocks` and the swaps take the per-group pairs the
manager returns.

A float8 pool takes one K and one V scale per model layer; layers that share a slot (in other
groups' blocks) may differ, so each group reads and writes through `group_cache(g)`, the pool's
tensors with the scales of `g`'s layers.

>>> from pagedkv import Attention, HybridManager
>>> from pagedkv.groups import KVGroups
>>> groups = KVGroups.from_layers([Attention.sliding_window(8), Attention.full()] * 2)
>>> cache = GroupedKVCache(groups, 32, 4, 1, 8, dtype=torch.float32)
>>> mgr = HybridManager(32, 4, groups.attention)
>>> _ = mgr.allocate(1, list(range(6)))
>>> plans = mgr.plan([1], [6])
>>> cache.write(2, torch.ones(6, 1, 8), torch.ones(6, 1, 8), plans)  # layer 2: group 1, slot 1
>>> cache.locate(2), cache.pool.num_layers
((1, 1), 2)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.groups import KVGroups
from pagedkv.kv_cache import KVCache, SlotIndex, Slots, Transfer, _check_scales
from pagedkv.kv_layout import Layout


class GroupedKVCache:
    """The K/V of every group of `groups` in one pool of `num_blocks` pages, on one device.

    `num_blocks` and `block_size` are the `HybridManager`'s; the other arguments are
    `KVCache`'s, but a float8 pool's `scales` are `[groups.num_layers, 2]`, one `(k, v)` per
    model layer (ones by default). `pool` holds the bytes; `PagedAttention.run` reads a layer
    through its group's cache: `attns[g].run(q, cache.group_cache(g), cache.slot_of(layer))`.
    """

    def __init__(
        self,
        groups: KVGroups,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        *,
        layout: Layout = "NHD",
        rope_dim: int = 0,
        scales: npt.ArrayLike | None = None,
        pin_memory: bool = False,
    ) -> None:
        if not isinstance(groups, KVGroups):
            raise ValueError(f"groups must be a KVGroups, got {type(groups).__name__}")
        self.groups = groups
        # Per model layer; the message names the model's layers, not the pool's.
        self._scales = _check_scales(scales, groups.num_layers, dtype)
        self.pool = KVCache(
            groups.layers_per_group,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            layout=layout,
            rope_dim=rope_dim,
            pin_memory=pin_memory,
        )
        self._group_caches = tuple(self._cache_of(g) for g in range(groups.num_groups))

    def _cache_of(self, group: int) -> KVCache:
        """The pool with `group`'s scales per slot (a padding slot's are ones); the pool itself
        when it has no scales."""
        if not self._scales:
            return self.pool
        view = copy.copy(self.pool)  # shares the pool's layer tensors
        slot_scales = [
            self._scales[layer] if layer >= 0 else (1.0, 1.0) for layer in self.groups.layers[group]
        ]
        view._scales = _check_scales(slot_scales, self.pool.num_layers, self.pool.dtype)
        return view

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return self.groups.num_groups

    def locate(self, layer: int) -> tuple[int, int]:
        """`(group, slot)` of model layer `layer`: its group's plans address it in pool layer
        `slot`."""
        return self.groups.group_of(layer), self.groups.slot_of(layer)

    def slot_of(self, layer: int) -> int:
        """The pool layer holding model layer `layer` (in its group's blocks)."""
        return self.groups.slot_of(layer)

    def group_cache(self, group: int) -> KVCache:
        """Group `group`'s layers as a `KVCache` for `PagedAttention.run` (pool layer = slot):
        the pool's tensors with that group's float8 scales."""
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group: {group} out of range for {self.num_groups} groups")
        return self._group_caches[group]

    def scales(self, layer: int) -> tuple[float, float] | None:
        """`(k_scale, v_scale)` of model layer `layer` (MLA: latent and rope), or None unless
        float8."""
        group, slot = self.locate(layer)
        return self._group_caches[group].scales(slot)

    def layer(self, layer: int) -> torch.Tensor:
        """The pool tensor of model layer `layer` (shared with the other groups' layers in the
        same slot, each group in its own blocks)."""
        return self.pool.layer(self.slot_of(layer))

    def slot_tensors(self, plans: Sequence[Slots | SlotIndex]) -> list[SlotIndex]:
        """Every group's slots prepared for `write`, once per step (see `KVCache.slot_tensor`)."""
        return [self.pool.slot_tensor(s) for s in self._per_group("plans", plans)]

    def write(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        plans: Sequence[Slots | SlotIndex],
    ) -> None:
        """Store model layer `layer`'s new `k` and `v` at the slots of its group's plan;
        `plans` holds one plan (or `slot_tensors` entry) per group, in group order."""
        group, slot = self.locate(layer)
        self._group_caches[group].write(slot, k, v, self._per_group("plans", plans)[group])

    def write_latent(
        self,
        layer: int,
        latent: torch.Tensor,
        rope: torch.Tensor,
        plans: Sequence[Slots | SlotIndex],
    ) -> None:
        """`write` for an MLA pool (see `KVCache.write_latent`)."""
        group, slot = self.locate(layer)
        cache = self._group_caches[group]
        cache.write_latent(slot, latent, rope, self._per_group("plans", plans)[group])

    def copy_blocks(self, pairs: Sequence[npt.NDArray[Any]]) -> None:
        """Apply each group's copy-on-write pairs (`[plan.copies for plan in plans]`)."""
        for group_pairs in self._per_group("pairs", pairs):
            self.pool.copy_blocks(group_pairs)

    def swap_out(self, cpu_cache: GroupedKVCache, pairs: Sequence[npt.NDArray[Any]]) -> Transfer:
        """Copy every group's blocks to `cpu_cache` by the per-group `(gpu, cpu)` pairs of
        `HybridManager.swap_out` (see `KVCache.swap_out`)."""
        return self.pool.swap_out(self._peer(cpu_cache), self._joined(pairs))

    def swap_in(self, cpu_cache: GroupedKVCache, pairs: Sequence[npt.NDArray[Any]]) -> Transfer:
        """Copy every group's blocks back from `cpu_cache` by the per-group `(cpu, gpu)` pairs
        of `HybridManager.swap_in` (see `KVCache.swap_in`)."""
        return self.pool.swap_in(self._peer(cpu_cache), self._joined(pairs))

    def _per_group(self, name: str, items: Sequence[Any]) -> Sequence[Any]:
        """`items`, checked to hold one entry per group (a plan of the group's attention)."""
        if isinstance(items, (np.ndarray, torch.Tensor)) or not isinstance(items, Sequence):
            raise ValueError(f"{name}: expected one entry per group, got {type(items).__name__}")
        if len(items) != self.num_groups:
            raise ValueError(
                f"{name}: expected {self.num_groups} (one per group), got {len(items)}"
            )
        for g, item in enumerate(items):
            attention = getattr(item, "attention", None)
            if attention is not None and attention != self.groups.attention[g]:
                raise ValueError(
                    f"{name}[{g}] is a plan of {attention!r}, group {g} is "
                    f"{self.groups.attention[g]!r}: pass the plans in group order"
                )
        return items

    def _joined(self, pairs: Sequence[npt.NDArray[Any]]) -> npt.NDArray[np.int64]:
        """The groups' pairs as one array (their blocks are disjoint)."""
        arrays = []
        for g, group_pairs in enumerate(self._per_group("pairs", pairs)):
            arr = np.asarray(group_pairs)
            if arr.size == 0:
                arr = arr.reshape(0, 2)
            if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"pairs[{g}] must be an [n, 2] integer array, got {arr.shape}")
            arrays.append(arr.astype(np.int64))
        return np.concatenate(arrays)

    def _peer(self, cpu_cache: GroupedKVCache) -> KVCache:
        if not isinstance(cpu_cache, GroupedKVCache) or cpu_cache.groups != self.groups:
            raise ValueError("cpu_cache must be a GroupedKVCache of the same groups")
        if cpu_cache._scales != self._scales:
            raise ValueError(f"cpu_cache has other scales: {cpu_cache._scales} vs {self._scales}")
        return cpu_cache.pool
