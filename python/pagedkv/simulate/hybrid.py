"""The hybrid paged system: the real `pagedkv.HybridManager`, one KV-cache group per set of
layers of one attention kind (`pagedkv.groups`), all in one pool of equal-sized pages, and for
a recurrent model (Mamba, linear attention) its state group: one slot per live sequence and
checkpoints of states after block-aligned prefixes.

A page holds `block_size` tokens of `layers_per_group` layers, so one pool page is
`layers_per_group / num_layers` of a uniform block. Memory is reported in token slots of every
layer, like the other systems: a group's page counts for its share of a token slot, a state
slot for its bytes over a token's KV bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pagedkv import HybridManager, OutOfBlocks, Plan, StateConfig
from pagedkv.simulate.engine import Active
from pagedkv.simulate.metrics import Composition, StateUse
from pagedkv.simulate.paged import PagedBase, simulation_hash_key
from pagedkv.simulate.presets import ModelPreset
from pagedkv.simulate.trace import Request


class HybridPagedSystem(PagedBase):
    """A hybrid model's KV memory managed by `pagedkv.HybridManager` with `model.groups()`.

    Admission checks that the pool's free and cached pages, less the watermark, cover the
    most pages the chunked prefill will hold at once in every group, and, with a `state`
    group, that a state slot is free or held by a checkpoint. Each admission also records how
    much of its prompt the full-attention group 0 alone had cached (its stored block hashes),
    the most any hit could serve. The state slots take `state.num_slots x state_bytes` of
    `kv_memory`; the pages the rest.
    """

    def __init__(
        self,
        model: ModelPreset,
        kv_memory: int,
        block_size: int,
        trace: Sequence[Request],
        *,
        beam: bool,
        seed: int,
        watermark: float = 0.01,
        prefill_chunk: int,
        layers_per_group: int | None = None,
        state: StateConfig | None = None,
        name: str = "hybrid paged",
    ) -> None:
        self.groups = model.groups(layers_per_group)
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        per_group = self.groups.layers_per_group
        self.page_bytes = per_group * block_size * model.layer_bytes_per_token
        self.state = state
        self.state_bytes = model.state_bytes if state is not None else 0
        state_memory = state.num_slots * self.state_bytes if state is not None else 0
        self.num_pages = (kv_memory - state_memory) // self.page_bytes
        self._num_layers = model.num_layers
        self._real = [sum(layer >= 0 for layer in slots) for slots in self.groups.layers]
        self.manager = HybridManager(
            self.num_pages,
            block_size,
            list(self.groups.attention),
            enable_prefix_caching=True,
            watermark=watermark,
            hash_key=simulation_hash_key(seed),
            state=state,
        )
        self._watermark_pages = int(watermark * self.num_pages)
        capacity = self.num_pages * block_size * per_group // model.num_layers
        self._slot_tokens = model.state_token_slots if state is not None else 0.0
        if state is not None:
            capacity += round(state.num_slots * self._slot_tokens)
        # Counted over the run: decode saves, hit copies, checkpoints held after each step.
        self._state_counts = {"saves": 0, "copies": 0, "steps": 0, "held": 0}
        self._peak_checkpoints = 0
        super().__init__(self.manager, capacity, trace, beam=beam, seed=seed, name=name)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_pages(self, length: int) -> int:
        """Pages a prompt of `length` tokens holds at most, over all groups, while prefilled in
        chunks: a full group every block; a window W at most the chunk and W (a chunk C: the
        chunk and C) plus a block on either side."""
        total = 0
        whole = self._pages(length)
        for attention in self.groups.attention:
            reach = attention.window if attention.window is not None else attention.chunk
            if reach is None:
                total += whole
            else:
                total += min(whole, self._pages(self.prefill_chunk + reach) + 1)
        return total

    def _fits(self, tokens: npt.NDArray[np.uint32]) -> bool:
        stats = self.manager.stats(0)
        available = stats.num_free + stats.num_cached - self._watermark_pages
        if self.state is not None:
            slots = self.manager.state_stats()
            if slots.num_free + slots.num_checkpoints < 1:
                return False
        return self.peak_pages(len(tokens)) <= available

    def _stepped(self, plans: object, tokens: int) -> None:
        super()._stepped(plans, tokens)
        if self.state is None:
            return
        assert isinstance(plans, list)
        counts = self._state_counts
        counts["saves"] += sum(len(p.state_saves) for p in plans if isinstance(p, Plan))
        held = self.manager.state_stats().num_checkpoints
        counts["steps"] += 1
        counts["held"] += held
        self._peak_checkpoints = max(self._peak_checkpoints, held)

    @property
    def state_use(self) -> StateUse | None:
        """The state group's slots, policy and counters so far (None without one)."""
        if self.state is None:
            return None
        stats = self.manager.state_stats()
        counts = self._state_counts
        return StateUse(
            num_slots=stats.num_slots,
            slot_bytes=self.state_bytes,
            max_checkpoints=self.state.max_checkpoints,
            checkpoint_interval=self.state.checkpoint_interval,
            checkpoints_per_sequence=self.state.checkpoints_per_sequence,
            mean_checkpoints=counts["held"] / counts["steps"] if counts["steps"] else 0.0,
            peak_checkpoints=self._peak_checkpoints,
            saved=stats.saved,
            skipped=stats.skipped,
            evictions=stats.evictions,
            dropped=stats.dropped,
            decode_saves=counts["saves"],
            decode_tokens=self.decode_tokens,
            hit_copies=counts["copies"],
            allowed_tokens=stats.prefix_allowed_tokens,
            hit_tokens=stats.prefix_hit_tokens,
        )

    def _full_group_cached(self, tokens: npt.NDArray[np.uint32]) -> int:
        """Prompt tokens group 0 alone has cached: its leading block hashes stored on the GPU
        (at most every block but the one holding the last token, as for any hit)."""
        stored = set(np.asarray(self.manager.stored_hashes()).tolist())
        hashes = np.asarray(self.manager.block_hashes(tokens)).tolist()
        hittable = (len(tokens) - 1) // self.block_size
        blocks = 0
        for block_hash in hashes[:hittable]:
            if block_hash not in stored:
                break
            blocks += 1
        return blocks * self.block_size

    def _prefill(self, seq: int, tokens: npt.NDArray[np.uint32]) -> int:
        """Allocate the hit and the first chunk, then append and plan chunk by chunk."""
        length = len(tokens)
        full_group = self._full_group_cached(tokens)
        hit = self.manager.cached_prefix_blocks(tokens) * self.block_size
        end = min(length, hit + self.prefill_chunk)
        reused = self.manager.allocate(seq, tokens[:end])
        if reused > 0 and self.state is not None:
            self._state_counts["copies"] += 1
        try:
            self.manager.plan([seq], [end - reused])
            while end < length:
                stop = min(length, end + self.prefill_chunk)
                self.manager.append(seq, tokens[end:stop])
                self.manager.plan([seq], [stop - end])
                end = stop
        except OutOfBlocks:
            self.manager.free(seq)
            raise
        self._count_reuse(length, reused, full_group)
        return length - reused

    def composition(self, running: Sequence[Active]) -> Composition:
        """Pages held, free and cached from the pool's stats, split by the running sequences'
        pages per group: their tokens in real layers, the padding slots of their pages, and
        the tails of last pages they will never fill (as slots of every layer). Pages shared
        by forks are counted per sequence, then scaled to the pages actually held."""
        stats = self.manager.stats(0)
        bs, per_group = self.block_size, self.groups.layers_per_group
        capacity = self.capacity
        held = stats.num_held * bs * per_group // self._num_layers
        token = internal = logical = 0  # in layer slots
        for active in running:
            for seq in self._seqs[active.index]:
                for g, real in enumerate(self._real):
                    first = self.manager.first_block(seq, g)
                    pages = self._pages(active.length) - first
                    stored = active.length - first * bs
                    logical += pages * bs * per_group
                    token += stored * real
                    tail = pages * bs - stored
                    internal += (per_group - real) * pages * bs
                    internal += real * max(0, tail - active.remaining)
        scale = min(1.0, held * self._num_layers / logical) if logical else 1.0
        token_slots = round(token * scale / self._num_layers)
        internal_slots = round(internal * scale / self._num_layers)
        reserved = max(0, held - token_slots - internal_slots)
        internal_slots = held - token_slots - reserved
        # A working state slot holds a live sequence's state: token states, never shared.
        # Checkpoints, like cached pages, and free slots are held by no running request.
        working = 0
        if self.state is not None:
            working = round(self.manager.state_stats().num_working * self._slot_tokens)
        return Composition(
            token_slots + working,
            reserved,
            internal_slots,
            capacity - held - working,
            logical=round(logical / self._num_layers) + working,
        )
