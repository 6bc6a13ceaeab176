"""The external KV tier on a hybrid model: every KV-cache group's blocks saved and loaded.

Two `HybridManager`s (a full and a sliding-window group) with their `GroupedKVCache`s share a
`MemoryStore`. Machine A computes a prompt four windows long, writing KV that names its layer,
position and token, and saves it from the block feed; machine B admits the same prompt and
must find every block it loads equal to A's, in every group, the window group loading only
the blocks its next query reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import Attention, HybridManager, StateConfig
from pagedkv.grouped_cache import GroupedKVCache
from pagedkv.groups import KVGroups
from pagedkv.tier import KVTier, MemoryStore, Namespace
from pagedkv.tier.codec import BlockSpec

BS, WINDOW = 4, 8
HASH_KEY = bytes(range(32))
GROUPS = KVGroups.from_layers([Attention.sliding_window(WINDOW), Attention.full()] * 2)
PROMPT = [(7 * i + 3) % 50 for i in range(40)]  # 10 blocks; a hit covers at most 9
FULL, WIN = 0, 1  # group 0 is the full-attention group


def machine() -> tuple[HybridManager, GroupedKVCache]:
    mgr = HybridManager(64, BS, GROUPS.attention, hash_key=HASH_KEY, block_feed=True)
    return mgr, GroupedKVCache(GROUPS, 64, BS, 1, 8, dtype=torch.float32)


def compute(mgr: HybridManager, cache: GroupedKVCache, seq: int) -> None:
    """Plan the sequence's uncomputed tokens and write KV naming each layer, position and token."""
    start = mgr.num_computed(seq)
    plans = mgr.plan([seq], [mgr.num_tokens(seq) - start])
    positions = torch.arange(start, mgr.num_tokens(seq), dtype=torch.float32)
    tokens = torch.tensor(mgr.token_ids(seq)[start:].tolist(), dtype=torch.float32)
    for layer in range(GROUPS.num_layers):
        k = (1000 * layer + 10 * positions + tokens / 100)[:, None, None].expand(-1, 1, 8)
        cache.write(layer, k.contiguous(), -k.contiguous(), plans)
    mgr.commit([seq])


def block_bytes(cache: GroupedKVCache, block: int) -> bytes:
    return cache.pool.read_blocks(np.array([block])).ready().numpy().tobytes()


def logical_blocks(mgr: HybridManager, seq: int, group: int) -> dict[int, int]:
    first = mgr.first_block(seq, group)
    return {first + j: int(b) for j, b in enumerate(mgr.block_table(seq, group))}


@pytest.fixture
def saved() -> tuple[MemoryStore, dict[int, dict[int, bytes]]]:
    """A's prompt saved to a store, and its blocks' bytes per group and logical block."""
    store = MemoryStore()
    mgr, cache = machine()
    with KVTier(store, "tiny", mgr, cache) as tier:
        assert tier.admit(1, PROMPT) == 0
        compute(mgr, cache, 1)
        tier.offer(mgr.take_registrations())
        assert tier.flush(5)
        assert tier.stats().saved_blocks == 2 * 10  # every full block of both groups
    kv = {
        g: {i: block_bytes(cache, b) for i, b in logical_blocks(mgr, 1, g).items()}
        for g in range(2)
    }
    return store, kv


def test_a_second_machine_loads_every_groups_blocks(
    saved: tuple[MemoryStore, dict[int, dict[int, bytes]]],
) -> None:
    store, kv = saved
    mgr, cache = machine()
    with KVTier(store, "tiny", mgr, cache) as tier:
        assert tier.admit(1, PROMPT) == 9 * BS
        stats = tier.stats()
    # The query at position 36 reads keys 29..36: the window group loaded blocks 7 and 8.
    assert stats.group_hit_blocks == (9, 2)
    assert stats.lookup_blocks == 9 + 2
    for g, loaded in ((FULL, range(9)), (WIN, range(7, 9))):
        table = logical_blocks(mgr, 1, g)
        assert [block_bytes(cache, table[i]) for i in loaded] == [kv[g][i] for i in loaded]
    # The window's earlier blocks were never filled, and the next plan releases them unused.
    zeros = block_bytes(cache, 63)
    assert all(block_bytes(cache, logical_blocks(mgr, 1, WIN)[i]) == zeros for i in range(7))
    compute(mgr, cache, 1)
    assert mgr.first_block(1, WIN) == 7
    mgr.check()


