"""Unit tests of pagedkv.BlockManager: every method, every error path, values checked by hand.

Block ids are predictable (rust/core/SEMANTICS.md): the free list is a LIFO stack that starts
with block 0 on top, and cached blocks are evicted least recently released first. Only computed
KV is shared: a prompt's blocks become prefix hits once a plan covering them is committed
(`prefill` below does what an engine does after `allocate`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from api_fields import PLAN_ARRAYS, STATS_FIELDS

from pagedkv import BlockManager, OutOfBlocks

KEY = bytes(range(32))


def stats_of(mgr: BlockManager) -> dict[str, Any]:
    """Every Stats field as a dict, for equality checks."""
    stats = mgr.stats()
    return {name: getattr(stats, name) for name in STATS_FIELDS}


def snapshot(mgr: BlockManager, seq_ids: list[int]) -> dict[str, Any]:
    """Everything observable about `mgr` and the given sequences."""
    state: dict[str, Any] = {"stats": stats_of(mgr), "len": len(mgr)}
    for seq_id in seq_ids:
        if seq_id not in mgr:
            state[str(seq_id)] = None
            continue
        try:
            table: list[int] | str = mgr.block_table(seq_id).tolist()
        except ValueError:
            table = "swapped out"
        state[str(seq_id)] = (
            mgr.num_tokens(seq_id),
            mgr.num_computed(seq_id),
            mgr.token_ids(seq_id).tolist(),
            table,
        )
    return state


def assert_fails_unchanged(
    mgr: BlockManager, seq_ids: list[int], exc: type[BaseException], op: Callable[[], object]
) -> BaseException:
    """Run `op`, expect `exc`, and check that nothing observable changed."""
    before = snapshot(mgr, seq_ids)
    with pytest.raises(exc) as info:
        op()
    assert snapshot(mgr, seq_ids) == before
    mgr.check()
    return info.value


def tables(mgr: BlockManager, *seq_ids: int) -> list[list[int]]:
    return [mgr.block_table(s).tolist() for s in seq_ids]


def prefill(mgr: BlockManager, *seq_ids: int) -> Any:
    """Plan every token without computed KV of each sequence and commit that forward pass."""
    ids = list(seq_ids)
    plan = mgr.plan(ids, [mgr.num_tokens(s) - mgr.num_computed(s) for s in ids])
    mgr.commit(ids)
    for seq_id in ids:
        assert mgr.num_computed(seq_id) == mgr.num_tokens(seq_id)
    return plan


def alloc(mgr: BlockManager, seq_id: int, tokens: Any, **kwargs: Any) -> int:
    """Allocate and prefill, as an engine admitting a prompt does; returns the reused tokens."""
    reused = mgr.allocate(seq_id, tokens, **kwargs)
    prefill(mgr, seq_id)
    return reused


# ---- construction ---------------------------------------------------------------------------


def test_new_manager_is_empty() -> None:
    mgr = BlockManager(10, 4, num_cpu_blocks=3)
    assert (mgr.num_blocks, mgr.block_size, mgr.num_cpu_blocks) == (10, 4, 3)
    assert stats_of(mgr) == {
        "num_blocks": 10,
        "num_free": 10,
        "num_cached": 0,
        "num_held": 0,
        "usage": 0.0,
        "token_usage": 0.0,
        "stored_tokens": 0,
        "prefix_query_tokens": 0,
        "prefix_hit_tokens": 0,
        "prefix_allowed_tokens": 0,
        "evictions": 0,
        "computed_tokens": 0,
        "pending_tokens": 0,
        "external_query_tokens": 0,
        "external_hit_tokens": 0,
        "external_failures": 0,
    }
    assert mgr.auto_commit and not BlockManager(4, auto_commit=False).auto_commit
    assert len(mgr) == 0
    assert 0 not in mgr
    assert BlockManager(5).block_size == 16
    mgr.check()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0},
        {"num_blocks": 4, "block_size": 0},
        {"num_blocks": 4, "hash_key": b"short"},
        {"num_blocks": 4, "watermark": -0.5},
        {"num_blocks": 4, "watermark": 1.5},
        {"num_blocks": 4, "watermark": 1.0},
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


# ---- allocate -------------------------------------------------------------------------------


def test_allocate_takes_blocks_in_order() -> None:
    mgr = BlockManager(8, 4)
    assert mgr.allocate(1, list(range(10))) == 0
    assert mgr.allocate(2, [100, 101]) == 0
    assert tables(mgr, 1, 2) == [[0, 1, 2], [3]]
    assert mgr.num_tokens(1) == 10
    assert mgr.token_ids(1).tolist() == list(range(10))
    assert 1 in mgr and 2 in mgr and 3 not in mgr
    assert len(mgr) == 2
    for table in (mgr.block_table(1), mgr.block_table(2)):
        assert table.dtype == np.int32
    mgr.check()


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t,
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # strided view
    ],
    ids=["list", "int32", "int64", "uint32", "strided-int64"],
)
def test_token_id_containers_are_equivalent(make: Callable[[list[int]], Any]) -> None:
    tokens = [5, 6, 7, 8, 9, 10, 2**31 - 1]
    mgr = BlockManager(8, 2)
    assert alloc(mgr, 1, tokens) == 0
    # The same prompt in another container hashes the same: three full blocks are reused.
    assert mgr.allocate(2, make(tokens)) == 6
    assert mgr.token_ids(2).tolist() == tokens
    mgr.append(2, make([3, 4]))
    prefill(mgr, 2)
    mgr.commit(make([1, 2]), make([7, 9]))
    mgr.step(np.array([1, 2], dtype=np.int64), make([11, 12]))
    assert mgr.token_ids(2).tolist() == [*tokens, 3, 4, 12]
    assert mgr.token_ids(1).tolist() == [*tokens, 11]
    mgr.check()


def test_largest_token_id() -> None:
    mgr = BlockManager(8, 2)
    big = 2**32 - 1
    alloc(mgr, 1, [big, 0, big])
    assert mgr.allocate(2, np.array([big, 0, big], dtype=np.uint32)) == 2
    assert mgr.allocate(3, np.array([big, 0, big], dtype=np.int64)) == 2
    mgr.append(1, [big])
    assert mgr.token_ids(1).tolist() == [big, 0, big, big]
    mgr.check()


def test_allocate_duplicate_id() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3])
    assert_fails_unchanged(mgr, [1], ValueError, lambda: mgr.allocate(1, [4, 5]))


@pytest.mark.parametrize(
    "bad",
    [
        [],
        np.array([], dtype=np.int64),
        [1, -1],
        [2**32],
        np.array([3, -2], dtype=np.int64),
        np.array([2**32], dtype=np.int64),
        np.array([1.0, 2.0]),
        [1.5, 2.0],
        np.array([[1, 2], [3, 4]], dtype=np.int64),
    ],
    ids=[
        "empty-list",
        "empty-array",
        "negative",
        "too-large",
        "negative-array",
        "too-large-array",
        "float-array",
        "float-list",
        "2d-array",
    ],
)
def test_bad_token_ids(bad: Any) -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3])
    assert_fails_unchanged(mgr, [1, 2], ValueError, lambda: mgr.allocate(2, bad))
    assert_fails_unchanged(mgr, [1, 2], ValueError, lambda: mgr.append(1, bad))
    if len(bad) == 0:
        assert mgr.can_allocate(bad) is False  # nothing to admit, but not an error
    else:
        with pytest.raises(ValueError):
            mgr.can_allocate(bad)


def test_allocate_out_of_blocks_changes_nothing() -> None:
    def setup() -> BlockManager:
        mgr = BlockManager(8, 2, hash_key=KEY, enable_events=True)
        alloc(mgr, 1, [1, 2, 3, 4, 5])  # blocks 0, 1, 2
        alloc(mgr, 2, [9, 9, 9, 9])  # blocks 3, 4
        mgr.free(2)  # 4 then 3 become cached
        mgr.take_events()
        return mgr

    mgr, twin = setup(), setup()
    err = assert_fails_unchanged(mgr, [1, 2, 3], OutOfBlocks, lambda: mgr.allocate(3, [7] * 17))
    assert "GPU" in str(err)
    assert isinstance(err, RuntimeError)
    # Free stack, cached queue, prefix map and event log are as if the call never happened.
    for m in (mgr, twin):
        assert m.allocate(3, [9, 9, 9, 9, 8]) == 4
        m.allocate(4, [6] * 3)
    assert tables(mgr, 1, 3, 4) == tables(twin, 1, 3, 4)
    assert stats_of(mgr) == stats_of(twin)
    assert [(e.kind, e.seq_no, e.block_hash) for e in mgr.take_events()] == [
        (e.kind, e.seq_no, e.block_hash) for e in twin.take_events()
    ]
    mgr.check()


def test_cached_prefix_hits_count_against_capacity() -> None:
    mgr = BlockManager(3, 2)
    alloc(mgr, 1, [1, 2, 3, 4, 5])
    mgr.free(1)  # 2 free, then 1 and 0 cached
    assert stats_of(mgr)["num_cached"] == 2
    # Reviving both cached hits and one fresh block uses all three blocks.
    assert mgr.allocate(2, [1, 2, 3, 4, 9]) == 4
    assert tables(mgr, 2) == [[0, 1, 2]]
    assert stats_of(mgr)["num_free"] == 0 and stats_of(mgr)["num_cached"] == 0
    mgr.check()


# ---- prefix cache ---------------------------------------------------------------------------


def test_prefix_hit_never_covers_last_token() -> None:
    mgr = BlockManager(8, 4, enable_events=True)
    prompt = list(range(1, 9))  # exactly two full blocks
    assert alloc(mgr, 1, prompt) == 0
    assert alloc(mgr, 2, prompt) == 4  # the second block would hold the last token
    assert tables(mgr, 1, 2) == [[0, 1], [0, 2]]
    # Block 2 has the same hash as block 1, which already owns it: block 2 stays unhashed.
    assert [(e.kind, e.block_id) for e in mgr.take_events()] == [("stored", 0), ("stored", 1)]
    assert mgr.allocate(3, [*prompt, 9]) == 8
    assert tables(mgr, 3) == [[0, 1, 3]]
    stats = mgr.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (8 + 8 + 9, 4 + 8)
    for seq_id in (1, 2, 3):
        mgr.free(seq_id)
    stats = mgr.stats()
    assert (stats.num_cached, stats.num_free, stats.num_held) == (2, 6, 0)
    mgr.check()


def test_lookup_stops_at_first_miss() -> None:
    mgr = BlockManager(16, 2)
    alloc(mgr, 1, [1, 2, 3, 4, 5, 6, 7])
    assert mgr.allocate(2, [1, 2, 0, 0, 5, 6, 7]) == 2  # block 1 differs; block 2 hash differs
    assert mgr.allocate(3, [0, 2, 3, 4, 5]) == 0
    mgr.check()


def test_salt_separates_tenants() -> None:
    mgr = BlockManager(32, 2)
    prompt = [1, 2, 3, 4, 5]
    assert alloc(mgr, 1, prompt, salt=b"tenant-a") == 0
    assert alloc(mgr, 2, prompt, salt=b"tenant-b") == 0
    assert alloc(mgr, 3, prompt) == 0
    assert mgr.allocate(4, prompt, salt=b"tenant-a") == 4
    assert mgr.allocate(5, prompt, salt=b"tenant-b") == 4
    assert mgr.allocate(6, prompt) == 4
    assert alloc(mgr, 7, prompt, salt="text-salt") == 0
    assert mgr.allocate(8, prompt, salt="text-salt") == 4
    assert mgr.can_allocate(prompt, salt=b"tenant-a")
    mgr.check()


def test_hash_key_makes_managers_agree() -> None:
    def stored_hashes(key: bytes | None) -> list[tuple[int | None, int | None]]:
        mgr = BlockManager(16, 4, hash_key=key, enable_events=True)
        alloc(mgr, 1, list(range(13)), salt=b"s")
        alloc(mgr, 2, list(range(9)))
        events = mgr.take_events()
        assert [e.kind for e in events] == ["stored"] * 5
        hashes = [e.block_hash for e in events]
        assert mgr.block_hashes(list(range(13)), salt=b"s") == hashes[:3]
        assert mgr.block_hashes(list(range(11))) == hashes[3:]
        return [(e.block_hash, e.parent_hash) for e in events]

    first = stored_hashes(KEY)
    assert stored_hashes(KEY) == first
    assert stored_hashes(bytes(32)) != first
    assert stored_hashes(None) != stored_hashes(None)  # random keys
    for block_hash, _ in first:
        assert block_hash is not None and 0 <= block_hash < 2**128


def test_prefix_caching_disabled() -> None:
    mgr = BlockManager(8, 2, enable_prefix_caching=False, enable_events=True)
    prompt = [1, 2, 3, 4, 5]
    assert alloc(mgr, 1, prompt) == 0
    assert alloc(mgr, 2, prompt) == 0
    assert tables(mgr, 1, 2) == [[0, 1, 2], [3, 4, 5]]
    assert mgr.cached_prefix_blocks(prompt) == 0
    assert mgr.hash_key_fingerprint is None
    with pytest.raises(ValueError):
        mgr.block_hashes(prompt)
    mgr.free(1)
    mgr.free(2)
    stats = mgr.stats()
    assert (stats.num_cached, stats.num_free, stats.prefix_hit_tokens) == (0, 8, 0)
    assert mgr.take_events() == []
    mgr.check()


def test_eviction_takes_least_recently_released_tail_first() -> None:
    mgr = BlockManager(4, 2, enable_events=True)
    alloc(mgr, 1, [1, 2, 3])  # blocks 0 (full, hashed), 1
    alloc(mgr, 2, [4, 5, 6])  # blocks 2 (full, hashed), 3
    mgr.free(1)  # 1 -> free stack, 0 -> cached
    mgr.free(2)  # 3 -> free stack, 2 -> cached
    stored = {e.token_ids[0]: e.block_hash for e in mgr.take_events()}
    mgr.allocate(3, [9] * 7)  # free stack (LIFO) 3, 1, then cached queue 0, 2
    assert tables(mgr, 3) == [[3, 1, 0, 2]]
    events = mgr.take_events()
    removed = [(e.block_hash, e.block_id, e.medium) for e in events if e.kind == "removed"]
    assert removed == [(stored[1], 0, "GPU"), (stored[4], 2, "GPU")]
    assert mgr.stats().evictions == 2
    mgr.check()


def test_tail_is_evicted_before_head() -> None:
    mgr = BlockManager(4, 2, enable_events=True)
    alloc(mgr, 1, [1, 2, 3, 4])
    mgr.free(1)  # block 1 then block 0 join the cached queue
    hashes = {tuple(e.token_ids): e.block_hash for e in mgr.take_events()}
    alloc(mgr, 2, [7, 7, 7])  # free blocks 2, 3
    mgr.allocate(3, [8])  # evicts block 1 (the tail of sequence 1)
    assert tables(mgr, 2, 3) == [[2, 3], [1]]
    assert [e.block_hash for e in mgr.take_events() if e.kind == "removed"] == [hashes[(3, 4)]]
    mgr.free(2)  # 3 -> free stack, 2 -> cached
    # The head survived, so the prefix still hits.
    assert mgr.allocate(4, [1, 2, 5]) == 2
    assert tables(mgr, 4) == [[0, 3]]
    mgr.check()


def test_prefix_hit_takes_block_out_of_queue() -> None:
    mgr = BlockManager(4, 2)
    alloc(mgr, 1, [1, 2, 3])
    alloc(mgr, 2, [4, 5, 6])
    mgr.free(1)
    mgr.free(2)  # cached queue: 0, 2; free stack: 3, 1
    assert mgr.allocate(3, [4, 5, 0]) == 2
    assert tables(mgr, 3) == [[2, 3]]
    mgr.allocate(4, [8] * 4)  # free 1, then evict 0
    assert tables(mgr, 4) == [[1, 0]]
    assert mgr.stats().evictions == 1
    mgr.check()


def test_reset_prefix_cache() -> None:
    mgr = BlockManager(6, 2, enable_events=True)
    alloc(mgr, 1, [1, 2, 3, 4, 5])  # 0, 1, 2
    alloc(mgr, 2, [9, 9, 9])  # 3 (hashed), 4
    mgr.free(2)  # 4 free, 3 cached
    mgr.take_events()
    mgr.reset_prefix_cache()
    events = mgr.take_events()
    assert [(e.kind, e.block_hash) for e in events] == [("cleared", None)]
    stats = mgr.stats()
    assert (stats.num_free, stats.num_cached, stats.num_held) == (3, 0, 3)
    # Held blocks lost their hashes: no hit, and the new sequence registers its own blocks.
    assert alloc(mgr, 3, [1, 2, 3, 4, 5]) == 0
    assert tables(mgr, 3) == [[3, 4, 5]]
    assert [(e.kind, e.block_id) for e in mgr.take_events()] == [("stored", 3), ("stored", 4)]
    mgr.free(1)  # its unhashed blocks go to the free list, not the cached queue
    stats = mgr.stats()
    assert (stats.num_free, stats.num_cached) == (3, 0)
    mgr.free(3)
    stats = mgr.stats()
    assert (stats.num_free, stats.num_cached) == (4, 2)
    mgr.check()


def test_can_allocate_keeps_watermark() -> None:
    mgr = BlockManager(100, 4, watermark=0.1)  # keeps 10 blocks in reserve
    assert mgr.can_allocate([1] * 360)  # 90 blocks
    assert not mgr.can_allocate([1] * 361)  # 91 blocks
    prompt = list(range(200))  # 50 full blocks
    alloc(mgr, 1, prompt)
    # 50 available; held prefix hits cost nothing.
    assert mgr.can_allocate(prompt + [7] * 157)  # 90 blocks, 50 hits, needs 40
    assert not mgr.can_allocate(prompt + [7] * 161)  # 91 blocks, needs 41
    assert not mgr.can_allocate([7] * 200)
    before = stats_of(mgr)
    assert mgr.can_allocate(prompt)
    assert stats_of(mgr) == before  # read-only: no prefix counters move
    # allocate itself ignores the watermark.
    assert mgr.allocate(2, [5] * 200) == 0
    assert mgr.stats().num_free == 0
    mgr.check()


def test_default_watermark_is_one_percent() -> None:
    mgr = BlockManager(100, 1)
    assert mgr.can_allocate([1] * 99)
    assert not mgr.can_allocate([1] * 100)


# ---- append, fork, copy-on-write ------------------------------------------------------------


def test_append_allocates_when_last_block_full() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3])
    mgr.append(1, [4])
    assert tables(mgr, 1) == [[0]]
    mgr.append(1, [5, 6, 7, 8, 9, 10])
    assert tables(mgr, 1) == [[0, 1, 2]]
    assert mgr.num_tokens(1) == 10
    assert mgr.num_computed(1) == 0  # appended tokens are pending until a plan computes them
    mgr.check()


def test_copy_on_write_after_fork() -> None:
    mgr = BlockManager(8, 4)
    alloc(mgr, 1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (partial)
    mgr.fork(1, 2)
    assert tables(mgr, 1, 2) == [[0, 1], [0, 1]]
    assert mgr.token_ids(2).tolist() == [1, 2, 3, 4, 5, 6]
    assert mgr.num_computed(2) == 6
    assert mgr.stats().num_held == 2
    mgr.append(2, [7])
    assert tables(mgr, 1, 2) == [[0, 1], [0, 2]]
    copies = mgr.plan([2], [1]).copies  # the batch that writes token 7 applies the copy
    assert copies.dtype == np.int32
    assert copies.tolist() == [[1, 2]]
    mgr.commit([2])  # the copy ran: sequence 2 lets go of block 1
    mgr.append(1, [8])  # block 1 is no longer shared: no copy
    assert tables(mgr, 1) == [[0, 1]]
    empty = mgr.plan([1], [1]).copies
    assert empty.shape == (0, 2) and empty.dtype == np.int32
    mgr.check()


def test_copy_source_is_held_until_its_plan_is_committed() -> None:
    mgr = BlockManager(4, 4)
    alloc(mgr, 1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1
    mgr.fork(1, 2)
    mgr.append(2, [7])  # copy 1 -> 2
    # Until the copy is committed, block 1 is a copy source: the parent copies too.
    mgr.append(1, [8])  # copy 1 -> 3
    assert tables(mgr, 1, 2) == [[0, 3], [0, 2]]
    plan = mgr.plan([2, 1], [1, 1])
    assert plan.copies.tolist() == [[1, 2], [1, 3]]
    mgr.free(1)  # block 1 stays held by sequence 2's copy
    stats = mgr.stats()
    assert (stats.num_held, stats.num_free) == (3, 1)
    mgr.allocate(3, [9])  # gets block 3, never the copy source
    assert tables(mgr, 3) == [[3]]
    mgr.check()
    mgr.commit([2])
    assert mgr.stats().num_free == 1  # block 1 (partial, never registered) is free again
    mgr.check()


def test_fork_of_full_block_needs_no_copy() -> None:
    mgr = BlockManager(8, 4)
    alloc(mgr, 1, [1, 2, 3, 4])
    mgr.fork(1, 2)
    mgr.append(2, [5])
    mgr.append(1, [6])
    assert tables(mgr, 1, 2) == [[0, 2], [0, 1]]
    assert mgr.plan([1, 2], [1, 1]).copies.shape == (0, 2)
    mgr.check()


def test_step_copy_on_write_in_batch_order() -> None:
    mgr = BlockManager(8, 4)
    alloc(mgr, 1, [1, 2, 3, 4, 5, 6])
    mgr.fork(1, 2)
    mgr.fork(1, 3)
    # Every holder copies: a copy keeps its source held until the step is committed.
    plan = mgr.step([2, 1, 3], [7, 8, 9])
    assert tables(mgr, 1, 2, 3) == [[0, 3], [0, 2], [0, 4]]
    assert plan.copies.tolist() == [[1, 2], [1, 3], [1, 4]]
    assert mgr.stats().num_held == 5
    mgr.commit([1, 2, 3])
    assert mgr.stats().num_held == 4  # block 1 is free once every copy ran
    mgr.check()


def test_step_checks_capacity_once_for_the_batch() -> None:
    # SEMANTICS.md: each sequence's need is computed before the batch runs and the sum is
    # checked once: two forks sharing a partial block both need a copy-on-write.
    mgr = BlockManager(3, 4)
    alloc(mgr, 1, [1, 2, 3, 4, 5, 6])
    mgr.fork(1, 2)
    assert_fails_unchanged(mgr, [1, 2], OutOfBlocks, lambda: mgr.step([1, 2], [7, 8]))
    mgr.step([1], [7])  # alone it needs one block, and one is available
    assert tables(mgr, 1, 2) == [[0, 2], [0, 1]]
    mgr.check()


def test_fork_errors() -> None:
    mgr = BlockManager(8, 4, num_cpu_blocks=4)
    alloc(mgr, 1, [1, 2, 3])
    alloc(mgr, 2, [4, 5, 6])
    ids = [1, 2, 3, 4, 5]
    assert_fails_unchanged(mgr, ids, KeyError, lambda: mgr.fork(9, 3))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.fork(1, 2))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.fork(1, 1))
    mgr.swap_out([2])
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.fork(2, 4))
    mgr.free(2)
    # A parent whose KV is not all computed: a child would share blocks with pending tokens.
    mgr.allocate(5, [7, 8, 9])
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.fork(5, 4))
    mgr.append(1, [4])
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.fork(1, 4))


def test_fork_auto_commits_the_parent() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    mgr.plan([1], [5])  # its forward pass runs before the next call names the sequence
    mgr.fork(1, 2)
    assert mgr.num_computed(1) == mgr.num_computed(2) == 5
    no_auto = BlockManager(8, 4, auto_commit=False)
    no_auto.allocate(1, [1, 2, 3, 4, 5])
    no_auto.plan([1], [5])
    assert_fails_unchanged(no_auto, [1, 2], ValueError, lambda: no_auto.fork(1, 2))
    no_auto.commit([1])
    no_auto.fork(1, 2)
    assert no_auto.num_computed(2) == 5
    no_auto.check()


def test_append_copy_on_write_out_of_blocks() -> None:
    mgr = BlockManager(2, 2)
    alloc(mgr, 1, [1, 2, 3])
    mgr.fork(1, 2)
    err = assert_fails_unchanged(mgr, [1, 2], OutOfBlocks, lambda: mgr.append(2, [4]))
    assert "GPU" in str(err)
    assert mgr.plan([2], [1]).copies.shape == (0, 2)
    assert_fails_unchanged(mgr, [1, 2], OutOfBlocks, lambda: mgr.append(1, [4, 5, 6]))


# ---- the KV lifecycle: plans, commits, gaps -------------------------------------------------


def test_nothing_is_shared_before_it_is_computed() -> None:
    mgr = BlockManager(16, 4, enable_events=True)
    prompt = list(range(13))  # three full blocks and one token
    assert mgr.allocate(1, prompt) == 0
    assert (mgr.num_tokens(1), mgr.num_computed(1)) == (13, 0)
    stats = mgr.stats()
    assert (stats.computed_tokens, stats.pending_tokens) == (0, 13)
    assert mgr.take_events() == []
    assert mgr.cached_prefix_blocks(prompt) == 0
    plan = mgr.plan([1], [13])
    assert plan.positions.tolist() == list(range(13))
    assert mgr.cached_prefix_blocks(prompt) == 0  # planned is not computed
    assert mgr.allocate(2, prompt) == 0
    mgr.commit([1])
    assert mgr.num_computed(1) == 13
    events = mgr.take_events()
    assert [(e.kind, e.block_id, e.medium) for e in events] == [
        ("stored", b, "GPU") for b in (0, 1, 2)
    ]
    assert mgr.cached_prefix_blocks(prompt) == 3
    assert mgr.allocate(3, prompt) == 12
    stats = mgr.stats()
    assert (stats.computed_tokens, stats.pending_tokens) == (13 + 12, 13 + 1)
    mgr.check()


def test_commit_counts_register_what_is_computed() -> None:
    mgr = BlockManager(16, 4, enable_events=True, auto_commit=False)
    mgr.allocate(1, list(range(6)))  # chunked prefill: the first 6 tokens of 10
    mgr.plan([1], [6])
    mgr.commit([1], [5])
    assert mgr.num_computed(1) == 5
    assert [e.block_id for e in mgr.take_events()] == [0]
    mgr.commit([1], np.array([2], dtype=np.int64))  # below computed: changes nothing
    assert mgr.num_computed(1) == 5
    assert_fails_unchanged(mgr, [1], ValueError, lambda: mgr.commit([1], [7]))  # beyond planned
    mgr.commit([1])  # up to the plan's end
    assert mgr.num_computed(1) == 6
    mgr.append(1, list(range(6, 10)))  # the next chunk
    mgr.plan([1], [4])
    mgr.plan([1], [3])  # planning again (a recompute) is fine
    assert mgr.num_computed(1) == 6  # no auto-commit
    mgr.commit([1], [10])
    assert [e.block_id for e in mgr.take_events()] == [1]
    mgr.check()


def test_commit_errors_change_nothing() -> None:
    mgr = BlockManager(16, 4, num_cpu_blocks=4)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    mgr.allocate(2, [6, 7])
    mgr.plan([1], [5])
    mgr.allocate(3, [8])
    mgr.swap_out([3])
    ids = [1, 2, 3]
    for exc, op in [
        (KeyError, lambda: mgr.commit([1, 9])),
        (ValueError, lambda: mgr.commit([1, 1])),
        (ValueError, lambda: mgr.commit([1, 3])),  # swapped out
        (ValueError, lambda: mgr.commit([1, 2], [5])),  # lengths differ
        (ValueError, lambda: mgr.commit([1, 2], [5, 1])),  # 2 has nothing planned
        (ValueError, lambda: mgr.commit([1], [6])),
        (ValueError, lambda: mgr.commit([1], [-1])),
        (ValueError, lambda: mgr.commit([1], [1.5])),
    ]:
        assert_fails_unchanged(mgr, ids, exc, op)
    assert mgr.num_computed(1) == 0
    with pytest.raises(KeyError):
        mgr.num_computed(9)


def test_gaps_are_rejected() -> None:
    mgr = BlockManager(16, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5, 6])
    ids = [1]
    # A decode step right after allocate would skip the prompt: it needs a prefill plan first.
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step([1], [7]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.plan([1], [5]))
    mgr.plan([1], [6])
    mgr.append(1, [7, 8])
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step([1], [9]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.plan([1], [1]))
    plan = mgr.plan([1], [2])
    assert plan.positions.tolist() == [6, 7]
    mgr.step([1], [9])
    assert mgr.num_computed(1) == 8  # the step committed the previous plan
    mgr.check()


def test_auto_commit_stands_when_the_call_fails() -> None:
    mgr = BlockManager(2, 2, enable_events=True)
    mgr.allocate(1, [1, 2, 3])  # both blocks
    mgr.plan([1], [3])
    with pytest.raises(OutOfBlocks):
        mgr.append(1, [4, 5])  # commits the plan, then finds no block
    assert mgr.num_computed(1) == 3
    assert [e.kind for e in mgr.take_events()] == ["stored"]
    mgr.check()


def test_without_auto_commit_nothing_is_computed_implicitly() -> None:
    mgr = BlockManager(16, 4, num_cpu_blocks=8, auto_commit=False)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    mgr.plan([1], [5])
    mgr.step([1], [6])  # plans ahead of the previous forward pass
    assert (mgr.num_computed(1), mgr.stats().pending_tokens) == (0, 6)
    assert_fails_unchanged(mgr, [1], ValueError, lambda: mgr.swap_out([1]))  # plan in flight
    mgr.commit([1], [5])
    assert_fails_unchanged(mgr, [1], ValueError, lambda: mgr.swap_out([1]))
    mgr.commit([1])
    assert mgr.num_computed(1) == 6
    assert mgr.swap_out([1]).shape == (2, 2)
    mgr.check()


# ---- external loads -------------------------------------------------------------------------


def test_allocate_loading_and_confirm_loads() -> None:
    mgr = BlockManager(16, 4, hash_key=KEY, enable_events=True)
    prompt = list(range(17))  # four full blocks (all hittable) and one token
    alloc(mgr, 9, prompt[:6])  # computed: block 0 is a GPU hit for the prompt
    mgr.take_events()
    reused, loads = mgr.allocate_loading(1, prompt, 3)
    assert reused == 4 and loads.dtype == np.int32
    assert loads.tolist() == [2, 3]  # logical blocks 1 and 2, to fill from the store
    assert mgr.block_table(1).tolist() == [0, 2, 3, 4, 5]
    stats = mgr.stats()
    assert (stats.external_query_tokens, stats.external_hit_tokens) == (12, 0)
    ids = [1, 2]
    for op in [
        lambda: mgr.plan([1], [13]),
        lambda: mgr.step([1], [5]),
        lambda: mgr.append(1, [5]),
        lambda: mgr.fork(1, 2),
        lambda: mgr.confirm_loads(1, 3),  # only two blocks were handed out
        lambda: mgr.confirm_loads(9, 0),  # nothing to confirm
        lambda: mgr.allocate_loading(1, prompt, 3),  # duplicate
        lambda: mgr.allocate_loading(2, [], 3),
    ]:
        assert_fails_unchanged(mgr, ids, ValueError, op)
    assert_fails_unchanged(mgr, ids, KeyError, lambda: mgr.confirm_loads(2, 0))
    assert mgr.cached_prefix_blocks(prompt) == 1
    mgr.confirm_loads(1, 1)  # block 2 arrived, block 3 did not
    assert mgr.num_computed(1) == 8
    assert [(e.kind, e.block_id) for e in mgr.take_events()] == [("stored", 2)]
    assert mgr.cached_prefix_blocks(prompt) == 2
    stats = mgr.stats()
    assert (stats.external_hit_tokens, stats.external_failures) == (4, 1)
    assert stats.prefix_hit_tokens == 4 + 4
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.confirm_loads(1, 0))
    plan = prefill(mgr, 1)  # the failed block is recomputed with the rest
    assert plan.positions.tolist() == list(range(8, 17))
    assert mgr.cached_prefix_blocks(prompt) == 4
    mgr.check()


def test_allocate_loading_limits() -> None:
    mgr = BlockManager(16, 4)
    # More loadable blocks than hittable ones (the last token is never loaded).
    reused, loads = mgr.allocate_loading(1, list(range(8)), 5)
    assert (reused, loads.tolist()) == (0, [0])
    reused, loads = mgr.allocate_loading(2, list(range(3)), 5)
    assert (reused, loads.tolist()) == (0, [])  # no full block: nothing to load, not waiting
    mgr.plan([2], [3])
    reused, loads = mgr.allocate_loading(3, list(range(20)), 0)
    assert loads.tolist() == []
    stats = mgr.stats()
    assert stats.external_query_tokens == 4 + 0 + 16
    mgr.free(1)  # freed while waiting: its load counts as failed
    assert mgr.stats().external_failures == 1
    off = BlockManager(16, 4, enable_prefix_caching=False)
    assert off.allocate_loading(1, list(range(20)), 4)[1].tolist() == []
    off.plan([1], [20])
    mgr.check()
    off.check()


# ---- free -----------------------------------------------------------------------------------


def test_free_and_double_free() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    mgr.free(1)
    assert 1 not in mgr and len(mgr) == 0
    assert mgr.stats().num_held == 0
    assert mgr.stats().pending_tokens == 0
    assert_fails_unchanged(mgr, [1], KeyError, lambda: mgr.free(1))


def test_free_never_registers_uncommitted_kv() -> None:
    mgr = BlockManager(8, 4, enable_events=True)
    mgr.allocate(1, list(range(9)))
    mgr.plan([1], [9])
    mgr.free(1)  # its forward pass never ran (or failed)
    assert mgr.take_events() == []
    assert (mgr.stats().num_free, mgr.allocate(2, list(range(9)))) == (8, 0)


def test_unknown_sequence_is_key_error() -> None:
    mgr = BlockManager(8, 4, num_cpu_blocks=4)
    alloc(mgr, 1, [1, 2, 3])
    ops: list[Callable[[], object]] = [
        lambda: mgr.append(7, [1]),
        lambda: mgr.step([1, 7], [1, 2]),
        lambda: mgr.plan([7], [1]),
        lambda: mgr.commit([7]),
        lambda: mgr.commit([7], [0]),
        lambda: mgr.fork(7, 8),
        lambda: mgr.free(7),
        lambda: mgr.block_table(7),
        lambda: mgr.num_tokens(7),
        lambda: mgr.num_computed(7),
        lambda: mgr.token_ids(7),
        lambda: mgr.swap_out([1, 7]),
        lambda: mgr.swap_in([7]),
        lambda: mgr.confirm_swap_out([7]),
        lambda: mgr.confirm_swap_in([7]),
        lambda: mgr.confirm_loads(7, 0),
    ]
    for op in ops:
        err = assert_fails_unchanged(mgr, [1, 7], KeyError, op)
        assert "7" in str(err)


# ---- step and plan --------------------------------------------------------------------------


def assert_plan(plan: Any, **expected: Any) -> None:
    for name in ("copies", "state_slots", "state_copies", "state_resets", "state_saves"):
        expected.setdefault(name, [])
    for name in PLAN_ARRAYS:
        arr = getattr(plan, name)
        assert arr.dtype == np.int32, name
        assert arr.tolist() == expected[name], name
    assert plan.batch_size == expected["batch_size"]
    assert plan.num_query_tokens == expected["num_query_tokens"]


def test_plan_by_hand() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1
    mgr.allocate(2, [7, 8, 9])  # block 2
    plan = mgr.plan([1, 2], [6, 3])  # prefill
    assert plan.block_size == 4
    assert_plan(
        plan,
        kv_indptr=[0, 2, 3],
        kv_indices=[0, 1, 2],
        kv_last_page_len=[2, 3],
        qo_indptr=[0, 6, 9],
        positions=[0, 1, 2, 3, 4, 5, 0, 1, 2],
        slot_mapping=[0, 1, 2, 3, 4, 5, 8, 9, 10],
        block_tables=[[0, 1], [2, -1]],
        batch_size=2,
        num_query_tokens=9,
    )
    plan = mgr.plan([1, 2], [2, 3])  # recomputes planned tokens: no gap
    assert_plan(
        plan,
        kv_indptr=[0, 2, 3],
        kv_indices=[0, 1, 2],
        kv_last_page_len=[2, 3],
        qo_indptr=[0, 2, 5],
        positions=[4, 5, 0, 1, 2],
        slot_mapping=[4, 5, 8, 9, 10],
        block_tables=[[0, 1], [2, -1]],
        batch_size=2,
        num_query_tokens=5,
    )
    plan = mgr.plan(np.array([2, 1], dtype=np.int64), np.array([1, 6], dtype=np.int32))
    assert_plan(
        plan,
        kv_indptr=[0, 1, 3],
        kv_indices=[2, 0, 1],
        kv_last_page_len=[3, 2],
        qo_indptr=[0, 1, 7],
        positions=[2, 0, 1, 2, 3, 4, 5],
        slot_mapping=[10, 0, 1, 2, 3, 4, 5],
        block_tables=[[2, -1], [0, 1]],
        batch_size=2,
        num_query_tokens=7,
    )
    mgr.check()


def test_step_by_hand() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5, 6])  # blocks 0, 1
    mgr.allocate(2, [7, 8, 9])  # block 2
    mgr.plan([1, 2], [6, 3])
    plan = mgr.step([1, 2], [10, 11])
    assert_plan(
        plan,
        kv_indptr=[0, 2, 3],
        kv_indices=[0, 1, 2],
        kv_last_page_len=[3, 4],
        qo_indptr=[0, 1, 2],
        positions=[6, 3],
        slot_mapping=[6, 11],
        block_tables=[[0, 1], [2, -1]],
        batch_size=2,
        num_query_tokens=2,
    )
    plan = mgr.step(np.array([1, 2], dtype=np.int64), np.array([12, 13], dtype=np.int32))
    assert_plan(
        plan,
        kv_indptr=[0, 2, 4],
        kv_indices=[0, 1, 2, 3],
        kv_last_page_len=[4, 1],
        qo_indptr=[0, 1, 2],
        positions=[7, 4],
        slot_mapping=[7, 12],
        block_tables=[[0, 1], [2, 3]],
        batch_size=2,
        num_query_tokens=2,
    )
    assert mgr.token_ids(1).tolist() == [1, 2, 3, 4, 5, 6, 10, 12]
    assert mgr.token_ids(2).tolist() == [7, 8, 9, 11, 13]
    assert [mgr.num_computed(s) for s in (1, 2)] == [7, 4]  # the last step is not committed
    mgr.check()


def test_step_errors_change_nothing() -> None:
    mgr = BlockManager(8, 4)
    alloc(mgr, 1, [1, 2, 3])
    alloc(mgr, 2, [4, 5])
    ids = [1, 2]
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step([1, 1], [5, 6]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step([1, 2], [5]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step([1, 2], [5, -6]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step([1, 2], np.array([5.0, 6.0])))
    two_d = np.array([[1], [2]], dtype=np.int64)
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.step(two_d, [5, 6]))
    assert_fails_unchanged(mgr, ids, KeyError, lambda: mgr.step([1, 2, 3], [5, 6, 7]))


def test_step_out_of_blocks_is_atomic() -> None:
    mgr = BlockManager(4, 2)
    for seq_id in range(4):
        alloc(mgr, seq_id, [seq_id, seq_id])  # every block full and held
    assert_fails_unchanged(mgr, [0, 1, 2, 3], OutOfBlocks, lambda: mgr.step([0, 1], [7, 7]))
    assert mgr.num_tokens(0) == 2


@pytest.mark.parametrize(
    "query_lens",
    [[0, 1], [1, 4], [-1, 1], [1], [1, 1, 1], np.array([1.0, 1.0])],
    ids=["zero", "too-long", "negative", "short", "long", "float"],
)
def test_plan_bad_query_lens(query_lens: Any) -> None:
    mgr = BlockManager(8, 4)
    alloc(mgr, 1, [1, 2, 3])
    alloc(mgr, 2, [4, 5, 6])
    assert_fails_unchanged(mgr, [1, 2], ValueError, lambda: mgr.plan([1, 2], query_lens))


def test_plan_repeated_sequence() -> None:
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3])
    assert_fails_unchanged(mgr, [1], ValueError, lambda: mgr.plan([1, 1], [3, 3]))


def test_plan_arrays_are_zero_copy() -> None:
    mgr = BlockManager(16, 4)
    alloc(mgr, 1, list(range(9)))
    mgr.fork(1, 3)
    alloc(mgr, 2, [1, 2])
    plan = mgr.step(np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int32))
    assert plan.copies.shape == (1, 2)
    # The padded block tables are derived on access (batch x longest can be huge), never kept.
    assert not np.shares_memory(plan.block_tables, plan.block_tables)
    for name in (name for name in PLAN_ARRAYS if name != "block_tables"):
        arr = getattr(plan, name)
        again = getattr(plan, name)
        assert arr.dtype == np.int32 and arr.flags.c_contiguous, name
        # A view of a buffer owned elsewhere (the Rust plan), not a fresh numpy allocation...
        assert not arr.flags.owndata and arr.base is not None, name
        # ...and the same buffer on every access, while both arrays are alive.
        assert arr.ctypes.data == again.ctypes.data, name
        if arr.size:  # torch gives an empty tensor no data pointer (the state arrays here)
            tensor = torch.from_numpy(arr)
            assert tensor.data_ptr() == arr.ctypes.data, name
            assert np.shares_memory(tensor.numpy(), arr), name
    mgr.check()


def test_old_plan_survives_next_step() -> None:
    mgr = BlockManager(16, 4)
    alloc(mgr, 1, list(range(7)))
    plan = mgr.step([1], [7])
    saved = {name: getattr(plan, name).copy() for name in PLAN_ARRAYS}
    for token in range(8, 20):
        mgr.step([1], [token])
    for name in PLAN_ARRAYS:
        assert np.array_equal(getattr(plan, name), saved[name]), name


# ---- swap -----------------------------------------------------------------------------------


def test_swap_round_trip() -> None:
    mgr = BlockManager(8, 4, num_cpu_blocks=4)
    prompt = list(range(10))
    alloc(mgr, 1, prompt)  # 0, 1, 2
    mgr.fork(1, 2)
    pairs = mgr.swap_out([1, 2])
    assert pairs.dtype == np.int32
    assert pairs.tolist() == [[0, 0], [1, 1], [2, 2]]  # shared blocks copied once
    stats = mgr.stats()
    assert (stats.num_free, stats.num_cached, stats.num_held) == (5, 0, 3)  # until confirmed
    mgr.confirm_swap_out([1, 2])
    stats = mgr.stats()
    # Block 2 (partial, unhashed) is free again; the full blocks 1 and 0 are cached.
    assert (stats.num_free, stats.num_cached, stats.num_held) == (6, 2, 0)
    assert mgr.num_tokens(1) == 10 and mgr.token_ids(2).tolist() == prompt
    assert mgr.num_computed(2) == 10
    assert 1 in mgr and len(mgr) == 2
    pairs = mgr.swap_in([1, 2])
    assert pairs.tolist() == [[0, 2], [1, 3], [2, 4]]
    assert tables(mgr, 1, 2) == [[2, 3, 4], [2, 3, 4]]
    mgr.confirm_swap_in([1, 2])
    stats = mgr.stats()
    assert (stats.num_free, stats.num_cached, stats.num_held) == (3, 2, 3)
    mgr.append(1, [10])  # still shared after the round trip: copy on write
    assert mgr.plan([1], [1]).copies.tolist() == [[4, 5]]
    mgr.check()


def test_swap_in_registers_full_blocks_when_confirmed() -> None:
    mgr = BlockManager(8, 2, num_cpu_blocks=4)
    prompt = [1, 2, 3, 4, 9]
    alloc(mgr, 1, [1, 2, 3, 4, 5])
    mgr.swap_out([1])
    mgr.confirm_swap_out([1])
    mgr.reset_prefix_cache()  # forget the GPU copies
    mgr.swap_in([1])
    assert tables(mgr, 1) == [[0, 1, 2]]
    assert mgr.cached_prefix_blocks(prompt) == 0  # the copy-in has not run yet
    mgr.confirm_swap_in([1])
    assert mgr.cached_prefix_blocks(prompt) == 2
    assert mgr.allocate(2, prompt) == 4
    mgr.check()


def test_swap_out_keeps_gpu_sources_until_confirmed() -> None:
    mgr = BlockManager(4, 2, num_cpu_blocks=4)
    alloc(mgr, 1, [1, 2, 3, 4, 5])  # 3 blocks
    mgr.swap_out([1])
    assert_fails_unchanged(mgr, [1, 2], OutOfBlocks, lambda: mgr.allocate(2, [9] * 3))
    mgr.allocate(2, [9])  # the one free block, never a source of the pending copy
    assert tables(mgr, 2) == [[3]]
    mgr.confirm_swap_out([1])
    assert mgr.stats().num_free == 1  # block 2; blocks 0 and 1 are cached
    mgr.check()


def test_swap_misuse() -> None:
    mgr = BlockManager(8, 4, num_cpu_blocks=8)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    mgr.allocate(2, [6, 7])
    ids = [1, 2, 3]
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.swap_in([1]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.swap_out([1, 1]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.confirm_swap_out([1]))
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.confirm_swap_in([1]))
    mgr.swap_out([1])
    for op in [
        lambda: mgr.swap_out([1]),
        lambda: mgr.swap_out([2, 1]),
        lambda: mgr.append(1, [1]),
        lambda: mgr.step([1], [1]),
        lambda: mgr.plan([1], [1]),
        lambda: mgr.commit([1]),
        lambda: mgr.block_table(1),
        lambda: mgr.fork(1, 3),
        lambda: mgr.swap_in([1]),  # the swap-out is not confirmed
        lambda: mgr.swap_in([1, 2]),
        lambda: mgr.swap_in([1, 1]),
        lambda: mgr.confirm_swap_out([1, 2]),
        lambda: mgr.confirm_swap_out([1, 1]),
        lambda: mgr.confirm_swap_in([1]),
    ]:
        assert_fails_unchanged(mgr, ids, ValueError, op)
    mgr.confirm_swap_out([1])
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.confirm_swap_out([1]))
    mgr.swap_in([1])
    for op in [
        lambda: mgr.swap_out([1]),  # the swap-in is not confirmed
        lambda: mgr.fork(1, 3),
        lambda: mgr.confirm_swap_in([1, 2]),
        lambda: mgr.confirm_swap_out([1]),
    ]:
        assert_fails_unchanged(mgr, ids, ValueError, op)
    mgr.confirm_swap_in([1])
    assert_fails_unchanged(mgr, ids, ValueError, lambda: mgr.confirm_swap_in([1]))
    mgr.swap_out([1])
    mgr.free(1)  # freeing a swapped-out sequence returns its CPU and GPU blocks
    assert 1 not in mgr
    assert mgr.stats().num_held == 1
    assert mgr.swap_out([2]).tolist() == [[2, 0]]
    mgr.check()


def test_swap_out_of_blocks() -> None:
    mgr = BlockManager(4, 2, num_cpu_blocks=2)
    mgr.allocate(1, [1, 2, 3, 4, 5])  # 3 blocks
    err = assert_fails_unchanged(mgr, [1], OutOfBlocks, lambda: mgr.swap_out([1]))
    assert "CPU" in str(err)
    no_cpu = BlockManager(4, 2)
    no_cpu.allocate(1, [1])
    assert_fails_unchanged(no_cpu, [1], OutOfBlocks, lambda: no_cpu.swap_out([1]))

    mgr = BlockManager(4, 2, num_cpu_blocks=4)
    alloc(mgr, 1, [1, 2, 3, 4, 5])
    mgr.swap_out([1])
    mgr.confirm_swap_out([1])
    mgr.allocate(2, [9] * 7)  # takes every GPU block, evicting the cached ones
    err = assert_fails_unchanged(mgr, [1, 2], OutOfBlocks, lambda: mgr.swap_in([1]))
    assert "GPU" in str(err)


# ---- events and stats -----------------------------------------------------------------------


def test_events() -> None:
    mgr = BlockManager(4, 2, enable_events=True)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    assert mgr.take_events() == []  # nothing is computed yet
    prefill(mgr, 1)
    events = mgr.take_events()
    assert [(e.kind, e.token_ids, e.block_id, e.medium) for e in events] == [
        ("stored", [1, 2], 0, "GPU"),
        ("stored", [3, 4], 1, "GPU"),
    ]
    first, second = events
    assert first.parent_hash is None
    assert second.parent_hash == first.block_hash
    assert first.block_hash != second.block_hash
    assert second.seq_no == first.seq_no + 1
    assert mgr.take_events() == []
    mgr.free(1)  # caching a block is not an event
    mgr.allocate(2, [7] * 8)  # evicts block 1 then block 0
    later = mgr.take_events()
    assert [(e.kind, e.block_hash, e.block_id, e.medium) for e in later] == [
        ("removed", second.block_hash, 1, "GPU"),
        ("removed", first.block_hash, 0, "GPU"),
    ]
    prefill(mgr, 2)
    later += mgr.take_events()
    assert len(later) == 6  # two removed, then the new sequence's four stored blocks
    mgr.reset_prefix_cache()
    cleared = mgr.take_events()
    assert [(e.kind, e.block_hash, e.parent_hash, e.block_id) for e in cleared] == [
        ("cleared", None, None, None)
    ]
    seq_nos = [e.seq_no for e in [*events, *later, *cleared]]
    assert seq_nos == list(range(seq_nos[0], seq_nos[0] + 9))
    mgr.check()


def test_cpu_tier_events() -> None:
    mgr = BlockManager(8, 2, num_cpu_blocks=8, enable_events=True)
    alloc(mgr, 1, [1, 2, 3, 4, 5])
    mgr.fork(1, 2)
    gpu = {e.block_id: e.block_hash for e in mgr.take_events()}
    assert mgr.swap_out([1, 2]).tolist() == [[0, 0], [1, 1], [2, 2]]
    assert mgr.take_events() == []  # nothing is on the CPU until the copy is confirmed
    mgr.confirm_swap_out([1, 2])
    stored = mgr.take_events()
    # One event per hash, however many sequences hold the CPU block.
    assert [(e.kind, e.block_id, e.medium, e.token_ids) for e in stored] == [
        ("stored", 0, "CPU", [1, 2]),
        ("stored", 1, "CPU", [3, 4]),
    ]
    assert [e.block_hash for e in stored] == [gpu[0], gpu[1]]
    assert stored[1].parent_hash == gpu[0]
    mgr.reset_prefix_cache()
    mgr.take_events()
    mgr.swap_in([1, 2])
    mgr.confirm_swap_in([1, 2])
    events = mgr.take_events()
    assert [(e.kind, e.block_id, e.medium) for e in events] == [
        ("stored", 0, "GPU"),
        ("stored", 1, "GPU"),
    ]  # the CPU tier was cleared with the prefix cache: no CPU removal to announce
    mgr.swap_out([2])
    mgr.confirm_swap_out([2])
    assert [(e.kind, e.medium) for e in mgr.take_events()] == [("stored", "CPU")] * 2
    mgr.free(2)  # the last CPU copies leave
    removed = mgr.take_events()
    assert [(e.kind, e.medium) for e in removed] == [("removed", "CPU")] * 2
    assert {e.block_hash for e in removed} == {gpu[0], gpu[1]}
    mgr.check()


def test_events_disabled() -> None:
    mgr = BlockManager(4, 2)
    alloc(mgr, 1, [1, 2, 3])
    assert mgr.take_events() == []


def test_stats_by_hand() -> None:
    mgr = BlockManager(10, 4)
    mgr.allocate(1, [1, 2, 3, 4, 5, 6])  # 0, 1
    stats = mgr.stats()
    assert stats.num_held == 2
    assert (stats.usage, stats.token_usage) == pytest.approx((0.2, 6 / 8))
    assert (stats.stored_tokens, stats.computed_tokens, stats.pending_tokens) == (6, 0, 6)
    prefill(mgr, 1)
    assert (mgr.stats().computed_tokens, mgr.stats().pending_tokens) == (6, 0)
    mgr.fork(1, 2)  # shared blocks count once
    assert mgr.stats().token_usage == pytest.approx(6 / 8)
    assert mgr.stats().computed_tokens == 12
    mgr.append(2, [7, 8])  # copy on write to block 2, now full; block 1 held by the copy
    stats = mgr.stats()
    assert stats.num_held == 3
    assert stats.token_usage == pytest.approx((4 + 2 + 4) / 12)
    assert (stats.computed_tokens, stats.pending_tokens) == (12, 2)
    assert mgr.allocate(3, [1, 2, 3, 4, 5, 9]) == 4  # 0, 3
    stats = mgr.stats()
    assert stats.num_held == 4
    assert stats.usage == pytest.approx(0.4)
    assert stats.token_usage == pytest.approx((4 + 2 + 4 + 2) / 16)
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (12, 4)
    for seq_id in (1, 2, 3):
        mgr.free(seq_id)
    assert stats_of(mgr) == {
        "num_blocks": 10,
        "num_free": 9,
        "num_cached": 1,  # block 0; sequence 2's block 2 was never computed
        "num_held": 0,
        "usage": 0.0,
        "token_usage": 0.0,
        "stored_tokens": 0,
        "prefix_query_tokens": 12,
        "prefix_hit_tokens": 4,
        "prefix_allowed_tokens": 4,
        "evictions": 0,
        "computed_tokens": 0,
        "pending_tokens": 0,
        "external_query_tokens": 0,
        "external_hit_tokens": 0,
        "external_failures": 0,
    }
    mgr.check()


def test_the_field_lists_name_every_attribute() -> None:
    """STATS_FIELDS and PLAN_ARRAYS (with the plan's three sizes and its attention) are exactly
    the attributes of Stats and Plan, so the tests that compare every field miss none."""
    mgr = BlockManager(8, 4)
    mgr.allocate(1, [1, 2, 3])

    def public(obj: object) -> set[str]:
        return {name for name in dir(obj) if not name.startswith("_")}

    assert public(mgr.stats()) == set(STATS_FIELDS)
    sizes = {"batch_size", "num_query_tokens", "block_size", "attention"}
    assert public(mgr.plan([1], [3])) == set(PLAN_ARRAYS) | sizes
