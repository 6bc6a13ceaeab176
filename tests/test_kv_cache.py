"""KVCache: layout, writes by slot mapping, copy-on-write pairs and swaps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pagedkv.kv_cache import KVCache

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@dataclass
class Slots:
    """Just the fields of a `Plan` that `write` reads."""

    slot_mapping: npt.NDArray[np.int32]
    block_size: int


def filled(cache: KVCache, seed: int) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    for layer in range(cache.num_layers):
        t = cache.layer(layer)
        t.copy_(torch.randn(t.shape, generator=gen).to(cache.dtype))
    return cache


def pairs(*ps: tuple[int, int]) -> npt.NDArray[np.int32]:
    return np.asarray(ps, dtype=np.int32).reshape(-1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_is_flashinfer_nhd(dtype: torch.dtype) -> None:
    cache = KVCache(3, 10, 16, 4, 32, dtype=dtype)
    for layer in range(3):
        t = cache.layer(layer)
        assert t.shape == (10, 2, 16, 4, 32)
        assert t.dtype == dtype and t.is_contiguous()
        assert not t.any()
    assert cache.nbytes == 3 * 10 * 2 * 16 * 4 * 32 * torch.tensor([], dtype=dtype).element_size()
    assert cache.num_slots == 160
    assert cache.layer(0).data_ptr() != cache.layer(1).data_ptr()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(1, 0, 16, 1, 8)
    with pytest.raises(ValueError, match="floating point"):
        KVCache(1, 4, 16, 1, 8, dtype=torch.int32)
    with pytest.raises(IndexError, match="layer 2"):
        KVCache(2, 4, 16, 1, 8).layer(2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_scatters_by_slot_mapping(dtype: torch.dtype) -> None:
    bs = 4
    cache = KVCache(2, 6, bs, 2, 8, dtype=dtype)
    slots = np.array([13, 0, 22, 5, 14], dtype=np.int32)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=gen).to(dtype)
    v = torch.randn(5, 2, 8, generator=gen).to(dtype)
    cache.write(1, k, v, Slots(slots, bs))
    t = cache.layer(1)
    for i, s in enumerate(slots):
        assert torch.equal(t[s // bs, 0, s % bs], k[i])
        assert torch.equal(t[s // bs, 1, s % bs], v[i])
    written = torch.zeros(6 * bs, dtype=torch.bool)
    written[torch.from_numpy(slots).long()] = True
    untouched = t.transpose(1, 2).reshape(6 * bs, 2, 2, 8)[~written]
    assert not untouched.any()
    assert not cache.layer(0).any()


def test_write_accepts_plan_array_and_prepared_tensor() -> None:
    slots = np.array([3, 1], dtype=np.int32)
    k = torch.ones(2, 1, 2)
    results = []
    for arg in (Slots(slots, 2), slots, torch.from_numpy(slots)):
        cache = KVCache(1, 2, 2, 1, 2, dtype=torch.float32)
        prepared = cache.slot_tensor(arg)
        assert prepared.slots.dtype == torch.int64
        cache.write(0, k, 2 * k, arg)
        results.append(cache.layer(0).clone())
    assert all(torch.equal(r, results[0]) for r in results)


def test_write_validates() -> None:
    cache = KVCache(1, 2, 2, 1, 2, dtype=torch.float32)
    k = torch.zeros(2, 1, 2)
    slots = np.array([0, 1], dtype=np.int32)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        cache.write(0, k, k, np.array([0, 4], dtype=np.int32))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        cache.write(0, k, k, np.array([-2, 0], dtype=np.int32))
    with pytest.raises(ValueError, match="2 slots for 3 tokens"):
        cache.write(0, torch.zeros(3, 1, 2), torch.zeros(3, 1, 2), slots)
    with pytest.raises(ValueError, match="k must have shape"):
        cache.write(0, torch.zeros(2, 2, 2), k, slots)
    with pytest.raises(ValueError, match="float16"):
        cache.write(0, k, k.half(), slots)
    with pytest.raises(ValueError, match="integer"):
        cache.write(0, k, k, np.array([0.0, 1.0]))
    with pytest.raises(IndexError, match="layer 1"):
        cache.write(1, k, k, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer(dtype: torch.dtype) -> None:
    cache = filled(KVCache(2, 6, 4, 2, 8, dtype=dtype), seed=1)
    before = [cache.layer(i).clone() for i in range(2)]
    cache.copy_blocks(pairs((1, 4), (0, 5)))
    for i in range(2):
        want = before[i].clone()
        want[4], want[5] = before[i][1], before[i][0]
        assert torch.equal(cache.layer(i), want)


def test_copy_blocks_applies_chains_in_order() -> None:
    cache = filled(KVCache(1, 5, 2, 1, 2, dtype=torch.float32), seed=2)
    b = cache.layer(0).clone()
    # (0 -> 1) then (1 -> 2): block 2 must end up with block 0's data; then (3 -> 0) overwrites
    # a block an earlier pair read, which must not change what the earlier pair copied.
    cache.copy_blocks(pairs((0, 1), (1, 2), (3, 0)))
    t = cache.layer(0)
    assert torch.equal(t[1], b[0]) and torch.equal(t[2], b[0]) and torch.equal(t[0], b[3])
    assert torch.equal(t[3], b[3]) and torch.equal(t[4], b[4])


def test_copy_blocks_validates_and_accepts_empty() -> None:
    cache = KVCache(1, 3, 2, 1, 2, dtype=torch.float32)
    cache.copy_blocks(np.zeros((0, 2), dtype=np.int32))
    with pytest.raises(ValueError, match=r"shape \[n, 2\]"):
        cache.copy_blocks(np.array([1, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="destination block ids"):
        cache.copy_blocks(pairs((0, 3)))
    with pytest.raises(ValueError, match="source block ids"):
        cache.copy_blocks(pairs((-1, 2)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_round_trip_by_pairs(dtype: torch.dtype) -> None:
    gpu = filled(KVCache(2, 8, 4, 2, 8, dtype=dtype), seed=3)
    cpu = KVCache(2, 5, 4, 2, 8, dtype=dtype)
    original = [gpu.layer(i).clone() for i in range(2)]
    gpu.swap_out(cpu, pairs((6, 0), (2, 3), (7, 1)))
    for i in range(2):
        assert torch.equal(cpu.layer(i)[0], original[i][6])
        assert torch.equal(cpu.layer(i)[3], original[i][2])
        assert torch.equal(cpu.layer(i)[1], original[i][7])
        gpu.layer(i).zero_()
    gpu.swap_in(cpu, pairs((3, 0), (0, 4), (1, 5)))
    for i in range(2):
        assert torch.equal(gpu.layer(i)[0], original[i][2])
        assert torch.equal(gpu.layer(i)[4], original[i][6])
        assert torch.equal(gpu.layer(i)[5], original[i][7])


def test_swap_validates() -> None:
    gpu = KVCache(2, 4, 4, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="caches differ"):
        gpu.swap_out(KVCache(2, 4, 4, 1, 8, dtype=torch.float16), pairs((0, 0)))
    with pytest.raises(ValueError, match="caches differ"):
        gpu.swap_out(KVCache(1, 4, 4, 1, 8, dtype=torch.float32), pairs((0, 0)))
    cpu = KVCache(2, 2, 4, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="destination block ids"):
        gpu.swap_out(cpu, pairs((0, 2)))
    with pytest.raises(ValueError, match="source block ids"):
        gpu.swap_in(cpu, pairs((2, 0)))
    with pytest.raises(ValueError, match="appears twice"):
        gpu.swap_out(cpu, pairs((0, 1), (2, 1)))
    with pytest.raises(ValueError, match="same cache"):
        gpu.swap_out(gpu, pairs((0, 1)))


def test_copy_blocks_uploads_all_pairs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedkv.kv_cache as kv_cache

    uploads = []
    real = kv_cache.upload_ints
    monkeypatch.setattr(kv_cache, "upload_ints", lambda a, d: uploads.append(a.shape) or real(a, d))
    cache = filled(KVCache(2, 6, 2, 1, 4, dtype=torch.float32), seed=5)
    before = cache.layer(1).clone()
    cache.copy_blocks(pairs((0, 1), (1, 2), (3, 0)))  # a chain: applied pair by pair
    assert uploads == [(3, 2)]
    assert torch.equal(cache.layer(1)[2], before[0]) and torch.equal(cache.layer(1)[0], before[3])


def test_prepared_slots_are_uploaded_once_for_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedkv.kv_cache as kv_cache

    uploads = []
    real = kv_cache.upload_ints
    monkeypatch.setattr(kv_cache, "upload_ints", lambda a, d: uploads.append(a.shape) or real(a, d))
    bs = 4
    cache = KVCache(3, 5, bs, 2, 8, dtype=torch.float32)
    slots = np.array([19, 0, 6], dtype=np.int32)
    index = cache.slot_tensor(Slots(slots, bs))
    # Rows of [heads, dim]: K of slot s at 2 * (s // bs) * bs + s % bs, V one block further.
    assert index.k_rows.tolist() == [35, 0, 10] and index.v_rows.tolist() == [39, 4, 14]
    k = torch.randn(3, 2, 8)
    for layer in range(3):
        cache.write(layer, k, -k, index)
        assert torch.equal(cache.layer(layer)[4, 0, 3], k[0])
        assert torch.equal(cache.layer(layer)[1, 1, 2], -k[2])
    assert uploads == [(3,)]
    with pytest.raises(ValueError, match="another cache"):
        KVCache(1, 5, 2, 2, 8, dtype=torch.float32).write(0, k, k, index)


def test_swap_merges_runs_and_matches_pairwise_copies() -> None:
    from pagedkv.kv_cache import _runs

    runs = _runs(pairs((4, 0), (5, 1), (6, 2), (9, 7), (1, 3)))
    assert runs == [(4, 0, 3), (1, 3, 1), (9, 7, 1)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(0, 12))
        src = rng.permutation(16)[:n]
        dst = np.sort(rng.permutation(12)[:n]) if rng.random() < 0.5 else rng.permutation(12)[:n]
        gpu = filled(KVCache(2, 16, 2, 1, 4, dtype=torch.float32), seed=int(n))
        cpu = KVCache(2, 12, 2, 1, 4, dtype=torch.float32)
        transfer = gpu.swap_out(cpu, np.stack([src, dst], axis=1))
        assert transfer.done()
        transfer.wait()
        for layer in range(2):
            for s_id, d_id in zip(src, dst, strict=True):
                assert torch.equal(cpu.layer(layer)[d_id], gpu.layer(layer)[s_id])


def read_sequence(cache: KVCache, table: npt.NDArray[np.int32], num_tokens: int) -> torch.Tensor:
    """The K/V of a sequence's tokens, `[layers, tokens, 2, heads, dim]`, through its table."""
    t = torch.from_numpy(np.asarray(table, dtype=np.int64))
    per_layer = [cache.layer(i)[t].transpose(1, 2) for i in range(cache.num_layers)]
    return torch.stack([x.reshape(-1, *x.shape[2:])[:num_tokens] for x in per_layer])