def test_a_missing_block_of_the_full_group_shortens_the_hit(
    saved: tuple[MemoryStore, dict[int, dict[int, bytes]]],
) -> None:
    store, _ = saved
    mgr, cache = machine()
    del store.data[tier_keys(mgr, cache, FULL)[5]]
    with KVTier(store, "tiny", mgr, cache) as tier:
        # Blocks 0..5 of the full group; the query at 20 reads window blocks 3 and 4.
        assert tier.admit(1, PROMPT) == 5 * BS
        assert tier.stats().group_hit_blocks == (5, 2)
    assert mgr.stats(WIN).external_hit_tokens == 5 * BS


def test_a_corrupt_window_block_shortens_the_hit_for_every_group(
    saved: tuple[MemoryStore, dict[int, dict[int, bytes]]],
) -> None:
    store, _ = saved
    mgr, cache = machine()
    key = tier_keys(mgr, cache, WIN)[8]
    store.data[key] = store.data[key][:-1] + bytes([store.data[key][-1] ^ 1])
    with KVTier(store, "tiny", mgr, cache) as tier:
        # The full group loaded all 9 blocks, the window only block 7: no hit reads just those.
        assert tier.admit(1, PROMPT) == 0
        stats = tier.stats()
    assert (stats.corrupt_blocks, stats.hit_blocks, stats.group_hit_blocks) == (1, 0, (0, 0))
    assert mgr.stats(FULL).external_failures == 9
    compute(mgr, cache, 1)  # recomputed as any prompt
    mgr.check()


def test_a_store_that_is_down_loads_nothing(
    saved: tuple[MemoryStore, dict[int, dict[int, bytes]]],
) -> None:
    store, _ = saved
    store.down = True
    mgr, cache = machine()
    with KVTier(store, "tiny", mgr, cache) as tier:
        assert tier.admit(1, PROMPT) == 0
        stats = tier.stats()
    assert (stats.errors, stats.hit_blocks) == (1, 0)  # the one lookup; nothing to load
    assert mgr.num_computed(1) == 0


def tier_keys(mgr: HybridManager, cache: GroupedKVCache, group: int) -> list[bytes]:
    tier = KVTier(MemoryStore(), "tiny", mgr, cache)
    tier.close()
    return tier.lanes[group].namespace.keys(mgr.block_hashes(PROMPT, group=group))


def test_groups_keys_never_collide_and_plain_keys_stay(
    saved: tuple[MemoryStore, dict[int, dict[int, bytes]]],
) -> None:
    store, _ = saved
    mgr, cache = machine()
    full, win = (set(tier_keys(mgr, cache, g)) for g in (FULL, WIN))
    assert len(full) == len(win) == 10 and not full & win
    assert set(store.data) == full | win
    # The group's namespace alone separates them, even under one hash.
    tier = KVTier(MemoryStore(), "tiny", mgr, cache)
    tier.close()
    prefixes = {lane.namespace.prefix for lane in tier.lanes}
    plain = Namespace("tiny", tier.lanes[0].spec, tier.lanes[0].namespace.hash_key_fingerprint)
    assert len(prefixes | {plain.prefix}) == 3
    # A plain BlockManager's keys are what they were before groups had key spaces.
    spec = BlockSpec(2, 4, 1, 8, "float32")
    assert Namespace("tiny", spec, "0123456789abcdef").digest == "9cd57ee91a67d8dc6129f37e6cf01b3d"


def test_managers_the_tier_cannot_serve_are_refused_by_name() -> None:
    _, cache = machine()
    state = HybridManager(64, BS, GROUPS.attention, block_feed=True, state=StateConfig(4))
    with pytest.raises(ValueError, match="state group"):
        KVTier(MemoryStore(), "tiny", state, cache)
    unfed = HybridManager(64, BS, GROUPS.attention)
    with pytest.raises(ValueError, match="block_feed=True"):
        KVTier(MemoryStore(), "tiny", unfed, cache)
    other = HybridManager(64, BS, [Attention.full(), Attention.sliding_window(4)], block_feed=True)
    with pytest.raises(ValueError, match="GroupedKVCache of the same groups"):
        KVTier(MemoryStore(), "tiny", other, cache)


def test_per_group_runs_are_checked_before_anything_changes() -> None:
    mgr, _ = machine()
    reused, loads = mgr.allocate_loading(1, PROMPT, 9)
    assert (reused, [len(ids) for ids in loads]) == (0, [9, 2])  # the window: blocks 7 and 8
    for bad, match in (([9], "one count per group"), ([9, 3], r"loaded\[1\]")):
        with pytest.raises(ValueError, match=match):
            mgr.confirm_loads(1, bad)
        assert mgr.num_computed(1) == 0
    mgr.confirm_loads(1, np.array([9, 2]))
    assert mgr.num_computed(1) == 9 * BS
    mgr.check()
