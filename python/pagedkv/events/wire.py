"""The wire format KV-aware routers read: vLLM's KV event batches in msgpack.

A message on the PUB socket has three frames: the topic, the sequence number (8 bytes,
big-endian) and the payload, a msgpack array `[ts, events, data_parallel_rank]`. Each event is
a map tagged by `"type"` (`encoding="map"`, what current vLLM writes) or an array whose first
element is the tag (`encoding="array"`, what older vLLM wrote and llm-d's decoder reads).
Block hashes are unsigned 64-bit integers (`wire_hash`), the same value in every event. A
chain carries its LoRA adapter as `lora_name`, its salt's string form as `cache_salt` (map
encoding), and `extra_keys` as vLLM writes them (both encodings): per block, the LoRA adapter,
the block's extra keys, then (a sequence's first block only) the salt.
`BlockManager.take_event_batch` writes the same bytes in Rust; this module encodes event
lists built in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = ("map", "array")
Medium = Literal["GPU", "CPU"]

HASH_MASK = 2**64 - 1


def wire_hash(block_hash: int) -> int:
    """The 64-bit wire hash of a pagedkv block hash: its low 64 bits, unsigned."""
    return block_hash & HASH_MASK


@dataclass(slots=True)
class BlockStored:
    """A chain of full blocks whose KV became available in `medium`, each the next's parent."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block starts a sequence
    token_ids: list[int]  # the blocks' tokens, concatenated
    block_size: int
    medium: str = "GPU"
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None  # the salt's string form, None when unsalted
    extra_keys: list[list[str] | None] | None = None  # per block; None: no block has any


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left `medium`."""

    block_hashes: list[int]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of this engine is gone: the router forgets all it knew about it."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _as_map(event: WireEvent) -> dict[str, Any]:
    # vLLM omits fields declared with a default (extra_keys, group_idx, ...) when unset;
    # lora_id, medium and lora_name have none there, so they are always written.
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            fields["extra_keys"] = event.extra_keys
        if event.cache_salt is not None:
            fields["cache_salt"] = event.cache_salt
        return fields
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def _as_array(event: WireEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        fields = [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        ]
        return fields if event.extra_keys is None else [*fields, event.extra_keys]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode_batch(
    ts: float,
    events: Sequence[WireEvent],
    data_parallel_rank: int | None = None,
    encoding: Encoding = "map",
) -> bytes:
    """The msgpack payload of one event batch."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
    convert = _as_map if encoding == "map" else _as_array
    # The rank is always written (None when unset): Dynamo decodes the batch as a 3-tuple.
    payload: bytes = msgpack.packb([float(ts), [convert(e) for e in events], data_parallel_rank])
    return payload
