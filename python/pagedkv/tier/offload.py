"""`KVTier`: the engine's glue to an external KV store.

Write path: after each step the engine hands the manager's events to `offer`. Each block whose
KV became computed ("stored" on the GPU) is offered once per hash: its device-to-host copy is
enqueued right away, so a later step that overwrites the block cannot race it, and a background
thread waits for the copy, encodes the block and puts it. The step loop never waits on the
network; when more than `max_pending_blocks` wait, new blocks are dropped and counted.

Read path: `admit` replaces `BlockManager.allocate` for a new prompt. After the GPU prefix hit
it asks the store, in one call, how many of the following blocks exist, admits the sequence with
those blocks to be loaded, fetches them in one call, writes the valid consecutive run into its
fresh GPU blocks and confirms them. Anything that goes wrong with the store (down, timeout,
missing, short or corrupt value) leaves the affected blocks to be recomputed by the normal
prefill, and is counted in `stats()`; it never raises into the engine.

Hybrid models: with a `HybridManager` (built with `block_feed=True`) and a `GroupedKVCache`,
every KV-cache group is a lane with its own key space (`GroupKey`). The engine hands `offer`
the manager's `take_registrations()` (every group's newly registered blocks with their hash in
the group's chain; the router events announce group 0 alone). At admission the full-attention
groups' blocks past the GPU hit are looked up in one call, then the blocks the window groups'
next query reads at the end of that run, in a second; each group loads its own blocks, and
`confirm_loads` keeps the longest hit every group serves (a short run in one group shortens
it for all; the rest is recomputed). Recurrent states are not stored: a manager with a state
group is refused.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pagedkv._core import BlockManager, HybridManager
from pagedkv.grouped_cache import GroupedKVCache
from pagedkv.kv_cache import HostBlocks, KVCache
from pagedkv.tier.codec import HEADER_SIZE, BlockSpec, CorruptValue, decode, encode_into
from pagedkv.tier.lanes import Lane, cache_block_size, lanes_of
from pagedkv.tier.store import Store, StoreError, StoreTimeout


class BlockEvent(Protocol):
    """The fields of a `pagedkv.Event` the tier reads."""

    @property
    def kind(self) -> str: ...
    @property
    def block_hash(self) -> int | None: ...
    @property
    def medium(self) -> str: ...
    @property
    def block_id(self) -> int | None: ...


class GroupRegistration(Protocol):
    """The fields of a `HybridManager.take_registrations()` entry the tier reads."""

    @property
    def kind(self) -> str: ...
    @property
    def group(self) -> int | None: ...
    @property
    def block_hash(self) -> int | None: ...
    @property
    def block_id(self) -> int | None: ...


@dataclass(frozen=True)
class TierStats:
    """What the tier did so far. Misses include corrupt blocks and failed lookups."""

    lookup_blocks: int = 0  # blocks after the GPU prefix hit asked of the store
    hit_blocks: int = 0  # blocks loaded from the store and confirmed (all groups)
    corrupt_blocks: int = 0  # values rejected (header, length or checksum)
    timeouts: int = 0  # store calls that ran out of time
    errors: int = 0  # store calls that failed otherwise
    offered_blocks: int = 0  # computed blocks taken for saving (once per hash)
    saved_blocks: int = 0  # blocks the store accepted
    dropped_blocks: int = 0  # blocks not saved because the save queue was full
    failed_saves: int = 0  # blocks whose put failed
    group_hit_blocks: tuple[int, ...] = ()  # `hit_blocks` per KV-cache group

    @property
    def miss_blocks(self) -> int:
        """Looked-up blocks that were not loaded."""
        return self.lookup_blocks - self.hit_blocks


@dataclass
class _SaveBatch:
    lane: Lane
    hashes: list[int]
    buffer: torch.Tensor  # from `_HostBuffers`, given back once the batch is saved or failed
    values: torch.Tensor  # uint8 [n, HEADER_SIZE + payload] rows of `buffer`
    blocks: HostBlocks  # the copy into `values`, maybe in flight


class _HostBuffers:
    """Host buffers for save batches, reused: fresh host memory costs a page fault per page on
    first touch (pinned memory on CUDA costs far more to allocate). Idle buffers hold at most
    `keep_rows` rows in all, so the memory kept is what the most saves in flight at once
    needed, up to that bound."""

    def __init__(self, row_bytes: int, pin: bool, keep_rows: int) -> None:
        self._row_bytes = row_bytes
        self._pin = pin
        self._keep_rows = keep_rows
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, rows: int) -> torch.Tensor:
        """A uint8 buffer of at least `rows` rows: the smallest idle one that fits, else new."""
        with self._lock:
            fits = [i for i, buffer in enumerate(self._idle) if buffer.shape[0] >= rows]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].shape[0]))
        return torch.empty((rows, self._row_bytes), dtype=torch.uint8, pin_memory=self._pin)

    def give(self, buffer: torch.Tensor) -> None:
        """Returns a buffer nobody reads or writes any more."""
        with self._lock:
            if sum(b.shape[0] for b in self._idle) + buffer.shape[0] <= self._keep_rows:
                self._idle.append(buffer)


class KVTier:
    """Saves computed blocks of `cache` to `store` and loads prompts' blocks from it.

    `manager` is a `BlockManager` with a `KVCache`, or a `HybridManager` built with
    `block_feed=True` (no state group) with the `GroupedKVCache` of its groups. `model_id`
    names the weights (blocks are shared only between engines with equal model id, KV shape,
    dtype, groups and hash key). `timeout` bounds each admission lookup and load (seconds),
    `save_timeout` each background put; `save_threads` threads encode and put concurrently, so
    one batch's checksum overlaps another's network transfer. An offer is put in batches of at
    most `save_batch_blocks`, so the first leaves while the rest are copied; the host buffers
    they are copied into are reused (idle ones hold at most `max_pending_blocks` blocks).
    Loads fetch `load_chunk_blocks` blocks per call, the next chunk in flight while one is
    checked and copied. Call `close()` (or use it as a context manager) to finish the saves in
    flight.
    """

    def __init__(
        self,
        store: Store,
        model_id: str,
        manager: BlockManager | HybridManager,
        cache: KVCache | GroupedKVCache,
        *,
        timeout: float = 1.0,
        save_timeout: float = 5.0,
        max_pending_blocks: int = 1024,
        dedup_capacity: int = 1 << 16,
        save_threads: int = 2,
        save_batch_blocks: int = 8,
        load_chunk_blocks: int = 16,
    ) -> None:
        if manager.block_size != cache_block_size(cache):
            raise ValueError(
                f"manager block size {manager.block_size} != cache block size "
                f"{cache_block_size(cache)}"
            )
        fingerprint = manager.hash_key_fingerprint
        if fingerprint is None:
            raise ValueError("an external KV tier needs a manager with prefix caching enabled")
        for name, value in (("timeout", timeout), ("save_timeout", save_timeout)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        counts = (max_pending_blocks, dedup_capacity, save_threads, save_batch_blocks)
        if min(*counts, load_chunk_blocks) < 1:
            raise ValueError(
                "max_pending_blocks, dedup_capacity, save_threads, save_batch_blocks and "
                "load_chunk_blocks must be >= 1"
            )
        self.store = store
        self.manager = manager
        self.cache = cache
        self.lanes = lanes_of(model_id, manager, cache, fingerprint)
        self.spec = self.lanes[0].spec
        self.namespace = self.lanes[0].namespace
        self.timeout = timeout
        self.save_timeout = save_timeout
        self.max_pending_blocks = max_pending_blocks
        self.load_chunk_blocks = load_chunk_blocks
        self.save_batch_blocks = save_batch_blocks
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tier-loader")
        self._dedup_capacity = dedup_capacity
        self._offered: OrderedDict[tuple[int, int], None] = OrderedDict()  # engine thread only
        self._stats = TierStats(group_hit_blocks=(0,) * len(self.lanes))
        self._stats_lock = threading.Lock()
        self._queue: deque[_SaveBatch] = deque()
        self._buffers = _HostBuffers(
            HEADER_SIZE + self.spec.payload_size,
            self.lanes[0].cache.device.type == "cuda",
            keep_rows=max_pending_blocks,
        )
        self._pending = 0  # blocks queued or being saved
        self._closing = False
        self._cond = threading.Condition()
        self._savers = [
            threading.Thread(target=self._save_loop, name=f"pagedkv-tier-saver-{i}", daemon=True)
            for i in range(save_threads)
        ]
        for saver in self._savers:
            saver.start()

    # ---- counters

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            return self._stats

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    def _count_hits(self, per_group: Sequence[int]) -> None:
        with self._stats_lock:
            s = self._stats
            groups = tuple(a + b for a, b in zip(s.group_hit_blocks, per_group, strict=True))
            self._stats = replace(
                s, hit_blocks=s.hit_blocks + sum(per_group), group_hit_blocks=groups
            )

    def _count_failure(self, err: Exception) -> None:
        self._count(**{"timeouts" if isinstance(err, StoreTimeout) else "errors": 1})

    # ---- write path

    def offer(self, events: Iterable[BlockEvent] | Iterable[GroupRegistration]) -> None:
        """Queue the newly computed GPU blocks among `events` for saving.

        Pass every batch of `BlockManager.take_events()` (of `HybridManager.take_registrations()`
        for a hybrid manager) as taken, before the next forward pass is enqueued: a block stored
        and then removed within one batch may hold other KV by now, so it is skipped.
        """
        stored: dict[tuple[int, int], int] = {}  # (group, block id) -> hash, in event order
        for ev in events:
            where = _block_of(ev)
            if ev.kind == "cleared":
                stored.clear()
            elif where is None:
                continue
            elif ev.kind == "removed":
                stored.pop(where, None)
            elif ev.kind == "stored" and ev.block_hash is not None:
                stored[where] = ev.block_hash
        fresh = [(g, b, h) for (g, b), h in stored.items() if (g, h) not in self._offered]
        if not fresh:
            return
        with self._cond:
            room = max(0, self.max_pending_blocks - self._pending)
            taken = fresh[:room]
            self._pending += len(taken)
        if len(taken) < len(fresh):
            self._count(dropped_blocks=len(fresh) - len(taken))
        if not taken:
            return
        for g, _, h in taken:
            self._remember(g, h)
        self._count(offered_blocks=len(taken))
        for g, lane in enumerate(self.lanes):
            mine = [(b, h) for group, b, h in taken if group == g]
            # Puts of at most `save_batch_blocks`: the first leaves while the rest are copied.
            for lo in range(0, len(mine), self.save_batch_blocks):
                part = mine[lo : lo + self.save_batch_blocks]
                ids = np.fromiter((b for b, _ in part), dtype=np.int64, count=len(part))
                batch = self._read(lane, ids, [h for _, h in part])
                with self._cond:
                    self._queue.append(batch)
                    self._cond.notify_all()

    def _read(self, lane: Lane, block_ids: npt.NDArray[np.int64], hashes: list[int]) -> _SaveBatch:
        """Enqueue the copy of `block_ids` into values with room for their headers."""
        c, n = lane.cache, len(hashes)
        buffer = self._buffers.take(n)
        values = buffer[:n]
        shape = (n, c.num_layers, *c.page_shape)
        blocks = values[:, HEADER_SIZE:].view(c.dtype).view(shape)
        return _SaveBatch(lane, hashes, buffer, values, c.read_blocks(block_ids, out=blocks))

    def _remember(self, group: int, block_hash: int) -> None:
        self._offered[group, block_hash] = None
        if len(self._offered) > self._dedup_capacity:
            self._offered.popitem(last=False)

    def _save_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()
            try:
                self._save(batch)
            finally:
                self._buffers.give(batch.buffer)
                with self._cond:
                    self._pending -= len(batch.hashes)
                    self._cond.notify_all()

    def _save(self, batch: _SaveBatch) -> None:
        n, lane = len(batch.hashes), batch.lane
        try:
            batch.blocks.ready()
            values = [row.data for row in batch.values.numpy()]
            for h, value in zip(batch.hashes, values, strict=True):
                encode_into(lane.spec, h, value)
            self.store.put_many(
                list(zip(lane.namespace.keys(batch.hashes), values, strict=True)),
                self.save_timeout,
            )
        except Exception as e:  # a failed save only costs a later recomputation
            self._count(failed_saves=n)
            self._count_failure(e)
            return
        self._count(saved_blocks=n)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is saved or failed; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish the queued saves and stop the background thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for saver in self._savers:
            saver.join()
        self._loader.shutdown()

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- read path

    def admit(
        self, seq_id: int, token_ids: Sequence[int], *, salt: bytes | str | None = None
    ) -> int:
        """Admit a new sequence like `allocate`, loading what the store holds.

        Returns the prompt tokens whose KV is computed (GPU prefix hit plus loaded blocks); the
        engine prefills the rest. Manager errors (`OutOfBlocks`, bad input) propagate as from
        `allocate`; store faults only shorten the loaded run.
        """
        mgr, bs = self.manager, self.manager.block_size
        tokens = list(token_ids)
        hashes = self._hashes(tokens, salt)
        # A full-prompt hit must still leave its last token to compute.
        hittable = min(len(hashes[0]), (len(tokens) - 1) // bs)
        k = mgr.cached_prefix_blocks(tokens, salt=salt)
        end = self._lookup(hashes, k, hittable)
        reused, load_ids = self._allocate_loading(seq_id, tokens, end, salt)
        hit = reused // bs
        end = max(hit, min(end, hittable))
        if end == hit:
            return mgr.num_computed(seq_id)
        runs = []
        for lane, ids, group_hashes in zip(self.lanes, load_ids, hashes, strict=True):
            wanted = group_hashes[end - len(ids) : end]
            runs.append(self._load(lane, wanted, np.asarray(ids)) if len(ids) else 0)
        self._confirm(seq_id, runs)
        # Each group loaded what a query at the new hit reads past the old one.
        upto = mgr.num_computed(seq_id) // bs
        firsts = [lane.reads_from(hit, upto, bs) for lane in self.lanes]
        self._count_hits([upto - first for first in firsts])
        for g, (first, group_hashes) in enumerate(zip(firsts, hashes, strict=True)):
            for h in group_hashes[first:upto]:
                self._remember(g, h)  # already in the store: never saved back
        return mgr.num_computed(seq_id)

    def _hashes(self, tokens: list[int], salt: bytes | str | None) -> list[list[int]]:
        """Each group's chain hashes over the prompt's full blocks."""
        mgr = self.manager
        if isinstance(mgr, HybridManager):
            return [mgr.block_hashes(tokens, salt=salt, group=g) for g in range(len(self.lanes))]
        return [mgr.block_hashes(tokens, salt=salt)]

    def _allocate_loading(
        self, seq_id: int, tokens: list[int], end: int, salt: bytes | str | None
    ) -> tuple[int, list[npt.NDArray[np.int32]]]:
        mgr = self.manager
        if isinstance(mgr, HybridManager):
            return mgr.allocate_loading(seq_id, tokens, end, salt=salt)
        reused, ids = mgr.allocate_loading(seq_id, tokens, end, salt=salt)
        return reused, [ids]

    def _confirm(self, seq_id: int, runs: list[int]) -> None:
        mgr = self.manager
        if isinstance(mgr, HybridManager):
            mgr.confirm_loads(seq_id, runs)
        else:
            mgr.confirm_loads(seq_id, runs[0])

    def _lookup(self, hashes: list[list[int]], hit: int, hittable: int) -> int:
        """The end (in blocks) of the longest hit past `hit` the store can serve in every group
        (`hit` when it fails): the full-attention groups' blocks from the hit on in one call,
        then the window groups' blocks a query at that end reads in another."""
        if hittable <= hit:
            return hit
        bs = self.manager.block_size
        full = [g for g, lane in enumerate(self.lanes) if lane.attention.kind == "full"]
        end = hittable
        if full:
            per_block = [self.lanes[g].namespace.keys(hashes[g][hit:hittable]) for g in full]
            keys = [key for block in zip(*per_block, strict=True) for key in block]
            end = hit + self._exists(keys) // len(full)
        windows = [g for g in range(len(self.lanes)) if g not in full]
        if not windows or end == hit:
            return end
        starts = [self.lanes[g].reads_from(hit, end, bs) for g in windows]
        keys = [
            key
            for g, start in zip(windows, starts, strict=True)
            for key in self.lanes[g].namespace.keys(hashes[g][start:end])
        ]
        present = self._exists(keys)  # a leading run over the groups' blocks, in order
        runs = []
        for start in starts:
            runs.append(min(present, end - start))
            present = max(0, present - (end - start)) if runs[-1] == end - start else 0
        lanes = [self.lanes[g] for g in windows]
        return max(
            h
            for h in range(hit, end + 1)
            if h == hit
            or all(
                h <= start + run and lane.reads_from(hit, h, bs) >= start
                for lane, start, run in zip(lanes, starts, runs, strict=True)
            )
        )

    def _exists(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, the store holds (0 when it fails)."""
        if not keys:
            return 0
        self._count(lookup_blocks=len(keys))
        try:
            return self.store.exists_prefix(keys, self.timeout)
        except StoreError as e:
            self._count_failure(e)
            return 0

    def _load(self, lane: Lane, hashes: list[int], block_ids: npt.NDArray[Any]) -> int:
        """Fetch `hashes` into `block_ids`; the length of the valid consecutive run written.

        Chunks of `load_chunk_blocks` are fetched one ahead: the next chunk is on the wire
        while this one is checked and copied into the cache.
        """
        keys = lane.namespace.keys(hashes)
        chunk = self.load_chunk_blocks
        ahead: Future[list[bytes | None]] | None = None
        ok = 0
        try:
            for lo in range(0, len(keys), chunk):
                wanted = keys[lo : lo + chunk]
                if ahead is None:
                    values = self._get(wanted)
                else:
                    values = ahead.result(self.timeout)
                    ahead = None
                if lo + chunk < len(keys):
                    ahead = self._loader.submit(self._get, keys[lo + chunk : lo + 2 * chunk])
                run = self._valid_run(lane.spec, hashes[lo : lo + len(wanted)], values)
                lane.cache.write_block_bytes(block_ids[ok : ok + len(run)], run)
                ok += len(run)
                if len(run) < len(wanted):
                    break
        except Exception as e:  # the rest is recomputed; the engine loop goes on
            self._count_failure(StoreTimeout(str(e)) if isinstance(e, FutureTimeout) else e)
        finally:
            if ahead is not None:
                ahead.cancel()
        return ok

    def _get(self, keys: list[bytes]) -> list[bytes | None]:
        values = self.store.get_many(keys, self.timeout)
        if len(values) != len(keys):
            raise StoreError(f"asked for {len(keys)} values, got {len(values)}")
        return values

    def _valid_run(
        self, spec: BlockSpec, hashes: list[int], values: list[bytes | None]
    ) -> list[memoryview]:
        """The payloads of the leading run of `values` that are present and valid."""
        payloads: list[memoryview] = []
        for h, value in zip(hashes, values, strict=True):
            if value is None:
                break
            try:
                payloads.append(decode(spec, h, value))
            except CorruptValue:
                self._count(corrupt_blocks=1)
                break
        return payloads


def _block_of(ev: BlockEvent | GroupRegistration) -> tuple[int, int] | None:
    """`(group, block id)` of a GPU block an event or registration names, else None."""
    if ev.block_id is None:
        return None
    group = getattr(ev, "group", None)
    if group is not None:
        return group, ev.block_id
    return (0, ev.block_id) if getattr(ev, "medium", "GPU") == "GPU" else None
