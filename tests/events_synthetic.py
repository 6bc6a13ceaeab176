"""A synthetic per-block event source with known truth, independent of the compiled core.

`SyntheticEngine.step()` returns events with the fields of `pagedkv.Event` (kind, block_hash,
parent_hash, token_ids, medium, block_id) following API.md's semantics: stored/removed per
block and tier, and `cleared` dropping both tiers (as `reset_prefix_cache` does). `truth` is
the set of (medium, hash).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

MASK = 2**64 - 1


@dataclass(frozen=True)
class FakeEvent:
    kind: str
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    medium: str = "GPU"
    block_id: int | None = None
    seq_no: int = 0


@dataclass
class SyntheticEngine:
    block_size: int = 4
    seed: int = 0
    truth: set[tuple[str, int]] = field(default_factory=set)
    chains: dict[int, int | None] = field(default_factory=dict)  # hash -> parent hash

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _new_hash(self) -> int:
        # Full 128-bit values with high bits set, so the 64-bit truncation matters.
        return self.rng.getrandbits(128) | (1 << 127)

    def step(self) -> list[FakeEvent]:
        rng, events = self.rng, []
        for _ in range(rng.randrange(0, 4)):
            action = rng.random()
            gpu = sorted(h for m, h in self.truth if m == "GPU")
            cpu = sorted(h for m, h in self.truth if m == "CPU")
            if action < 0.45 or not gpu:  # a chain of computed blocks, maybe off a cached one
                parent = rng.choice(gpu) if gpu and rng.random() < 0.5 else None
                for _ in range(rng.randrange(1, 6)):
                    h = self._new_hash()
                    tokens = [rng.randrange(32000) for _ in range(self.block_size)]
                    events.append(FakeEvent("stored", h, parent, tokens, "GPU"))
                    self.truth.add(("GPU", h))
                    self.chains[h] = parent
                    parent = h
            elif action < 0.7:  # evictions
                for h in rng.sample(gpu, min(len(gpu), rng.randrange(1, 4))):
                    events.append(FakeEvent("removed", h, medium="GPU"))
                    self.truth.discard(("GPU", h))
            elif action < 0.85:  # a swap-out confirmed: copies appear on the CPU tier
                for h in rng.sample(gpu, min(len(gpu), rng.randrange(1, 4))):
                    if ("CPU", h) not in self.truth:
                        events.append(
                            FakeEvent("stored", h, self.chains[h], [7] * self.block_size, "CPU")
                        )
                        self.truth.add(("CPU", h))
            elif action < 0.97 and cpu:  # a swap-in confirmed: the CPU copy leaves
                h = rng.choice(cpu)
                events.append(FakeEvent("removed", h, medium="CPU"))
                self.truth.discard(("CPU", h))
            elif action >= 0.97:  # reset_prefix_cache: GPU registrations only
                events.append(FakeEvent("cleared"))
                self.truth = set()
        return events

    def wire_truth(self, medium: str) -> set[int]:
        return {h & MASK for m, h in self.truth if m == medium}
