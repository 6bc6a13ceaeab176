"""The persistent decode batch: `pagedkv.Batch` with `BlockManager.step_batch`, checked against
the one-shot `step` of the same rows, and its table kept on a device by `DeviceBlockTable`.

The Rust model test (rust/core/tests/model.rs) drives `step_batch` through every operation of
the manager; these tests cover the Python surface: arrays, errors, the update log and the
device-side CSR.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv import Batch, BlockManager, OutOfBlocks
from pagedkv.attention._device_table import DeviceBlockTable

KEY = bytes(32)


def admitted(mgr: BlockManager, seq_id: int, prompt: list[int]) -> int:
    """Allocates and prefills `seq_id`."""
    reused = mgr.allocate(seq_id, prompt)
    mgr.plan([seq_id], [len(prompt) - reused])
    return seq_id


def two_rows() -> tuple[BlockManager, Batch]:
    """A manager with sequence 1 (5 tokens, blocks 0 and 1) and 2 (3 tokens, block 2)
    prefilled, and a batch of them in that order."""
    mgr = BlockManager(16, 4, hash_key=KEY)
    admitted(mgr, 1, [1, 2, 3, 4, 5])
    admitted(mgr, 2, [9, 9, 9])
    batch = Batch()
    batch.add(1)
    batch.add(2)
    return mgr, batch


def test_step_batch_by_hand() -> None:
    mgr, batch = two_rows()
    assert len(batch) == 2 and 2 in batch and 3 not in batch and batch.row(2) == 1
    assert batch.block_size == 0
    mgr.step_batch(batch, [6, 7])
    assert batch.block_size == 4
    assert batch.seq_ids.tolist() == [1, 2]
    assert batch.kv_indptr.tolist() == [0, 2, 3]
    assert batch.kv_indices.tolist() == [0, 1, 2]
    assert batch.kv_last_page_len.tolist() == [2, 4]
    assert batch.qo_indptr.tolist() == [0, 1, 2]
    assert batch.positions.tolist() == [5, 3]
    assert batch.slot_mapping.tolist() == [1 * 4 + 1, 2 * 4 + 3]
    assert batch.copies.shape == (0, 2)
    assert batch.width == 16
    table = batch.block_table
    assert table.shape == (2, 16) and table.dtype == np.int32
    assert table[0, :3].tolist() == [0, 1, -1] and table[1, :2].tolist() == [2, -1]
    # The first step writes each row's blocks into the 16 columns a new batch has.
    full, index, blocks = batch.take_updates()
    assert not full and index.tolist() == [0, 1, 16] and blocks.tolist() == [0, 1, 2]
    mgr.step_batch(batch, [8, 9])  # sequence 2 fills block 2 and takes block 3
    full, index, blocks = batch.take_updates()
    assert not full and index.dtype == np.int64 and blocks.dtype == np.int32
    assert index.tolist() == [16 + 1] and blocks.tolist() == [3]
    assert mgr.token_ids(2).tolist() == [9, 9, 9, 7, 9]
    assert repr(batch) == "Batch(len=2, width=16)"
    mgr.check()


def test_rows_move_on_removal() -> None:
    mgr = BlockManager(32, 4, hash_key=KEY)
    batch = Batch()
    for seq_id in (1, 2, 3):
        admitted(mgr, seq_id, [seq_id] * (4 * seq_id))
        batch.add(seq_id)
    mgr.step_batch(batch, [0, 0, 0])
    batch.take_updates()
    batch.remove(1)
    assert batch.seq_ids.tolist() == [3, 2]
    # The last step's inputs described three rows: gone until the next step.
    assert batch.kv_indptr.tolist() == [0] and batch.kv_indices.size == 0
    assert batch.block_size == 4
    mgr.step_batch(batch, [0, 0])
    assert batch.kv_indices.tolist() == [
        *mgr.block_table(3).tolist(),
        *mgr.block_table(2).tolist(),
    ]
    batch.clear()
    assert len(batch) == 0


def test_errors_name_the_problem_and_change_nothing() -> None:
    mgr = BlockManager(4, 4, hash_key=KEY)
    admitted(mgr, 1, [1, 2, 3, 4])  # one full block: the next token needs another
    batch = Batch()
    batch.add(1)
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add(1)
    with pytest.raises(ValueError, match="not in the batch"):
        batch.remove(7)
    with pytest.raises(ValueError, match="1 sequences but 2 tokens"):
        mgr.step_batch(batch, [5, 6])
    batch.add(9)
    with pytest.raises(KeyError):
        mgr.step_batch(batch, [5, 6])
    batch.remove(9)
    mgr.allocate(2, list(range(12)))  # the pool's other three blocks
    with pytest.raises(OutOfBlocks):
        mgr.step_batch(batch, [5])
    assert mgr.token_ids(1).tolist() == [1, 2, 3, 4]
    mgr.free(2)
    mgr.step_batch(batch, [5])
    assert mgr.token_ids(1).tolist() == [1, 2, 3, 4, 5]
    mgr.check()


def test_membership_and_width_are_as_the_manager_has_them() -> None:
    mgr = BlockManager(8, 4, hash_key=KEY)
    batch = Batch()
    assert batch.width == 16
    for not_an_id in ("x", -1, 2**64, 1.5, None):
        assert not_an_id not in batch and not_an_id not in mgr


def test_every_sharer_of_a_partial_block_copies_it() -> None:
    """A fork's two sequences decoding in one step both copy their shared partial block: the
    first copy holds its source until its forward pass is committed (SEMANTICS.md, `append`)."""
    mgr = BlockManager(8, 4, hash_key=KEY)
    admitted(mgr, 1, [1, 2, 3, 4, 5, 6])
    mgr.step([1], [7])
    mgr.fork(1, 2)
    tail = int(mgr.block_table(1)[-1])
    plan = mgr.step([1, 2], [8, 9])
    assert plan.copies[:, 0].tolist() == [tail, tail]
    assert len(set(plan.copies[:, 1].tolist())) == 2
    mgr.check()


def test_a_verify_step_plans_every_draft_and_a_rollback_drops_the_rejected() -> None:
    mgr, batch = two_rows()
    mgr.verify_batch(batch, [6, 60, 61, 62, 7], [4, 1])  # row 1: last token + 3 drafts
    assert batch.qo_indptr.tolist() == [0, 4, 5]
    assert batch.positions.tolist() == [5, 6, 7, 8, 3]
    assert batch.kv_indptr.tolist() == [0, 3, 4] and batch.block_table[0, :3].tolist() == [0, 1, 3]
    mgr.rollback_batch(batch, np.array([2, 0], dtype=np.uint64))  # 61 and 62 rejected
    assert mgr.token_ids(1).tolist() == [1, 2, 3, 4, 5, 6, 60]
    assert batch.block_table[0, :3].tolist() == [0, 1, -1]
    mgr.check()
    with pytest.raises(ValueError, match="cannot roll back 3"):
        mgr.rollback([2], [3])  # its prompt is committed
    with pytest.raises(ValueError, match="add up to"):
        mgr.verify_batch(batch, [1, 2], [1, 2])
    mgr.check()


def test_an_empty_batch_steps_to_empty_inputs() -> None:
    mgr = BlockManager(8, 4, hash_key=KEY)
    batch = Batch()
    mgr.step_batch(batch, [])
    assert batch.kv_indptr.tolist() == [0] and batch.positions.size == 0
    assert batch.block_table.shape == (0, 16) and batch.kv_indices.size == 0


def run_random_batch(seed: int, device: torch.device, triton: bool | None = None) -> None:
    """Random admissions, decode steps, removals and frees through one batch and the one-shot
    `step` on a twin manager; the device table, synced from the update log alone, must equal
    the host table, and its CSR the step's."""
    rng = np.random.default_rng(seed)
    mgrs = [BlockManager(96, 4, hash_key=KEY) for _ in range(2)]
    batch = Batch()
    table = DeviceBlockTable(device, triton=triton)
    order: list[int] = []  # the rows, as the one-shot step sees them
    next_id = 0
    for _ in range(300):
        if len(order) < 8 and rng.random() < 0.3:
            prompt = rng.integers(0, 50, int(rng.integers(1, 30))).tolist()
            if all(m.can_allocate(prompt) for m in mgrs):
                for m in mgrs:
                    admitted(m, next_id, prompt)
                batch.add(next_id)
                order = batch.seq_ids.tolist()
                next_id += 1
        if order and rng.random() < 0.15:
            gone = int(rng.choice(order))
            for m in mgrs:
                m.free(gone)
            batch.remove(gone)
            order = batch.seq_ids.tolist()
        if not order:
            continue
        tokens = rng.integers(0, 50, len(order)).astype(np.int32)
        try:
            mgrs[0].step_batch(batch, tokens)
        except OutOfBlocks:
            with pytest.raises(OutOfBlocks):
                mgrs[1].step(order, tokens)
            continue
        plan = mgrs[1].step(order, tokens)
        for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr", "positions"):
            np.testing.assert_array_equal(getattr(batch, name), getattr(plan, name), name)
        # Same decisions; the twins take the same blocks since rows are in the same order.
        np.testing.assert_array_equal(batch.slot_mapping, plan.slot_mapping)
        table.sync(batch)
        rows = len(batch)
        host = torch.from_numpy(batch.block_table)
        assert torch.equal(table.table[:rows].cpu(), host)
        assert bool((table.table[rows:] == -1).all())
        indptr = torch.from_numpy(batch.kv_indptr).to(device)
        csr = table.kv_indices(indptr, int(batch.kv_indptr[-1]))
        np.testing.assert_array_equal(csr.cpu().numpy(), plan.kv_indices)
    for m in mgrs:
        m.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_table_follows_the_batch_on_cpu(seed: int) -> None:
    run_random_batch(seed, torch.device("cpu"))


