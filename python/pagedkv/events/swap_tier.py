"""The swap (CPU) tier as the stream announced it, so it survives an `AllBlocksCleared`.

The manager's `cleared` event (`reset_prefix_cache`) drops its GPU registrations only; the
CPU copies stay. Routers read `AllBlocksCleared` as "forget this engine", so right after it
the publisher announces the CPU blocks again, and an index built from the stream stays equal
to the manager's tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.events.chains import CoreEvent


class SwapTierMirror:
    """Stored CPU blocks by hash, in the order they were announced (parents first)."""

    def __init__(self) -> None:
        self._blocks: dict[int, CoreEvent] = {}

    def follow(self, events: Sequence[CoreEvent]) -> Sequence[CoreEvent]:
        """`events`, with the CPU blocks re-announced after each `cleared`."""
        out: list[CoreEvent] | None = None
        for i, event in enumerate(events):
            kind = event.kind
            if kind == "cleared":
                if out is None:
                    out = list(events[:i])
                out.append(event)
                out.extend(self._blocks.values())
                continue
            if out is not None:
                out.append(event)
            if event.medium != "CPU" or event.block_hash is None:
                continue
            if kind == "stored":
                self._blocks[event.block_hash] = event
            elif kind == "removed":
                self._blocks.pop(event.block_hash, None)
        return events if out is None else out

    def forget(self) -> None:
        """Drop everything (after lost events, the mirror may hold blocks that left)."""
        self._blocks.clear()
