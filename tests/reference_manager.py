"""A plain, single-threaded Python model of pagedkv's BlockManager.

It implements rust/core/SEMANTICS.md operation by operation with ordinary data structures (a list
as the free stack, an OrderedDict as the cached queue, a dict from hash to block, refcount lists,
and per sequence the KV lifecycle `computed <= planned <= len`), so that the stateful test can
check the real manager against it block id for block id, and so that benches/bench_step.py has an
honest Python baseline. Hash values differ from the real manager's (BLAKE2b here, keyed BLAKE3
there); only their structure is comparable.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
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
Ints = Iterable[int] | npt.NDArray[np.integer]
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
    copies: I32
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
    stored_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    computed_tokens: int
    pending_tokens: int
    external_query_tokens: int
    external_hit_tokens: int
    external_failures: int


@dataclass
class RefEvent:
    """The same fields as pagedkv.Event; hashes are this model's own."""

    kind: str
    seq_no: int
    block_hash: int | None
    parent_hash: int | None
    token_ids: list[int]
    block_id: int | None
    medium: str


@dataclass
class _Copy:
    """A copy-on-write copy; the sequence holds `src` until the plan applying it is committed."""

    src: int
    dst: int
    fill: int  # tokens of `src` the copy carries
    until: int = 0  # done once the sequence is computed up to here (set when planned)


@dataclass
class _Sequence:
    tokens: list[int]
    table: list[int]  # GPU block ids, or CPU block ids while swapped out
    hashes: list[bytes]  # h_i of every full block, whether or not it is registered
    salt_root: bytes
    computed: int
    planned: int
    registered: int  # full blocks 0..registered were offered to the prefix cache
    swapped: bool = False
    copies: list[_Copy] = field(default_factory=list)  # recorded, not planned yet
    copying: list[_Copy] = field(default_factory=list)  # planned, not committed yet
    swap_source: list[int] | None = None  # the other pool's table of an unconfirmed swap
    loading: tuple[int, int] | None = None  # (first logical block, count) to load


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
    external_query_tokens: int = 0
    external_hit_tokens: int = 0
    external_failures: int = 0
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
    "stored_tokens",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "evictions",
    "computed_tokens",
    "pending_tokens",
    "external_query_tokens",
    "external_hit_tokens",
    "external_failures",
)
PLAN_ARRAYS = (
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "qo_indptr",
    "slot_mapping",
    "positions",
    "block_tables",
    "copies",
)


