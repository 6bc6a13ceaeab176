"""The paged system: the real `pagedkv.BlockManager`, driven block by block.

Token states and held memory come from the manager's own `stats()`; this module only adds
what the manager cannot know (how many tokens each sequence will still store) to split the
empty slots of held blocks into reserved and internal fragmentation. `PagedBase` is the
driving shared with the hybrid system (`pagedkv.simulate.hybrid`).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pagedkv import BlockManager, OutOfBlocks
from pagedkv.simulate.engine import Active
from pagedkv.simulate.errors import SimulationError
from pagedkv.simulate.metrics import Composition, PrefixReuse
from pagedkv.simulate.trace import Request

VOCAB = 32000  # token ids are drawn below this; any value works, only equality matters

# Beam search model: at each step every beam keeps its own hypothesis with this probability
# and otherwise continues a uniformly chosen beam of the same request (a fork of it). This is
# our assumption of how often beams are overtaken; it sets how much history beams share.
BEAM_KEEP_PROBABILITY = 0.5

EventSink = Callable[[BlockManager], object]  # called after each step, e.g. publish_from


def _output_tokens(
    seq_ids: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint32]:
    """The token each sequence stores at each position (deterministic, so recompute matches)."""
    mixed = seq_ids.astype(np.uint64) * np.uint64(2654435761) + positions.astype(np.uint64)
    tokens: npt.NDArray[np.uint32] = (mixed % np.uint64(VOCAB)).astype(np.uint32)
    return tokens


class PromptTokens:
    """Seeded token ids of a trace's requests: a prompt, and what a sequence stores later.

    Requests with one `prefix_id` share that prefix's tokens; requests of one `conversation`
    read their prompts and outputs from that conversation's one token history.
    """

    def __init__(self, trace: Sequence[Request], seed: int) -> None:
        self._trace = trace
        self._seed = seed
        self._prefix_index: dict[str, int] = {}
        self._histories: dict[str, npt.NDArray[np.uint32]] = {}
        lengths: dict[str, int] = {}
        for request in trace:
            if request.prefix_id is not None:
                self._prefix_index.setdefault(request.prefix_id, len(self._prefix_index))
            if request.conversation is not None:
                name = request.conversation
                lengths[name] = max(lengths.get(name, 0), request.final_len)
        for i, (name, length) in enumerate(lengths.items()):
            rng = np.random.default_rng([seed, 3, i])
            self._histories[name] = rng.integers(0, VOCAB, size=length, dtype=np.uint32)

    def __call__(self, index: int) -> npt.NDArray[np.uint32]:
        """Prompt of request `index`."""
        request = self._trace[index]
        if request.conversation is not None:
            return self._histories[request.conversation][: request.prompt_len]
        own = np.random.default_rng([self._seed, 0, index])
        tokens = own.integers(0, VOCAB, size=request.prompt_len, dtype=np.uint32)
        if request.prefix_id is not None:
            prefix = np.random.default_rng([self._seed, 1, self._prefix_index[request.prefix_id]])
            tokens[: request.prefix_len] = prefix.integers(
                0, VOCAB, size=request.prefix_len, dtype=np.uint32
            )
        return tokens

    def generated(
        self,
        indices: npt.NDArray[np.int64],
        seq_ids: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.uint32]:
        """The token sequence `seq_ids[i]` of request `indices[i]` stores at `positions[i]`."""
        tokens = _output_tokens(seq_ids, positions)
        if not self._histories:
            return tokens
        for row, index in enumerate(indices.tolist()):
            name = self._trace[index].conversation
            if name is not None:
                tokens[row] = self._histories[name][positions[row]]
        return tokens


class PagedManager(Protocol):
    """What the paged systems call on `BlockManager` and `HybridManager` alike."""

    def commit(self, seq_ids: list[int]) -> None: ...
    def fork(self, parent: int, child: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def step(self, seq_ids: npt.NDArray[np.int64], token_ids: npt.NDArray[np.uint32]) -> object: ...


class PagedBase(ABC):
    """Admission, decode with preemption, forks and beams over a paged manager.

    A request with `n > 1` samples or beams allocates its prompt once and forks one sequence
    per sample or beam, so the prompt's full blocks are shared; beams fork each other as
    they advance (see BEAM_KEEP_PROBABILITY). Prefix caching is on, so requests that share a
    `prefix_id` or a `conversation` share those blocks too. Subclasses build the manager and
    say whether a prompt fits, how it is prefilled and where the memory is.
    """

    def __init__(
        self,
        manager: PagedManager,
        capacity: int,
        trace: Sequence[Request],
        *,
        beam: bool,
        seed: int,
        name: str,
        after_step: Callable[[], object] | None = None,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self._manager = manager
        self._after_step = after_step
        self._prompt = PromptTokens(trace, seed)
        self._beam = beam
        self._rng = np.random.default_rng([seed, 2])
        self._seqs: dict[int, list[int]] = {}  # request index -> live sequence ids
        self._next_seq = 0
        self._reuse = [0, 0, 0]  # query, hit, full-group tokens
        self.decode_tokens = 0  # tokens stored by decode steps

    @abstractmethod
    def _fits(self, tokens: npt.NDArray[np.uint32]) -> bool:
        """Whether a new sequence of `tokens` can be admitted now."""

    @abstractmethod
    def _prefill(self, seq: int, tokens: npt.NDArray[np.uint32]) -> int:
        """Admit one sequence and plan the tokens the prefix cache did not cover; returns them.
        Raises OutOfBlocks with nothing admitted."""

    @abstractmethod
    def composition(self, running: Sequence[Active]) -> Composition:
        """Where the memory is now."""

    def _stepped(self, plans: object, tokens: int) -> None:
        """A decode step stored `tokens` tokens with these plans (subclasses count more)."""
        self.decode_tokens += tokens

    @property
    def prefix_reuse(self) -> PrefixReuse:
        """Prompt tokens looked up, served and servable by the full-attention layers so far."""
        return PrefixReuse(*self._reuse)

    def _count_reuse(self, query: int, hit: int, full_group: int) -> None:
        self._reuse[0] += query
        self._reuse[1] += hit
        self._reuse[2] += full_group

    def _new_seq_id(self) -> int:
        self._next_seq += 1
        return self._next_seq - 1

    def admit(self, active: Active) -> int | None:
        """Allocate the prompt (and, after a preemption, the tokens already generated) and plan
        its prefill; returns the tokens the prefill computes."""
        prompt = self._prompt(active.index)
        seqs = self._seqs.get(active.index)
        if seqs is None:  # first admission: one allocation, the other sequences fork it
            if not self._fits(prompt):
                return None
            first = self._new_seq_id()
            try:
                computed = self._prefill(first, prompt)
            except OutOfBlocks:
                return None
            seqs = [first]
            try:
                for _ in range(active.width - 1):  # the fork commits the prefill's forward pass
                    child = self._new_seq_id()
                    self._manager.fork(first, child)
                    seqs.append(child)
            except OutOfBlocks:  # no state slot for a child: wait, holding nothing
                for seq in seqs:
                    self._manager.free(seq)
                return None
            self._seqs[active.index] = seqs
            return computed
        # Recompute after preemption: each sequence is rebuilt from the prompt and its own
        # generated tokens; once the first one's prefill is computed, the others reuse the
        # prompt's full blocks from the prefix cache.
        generated = np.arange(len(prompt), active.length)
        index = np.full_like(generated, active.index)
        histories = [
            np.concatenate(
                [prompt, self._prompt.generated(index, np.full_like(generated, s), generated)]
            )
            for s in seqs
        ]
        if not self._fits(histories[0]):
            return None
        computed = 0
        for i, (seq, tokens) in enumerate(zip(seqs, histories, strict=True)):
            try:
                computed += self._prefill(seq, tokens)
            except OutOfBlocks:
                for done in seqs[:i]:
                    self._manager.free(done)
                return None
            self._manager.commit([seq])
        return computed

    def _reshuffle_beams(self, active: Active) -> None:
        """Advance one request's beams: some continue another beam instead of their own."""
        seqs = self._seqs[active.index]
        old = list(seqs)
        for slot in range(len(seqs)):
            if self._rng.random() < BEAM_KEEP_PROBABILITY:
                continue
            parent = int(self._rng.integers(len(old)))
            if parent != slot:
                child = self._new_seq_id()
                try:
                    self._manager.fork(old[parent], child)
                except OutOfBlocks:  # no state slot for the fork: the beam keeps its own
                    continue
                seqs[slot] = child
        for before, after in zip(old, seqs, strict=True):
            if before != after:
                self._manager.free(before)

    def decode(self, running: Sequence[Active]) -> list[Active]:
        """One `step` over every sequence; on OutOfBlocks preempt the latest request, retry."""
        if self._beam:
            for active in running:
                self._reshuffle_beams(active)
        batch = list(running)
        preempted: list[Active] = []
        while True:
            rows = [(a.index, s, a.length) for a in batch for s in self._seqs[a.index]]
            index, ids, positions = np.array(rows, dtype=np.int64).reshape(-1, 3).T.copy()
            try:
                plans = self._manager.step(ids, self._prompt.generated(index, ids, positions))
                self._stepped(plans, len(ids))
                if self._after_step is not None:
                    self._after_step()
                return preempted
            except OutOfBlocks:
                if len(batch) == 1:
                    raise SimulationError(
                        f"{self.name}: request {batch[0].index} alone outgrows the KV memory "
                        f"({self.capacity} token slots)"
                    ) from None
                victim = batch.pop()
                for seq in self._seqs[victim.index]:  # ids kept: admit() recomputes them
                    self._manager.free(seq)
                preempted.append(victim)

    def release(self, active: Active) -> None:
        """Free every sequence of a finished request."""
        for seq in self._seqs.pop(active.index):
            self._manager.free(seq)


