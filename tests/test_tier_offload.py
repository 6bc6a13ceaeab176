"""`KVTier`'s glue against a stand-in manager: saving, dedup, the bounded queue, loading, faults.

The stand-in implements only the external-admission calls the tier makes, with the contract's
arithmetic; the real `BlockManager` runs in `test_tier_e2e.py`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pagedkv import Attention
from pagedkv.kv_cache import KVCache
from pagedkv.tier import KVTier, MemoryStore, Namespace, StoreError, StoreTimeout, TierStats
from pagedkv.tier.codec import HEADER_SIZE
from pagedkv.tier.lanes import block_spec
from pagedkv.tier.offload import _HostBuffers

BS = 4
TOKENS = list(range(100, 121))  # 21 tokens: 5 full blocks, all hittable


class StandInManager:
    """External-admission calls of `BlockManager` for one sequence, per the API contract."""

    block_size = BS
    attention = Attention.full()

    def __init__(self, cached_blocks: int = 0, fingerprint: str = "0123456789abcdef") -> None:
        self.hash_key_fingerprint = fingerprint
        self.cached = cached_blocks
        self.loading: npt.NDArray[np.int32] = np.empty(0, np.int32)
        self.confirmed: int | None = None
        self.loadable: int | None = None

    def block_hashes(self, token_ids: Sequence[int], *, salt: Any = None) -> list[int]:
        out, parent = [], b""
        for b in range(len(token_ids) // BS):
            data = parent + repr((list(token_ids[b * BS : (b + 1) * BS]), salt)).encode()
            parent = hashlib.blake2b(data, digest_size=16).digest()
            out.append(int.from_bytes(parent, "little"))
        return out

    def cached_prefix_blocks(self, token_ids: Sequence[int], *, salt: Any = None) -> int:
        return self.cached

    def allocate_loading(
        self, seq_id: int, token_ids: Sequence[int], loadable_blocks: int, *, salt: Any = None
    ) -> tuple[int, npt.NDArray[np.int32]]:
        self.loadable = loadable_blocks
        hittable = (len(token_ids) - 1) // BS
        n = max(0, min(loadable_blocks, hittable) - self.cached)
        self.loading = np.arange(20, 20 + n, dtype=np.int32)
        return self.cached * BS, self.loading

    def confirm_loads(self, seq_id: int, num_loaded: int) -> None:
        assert 0 <= num_loaded <= len(self.loading)
        self.confirmed = num_loaded

    def num_computed(self, seq_id: int) -> int:
        return (self.cached + (self.confirmed or 0)) * BS


@dataclass
class Ev:
    kind: str
    block_hash: int | None
    block_id: int | None
    medium: str = "GPU"


def make_cache(seed: int | None = None) -> KVCache:
    cache = KVCache(2, 32, BS, 2, 8, dtype=torch.float32)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for layer in range(cache.num_layers):
            cache.layer(layer).copy_(torch.randn(cache.layer(layer).shape, generator=gen))
    return cache


def stored_events(mgr: StandInManager, block_ids: list[int]) -> list[Ev]:
    hashes = mgr.block_hashes(TOKENS)
    return [Ev("stored", h, b) for h, b in zip(hashes, block_ids, strict=False)]


def blocks(cache: KVCache, ids: list[int]) -> torch.Tensor:
    return torch.stack([cache.layer(layer)[ids] for layer in range(cache.num_layers)], dim=1)


def saved_tier(store: MemoryStore, ids: list[int] | None = None) -> tuple[KVCache, list[int]]:
    """Save `ids` (default: 5 blocks) of a random cache as TOKENS' blocks into `store`."""
    ids = ids or [3, 9, 4, 11, 7]
    cache = make_cache(seed=1)
    mgr = StandInManager()
    with KVTier(store, "m", mgr, cache) as tier:
        tier.offer(stored_events(mgr, ids))
        assert tier.flush(5)
        assert tier.stats().saved_blocks == len(ids)
    return cache, ids


# ---- KVCache byte movement