def _int_list(values: Ints, what: str, *, limit: int | None = None) -> list[int]:
    """Check that `values` is a 1-D sequence of integers in [0, limit] and return it."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {values.shape}")
        if values.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integers, got dtype {values.dtype}")
        ints: list[int] = values.tolist()
    else:
        ints = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                # The API reports every bad argument as ValueError, type included.
                raise ValueError(f"{what} must hold integers, got {type(v).__name__}")
            ints.append(int(v))
    for v in ints:
        if v < 0 or (limit is not None and v > limit):
            raise ValueError(f"{what} must be in [0, {limit}], got {v}")
    return ints


def _tokens(token_ids: TokenIds, *, allow_empty: bool = False) -> list[int]:
    """Validate token ids (1-D, integral, in u32 range) and return them as ints."""
    values = _int_list(token_ids, "token ids", limit=MAX_TOKEN)
    if not values and not allow_empty:
        raise ValueError("token_ids must not be empty")
    return values


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
        auto_commit: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be >= 1, num_cpu_blocks >= 0")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if hash_key is not None and len(hash_key) != 32:
            raise ValueError("hash_key must be 32 bytes")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.enable_events = enable_events
        self.auto_commit = auto_commit
        self._key = hash_key if hash_key is not None else os.urandom(32)
        # Free stacks: the top is the end of the list, so block 0 is popped first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # head = least recently released
        self._refcount = [0] * num_blocks
        self._cpu_refcount = [0] * num_cpu_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._prefix: dict[bytes, _CachedBlock] = {}
        # The CPU tier (kept only with events): the hash of each announced CPU block, and how
        # many announced CPU blocks hold each hash.
        self._cpu_hash: dict[int, bytes] = {}
        self._cpu_copies: dict[bytes, int] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._n = _Counters()

    @property
    def hash_key_fingerprint(self) -> str | None:
        """16 hex digits identifying the hash key (None without prefix caching)."""
        if not self.enable_prefix_caching:
            return None
        return hashlib.blake2b(b"fingerprint", digest_size=8, key=self._key).hexdigest()

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
        self,
        kind: str,
        block_hash: bytes | None,
        parent: bytes | None = None,
        toks: list[int] | None = None,
        block_id: int | None = None,
        medium: str = "GPU",
    ) -> None:
        if not self.enable_events:
            return
        self._n.events.append(
            RefEvent(
                kind,
                self._n.next_seq_no,
                _as_int(block_hash),
                _as_int(parent),
                toks or [],
                block_id,
                medium,
            )
        )
        self._n.next_seq_no += 1

    # ---- pools -----------------------------------------------------------------------------

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
            self._emit("removed", block_hash, block_id=block)
        self._refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._block_hash[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _release_table(self, table: list[int]) -> None:
        for block in reversed(table):
            self._release(block)

    def _release_cpu_table(self, table: list[int]) -> None:
        """Release CPU blocks tail first; a hash's last announced copy leaving is an event."""
        for block in reversed(table):
            self._cpu_refcount[block] -= 1
            if self._cpu_refcount[block] > 0:
                continue
            self._cpu_free.append(block)
            block_hash = self._cpu_hash.pop(block, None)
            if block_hash is None:
                continue
            self._cpu_copies[block_hash] -= 1
            if self._cpu_copies[block_hash] == 0:
                del self._cpu_copies[block_hash]
                self._emit("removed", block_hash, block_id=block, medium="CPU")

    def _acquire_hit(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._cached[block]
        self._refcount[block] += 1

    def _check_gpu(self, needed: int) -> None:
        if needed > self._available():
            raise OutOfBlocks(f"GPU: needed {needed} blocks, {self._available()} available")

    # ---- prefix cache ----------------------------------------------------------------------

    def _register(self, seq: _Sequence, i: int) -> None:
        """Put full block i of `seq` in the prefix map unless its hash is already there."""
        block_hash = seq.hashes[i]
        if block_hash in self._prefix:
            return
        block = seq.table[i]
        bs = self.block_size
        parent = seq.hashes[i - 1] if i else seq.salt_root
        toks = tuple(seq.tokens[i * bs : (i + 1) * bs])
        self._prefix[block_hash] = _CachedBlock(block, parent, toks)
        self._block_hash[block] = block_hash
        self._emit("stored", block_hash, seq.hashes[i - 1] if i else None, list(toks), block)

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

    # ---- the KV lifecycle ------------------------------------------------------------------

    def _commit_to(self, seq: _Sequence, upto: int) -> None:
        """Computed up to `upto`; finish committed copies; register computed full blocks."""
        seq.computed = max(seq.computed, upto)
        done = [c for c in seq.copying if c.until <= seq.computed]
        seq.copying = [c for c in seq.copying if c.until > seq.computed]
        for copy in done:
            self._release(copy.src)
        if seq.swapped or seq.swap_source is not None or seq.loading is not None:
            return
        if not self.enable_prefix_caching:
            return
        full = seq.computed // self.block_size
        for i in range(seq.registered, full):
            self._register(seq, i)
        seq.registered = max(seq.registered, full)

    def _auto_commit(self, seq: _Sequence) -> None:
        if self.auto_commit:
            self._commit_to(seq, seq.planned)

    # ---- sequence lookups ------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id}")
        return seq

    def _batch(
        self,
        seq_ids: Ints,
        swapped: bool,
        check: Callable[[int, int, _Sequence], None] | None = None,
    ) -> list[_Sequence]:
        """Validate a batch in order: unknown, repeated, wrong side, then `check(b, id, seq)`."""
        ids = _int_list(seq_ids, "sequence ids")
        seqs: list[_Sequence] = []
        for b, seq_id in enumerate(ids):
            seq = self._seq(seq_id)
            if seq_id in ids[:b]:
                raise ValueError(f"sequence {seq_id} appears twice in the batch")
            if seq.swapped != swapped:
                side = "swapped out" if seq.swapped else "not swapped out"
                raise ValueError(f"sequence {seq_id} is {side}")
            if check is not None:
                check(b, seq_id, seq)
            seqs.append(seq)
        return seqs

    @staticmethod
    def _not_loading(seq_id: int, seq: _Sequence) -> None:
        if seq.loading is not None:
            raise ValueError(f"sequence {seq_id}: confirm its external loads first")

    # ---- operations ------------------------------------------------------------------------

    def allocate(self, seq_id: int, token_ids: TokenIds, *, salt: bytes | str | None = None) -> int:
        """Admit a sequence; return how many prompt tokens the prefix cache already holds."""
        return self._admit(seq_id, token_ids, salt, None)[0]

    def allocate_loading(
        self,
        seq_id: int,
        token_ids: TokenIds,
        loadable_blocks: int,
        *,
        salt: bytes | str | None = None,
    ) -> tuple[int, I32]:
        """Admit like `allocate`; also return the GPU blocks to fill from an external store."""
        if loadable_blocks < 0:
            raise ValueError(f"loadable_blocks must be >= 0, got {loadable_blocks}")
        reused, loads = self._admit(seq_id, token_ids, salt, loadable_blocks)
        return reused, np.array(loads, dtype=np.int32)

    def _admit(
        self, seq_id: int, token_ids: TokenIds, salt: bytes | str | None, loadable: int | None
    ) -> tuple[int, list[int]]:
        tokens = _tokens(token_ids)
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        hits, hit_hashes = self._lookup(tokens, salt)
        self._check_gpu(self._alloc_needed(tokens, hits))
        for block in hits:
            self._acquire_hit(block)
        bs = self.block_size
        n, k = math.ceil(len(tokens) / bs), len(hits)
        table = hits + [self._take() for _ in range(n - k)]
        seq = _Sequence(tokens, table, hit_hashes, self._root(salt), k * bs, k * bs, k)
        self._extend_hashes(seq)
        hittable = n - 1
        loads = 0
        if loadable is not None:
            if self.enable_prefix_caching:
                loads = max(0, min(loadable, hittable) - k)
            self._n.external_query_tokens += (hittable - k) * bs
        if loads:
            seq.loading = (k, loads)
        self._seqs[seq_id] = seq
        self._n.prefix_query_tokens += len(tokens)
        self._n.prefix_hit_tokens += k * bs
        return k * bs, table[k : k + loads]

    def confirm_loads(self, seq_id: int, num_loaded: int) -> None:
        """The first `num_loaded` blocks of `allocate_loading` hold their KV now."""
        seq = self._seq(seq_id)
        if num_loaded < 0:
            raise ValueError(f"num_loaded must be >= 0, got {num_loaded}")
        if seq.loading is None:
            raise ValueError(f"sequence {seq_id} has no external loads to confirm")
        first, count = seq.loading
        if num_loaded > count:
            raise ValueError(f"sequence {seq_id} was handed {count} blocks, not {num_loaded}")
        seq.loading = None
        upto = (first + num_loaded) * self.block_size
        seq.planned = max(seq.planned, upto)
        self._commit_to(seq, upto)
        self._n.external_hit_tokens += num_loaded * self.block_size
        self._n.prefix_hit_tokens += num_loaded * self.block_size
        self._n.external_failures += count - num_loaded

    def can_allocate(self, token_ids: TokenIds, *, salt: bytes | str | None = None) -> bool:
        """Whether `allocate` would succeed and leave the watermark reserve untouched.

        An empty prompt is not an error here, just something that cannot be allocated.
        """
        tokens = _tokens(token_ids, allow_empty=True)
        if not tokens:
            return False
        hits, _ = self._lookup(tokens, salt)
        reserve = math.floor(self.watermark * self.num_blocks)
        return self._available() - self._alloc_needed(tokens, hits) >= reserve

    def cached_prefix_blocks(self, token_ids: TokenIds, *, salt: bytes | str | None = None) -> int:
        """How many leading full blocks of the prompt the GPU prefix cache holds (read-only)."""
        tokens = _tokens(token_ids, allow_empty=True)
        return len(self._lookup(tokens, salt)[0]) if tokens else 0

    def block_hashes(self, token_ids: TokenIds, *, salt: bytes | str | None = None) -> list[int]:
        """This model's hashes of every full block of the prompt."""
        if not self.enable_prefix_caching:
            raise ValueError("block hashes need prefix caching")
        tokens = _tokens(token_ids, allow_empty=True)
        bs, parent, out = self.block_size, self._root(salt), []
        for i in range(len(tokens) // bs):
            parent = self._hash(parent, tokens[i * bs : (i + 1) * bs])
            out.append(int.from_bytes(parent, "big"))
        return out

    def _append_needed(self, seq: _Sequence, m: int) -> int:
        bs = self.block_size
        length = len(seq.tokens)
        cow = 1 if length % bs and self._refcount[seq.table[-1]] > 1 else 0
        return cow + math.ceil((length + m) / bs) - len(seq.table)

    def _append(self, seq: _Sequence, tokens: list[int]) -> None:
        """Append with capacity already checked: copy on write, then new blocks."""
        bs = self.block_size
        length = len(seq.tokens)
        if length % bs and self._refcount[seq.table[-1]] > 1:
            # The sequence's reference to the source now belongs to the copy.
            src, dst = seq.table[-1], self._take()
            seq.copies.append(_Copy(src, dst, length % bs))
            seq.table[-1] = dst
        seq.tokens.extend(tokens)
        while len(seq.table) < math.ceil(len(seq.tokens) / bs):
            seq.table.append(self._take())
        self._extend_hashes(seq)

    def append(self, seq_id: int, token_ids: TokenIds) -> None:
        """Append one or more tokens to a running sequence; their KV is pending."""
        tokens = _tokens(token_ids)
        seq = self._seq(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out")
        self._not_loading(seq_id, seq)
        self._auto_commit(seq)
        self._check_gpu(self._append_needed(seq, len(tokens)))
        self._append(seq, tokens)

    def step(self, seq_ids: Ints, token_ids: TokenIds) -> RefPlan:
        """Append one decode token to each sequence, then plan the batch with q = 1."""
        ids = _int_list(seq_ids, "sequence ids")
        tokens = _tokens(token_ids, allow_empty=True)
        if len(tokens) != len(ids):
            raise ValueError(f"{len(ids)} sequences but {len(tokens)} tokens")

        def check(_: int, seq_id: int, seq: _Sequence) -> None:
            self._not_loading(seq_id, seq)
            if seq.planned != len(seq.tokens):
                raise ValueError(f"sequence {seq_id}: plan its pending tokens before a step")

        seqs = self._batch(ids, False, check)
        for seq in seqs:  # a completed copy may unshare another member's tail
            if seq.copying:
                self._auto_commit(seq)
        self._check_gpu(sum(self._append_needed(seq, 1) for seq in seqs))
        for seq, token in zip(seqs, tokens, strict=True):
            self._auto_commit(seq)
            self._append(seq, [token])
        return self._plan(seqs, [1] * len(seqs))

    def plan(self, seq_ids: Ints, query_lens: Ints) -> RefPlan:
        """Build the attention metadata for a batch: CSR page table, slots, positions, copies."""
        ids = _int_list(seq_ids, "sequence ids")
        qs = _int_list(query_lens, "query lengths", limit=2**32 - 1)
        if len(qs) != len(ids):
            raise ValueError(f"{len(ids)} sequences but {len(qs)} query lengths")

        def check(b: int, seq_id: int, seq: _Sequence) -> None:
            self._not_loading(seq_id, seq)
            if not 1 <= qs[b] <= len(seq.tokens):
                raise ValueError(f"query length {qs[b]} of sequence {seq_id} is out of range")
            if len(seq.tokens) - qs[b] > seq.planned:
                raise ValueError(f"sequence {seq_id}: its queries leave a gap")

        seqs = self._batch(ids, False, check)
        for seq in seqs:
            self._auto_commit(seq)
        return self._plan(seqs, qs)

    def _plan(self, seqs: list[_Sequence], qs: list[int]) -> RefPlan:
        bs = self.block_size
        kv_indptr, kv_indices, last_page, qo_indptr = [0], [], [], [0]
        slots, positions, copies = [], [], []
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
            for copy in seq.copies:
                copy.until = kv_len
                copies.append((copy.src, copy.dst))
            seq.copying.extend(seq.copies)
            seq.copies = []
            seq.planned = kv_len
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
            copies=np.array(copies, dtype=np.int32).reshape(-1, 2),
            batch_size=len(seqs),
            num_query_tokens=qo_indptr[-1],
            block_size=bs,
        )

    def commit(self, seq_ids: Ints, num_computed: Ints | None = None) -> None:
        """The engine computed each sequence's KV up to its latest plan, or `num_computed[i]`."""
        ids = _int_list(seq_ids, "sequence ids")
        upto = None if num_computed is None else _int_list(num_computed, "token counts")
        if upto is not None and len(upto) != len(ids):
            raise ValueError(f"commit got {len(ids)} sequences but {len(upto)} token counts")

        def check(b: int, seq_id: int, seq: _Sequence) -> None:
            if upto is not None and upto[b] > seq.planned:
                raise ValueError(f"sequence {seq_id}: only {seq.planned} tokens are planned")

        seqs = self._batch(ids, False, check)
        for b, seq in enumerate(seqs):
            self._commit_to(seq, seq.planned if upto is None else upto[b])

    def num_computed(self, seq_id: int) -> int:
        """Tokens of the sequence whose KV is computed."""
        return self._seq(seq_id).computed

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make `child_id` share every block of `parent_id`, whose KV must be computed."""
        parent = self._seq(parent_id)
        if parent.swapped:
            raise ValueError(f"sequence {parent_id} is swapped out")
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id} already exists")
        self._not_loading(parent_id, parent)
        if parent.swap_source is not None:
            raise ValueError(f"sequence {parent_id}: confirm its swap-in before forking it")
        self._auto_commit(parent)
        if parent.computed != len(parent.tokens):
            raise ValueError(f"sequence {parent_id}: its KV is not all computed")
        for block in parent.table:
            self._refcount[block] += 1
        self._seqs[child_id] = _Sequence(
            list(parent.tokens),
            list(parent.table),
            list(parent.hashes),
            parent.salt_root,
            parent.computed,
            parent.computed,
            parent.registered,
        )

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks (table tail first, swap source, copy sources)."""
        seq = self._seq(seq_id)
        if seq.swapped:
            self._release_cpu_table(seq.table)
        else:
            self._release_table(seq.table)
        if seq.swap_source is not None:
            if seq.swapped:
                self._release_table(seq.swap_source)
            else:
                self._release_cpu_table(seq.swap_source)
        for copy in seq.copies + seq.copying:
            self._release(copy.src)
        if seq.loading is not None:
            self._n.external_failures += seq.loading[1]
        del self._seqs[seq_id]

    def swap_out(self, seq_ids: Ints) -> I32:
        """Move sequences to CPU blocks; return the (gpu, cpu) pairs to copy."""

        def check(_: int, seq_id: int, seq: _Sequence) -> None:
            if seq.swap_source is not None:
                raise ValueError(f"sequence {seq_id}: confirm its swap-in first")
            self._not_loading(seq_id, seq)
            in_flight = not self.auto_commit and (seq.planned != seq.computed or seq.copying)
            if in_flight or seq.copies:
                raise ValueError(f"sequence {seq_id}: plan and commit its pending work first")

        seqs = self._batch(seq_ids, False, check)
        for seq in seqs:
            self._auto_commit(seq)
        refs: dict[int, int] = {}  # distinct GPU blocks in first-appearance order
        for seq in seqs:
            for block in seq.table:
                refs[block] = refs.get(block, 0) + 1
        if len(refs) > len(self._cpu_free):
            raise OutOfBlocks(f"CPU: needed {len(refs)} blocks, {len(self._cpu_free)} available")
        mapping: dict[int, int] = {}
        for gpu, count in refs.items():
            cpu = self._cpu_free.pop()
            self._cpu_refcount[cpu] = count
            mapping[gpu] = cpu
        for seq in seqs:
            seq.swap_source = seq.table
            seq.table = [mapping[b] for b in seq.table]
            seq.swapped = True
        return np.array(list(mapping.items()), dtype=np.int32).reshape(-1, 2)

    def confirm_swap_out(self, seq_ids: Ints) -> None:
        """The swap-out copies ran: release the GPU sources, announce the CPU tier."""
        seqs = self._batch(seq_ids, True, self._swap_to_confirm("swap-out"))
        bs = self.block_size
        for seq in seqs:
            assert seq.swap_source is not None
            self._release_table(seq.swap_source)
            seq.swap_source = None
            if not (self.enable_events and self.enable_prefix_caching):
                continue
            for i in range(seq.computed // bs):
                block, block_hash = seq.table[i], seq.hashes[i]
                if block in self._cpu_hash:
                    continue
                self._cpu_hash[block] = block_hash
                self._cpu_copies[block_hash] = self._cpu_copies.get(block_hash, 0) + 1
                if self._cpu_copies[block_hash] == 1:
                    parent = seq.hashes[i - 1] if i else None
                    toks = seq.tokens[i * bs : (i + 1) * bs]
                    self._emit("stored", block_hash, parent, toks, block, "CPU")

    @staticmethod
    def _swap_to_confirm(what: str) -> Callable[[int, int, _Sequence], None]:
        def check(_: int, seq_id: int, seq: _Sequence) -> None:
            if seq.swap_source is None:
                raise ValueError(f"sequence {seq_id} has no {what} to confirm")

        return check

    def swap_in(self, seq_ids: Ints) -> I32:
        """Bring swapped-out sequences back to GPU blocks; return the (cpu, gpu) pairs."""

        def check(_: int, seq_id: int, seq: _Sequence) -> None:
            if seq.swap_source is not None:
                raise ValueError(f"sequence {seq_id}: confirm its swap-out first")

        seqs = self._batch(seq_ids, True, check)
        refs: dict[int, int] = {}  # distinct CPU blocks in first-appearance order
        for seq in seqs:
            for block in seq.table:
                refs[block] = refs.get(block, 0) + 1
        self._check_gpu(len(refs))
        mapping: dict[int, int] = {}
        for cpu, count in refs.items():
            gpu = self._take()
            self._refcount[gpu] = count
            mapping[cpu] = gpu
        for seq in seqs:
            seq.swap_source = seq.table
            seq.table = [mapping[b] for b in seq.table]
            seq.swapped = False
            seq.registered = 0
        return np.array(list(mapping.items()), dtype=np.int32).reshape(-1, 2)

    def confirm_swap_in(self, seq_ids: Ints) -> None:
        """The swap-in copies ran: release the CPU sources, register the computed blocks."""
        seqs = self._batch(seq_ids, False, self._swap_to_confirm("swap-in"))
        for seq in seqs:
            assert seq.swap_source is not None
            self._release_cpu_table(seq.swap_source)
            seq.swap_source = None
            self._commit_to(seq, seq.computed)

    def block_table(self, seq_id: int) -> I32:
        """The sequence's GPU block ids in logical order."""
        seq = self._seq(seq_id)
        if seq.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return np.array(seq.table, dtype=np.int32)

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
        self._cpu_hash.clear()
        self._cpu_copies.clear()
        self._emit("cleared", None)

    def _gpu_fills(self) -> dict[int, int]:
        """Every GPU block some sequence, swap source or copy holds -> tokens it holds."""
        bs = self.block_size
        fills: dict[int, int] = {}
        for seq in self._seqs.values():
            length = len(seq.tokens)
            gpu_table = seq.swap_source if seq.swapped else seq.table
            for i, block in enumerate(gpu_table or []):
                fills[block] = min(bs, length - i * bs)
            for copy in seq.copies + seq.copying:
                fills[copy.src] = copy.fill
        return fills

    def stats(self) -> RefStats:
        """Block counts, token-level usage, prefix and lifecycle counters."""
        bs = self.block_size
        stored = sum(self._gpu_fills().values())  # a shared block counts once
        held = self.num_blocks - len(self._free) - len(self._cached)
        computed = sum(seq.computed for seq in self._seqs.values())
        total = sum(len(seq.tokens) for seq in self._seqs.values())
        return RefStats(
            num_blocks=self.num_blocks,
            num_free=len(self._free),
            num_cached=len(self._cached),
            num_held=held,
            usage=held / self.num_blocks,
            token_usage=stored / (held * bs) if held else 0.0,
            stored_tokens=stored,
            prefix_query_tokens=self._n.prefix_query_tokens,
            prefix_hit_tokens=self._n.prefix_hit_tokens,
            evictions=self._n.evictions,
            computed_tokens=computed,
            pending_tokens=total - computed,
            external_query_tokens=self._n.external_query_tokens,
            external_hit_tokens=self._n.external_hit_tokens,
            external_failures=self._n.external_failures,
        )

    def take_events(self) -> list[RefEvent]:
        """Events since the last call."""
        events, self._n.events = self._n.events, []
        return events

    def check(self) -> None:
        """Verify the model's own invariants (refcounts match holders, lifecycle bounds)."""
        bs = self.block_size
        holders = [0] * self.num_blocks
        cpu_holders = [0] * self.num_cpu_blocks
        for seq in self._seqs.values():
            if not seq.computed <= seq.planned <= len(seq.tokens):
                raise RuntimeError("computed <= planned <= len fails")
            if seq.registered > seq.computed // bs:
                raise RuntimeError("a registered block is not computed")
            gpu, cpu = (seq.swap_source, seq.table) if seq.swapped else (seq.table, seq.swap_source)
            for block in gpu or []:
                holders[block] += 1
            for block in cpu or []:
                cpu_holders[block] += 1
            for copy in seq.copies + seq.copying:
                holders[copy.src] += 1
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
        if any(self._cpu_refcount[b] == 0 for b in self._cpu_hash):
            raise RuntimeError("an announced CPU block is not held")

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)
