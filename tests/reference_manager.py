"""A plain, single-threaded Python model of pagedkv's BlockManager.

It implements rust/core/SEMANTICS.md operation by operation with ordinary data structures (a list
as the free stack, an OrderedDict as the cached queue, a dict from hash to block, a refcount list),
so that the stateful test can check the real manager against it block id for block id, and so that
benches/bench_step.py has an honest Python baseline. Hash values differ from the real manager's
(BLAKE2b here, keyed BLAKE3 there); only their structure is comparable.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

try:
    from pagedkv import OutOfBlocks  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # keeps the model usable before the extension is built

    class OutOfBlocks(RuntimeError):  # type: ignore[no-redef,unused-ignore]
        """Not enough free or evictable blocks for the operation."""


I32 = npt.NDArray[np.int32]
TokenIds = Sequence[int] | npt.NDArray[np.integer]
MAX_TOKEN = 2**32 - 1


@dataclass
class RefPlan:
    """The same fields as pagedkv.Plan, built with numpy."""

    kv_indptr: I32
    kv_indices: I32
    kv_last_page_len: I32
    qo_indptr: I32
    slot_mapping: I32
    positions: I32
    block_tables: I32
    batch_size: int
    num_query_tokens: int
    block_size: int


@dataclass
class RefStats:
    """The same fields as pagedkv.Stats."""

    num_blocks: int
    num_free: int
    num_cached: int
    num_held: int
    usage: float
    token_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int


@dataclass
class RefEvent:
    """The same fields as pagedkv.Event; hashes are this model's own."""

    kind: str
    seq_no: int
    block_hash: int | None
    parent_hash: int | None
    token_ids: list[int]


@dataclass
class _Sequence:
    tokens: list[int]
    table: list[int]  # GPU block ids, or CPU block ids while swapped out
    hashes: list[bytes]  # h_i of every full block, whether or not it is registered
    salt_root: bytes
    swapped: bool = False


@dataclass
class _CachedBlock:
    """What the prefix map remembers about a registered block, to verify a hit."""

    block: int
    parent: bytes
    tokens: tuple[int, ...]


@dataclass
class _Counters:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    events: list[RefEvent] = field(default_factory=list)
    next_seq_no: int = 0


# The observable fields both managers expose, for tests comparing them.
STATS_FIELDS = (
    "num_blocks",
    "num_free",
    "num_cached",
    "num_held",
    "usage",
    "token_usage",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "evictions",
)
PLAN_ARRAYS = (
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "qo_indptr",
    "slot_mapping",
    "positions",
    "block_tables",
)