def test_read_and_write_blocks_round_trip() -> None:
    src, dst = make_cache(seed=0), make_cache()
    host = src.read_blocks(np.array([5, 1, 30]))
    data = host.ready()
    assert data.shape == (3, 2, 2, BS, 2, 8) and data.device.type == "cpu"
    assert torch.equal(data, blocks(src, [5, 1, 30]))
    dst.write_blocks(np.array([0, 7, 2], dtype=np.int32), data)
    assert torch.equal(blocks(dst, [0, 7, 2]), blocks(src, [5, 1, 30]))
    assert not blocks(dst, [1]).any()  # nothing else written
    assert src.read_blocks(np.empty(0, np.int64)).ready().shape[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_round_trip(dtype: torch.dtype) -> None:
    src = KVCache(3, 16, BS, 2, 8, dtype=dtype)
    dst = KVCache(3, 16, BS, 2, 8, dtype=dtype)
    for layer in range(src.num_layers):
        src.layer(layer).normal_()
    assert src.block_nbytes == 3 * 2 * BS * 2 * 8 * dtype.itemsize
    # Read into rows behind a header, as the tier does, then write from bytes of those rows.
    values = torch.zeros((3, HEADER_SIZE + src.block_nbytes), dtype=torch.uint8)
    out = values[:, HEADER_SIZE:].view(dtype).view(3, 3, 2, BS, 2, 8)
    src.read_blocks(np.array([9, 0, 15]), out=out).ready()
    assert not values[:, :HEADER_SIZE].any()  # the header room is left alone
    payloads = [memoryview(bytes(row))[HEADER_SIZE:] for row in values.numpy()]
    dst.write_block_bytes(np.array([4, 15, 1]), payloads)
    assert torch.equal(blocks(dst, [4, 15, 1]), blocks(src, [9, 0, 15]))
    assert not blocks(dst, [0, 2, 3]).any()  # nothing else written
    dst.write_block_bytes(np.empty(0, np.int64), [])


def test_read_blocks_is_a_snapshot() -> None:
    cache = make_cache(seed=0)
    host = cache.read_blocks(np.array([2]))
    before = blocks(cache, [2]).clone()
    cache.layer(0)[2] = 0  # a later step overwrites the block
    assert torch.equal(host.ready(), before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_and_write_blocks_on_cuda() -> None:
    src = KVCache(2, 32, BS, 2, 8, dtype=torch.float16, device="cuda")
    for layer in range(src.num_layers):
        src.layer(layer).normal_()
    want = blocks(src, [5, 1, 30]).cpu()
    # Into room behind a 64-byte header per block, as the tier reads them.
    values = torch.empty((3, 64 + 2 * 2 * BS * 2 * 8 * 2), dtype=torch.uint8, pin_memory=True)
    out = values[:, 64:].view(torch.float16).view(3, 2, 2, BS, 2, 8)
    host = src.read_blocks(np.array([5, 1, 30]), out=out)
    for layer in range(src.num_layers):
        src.layer(layer).zero_()  # enqueued after the copy: must not show in it
    assert torch.equal(host.ready(), want)
    assert torch.equal(src.read_blocks(np.array([5])).ready(), torch.zeros_like(want[:1]))
    src.write_blocks(np.array([7, 2, 9]), want)
    assert torch.equal(blocks(src, [7, 2, 9]).cpu(), want)
    src.write_block_bytes(np.array([3, 4]), [bytes(values[i, 64:].numpy()) for i in (2, 0)])
    assert torch.equal(blocks(src, [3, 4]).cpu(), want[[2, 0]])


def test_read_and_write_blocks_reject_bad_input() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 32\)"):
        cache.read_blocks(np.array([32]))
    with pytest.raises(ValueError, match="1-D integer"):
        cache.read_blocks(np.array([[1]]))
    good = torch.zeros(2, 2, 2, BS, 2, 8)
    with pytest.raises(ValueError, match="host blocks must be"):
        cache.write_blocks(np.array([1]), good)
    with pytest.raises(ValueError, match="host blocks must be"):
        cache.write_blocks(np.array([1, 2]), good.double())
    with pytest.raises(ValueError, match="appears twice"):
        cache.write_blocks(np.array([1, 1]), good)
    with pytest.raises(ValueError, match="contiguous blocks"):
        cache.read_blocks(np.array([1]), out=torch.zeros(1, 2, 2, BS, 2, 16)[..., ::2])
    block = bytes(cache.block_nbytes)
    with pytest.raises(ValueError, match="2 block ids for 1 blocks"):
        cache.write_block_bytes(np.array([1, 2]), [block])
    with pytest.raises(
        ValueError, match=f"block 1 has 4 bytes; a block of this cache has {len(block)}"
    ):
        cache.write_block_bytes(np.array([1, 2]), [block, b"four"])
    with pytest.raises(ValueError, match="appears twice"):
        cache.write_block_bytes(np.array([3, 3]), [block, block])
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 32\)"):
        cache.write_block_bytes(np.array([-1]), [block])


