"""The binding of windowed attention and KV-cache groups: `Attention`, a windowed
`BlockManager` and `HybridManager` (the semantics are the Rust model test's)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import Attention, Batch, BlockManager, HybridManager, OutOfBlocks

KEY = bytes(range(32))


def hybrid(num_blocks: int = 64, block_size: int = 4, **kwargs: object) -> HybridManager:
    groups = [Attention.full(), Attention.sliding_window(8)]
    return HybridManager(num_blocks, block_size, groups, hash_key=KEY, watermark=0.0, **kwargs)


def test_attention_describes_what_a_query_reads() -> None:
    full, window, chunk = (
        Attention.full(),
        Attention.sliding_window(1024),
        Attention.chunked_local(8192),
    )
    assert (full.kind, full.window, full.chunk, full.window_left) == ("full", None, None, -1)
    assert (window.kind, window.window, window.window_left) == ("sliding_window", 1024, 1023)
    assert (chunk.kind, chunk.chunk, chunk.window_left) == ("chunked_local", 8192, -1)
    assert [a.first_key(10_000) for a in (full, window, chunk)] == [0, 8977, 8192]
    assert window.first_key(np.int64(3)) == 0
    assert Attention.sliding_window(1024) == window and window != full
    assert len({full, window, Attention.full()}) == 2
    assert repr(chunk) == "Attention.chunked_local(8192)"
    for bad in (0, -1, 2**32, 1.5):
        with pytest.raises(ValueError, match="window"):
            Attention.sliding_window(bad)
    with pytest.raises(ValueError, match="chunk"):
        Attention.chunked_local(0)


def test_a_windowed_manager_holds_only_its_window() -> None:
    mgr = BlockManager(32, 4, attention=Attention.sliding_window(8), hash_key=KEY)
    assert mgr.attention == Attention.sliding_window(8)
    assert BlockManager(8, 4).attention == Attention.full()
    mgr.allocate(1, list(range(20)))
    plan = mgr.plan([1], [20])
    assert plan.attention == Attention.sliding_window(8)
    plan = mgr.step([1], [20])
    assert mgr.first_block(1) == 3
    assert plan.kv_indptr.tolist() == [0, 3]
    assert len(mgr.block_table(1)) == 3
    mgr.check()
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockManager(8, 4, attention=Attention.chunked_local(6))


def test_every_group_gets_its_plan_from_one_pool() -> None:
    mgr = hybrid()
    assert mgr.num_groups == 2
    assert mgr.groups == [Attention.full(), Attention.sliding_window(8)]
    assert mgr.allocate(1, list(range(20))) == 0
    assert mgr.stats(0).num_held == 10
    plans = mgr.plan([1], [20])
    assert [p.kv_indptr.tolist() for p in plans] == [[0, 5], [0, 5]]
    plans = mgr.step([1], [20])
    assert [p.kv_indptr.tolist() for p in plans] == [[0, 6], [0, 3]]
    assert [p.attention for p in plans] == mgr.groups
    assert plans[0].positions.tolist() == plans[1].positions.tolist() == [20]
    assert mgr.first_block(1, 1) == 3 and mgr.first_block(1, 0) == 0
    assert mgr.block_table(1, 1).tolist() == plans[1].kv_indices.tolist()
    # A second request reuses the prefix both groups serve.
    assert mgr.cached_prefix_blocks(list(range(17))) == 4
    assert mgr.allocate(2, list(range(17))) == 16
    assert mgr.stats(1).prefix_allowed_tokens == 16
    assert 2 in mgr and len(mgr) == 2 and mgr.num_tokens(2) == 17
    mgr.check()


def test_batches_rollbacks_forks_and_swaps_run_on_every_group() -> None:
    mgr = hybrid(num_cpu_blocks=64)
    for seq in (1, 2):
        mgr.allocate(seq, [seq] * 10)
    mgr.plan([1, 2], [10, 10])
    batches = [Batch(), Batch()]
    for b in batches:
        b.add(1)
        b.add(2)
    for t in range(6):
        mgr.step_batch(batches, [t, t])
    # Query 15 reads 8..=15: blocks 2 and 3.
    assert batches[1].kv_indptr.tolist() == [0, 2, 4]
    mgr.verify_batch(batches, [1, 2, 3, 4], [2, 2])
    mgr.rollback_batch(batches, [1, 1])
    assert mgr.num_tokens(1) == 17
    mgr.fork(1, 3)
    pairs = mgr.swap_out([2])
    assert [p.shape[1] for p in pairs] == [2, 2] and len(pairs[0]) > len(pairs[1])
    mgr.confirm_swap_out([2])
    mgr.swap_in([2])
    mgr.confirm_swap_in([2])
    mgr.check()
    for seq in (1, 2, 3):
        mgr.free(seq)
    assert mgr.stats(0).num_held == 0
    mgr.check()


def test_plan_takes_draft_counts_without_a_state_group() -> None:
    # Drafts matter to a state group only; without one they are checked and the KV groups roll
    # the rejected ones back as usual.
    mgr = hybrid()
    mgr.allocate(1, [1] * 10)
    mgr.plan([1], [10])
    mgr.append(1, [5, 6, 7])
    with pytest.raises(ValueError, match="row 0 has 3 drafts in a query of 3 tokens"):
        mgr.plan([1], [3], drafts=[3])
    plans = mgr.plan([1], [3], drafts=[2])
    assert [p.positions.tolist() for p in plans] == [[10, 11, 12]] * 2
    mgr.rollback([1], [2])
    assert mgr.num_tokens(1) == 11
    mgr.check()


def test_bad_input_names_the_argument_and_changes_nothing() -> None:
    with pytest.raises(ValueError, match="groups"):
        HybridManager(8, 4, [])
    with pytest.raises(ValueError, match="groups"):
        HybridManager(8, 4, ["full"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"groups\[1\]"):
        HybridManager(8, 4, [Attention.full(), Attention.chunked_local(6)])
    mgr = hybrid(num_blocks=7)
    mgr.allocate(1, [1] * 12)
    mgr.plan([1], [12])
    tables = [mgr.block_table(1, g).tolist() for g in range(2)]
    with pytest.raises(OutOfBlocks):
        mgr.step([1], [5])
    assert [mgr.block_table(1, g).tolist() for g in range(2)] == tables
    assert mgr.num_tokens(1) == 12
    with pytest.raises(ValueError, match="one batch per group"):
        mgr.step_batch([Batch()], [1])
    with pytest.raises(ValueError, match="group 2 out of range"):
        mgr.stats(2)
    with pytest.raises(ValueError, match="batches"):
        mgr.step_batch([1, 2], [1])  # type: ignore[list-item]
    mgr.check()


def test_paged_attention_refuses_another_groups_plan() -> None:
    """A PagedAttention built for one group's attention refuses a plan or batch of another
    group by name; one built without `attention` takes each plan's window."""
    torch = pytest.importorskip("torch")
    from pagedkv.attention import PagedAttention

    attn = PagedAttention(2, 1, 8, 4, device="cpu", dtype=torch.float32, attention=Attention.full())
    windowed = PagedAttention(
        2, 1, 8, 4, device="cpu", dtype=torch.float32, attention=Attention.sliding_window(8)
    )
    mgr = hybrid()
    mgr.allocate(1, list(range(10)))
    full, window = mgr.plan([1], [10])
    attn.plan(full)
    windowed.plan(window)
    with pytest.raises(ValueError, match=r"plan\.attention"):
        attn.plan(window)
    with pytest.raises(ValueError, match=r"plan\.attention"):
        windowed.plan(full)
    batches = [Batch(), Batch()]
    for b in batches:
        b.add(1)
    mgr.step_batch(batches, [3])
    assert batches[1].attention == Attention.sliding_window(8)
    attn.plan(batches[0])
    with pytest.raises(ValueError, match=r"plan\.attention"):
        attn.plan(batches[1])
    any_attention = PagedAttention(2, 1, 8, 4, device="cpu", dtype=torch.float32)
    any_attention.plan(batches[1])
    any_attention.plan(batches[0])
