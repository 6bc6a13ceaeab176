"""The hybrid paged system: the real `pagedkv.HybridManager`, one KV-cache group per set of
layers of one attention kind (`pagedkv.groups`), all in one pool of equal-sized pages.

A page holds `block_size` tokens of `layers_per_group` layers, so one pool page is
`layers_per_group / num_layers` of a uniform block. Memory is reported in token slots of every
layer, like the other systems: a group's page counts for its share of a token slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pagedkv import HybridManager, OutOfBlocks
from pagedkv.simulate.engine import Active
from pagedkv.simulate.metrics import Composition
from pagedkv.simulate.paged import PagedBase, simulation_hash_key
from pagedkv.simulate.presets import ModelPreset
from pagedkv.simulate.trace import Request


class HybridPagedSystem(PagedBase):
    """A hybrid model's KV memory managed by `pagedkv.HybridManager` with `model.groups()`.

    Admission checks that the pool's free and cached pages, less the watermark, cover the
    most pages the chunked prefill will hold at once in every group. Each admission also
    records how much of its prompt the full-attention group 0 alone had cached (its stored
    block hashes), the most any hit could serve.
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
        name: str = "hybrid paged",
    ) -> None:
        self.groups = model.groups(layers_per_group)
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        per_group = self.groups.layers_per_group
        self.page_bytes = per_group * block_size * model.layer_bytes_per_token
        self.num_pages = kv_memory // self.page_bytes
        self._num_layers = model.num_layers
        self._real = [sum(layer >= 0 for layer in slots) for slots in self.groups.layers]
        self.manager = HybridManager(
            self.num_pages,
            block_size,
            list(self.groups.attention),
            enable_prefix_caching=True,
            watermark=watermark,
            hash_key=simulation_hash_key(seed),
        )
        self._watermark_pages = int(watermark * self.num_pages)
        capacity = self.num_pages * block_size * per_group // model.num_layers
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
        return self.peak_pages(len(tokens)) <= available

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
        return Composition(
            token_slots,
            reserved,
            internal_slots,
            capacity - held,
            logical=round(logical / self._num_layers),
        )