# ---- write path


def test_saved_blocks_load_into_another_cache() -> None:
    store = MemoryStore()
    src, ids = saved_tier(store)
    dst = make_cache()
    mgr = StandInManager()
    with KVTier(store, "m", mgr, dst) as tier:
        assert tier.admit(0, TOKENS) == 5 * BS
        # The confirmed loads come back as stored events: already in the store, not re-saved.
        tier.offer(stored_events(mgr, list(range(20, 25))))
        stats = tier.stats()
    assert stats.offered_blocks == 0
    assert mgr.loadable == 5 and mgr.confirmed == 5
    assert torch.equal(blocks(dst, list(range(20, 25))), blocks(src, ids))
    assert (stats.lookup_blocks, stats.hit_blocks, stats.miss_blocks) == (5, 5, 0)


def test_admission_after_a_gpu_hit_looks_up_only_the_rest() -> None:
    store = MemoryStore()
    src, ids = saved_tier(store)
    dst = make_cache()
    mgr = StandInManager(cached_blocks=2)
    with KVTier(store, "m", mgr, dst) as tier:
        assert tier.admit(0, TOKENS) == 5 * BS
        assert tier.stats().lookup_blocks == 3
    assert torch.equal(blocks(dst, [20, 21, 22]), blocks(src, ids[2:]))


def test_offer_dedups_and_skips_blocks_removed_in_the_same_batch() -> None:
    store = MemoryStore()
    cache = make_cache(seed=2)
    mgr = StandInManager()
    h = mgr.block_hashes(TOKENS)
    with KVTier(store, "m", mgr, cache) as tier:
        tier.offer(
            [
                Ev("stored", h[0], 1),
                Ev("stored", h[1], 2),
                Ev("removed", h[1], 2),  # evicted and maybe refilled already: skipped
                Ev("stored", h[2], 3, medium="CPU"),  # a CPU copy: not read from the GPU
                Ev("stored", h[3], 4),
            ]
        )
        tier.offer([Ev("stored", h[0], 5), Ev("stored", h[4], 6), Ev("cleared", None, None)])
        tier.offer([Ev("stored", h[0], 1), Ev("stored", h[4], 6)])  # h0 again: offered once
        assert tier.flush(5)
        stats = tier.stats()
        keys = tier.namespace.keys(h)
    assert (stats.offered_blocks, stats.saved_blocks) == (3, 3)
    assert [k in store.data for k in keys] == [True, False, False, True, True]


class PutRecordingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.puts: list[int] = []

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], timeout: float) -> None:
        self.puts.append(len(items))
        super().put_many(items, timeout)


def test_an_offer_is_put_in_batches_of_save_batch_blocks() -> None:
    store = PutRecordingStore()
    src = make_cache(seed=5)
    mgr = StandInManager()
    ids = [3, 9, 4, 11, 7]
    with KVTier(store, "m", mgr, src, save_threads=1, save_batch_blocks=2) as tier:
        tier.offer(stored_events(mgr, ids))
        assert tier.flush(5)
        assert tier.stats().saved_blocks == 5
    assert store.puts == [2, 2, 1]
    dst = make_cache()
    with KVTier(store, "m", StandInManager(), dst) as tier:  # every batch holds its own blocks
        assert tier.admit(0, TOKENS) == 5 * BS
    assert torch.equal(blocks(dst, list(range(20, 25))), blocks(src, ids))


