"""From the manager's per-block events to wire events: stored blocks grouped into chain runs.

`BlockManager.take_events()` reports one event per block. Routers take a chain of blocks per
`BlockStored`: a run is a maximal sequence of consecutive stored events of one medium in which
each event's parent is the previous event's block. Consecutive removals of one medium become
one `BlockRemoved`. Each block's `extra_keys` entry is its sequence's LoRA adapter, its own
extra keys, then (a sequence's first block only) the salt; events without those attributes
have none. `BlockManager.take_event_batch` groups and encodes the same way in Rust.
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
            lora_name = getattr(event, "lora_name", None)
            salt = getattr(event, "cache_salt", None)
            keys = [
                *([lora_name] if lora_name is not None else []),
                *getattr(event, "extra_keys", []),
                *([salt] if salt is not None and parent is None else []),
            ]
            if (
                isinstance(last, BlockStored)
                and parent is not None
                and parent == run_tail
                and last.medium == event.medium
            ):
                last.block_hashes.append(wire_hash(block))
                last.token_ids.extend(event.token_ids)
            else:
                last = BlockStored(
                    [wire_hash(block)],
                    None if parent is None else wire_hash(parent),
                    list(event.token_ids),
                    block_size,
                    event.medium,
                    lora_name=lora_name,
                    cache_salt=salt,
                    extra_keys=[],
                )
                out.append(last)
            assert last.extra_keys is not None
            last.extra_keys.append(keys or None)
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
    for wire in out:  # vLLM leaves the field out when no block has extra keys
        if isinstance(wire, BlockStored) and not any(wire.extra_keys or []):
            wire.extra_keys = None
    return out


def _hash_of(event: CoreEvent) -> int:
    if event.block_hash is None:
        raise ValueError(f"a {event.kind!r} event without a block hash")
    return event.block_hash