def test_block_manager_fork_copy_on_write_and_swap_round_trip() -> None:
    from pagedkv import BlockManager

    bs = 4
    mgr = BlockManager(16, bs, num_cpu_blocks=8)
    gpu = KVCache(2, 16, bs, 2, 4, dtype=torch.float32)
    cpu = KVCache(2, 8, bs, 2, 4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)

    def write_step(seqs: list[int], q_lens: list[int]) -> int:
        plan = mgr.plan(seqs, q_lens)
        gpu.copy_blocks(plan.copies)  # this batch's copies, before its KV is written
        for layer in range(2):
            k = torch.randn(sum(q_lens), 2, 4, generator=gen)
            gpu.write(layer, k, -k, plan)
        return len(plan.copies)

    mgr.allocate(1, list(range(10)))  # 2 full blocks + a partial one
    assert write_step([1], [10]) == 0
    parent = read_sequence(gpu, mgr.block_table(1), 10)
    mgr.fork(1, 2)
    assert np.array_equal(mgr.block_table(1), mgr.block_table(2))
    mgr.append(2, [99])  # the shared partial block must be copied before the child writes
    assert write_step([2], [1]) == 1
    child = read_sequence(gpu, mgr.block_table(2), 11)
    assert torch.equal(child[:, :10], parent)
    assert torch.equal(read_sequence(gpu, mgr.block_table(1), 10), parent)

    # Swap both out (shared full blocks are copied once), clobber the GPU, swap back in.
    out_pairs = mgr.swap_out([1, 2])
    gpu.swap_out(cpu, out_pairs)
    mgr.confirm_swap_out([1, 2])  # only now may the GPU blocks be reused
    for layer in range(2):
        gpu.layer(layer).fill_(float("nan"))
    mgr.allocate(3, list(range(50, 58)))  # takes GPU blocks the swapped sequences gave back
    gpu.swap_in(cpu, mgr.swap_in([2, 1]))
    mgr.confirm_swap_in([2, 1])
    assert torch.equal(read_sequence(gpu, mgr.block_table(1), 10), parent)
    assert torch.equal(read_sequence(gpu, mgr.block_table(2), 11), child)
    mgr.check()


# ---------------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_write_copy_and_swap_with_pinned_cpu_cache(dtype: torch.dtype) -> None:
    gpu = KVCache(2, 8, 16, 2, 64, dtype=dtype, device="cuda")
    cpu = KVCache(2, 8, 16, 2, 64, dtype=dtype, pin_memory=True)
    k = torch.randn(5, 2, 64, device="cuda").to(dtype)
    slots = np.array([3, 17, 40, 100, 127], dtype=np.int32)
    for layer in range(2):
        gpu.write(layer, k, -k, Slots(slots, 16))
    gpu.copy_blocks(pairs((0, 5)))
    original = [gpu.layer(i).clone() for i in range(2)]
    out = gpu.swap_out(cpu, pairs(*[(i, 7 - i) for i in range(8)]))
    assert out.event is not None  # asynchronous through the pinned cache
    for i in range(2):
        gpu.layer(i).zero_()  # ordered after the copies on the stream
    gpu.swap_in(cpu, pairs(*[(7 - i, i) for i in range(8)])).wait()
    for i in range(2):
        assert torch.equal(gpu.layer(i), original[i])
    assert torch.equal(original[0][5], original[0][0])