def test_host_buffers_are_reused_best_fit_and_bounded() -> None:
    buffers = _HostBuffers(row_bytes=16, pin=False, keep_rows=10)
    eight, four, two = buffers.take(8), buffers.take(4), buffers.take(2)
    assert [b.shape for b in (eight, four, two)] == [(8, 16), (4, 16), (2, 16)]
    buffers.give(eight)
    buffers.give(four)  # 8 + 4 rows would pass the bound of 10: not kept
    buffers.give(two)
    assert buffers.take(1) is two  # the smallest that fits
    assert buffers.take(3) is eight
    assert buffers.take(3).shape == (3, 16)  # none idle: a new one


def test_full_queue_drops_and_counts_without_waiting() -> None:
    store = MemoryStore()
    store.latency = 0.3  # a slow network
    cache = make_cache(seed=3)
    mgr = StandInManager()
    events = stored_events(mgr, [1, 2, 3, 4, 5])
    with KVTier(store, "m", mgr, cache, max_pending_blocks=2) as tier:
        start = time.monotonic()
        for ev in events:
            tier.offer([ev])
        assert time.monotonic() - start < 0.2  # offer never waits for the store
        assert tier.flush(5)
        stats = tier.stats()
    assert stats.offered_blocks == 2 and stats.dropped_blocks == 3 and stats.saved_blocks == 2


@pytest.mark.parametrize(("fault", "counter"), [("down", "errors"), ("slow", "timeouts")])
def test_failed_saves_are_counted(fault: str, counter: str) -> None:
    store = MemoryStore()
    store.down = fault == "down"
    store.latency = 1.0 if fault == "slow" else 0.0
    mgr = StandInManager()
    with KVTier(store, "m", mgr, make_cache(seed=4), save_timeout=0.05) as tier:
        tier.offer(stored_events(mgr, [1, 2]))
        assert tier.flush(5)
        stats = tier.stats()
    assert stats.failed_saves == 2 and stats.saved_blocks == 0
    assert getattr(stats, counter) == 1
    assert not store.data


# ---- read path faults: the affected blocks are recomputed, nothing raises


class LyingStore(MemoryStore):
    """Claims every key exists, so `get_many` meets whatever is really there."""

    def exists_prefix(self, keys: Sequence[bytes], timeout: float) -> int:
        return len(keys)


class FailingGetStore(MemoryStore):
    def __init__(self, err: StoreError) -> None:
        super().__init__()
        self.err = err

    def get_many(self, keys: Sequence[bytes], timeout: float) -> list[bytes | None]:
        raise self.err


def admit_after(
    store: MemoryStore, edit: Any = None, chunk: int = 16
) -> tuple[StandInManager, TierStats]:
    src, ids = saved_tier(store)
    mgr = StandInManager()
    keys = Namespace("m", block_spec(src), mgr.hash_key_fingerprint).keys(mgr.block_hashes(TOKENS))
    if edit is not None:
        edit(store, keys)
    dst = make_cache()
    mgr = StandInManager()
    with KVTier(store, "m", mgr, dst, timeout=0.05, load_chunk_blocks=chunk) as tier:
        computed = tier.admit(0, TOKENS)
        stats = tier.stats()
    assert computed == mgr.num_computed(0)
    loaded = mgr.confirmed or 0
    # Whatever was confirmed holds exactly the saved KV.
    assert torch.equal(blocks(dst, list(range(20, 20 + loaded))), blocks(src, ids[:loaded]))
    return mgr, stats


def test_down_store_loads_nothing() -> None:
    store = MemoryStore()

    def down(s: MemoryStore, keys: list[bytes]) -> None:
        s.down = True

    mgr, stats = admit_after(store, down)
    assert mgr.loadable == 0 and mgr.confirmed is None
    assert (stats.errors, stats.lookup_blocks, stats.miss_blocks) == (1, 5, 5)


