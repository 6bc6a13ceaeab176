"""The Python baseline of benches/bench_step.py: a plain, single-threaded paged block manager.

It does what that bench's continuous-batching loop needs, the way one would write it in Python
with ordinary data structures (a list as the free stack, an OrderedDict as the cached queue, a
dict from hash to block, refcount lists): prompt admission with prefix reuse, the prefill's
plan, decode steps with auto-commit (a sequence's previous step computed, its newly full blocks
registered), eviction of the least recently released cached block, and free. No forks, swaps,
events or external loads: the bench uses none, and pagedkv's own oracle is the Rust model test
(rust/core/tests/model.rs). The bench asserts that both managers make identical decisions on its
trace (prefix hits, steps, preemptions, plan digests), so a baseline that drifts from
rust/core/SEMANTICS.md fails `bench_step.py --quick` in CI.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv import OutOfBlocks

I32 = npt.NDArray[np.int32]
Ints = Iterable[int] | npt.NDArray[np.integer]
MAX_TOKEN = 2**32 - 1
WATERMARK = 0.01  # pagedkv's default


@dataclass
class BaselinePlan:
    """The fields of pagedkv.Plan, built with numpy."""

    kv_indptr: I32
    kv_indices: I32
    kv_last_page_len: I32
    qo_indptr: I32
    slot_mapping: I32
    positions: I32
    block_tables: I32
    batch_size: int
    num_query_tokens: int


@dataclass
class BaselineStats:
    """The prefix-cache counters of pagedkv.Stats."""

    prefix_query_tokens: int
    prefix_hit_tokens: int


@dataclass
class _Sequence:
    tokens: list[int]
    table: list[int]
    hashes: list[bytes]  # the hash of every full block, registered or not
    root: bytes
    planned: int  # tokens some plan covered: computed at the sequence's next step
    registered: int  # full blocks 0..registered were offered to the prefix cache


@dataclass
class _CachedBlock:
    """What the prefix map remembers about a registered block, to verify a hit."""

    block: int
    parent: bytes
    tokens: tuple[int, ...]


def _int_list(values: Ints, what: str, *, limit: int | None = None) -> list[int]:
    """`values` as ints, each checked to be in [0, limit]."""
    ints: list[int] = (
        values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]
    )
    for v in ints:
        if v < 0 or (limit is not None and v > limit):
            raise ValueError(f"{what} must be in [0, {limit}], got {v}")
    return ints


class PythonBlockManager:
    """A pure-Python block manager with the subset of pagedkv.BlockManager's API the bench uses."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, hash_key: bytes) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._key = hash_key
        # Free stack: the top is the end of the list, so block 0 is popped first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # head = least recently released
        self._refcount = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._prefix: dict[bytes, _CachedBlock] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._query_tokens = 0
        self._hit_tokens = 0

    # ---- hashing and the prefix cache ------------------------------------------------------

    def _hash(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        data = parent + np.asarray(tokens, dtype="<u4").tobytes()
        return hashlib.blake2b(data, digest_size=16, key=self._key).digest()

    def _root(self) -> bytes:
        return hashlib.blake2b(b"root", digest_size=16, key=self._key).digest()

    def _extend_hashes(self, seq: _Sequence) -> None:
        """Hash every full block of `seq` not hashed yet."""
        bs = self.block_size
        for i in range(len(seq.hashes), len(seq.tokens) // bs):
            parent = seq.hashes[i - 1] if i else seq.root
            seq.hashes.append(self._hash(parent, seq.tokens[i * bs : (i + 1) * bs]))

    def _lookup(self, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """Blocks of the longest cached prefix that leaves the last token uncomputed."""
        bs = self.block_size
        hits: list[int] = []
        hashes: list[bytes] = []
        parent = self._root()
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

    def _register(self, seq: _Sequence, i: int) -> None:
        """Put full block i of `seq` in the prefix map unless its hash is already there or the
        sequence's own block i - 1 is not registered (one tree, SEMANTICS.md)."""
        block_hash = seq.hashes[i]
        if block_hash in self._prefix or (i and self._block_hash[seq.table[i - 1]] is None):
            return
        bs = self.block_size
        parent = seq.hashes[i - 1] if i else seq.root
        block = seq.table[i]
        self._prefix[block_hash] = _CachedBlock(
            block, parent, tuple(seq.tokens[i * bs : (i + 1) * bs])
        )
        self._block_hash[block] = block_hash

    def _commit(self, seq: _Sequence) -> None:
        """The sequence's latest plan ran: register its newly computed full blocks."""
        full = seq.planned // self.block_size
        for i in range(seq.registered, full):
            self._register(seq, i)
        seq.registered = max(seq.registered, full)

    # ---- the pool --------------------------------------------------------------------------

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
        self._refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._block_hash[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _needed(self, tokens: list[int], hits: list[int]) -> int:
        """Blocks an admission takes from the available ones (cached hits included)."""
        n = math.ceil(len(tokens) / self.block_size)
        return n - len(hits) + sum(1 for b in hits if self._refcount[b] == 0)

    def _check_available(self, needed: int) -> None:
        if needed > self._available():
            raise OutOfBlocks(f"GPU: needed {needed} blocks, {self._available()} available")

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        return seq

    # ---- operations ------------------------------------------------------------------------

    def can_allocate(self, token_ids: Ints) -> bool:
        """Whether the prompt fits now and leaves the watermark free."""
        tokens = _int_list(token_ids, "token ids", limit=MAX_TOKEN)
        if not tokens:
            return False
        hits, _ = self._lookup(tokens)
        reserve = math.floor(WATERMARK * self.num_blocks)
        return self._available() - self._needed(tokens, hits) >= reserve

    def allocate(self, seq_id: int, token_ids: Ints) -> int:
        """Admit a sequence; return how many prompt tokens the prefix cache already holds."""
        tokens = _int_list(token_ids, "token ids", limit=MAX_TOKEN)
        if not tokens:
            raise ValueError("allocate needs at least one token")
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        hits, hit_hashes = self._lookup(tokens)
        self._check_available(self._needed(tokens, hits))
        for block in hits:
            if self._refcount[block] == 0:
                del self._cached[block]
            self._refcount[block] += 1
        bs = self.block_size
        n, k = math.ceil(len(tokens) / bs), len(hits)
        table = hits + [self._take() for _ in range(n - k)]
        seq = _Sequence(tokens, table, hit_hashes, self._root(), k * bs, k)
        self._extend_hashes(seq)
        self._seqs[seq_id] = seq
        self._query_tokens += len(tokens)
        self._hit_tokens += k * bs
        return k * bs

    def step(self, seq_ids: Ints, token_ids: Ints) -> BaselinePlan:
        """Commit each sequence's previous plan, append one token each, plan the batch."""
        ids = _int_list(seq_ids, "sequence ids")
        tokens = _int_list(token_ids, "token ids", limit=MAX_TOKEN)
        if len(tokens) != len(ids):
            raise ValueError(f"step got {len(ids)} sequences but {len(tokens)} tokens")
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence appears twice in the batch")
        seqs = [self._seq(seq_id) for seq_id in ids]
        for seq_id, seq in zip(ids, seqs, strict=True):
            if seq.planned != len(seq.tokens):
                raise ValueError(f"sequence {seq_id}: plan its pending tokens before a step")
        bs = self.block_size
        self._check_available(sum(len(seq.tokens) % bs == 0 for seq in seqs))
        for seq, token in zip(seqs, tokens, strict=True):
            self._commit(seq)
            seq.tokens.append(token)
            if len(seq.table) * bs < len(seq.tokens):
                seq.table.append(self._take())
            self._extend_hashes(seq)
        return self._plan(seqs, [1] * len(seqs))

    def plan(self, seq_ids: Ints, query_lens: Ints) -> BaselinePlan:
        """The plan of a batch whose last `query_lens[i]` tokens are the queries."""
        ids = _int_list(seq_ids, "sequence ids")
        qs = _int_list(query_lens, "query lengths")
        if len(qs) != len(ids):
            raise ValueError(f"plan got {len(ids)} sequences but {len(qs)} query lengths")
        seqs = [self._seq(seq_id) for seq_id in ids]
        for seq_id, seq, q in zip(ids, seqs, qs, strict=True):
            if not 1 <= q <= len(seq.tokens) or len(seq.tokens) - q > seq.planned:
                raise ValueError(f"query length {q} of sequence {seq_id} is out of range")
        for seq in seqs:
            self._commit(seq)
        return self._plan(seqs, qs)

    def _plan(self, seqs: list[_Sequence], qs: list[int]) -> BaselinePlan:
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
            seq.planned = kv_len
        width = max((len(seq.table) for seq in seqs), default=0)
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.table)] = seq.table
        return BaselinePlan(
            kv_indptr=np.array(kv_indptr, dtype=np.int32),
            kv_indices=np.array(kv_indices, dtype=np.int32),
            kv_last_page_len=np.array(last_page, dtype=np.int32),
            qo_indptr=np.array(qo_indptr, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int32),
            positions=np.array(positions, dtype=np.int32),
            block_tables=tables,
            batch_size=len(seqs),
            num_query_tokens=qo_indptr[-1],
        )

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, last block first; its uncommitted KV is not registered."""
        for block in reversed(self._seq(seq_id).table):
            self._release(block)
        del self._seqs[seq_id]

    def stats(self) -> BaselineStats:
        """The prefix-cache counters."""
        return BaselineStats(self._query_tokens, self._hit_tokens)

    def check(self) -> None:
        """Verify the pool's invariants: refcounts match holders, states partition the pool."""
        holders = [0] * self.num_blocks
        for seq in self._seqs.values():
            for block in seq.table:
                holders[block] += 1
        if holders != self._refcount:
            raise RuntimeError("refcount differs from the number of holders")
        free, cached = set(self._free), set(self._cached)
        held = {b for b in range(self.num_blocks) if self._refcount[b] > 0}
        if len(free) + len(cached) + len(held) != self.num_blocks or free & cached:
            raise RuntimeError("block states do not partition the pool")
        if any(self._block_hash[b] is not None for b in free) or any(
            self._block_hash[b] is None for b in cached
        ):
            raise RuntimeError("free blocks must be unhashed and cached blocks hashed")
        if sum(h is not None for h in self._block_hash) != len(self._prefix):
            raise RuntimeError("a hashed block is missing from the prefix map")
