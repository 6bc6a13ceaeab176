"""From the manager's per-block events to wire events: stored blocks grouped into chain runs.

`BlockManager.take_events()` reports one event per block. Routers take a chain of blocks per
`BlockStored`: a run is a maximal sequence of consecutive stored events of one medium in which
each event's parent is the previous event's block. Consecutive removals of one medium become
one `BlockRemoved`. `BlockManager.take_event_batch` groups and encodes the same way in Rust.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pagedkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    wire_hash,
)


class CoreEvent(Protocol):
    """What the grouping reads of a `pagedkv.Event` (or any object with these fields)."""

    @property
    def kind(self) -> str: ...
    @property
    def block_hash(self) -> int | None: ...
    @property
    def parent_hash(self) -> int | None: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def medium(self) -> str: ...


def to_wire(events: Iterable[CoreEvent], block_size: int) -> list[WireEvent]:
    """Group one take of per-block events into wire events, in order."""
    out: list[WireEvent] = []
    run_tail: int | None = None  # full hash of the last block of the open stored run
    for event in events:
        kind = event.kind
        last = out[-1] if out else None
        if kind == "stored":
            block = _hash_of(event)
            parent = event.parent_hash
            if (
                isinstance(last, BlockStored)
                and parent is not None
                and parent == run_tail
                and last.medium == event.medium
            ):
                last.block_hashes.append(wire_hash(block))
                last.token_ids.extend(event.token_ids)
            else:
                out.append(
                    BlockStored(
                        [wire_hash(block)],
                        None if parent is None else wire_hash(parent),
                        list(event.token_ids),
                        block_size,
                        event.medium,
                        cache_salt=getattr(event, "cache_salt", None),
                    )
                )
            run_tail = block
        elif kind == "removed":
            block = wire_hash(_hash_of(event))
            if isinstance(last, BlockRemoved) and last.medium == event.medium:
                last.block_hashes.append(block)
            else:
                out.append(BlockRemoved([block], event.medium))
            run_tail = None
        elif kind == "cleared":
            out.append(AllBlocksCleared())
            run_tail = None
        else:
            raise ValueError(f"unknown event kind {kind!r}")
    return out


def _hash_of(event: CoreEvent) -> int:
    if event.block_hash is None:
        raise ValueError(f"a {event.kind!r} event without a block hash")
    return event.block_hash