def test_slow_store_loads_nothing() -> None:
    def slow(s: MemoryStore, keys: list[bytes]) -> None:
        s.latency = 1.0

    mgr, stats = admit_after(MemoryStore(), slow)
    assert mgr.loadable == 0 and stats.timeouts == 1


def test_missing_key_ends_the_run() -> None:
    mgr, stats = admit_after(MemoryStore(), lambda s, keys: s.data.pop(keys[2]))
    assert mgr.loadable == 2 and mgr.confirmed == 2 and stats.hit_blocks == 2


def test_key_evicted_between_lookup_and_load_ends_the_run() -> None:
    mgr, stats = admit_after(LyingStore(), lambda s, keys: s.data.pop(keys[3]))
    assert mgr.loadable == 5 and mgr.confirmed == 3 and stats.miss_blocks == 2


class ChunkRecordingStore(LyingStore):
    """Records the keys of each `get_many`; the call numbered `fail_call` raises `err`."""

    def __init__(self, fail_call: int | None = None, err: StoreError | None = None) -> None:
        super().__init__()
        self.gets: list[int] = []
        self.fail_call, self.err = fail_call, err

    def get_many(self, keys: Sequence[bytes], timeout: float) -> list[bytes | None]:
        self.gets.append(len(keys))
        if len(self.gets) - 1 == self.fail_call and self.err is not None:
            raise self.err
        return super().get_many(keys, timeout)


def test_loads_fetch_chunks_one_ahead() -> None:
    store = ChunkRecordingStore()
    mgr, stats = admit_after(store, chunk=2)
    assert store.gets == [2, 2, 1]
    assert mgr.confirmed == 5 and stats.hit_blocks == 5


@pytest.mark.parametrize(("missing", "confirmed"), [(1, 1), (2, 2), (3, 3), (4, 4)])
def test_a_missing_key_in_any_chunk_ends_the_run(missing: int, confirmed: int) -> None:
    store = ChunkRecordingStore()
    mgr, stats = admit_after(store, lambda s, keys: s.data.pop(keys[missing]), chunk=2)
    assert mgr.confirmed == confirmed and stats.miss_blocks == 5 - confirmed
    # The chunk holding the gap was fetched; the one after it may have been, ahead.
    assert missing // 2 + 1 <= len(store.gets) <= min(3, missing // 2 + 2)


@pytest.mark.parametrize("err", [StoreError("gone"), StoreTimeout("slow")])
def test_a_failed_chunk_keeps_the_chunks_before_it(err: StoreError) -> None:
    mgr, stats = admit_after(ChunkRecordingStore(fail_call=1, err=err), chunk=2)
    assert mgr.loadable == 5 and mgr.confirmed == 2 and stats.hit_blocks == 2
    assert (stats.errors, stats.timeouts) == ((1, 0) if type(err) is StoreError else (0, 1))


@pytest.mark.parametrize(
    "damage",
    [
        lambda v: v[:-1],  # short
        lambda v: v[:HEADER_SIZE] + bytes([v[HEADER_SIZE] ^ 0xFF]) + v[HEADER_SIZE + 1 :],
        lambda v: b"",
        lambda v: v + b"tail",
    ],
    ids=["short", "flipped", "empty", "long"],
)
def test_corrupt_value_is_a_miss(damage: Any) -> None:
    def corrupt(s: MemoryStore, keys: list[bytes]) -> None:
        s.data[keys[1]] = damage(s.data[keys[1]])

    mgr, stats = admit_after(MemoryStore(), corrupt)
    assert mgr.confirmed == 1 and stats.corrupt_blocks == 1 and stats.hit_blocks == 1


def test_value_under_the_wrong_key_is_a_miss() -> None:
    def swap(s: MemoryStore, keys: list[bytes]) -> None:
        s.data[keys[0]], s.data[keys[1]] = s.data[keys[1]], s.data[keys[0]]

    mgr, stats = admit_after(MemoryStore(), swap)
    assert mgr.confirmed == 0 and stats.corrupt_blocks == 1