def _int_list(values: Iterable[int] | npt.NDArray[np.integer], what: str) -> list[int]:
    """Check that `values` is a 1-D sequence of integers and return it as a list of ints."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {values.shape}")
        if values.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integers, got dtype {values.dtype}")
        ints: list[int] = values.tolist()
        return ints
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            # The API reports every bad argument as ValueError, type included.
            raise ValueError(f"{what} must hold integers, got {type(v).__name__}")
        out.append(int(v))
    return out


def _tokens(token_ids: TokenIds) -> list[int]:
    """Validate token ids (1-D, integral, in u32 range, non-empty) and return them as ints."""
    values = _int_list(token_ids, "token_ids")
    if not values:
        raise ValueError("token_ids must not be empty")
    for t in values:
        if not 0 <= t <= MAX_TOKEN:
            raise ValueError(f"token id {t} is outside [0, 2**32)")
    return values


def _ids(seq_ids: Iterable[int] | npt.NDArray[np.integer]) -> list[int]:
    """Validate a batch of sequence ids: integral, no repeats."""
    ids = _int_list(seq_ids, "seq_ids")
    if len(set(ids)) != len(ids):
        raise ValueError("seq_ids contains a repeated sequence id")
    return ids


def _as_int(block_hash: bytes | None) -> int | None:
    return None if block_hash is None else int.from_bytes(block_hash, "big")


class ReferenceBlockManager:
    """Block manager with the Python API of pagedkv.BlockManager, written for clarity."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        hash_key: bytes | None = None,
        enable_events: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_cpu_blocks >= 0")
        if not 0.0 <= watermark <= 1.0:
            raise ValueError(f"watermark must be in [0, 1], got {watermark}")
        if hash_key is not None and len(hash_key) != 32:
            raise ValueError("hash_key must be 32 bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.enable_events = enable_events
        self._key = hash_key if hash_key is not None else os.urandom(32)
        # Free stacks: the top is the end of the list, so block 0 is popped first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # head = least recently released
        self._refcount = [0] * num_blocks
        self._cpu_refcount = [0] * num_cpu_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._prefix: dict[bytes, _CachedBlock] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._copies: list[tuple[int, int]] = []
        self._n = _Counters()

    # ---- hashing ---------------------------------------------------------------------------

    def _hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        data = parent + np.asarray(tokens, dtype="<u4").tobytes()
        return hashlib.blake2b(data, digest_size=16, key=self._key).digest()

    def _root(self, salt: bytes | str | None) -> bytes:
        if isinstance(salt, str):
            salt = salt.encode()
        tag = b"root" if salt is None else b"root:" + salt
        return hashlib.blake2b(tag, digest_size=16, key=self._key).digest()

    def _extend_hashes(self, seq: _Sequence) -> None:
        """Compute h_i for every block of `seq` that is full but not hashed yet."""
        bs = self.block_size
        for i in range(len(seq.hashes), len(seq.tokens) // bs):
            parent = seq.hashes[i - 1] if i else seq.salt_root
            seq.hashes.append(self._hash(parent, seq.tokens[i * bs : (i + 1) * bs]))

    def _emit(
        self, kind: str, block_hash: bytes | None, parent: bytes | None, toks: list[int]
    ) -> None:
        if not self.enable_events:
            return
        self._n.events.append(
            RefEvent(kind, self._n.next_seq_no, _as_int(block_hash), _as_int(parent), toks)
        )
        self._n.next_seq_no += 1

    # ---- pool ------------------------------------------------------------------------------

    def _available(self) -> int:
        return len(self._free) + len(self._cached)

    def _take(self) -> int:
        """Pop a free block, or evict the least recently released cached block."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            block_hash = self._block_hash[block]
            assert block_hash is not None
            del self._prefix[block_hash]
            self._block_hash[block] = None
            self._n.evictions += 1
            self._emit("removed", block_hash, None, [])
        self._refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._block_hash[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _acquire_hit(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._cached[block]
        self._refcount[block] += 1

    def _register(self, seq: _Sequence, i: int) -> None:
        """Put full block i of `seq` in the prefix map unless its hash is already there."""
        if not self.enable_prefix_caching:
            return
        block_hash = seq.hashes[i]
        if block_hash in self._prefix:
            return
        block = seq.table[i]
        bs = self.block_size
        parent = seq.hashes[i - 1] if i else seq.salt_root
        toks = tuple(seq.tokens[i * bs : (i + 1) * bs])
        self._prefix[block_hash] = _CachedBlock(block, parent, toks)
        self._block_hash[block] = block_hash
        self._emit("stored", block_hash, seq.hashes[i - 1] if i else None, list(toks))

    def _lookup(self, tokens: list[int], salt: bytes | str | None) -> tuple[list[int], list[bytes]]:
        """Blocks of the longest cached prefix that leaves the last token uncomputed."""
        hits: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return hits, hashes
        bs = self.block_size
        parent = self._root(salt)
        i = 0
        while (i + 1) * bs <= len(tokens) - 1:
            toks = tokens[i * bs : (i + 1) * bs]
            block_hash = self._hash(parent, toks)
            entry = self._prefix.get(block_hash)
            if entry is None or entry.parent != parent or entry.tokens != tuple(toks):
                break
            hits.append(entry.block)
            hashes.append(block_hash)
            parent = block_hash
            i += 1
        return hits, hashes

    def _alloc_needed(self, tokens: list[int], hits: list[int]) -> int:
        n = math.ceil(len(tokens) / self.block_size)
        return (n - len(hits)) + sum(1 for b in hits if self._refcount[b] == 0)

    def _out_of_blocks(self, needed: int, available: int, pool: str) -> OutOfBlocks:
        return OutOfBlocks(f"{pool}: needed {needed} blocks, {available} available")

    # ---- sequence lookups ------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        return seq

    def _gpu_seq(self, seq_id: int) -> _Sequence:
        seq = self._seq(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq

    # ---- operations ------------------------------------------------------------------------

    def allocate(self, seq_id: int, token_ids: TokenIds, *, salt: bytes | str | None = None) -> int:
        """Admit a sequence; return how many prompt tokens the prefix cache already holds."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        tokens = _tokens(token_ids)
        hits, hit_hashes = self._lookup(tokens, salt)
        needed = self._alloc_needed(tokens, hits)
        if needed > self._available():
            raise self._out_of_blocks(needed, self._available(), "GPU")
        for block in hits:
            self._acquire_hit(block)
        n = math.ceil(len(tokens) / self.block_size)
        table = hits + [self._take() for _ in range(n - len(hits))]
        seq = _Sequence(tokens, table, hit_hashes, self._root(salt))
        self._extend_hashes(seq)
        for i in range(len(hits), len(seq.hashes)):
            self._register(seq, i)
        self._seqs[seq_id] = seq
        self._n.prefix_query_tokens += len(tokens)
        hit_tokens = len(hits) * self.block_size
        self._n.prefix_hit_tokens += hit_tokens
        return hit_tokens

    def can_allocate(self, token_ids: TokenIds, *, salt: bytes | str | None = None) -> bool:
        """Whether `allocate` would succeed and leave the watermark reserve untouched.

        An empty prompt is not an error here, just something that cannot be allocated.
        """
        if len(token_ids) == 0:
            return False
        tokens = _tokens(token_ids)
        hits, _ = self._lookup(tokens, salt)
        reserve = math.floor(self.watermark * self.num_blocks)
        return self._available() - self._alloc_needed(tokens, hits) >= reserve

    def _append_needed(self, seq: _Sequence, m: int) -> int:
        bs = self.block_size
        length = len(seq.tokens)
        cow = 1 if length % bs and self._refcount[seq.table[-1]] > 1 else 0
        return cow + math.ceil((length + m) / bs) - math.ceil(length / bs)

    def _append(self, seq: _Sequence, tokens: list[int]) -> None:
        """Append with capacity already checked: CoW, new blocks, then registration."""
        bs = self.block_size
        length = len(seq.tokens)
        if length % bs and self._refcount[seq.table[-1]] > 1:
            src = seq.table[-1]
            dst = self._take()
            self._copies.append((src, dst))
            self._release(src)
            seq.table[-1] = dst
        for _ in range(math.ceil((length + len(tokens)) / bs) - math.ceil(length / bs)):
            seq.table.append(self._take())
        first_new_full = len(seq.hashes)
        seq.tokens.extend(tokens)
        self._extend_hashes(seq)
        for i in range(first_new_full, len(seq.hashes)):
            self._register(seq, i)

    def append(self, seq_id: int, token_ids: TokenIds) -> None:
        """Append one or more tokens to a running sequence."""
        seq = self._gpu_seq(seq_id)
        tokens = _tokens(token_ids)
        needed = self._append_needed(seq, len(tokens))
        if needed > self._available():
            raise self._out_of_blocks(needed, self._available(), "GPU")
        self._append(seq, tokens)

    def step(
        self, seq_ids: Iterable[int] | npt.NDArray[np.integer], token_ids: TokenIds
    ) -> RefPlan:
        """Append one decode token to each sequence, then plan the batch with q = 1."""
        ids = _ids(seq_ids)
        tokens = _tokens(token_ids) if len(ids) else []
        if len(tokens) != len(ids):
            raise ValueError(f"{len(ids)} sequences but {len(tokens)} tokens")
        seqs = [self._gpu_seq(s) for s in ids]
        needed = sum(self._append_needed(seq, 1) for seq in seqs)
        if needed > self._available():
            raise self._out_of_blocks(needed, self._available(), "GPU")
        for seq, token in zip(seqs, tokens, strict=True):
            self._append(seq, [token])
        return self.plan(ids, [1] * len(ids))

    def plan(
        self,
        seq_ids: Iterable[int] | npt.NDArray[np.integer],
        query_lens: Iterable[int] | npt.NDArray[np.integer],
    ) -> RefPlan:
        """Build the attention metadata for a batch: CSR page table, slots, positions."""
        ids = _ids(seq_ids)
        qs = _int_list(query_lens, "query_lens")
        if len(qs) != len(ids):
            raise ValueError(f"{len(ids)} sequences but {len(qs)} query lengths")
        seqs = [self._gpu_seq(s) for s in ids]
        for seq_id, seq, q in zip(ids, seqs, qs, strict=True):
            if not 1 <= q <= len(seq.tokens):
                raise ValueError(
                    f"query length {q} of sequence {seq_id} is outside [1, num_tokens]"
                )
        bs = self.block_size
        kv_indptr, kv_indices, last_page, qo_indptr = [0], [], [], [0]
        slots, positions = [], []
        for seq, q in zip(seqs, qs, strict=True):
            kv_len = len(seq.tokens)
            pages = math.ceil(kv_len / bs)
            kv_indices.extend(seq.table[:pages])
            kv_indptr.append(kv_indptr[-1] + pages)
            last_page.append(kv_len - (pages - 1) * bs)
            qo_indptr.append(qo_indptr[-1] + q)
            for p in range(kv_len - q, kv_len):
                positions.append(p)
                slots.append(seq.table[p // bs] * bs + p % bs)
        width = max((len(seq.table) for seq in seqs), default=0)
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.table)] = seq.table
        return RefPlan(
            kv_indptr=np.array(kv_indptr, dtype=np.int32),
            kv_indices=np.array(kv_indices, dtype=np.int32),
            kv_last_page_len=np.array(last_page, dtype=np.int32),
            qo_indptr=np.array(qo_indptr, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int32),
            positions=np.array(positions, dtype=np.int32),
            block_tables=tables,
            batch_size=len(seqs),
            num_query_tokens=qo_indptr[-1],
            block_size=bs,
        )

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make `child_id` share every block of `parent_id`."""
        parent = self._gpu_seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already exists")
        for block in parent.table:
            self._refcount[block] += 1
        self._seqs[child_id] = _Sequence(
            list(parent.tokens), list(parent.table), list(parent.hashes), parent.salt_root
        )

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first, and forget it."""
        seq = self._seq(seq_id)
        for block in reversed(seq.table):
            if seq.swapped:
                self._cpu_refcount[block] -= 1
                if self._cpu_refcount[block] == 0:
                    self._cpu_free.append(block)
            else:
                self._release(block)
        del self._seqs[seq_id]

    def take_copies(self) -> I32:
        """Copy-on-write (src, dst) pairs recorded since the last call."""
        pairs = np.array(self._copies, dtype=np.int32).reshape(-1, 2)
        self._copies = []
        return pairs

    def swap_out(self, seq_ids: Iterable[int] | npt.NDArray[np.integer]) -> I32:
        """Move sequences to CPU blocks; return the (gpu, cpu) pairs to copy."""
        ids = _ids(seq_ids)
        seqs = [self._gpu_seq(s) for s in ids]
        refs: dict[int, int] = {}  # distinct GPU blocks in first-appearance order
        for seq in seqs:
            for block in seq.table:
                refs[block] = refs.get(block, 0) + 1
        if len(refs) > len(self._cpu_free):
            raise self._out_of_blocks(len(refs), len(self._cpu_free), "CPU")
        mapping: dict[int, int] = {}
        for gpu, count in refs.items():
            cpu = self._cpu_free.pop()
            self._cpu_refcount[cpu] = count
            mapping[gpu] = cpu
        for seq in seqs:
            for block in reversed(seq.table):
                self._release(block)
            seq.table = [mapping[b] for b in seq.table]
            seq.swapped = True
        return np.array(list(mapping.items()), dtype=np.int32).reshape(-1, 2)

    def swap_in(self, seq_ids: Iterable[int] | npt.NDArray[np.integer]) -> I32:
        """Bring swapped-out sequences back to GPU blocks; return the (cpu, gpu) pairs."""
        ids = _ids(seq_ids)
        seqs = [self._seq(s) for s in ids]
        for seq_id, seq in zip(ids, seqs, strict=True):
            if not seq.swapped:
                raise ValueError(f"sequence {seq_id} is not swapped out")
        refs: dict[int, int] = {}  # distinct CPU blocks in first-appearance order
        for seq in seqs:
            for block in seq.table:
                refs[block] = refs.get(block, 0) + 1
        if len(refs) > self._available():
            raise self._out_of_blocks(len(refs), self._available(), "GPU")
        mapping: dict[int, int] = {}
        for cpu, count in refs.items():
            gpu = self._take()
            self._refcount[gpu] = count
            mapping[cpu] = gpu
        for seq in seqs:
            for block in reversed(seq.table):
                self._cpu_refcount[block] -= 1
                if self._cpu_refcount[block] == 0:
                    self._cpu_free.append(block)
        for seq in seqs:
            seq.table = [mapping[b] for b in seq.table]
            seq.swapped = False
        for seq in seqs:
            for i in range(len(seq.hashes)):
                self._register(seq, i)
        return np.array(list(mapping.items()), dtype=np.int32).reshape(-1, 2)

    def block_table(self, seq_id: int) -> I32:
        """The sequence's GPU block ids in logical order."""
        return np.array(self._gpu_seq(seq_id).table, dtype=np.int32)

    def num_tokens(self, seq_id: int) -> int:
        """How many tokens the sequence holds."""
        return len(self._seq(seq_id).tokens)

    def token_ids(self, seq_id: int) -> npt.NDArray[np.uint32]:
        """The sequence's tokens."""
        return np.array(self._seq(seq_id).tokens, dtype=np.uint32)

    def reset_prefix_cache(self) -> None:
        """Forget every hash: cached blocks become free, held blocks lose their hash."""
        for block in self._cached:
            self._free.append(block)
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._prefix.clear()
        self._emit("cleared", None, None, [])

    def stats(self) -> RefStats:
        """Block counts, token-level usage, prefix hit counters and evictions."""
        bs = self.block_size
        stored: dict[int, int] = {}  # a shared block counts once
        for seq in self._seqs.values():
            if seq.swapped:
                continue
            for i, block in enumerate(seq.table):
                stored[block] = min(bs, len(seq.tokens) - i * bs)
        held = self.num_blocks - len(self._free) - len(self._cached)
        return RefStats(
            num_blocks=self.num_blocks,
            num_free=len(self._free),
            num_cached=len(self._cached),
            num_held=held,
            usage=held / self.num_blocks,
            token_usage=sum(stored.values()) / (held * bs) if held else 0.0,
            prefix_query_tokens=self._n.prefix_query_tokens,
            prefix_hit_tokens=self._n.prefix_hit_tokens,
            evictions=self._n.evictions,
        )

    def take_events(self) -> list[RefEvent]:
        """Events since the last call."""
        events, self._n.events = self._n.events, []
        return events

    def check(self) -> None:
        """Verify the model's own invariants (refcounts match holders, states partition)."""
        holders = [0] * self.num_blocks
        cpu_holders = [0] * self.num_cpu_blocks
        for seq in self._seqs.values():
            for block in seq.table:
                if seq.swapped:
                    cpu_holders[block] += 1
                else:
                    holders[block] += 1
        if holders != self._refcount or cpu_holders != self._cpu_refcount:
            raise RuntimeError("refcount differs from the number of holders")
        free, cached = set(self._free), set(self._cached)
        held = {b for b in range(self.num_blocks) if self._refcount[b] > 0}
        if len(free) + len(cached) + len(held) != self.num_blocks or free & cached:
            raise RuntimeError("block states do not partition the pool")
        if any(self._block_hash[b] is not None for b in free) or any(
            self._block_hash[b] is None for b in cached
        ):
            raise RuntimeError("free blocks must be unhashed and cached blocks hashed")
        for block_hash, entry in self._prefix.items():
            if self._block_hash[entry.block] != block_hash:
                raise RuntimeError("prefix map and block hashes disagree")
        if sum(h is not None for h in self._block_hash) != len(self._prefix):
            raise RuntimeError("a hashed block is missing from the prefix map")

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)