class PagedSystem(PagedBase):
    """KV memory in blocks of `block_size` slots, managed by `pagedkv.BlockManager`.

    Every layer's KV of a block's tokens shares one block (for a hybrid model: uniform
    paging, every layer treated as full attention). Admission asks `can_allocate` (which
    keeps the manager's watermark free for the growth of running sequences); the prompt is
    prefilled in one pass. `event_sink(manager)`, if given, runs after each step with events
    on (`pagedkv simulate --kv-events`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        trace: Sequence[Request],
        *,
        beam: bool,
        seed: int,
        watermark: float = 0.01,
        name: str = "paged",
        event_sink: EventSink | None = None,
    ) -> None:
        self.block_size = block_size
        self.manager = BlockManager(
            num_blocks,
            block_size,
            enable_prefix_caching=True,
            watermark=watermark,
            enable_events=event_sink is not None,
            hash_key=simulation_hash_key(seed),
        )
        super().__init__(
            self.manager,
            num_blocks * block_size,
            trace,
            beam=beam,
            seed=seed,
            name=name,
            after_step=None if event_sink is None else lambda: event_sink(self.manager),
        )

    def _fits(self, tokens: npt.NDArray[np.uint32]) -> bool:
        return self.manager.can_allocate(tokens)

    def _prefill(self, seq: int, tokens: npt.NDArray[np.uint32]) -> int:
        reused = self.manager.allocate(seq, tokens)
        self._count_reuse(len(tokens), reused, reused)
        todo = len(tokens) - reused
        self.manager.plan([seq], [todo])
        return todo

    def composition(self, running: Sequence[Active]) -> Composition:
        """Token states and held blocks from the manager's stats; the split of empty slots.

        The empty slots of held blocks are the tails of sequences' last blocks (no partial
        block is shared after a step: a shared one is copied on the first write). A tail
        slot is reserved if the sequence will still fill it, internal fragmentation if not.
        """
        stats = self.manager.stats()
        bs = self.block_size
        held = stats.num_held * bs
        token = round(stats.token_usage * held)
        internal = logical = 0
        for active in running:
            blocks = -(-active.length // bs)
            tail = blocks * bs - active.length
            internal += active.width * max(0, tail - active.remaining)
            logical += active.width * blocks * bs
        reserved = held - token - internal
        if reserved < 0:
            raise RuntimeError(
                f"{self.name}: accounting broke: {held} held slots, {token} tokens, "
                f"{internal} internal"
            )
        external = (stats.num_free + stats.num_cached) * bs
        return Composition(token, reserved, internal, external, logical=logical)


def simulation_hash_key(seed: int) -> bytes:
    """Seeded, so a run's block hashes (and the events that carry them) are reproducible."""
    return hashlib.blake2b(f"pagedkv simulate {seed}".encode(), digest_size=32).digest()