@pytest.mark.parametrize("err", [StoreError("gone"), StoreTimeout("slow")])
def test_failed_load_confirms_nothing(err: StoreError) -> None:
    store = FailingGetStore(err)
    mgr, stats = admit_after(store)
    assert mgr.loadable == 5 and mgr.confirmed == 0
    assert (stats.errors, stats.timeouts) == ((1, 0) if type(err) is StoreError else (0, 1))


def test_other_namespace_never_hits() -> None:
    store = MemoryStore()
    saved_tier(store)
    for model, fingerprint in (("other-model", "0123456789abcdef"), ("m", "fedcba9876543210")):
        mgr = StandInManager(fingerprint=fingerprint)
        with KVTier(store, model, mgr, make_cache()) as tier:
            assert tier.admit(0, TOKENS) == 0
            assert tier.stats().hit_blocks == 0


E4M3 = torch.float8_e4m3fn
LAYOUT_CACHES: dict[str, Any] = {
    "HND-float16": {"dtype": torch.float16, "layout": "HND"},
    "NHD-e4m3": {"dtype": E4M3, "scales": [[0.5, 0.25], [1.0, 2.0]]},
    "MLA-e4m3": {"dtype": E4M3, "layout": "MLA", "rope_dim": 4, "scales": [[0.5, 0.25]] * 2},
}


def layout_cache(kind: str, seed: int | None = None, **override: Any) -> KVCache:
    kw = {**LAYOUT_CACHES[kind], **override}
    heads = 1 if kw.get("layout") == "MLA" else 2
    cache = KVCache(2, 32, BS, heads, 8, **kw)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for layer in range(cache.num_layers):
            t = cache.layer(layer)
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


@pytest.mark.parametrize("kind", sorted(LAYOUT_CACHES))
def test_every_layout_saves_and_loads_in_its_own_namespace(kind: str) -> None:
    store, mgr, ids = MemoryStore(), StandInManager(), [3, 9, 4, 11, 7]
    src = layout_cache(kind, seed=2)
    with KVTier(store, "m", mgr, src) as tier:
        tier.offer(stored_events(mgr, ids))
        assert tier.flush(5) and tier.stats().saved_blocks == 5
        namespace = tier.namespace
    assert namespace.spec.layout == src.layout and namespace.spec.scales == (
        tuple(s for layer in range(2) if (s := src.scales(layer)))
    )
    dst = layout_cache(kind)
    with KVTier(store, "m", StandInManager(), dst) as tier:
        assert tier.admit(0, TOKENS) == 5 * BS
    raw = [blocks(c, i).view(torch.uint8) for c, i in ((dst, list(range(20, 25))), (src, ids))]
    assert torch.equal(*raw)
    # Another layout, or the same float8 bytes under other scales, never hits these blocks.
    others = [
        layout_cache(
            kind, layout="NHD" if "MLA" in kind else "MLA", rope_dim=4 * ("MLA" not in kind)
        )
    ]
    if "e4m3" in kind:
        others.append(layout_cache(kind, scales=[[1.0, 1.0]] * 2))
    for other in others:
        with KVTier(store, "m", StandInManager(), other) as tier:
            assert tier.admit(0, TOKENS) == 0


def test_tier_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="block size"):
        KVTier(MemoryStore(), "m", StandInManager(), KVCache(1, 4, 8, 1, 2))
    with pytest.raises(ValueError, match="timeout must be > 0"):
        KVTier(MemoryStore(), "m", StandInManager(), make_cache(), timeout=0)
    with pytest.raises(ValueError, match="max_pending_blocks"):
        KVTier(MemoryStore(), "m", StandInManager(), make_cache(), max_pending_blocks=0)
    with pytest.raises(ValueError, match="save_batch_blocks"):
        KVTier(MemoryStore(), "m", StandInManager(), make_cache(), save_batch_blocks=0)
    with pytest.raises(ValueError, match="load_chunk_blocks"):
        KVTier(MemoryStore(), "m", StandInManager(), make_cache(), load_chunk_blocks=0)