def test_the_csr_kernel_equals_the_torch_ops() -> None:
    # The Triton kernel (in the interpreter on the CPU) against the torch ops, on rows of 0 to
    # 300 pages (more than one kernel block) in a wide table.
    rng = np.random.default_rng(0)
    pages = np.array([1, 300, 7, 129, 128, 2], dtype=np.int32)
    table = torch.full((8, 512), -1, dtype=torch.int32)
    for r, n in enumerate(pages):
        table[r, :n] = torch.from_numpy(rng.integers(0, 10_000, n, dtype=np.int32))
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
    results = []
    for triton in (True, False):
        device_table = DeviceBlockTable("cpu", triton=triton)
        device_table._table = table  # as a sync would leave it
        results.append(device_table.kv_indices(indptr, int(indptr[-1])))
    assert torch.equal(results[0], results[1])
    expected = torch.cat([table[r, :n] for r, n in enumerate(pages)])
    assert torch.equal(results[0], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("triton", [True, False])
def test_device_table_follows_the_batch_on_cuda(triton: bool) -> None:
    run_random_batch(0, torch.device("cuda"), triton)


def test_device_table_needs_a_sync_first() -> None:
    with pytest.raises(RuntimeError, match="sync"):
        _ = DeviceBlockTable("cpu").table


def test_a_batch_plans_attention_like_a_plan() -> None:
    from pagedkv.attention import PagedAttention, StepPlan

    mgrs = [BlockManager(64, 4, hash_key=KEY) for _ in range(2)]
    batch = Batch()
    for seq_id, prompt in ((1, [1, 2, 3, 4, 5, 6]), (2, [7, 8])):
        for m in mgrs:
            admitted(m, seq_id, prompt)
        batch.add(seq_id)
    mgrs[0].step_batch(batch, [9, 9])
    plan = mgrs[1].step([1, 2], [9, 9])
    ours, theirs = (StepPlan.from_plan(p, 4) for p in (batch, plan))
    for field in ("kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr", "kv_lens"):
        np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field), field)
    attn = PagedAttention(2, 1, 8, 4, backend="torch", dtype=torch.float32)
    attn.plan(batch)
    assert attn.graph_batch_size is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_from_the_device_table_equals_the_host_csr(backend: str) -> None:
    # Decode and verify steps of a persistent batch (the latter with rollbacks), attended with
    # the CSR built on the device from the table (plan(batch, table=...)) and with the host CSR
    # (plan(batch)): the same outputs.
    from pagedkv.attention import PagedAttention
    from pagedkv.kv_cache import KVCache

    bs, hkv, group, dim = 4, 2, 2, 16
    mgr = BlockManager(64, bs, hash_key=KEY)
    cache = KVCache(1, 64, bs, hkv, dim, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen))
    batch, table = Batch(), DeviceBlockTable("cpu")
    attn = PagedAttention(hkv * group, hkv, dim, bs, backend=backend, dtype=torch.float32)
    for seq_id, length in ((1, 9), (2, 3), (3, 14)):
        admitted(mgr, seq_id, list(range(length)))
        batch.add(seq_id)
    for step in range(8):
        if step == 3:
            batch.remove(2)  # row 3 moves into row 1
        counts = [1 + (row + step) % 4 if step % 2 else 1 for row in range(len(batch))]
        mgr.verify_batch(batch, [step] * sum(counts), counts)
        q = torch.randn(len(batch.positions), hkv * group, dim, generator=gen)
        attn.plan(batch, table=table)
        on_device = attn.run(q, cache, 0)
        attn.plan(batch)
        on_host = attn.run(q, cache, 0)
        torch.testing.assert_close(on_device, on_host, rtol=0, atol=0)
        mgr.rollback_batch(batch, [count // 2 for count in counts])


def test_attention_table_errors() -> None:
    from pagedkv.attention import PagedAttention

    mgr = BlockManager(16, 4, hash_key=KEY)
    attn = PagedAttention(2, 1, 8, 4, backend="torch", dtype=torch.float32)
    plan = mgr.plan([admitted(mgr, 1, [1, 2, 3])], [3])
    with pytest.raises(TypeError, match=r"needs a pagedkv\.Batch"):
        attn.plan(plan, table=DeviceBlockTable("cpu"))
    batch = Batch()
    with pytest.raises(ValueError, match="empty batch"):
        attn.plan(batch, table=DeviceBlockTable("cpu"))
    with pytest.raises(ValueError, match="DeviceBlockTable is on meta"):
        attn.plan(batch, table=DeviceBlockTable("meta"))


def test_graph_buckets_take_the_device_csr() -> None:
    # A decode step padded into a CUDA-graph bucket (Triton's fixed buffers; the interpreter
    # on CPU): the device CSR is padded on the device and copied into the bucket.
    from pagedkv.attention import PagedAttention
    from pagedkv.kv_cache import KVCache

    bs, hkv, hq, dim = 4, 2, 4, 16
    mgr = BlockManager(64, bs, hash_key=KEY)
    cache = KVCache(1, 64, bs, hkv, dim, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen))
    graphed = PagedAttention(
        hq, hkv, dim, bs, backend="triton", dtype=torch.float32,
        cuda_graph_batch_sizes=(4,), cuda_graph_max_pages=64,
    )  # fmt: skip
    eager = PagedAttention(hq, hkv, dim, bs, backend="triton", dtype=torch.float32)
    batch, table = Batch(), DeviceBlockTable("cpu")
    for seq_id, length in ((1, 5), (2, 11), (3, 2)):
        admitted(mgr, seq_id, list(range(length)))
        batch.add(seq_id)
    mgr.step_batch(batch, [7, 7, 7])
    graphed.plan(batch, table=table)
    assert graphed.graph_batch_size == 4
    q = torch.randn(3, hq, dim, generator=gen)
    out = graphed.run(torch.cat([q, torch.zeros(1, hq, dim)]), cache, 0)
    eager.plan(batch)
    torch.testing.assert_close(out[:3], eager.run(q, cache, 0), atol=1e-6, rtol=1e-6)
