"""The wire encoding and chain grouping, checked with the independent decoder (no sockets)."""

from __future__ import annotations

import msgpack
import pytest
from events_synthetic import FakeEvent, SyntheticEngine
from kv_events_decoder import FormatError, Index, decode_payload

from pagedkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    to_wire,
    wire_hash,
)

BIG = 2**127 + 2**64 + 5  # low 64 bits: 5


def stored(h: int, parent: int | None, medium: str = "GPU") -> FakeEvent:
    return FakeEvent("stored", h, parent, [h % 100, h % 100 + 1], medium)


def test_wire_hash_is_the_low_64_bits_unsigned() -> None:
    assert wire_hash(BIG) == 5
    assert wire_hash(2**128 - 1) == 2**64 - 1
    assert wire_hash(2**63) == 2**63  # stays unsigned


def test_consecutive_chain_blocks_form_one_run() -> None:
    events = [stored(BIG, None), stored(BIG + 1, BIG), stored(BIG + 2, BIG + 1)]
    assert to_wire(events, 2) == [
        BlockStored([5, 6, 7], None, [t for e in events for t in e.token_ids], 2, "GPU"),
    ]


def test_runs_break_on_parent_medium_and_other_events() -> None:
    events = [
        stored(10, 3),
        stored(11, 10),
        stored(12, 3),  # parent is not the previous block: new run
        stored(13, 12, "CPU"),  # other medium: new run
        FakeEvent("removed", 11),
        FakeEvent("removed", 12),
        FakeEvent("removed", 13, medium="CPU"),
        stored(14, 13, "CPU"),  # a removal in between: new run
        FakeEvent("cleared"),
        stored(15, None),
    ]
    assert to_wire(events, 2) == [
        BlockStored([10, 11], 3, [10, 11, 11, 12], 2, "GPU"),
        BlockStored([12], 3, [12, 13], 2, "GPU"),
        BlockStored([13], 12, [13, 14], 2, "CPU"),
        BlockRemoved([11, 12], "GPU"),
        BlockRemoved([13], "CPU"),
        BlockStored([14], 13, [14, 15], 2, "CPU"),
        AllBlocksCleared(),
        BlockStored([15], None, [15, 16], 2, "GPU"),
    ]


def test_runs_link_by_full_hash_not_by_its_low_bits() -> None:
    # Same low 64 bits as the previous block, but a different full hash: not its child.
    events = [stored(BIG, None), stored(BIG + 1, 5)]
    assert [len(e.block_hashes) for e in to_wire(events, 2)] == [1, 1]  # type: ignore[union-attr]


def test_unknown_kind_and_missing_hash_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown event kind 'moved'"):
        to_wire([FakeEvent("moved", 1)], 2)
    with pytest.raises(ValueError, match="without a block hash"):
        to_wire([FakeEvent("removed", None)], 2)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_independent_decoder_reads_every_event(encoding: str) -> None:
    wire = to_wire(
        [
            stored(BIG, None),
            stored(BIG + 1, BIG),
            FakeEvent("removed", 7, medium="CPU"),
            FakeEvent("cleared"),
        ],
        2,
    )
    batch = decode_payload(0, encode_batch(12.5, wire, 3, encoding))  # type: ignore[arg-type]
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    assert batch.events == [
        {
            "type": "BlockStored",
            "block_hashes": [5, 6],
            "parent_block_hash": None,
            "token_ids": [BIG % 100, BIG % 100 + 1, (BIG + 1) % 100, (BIG + 1) % 100 + 1],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_map_and_array_layouts() -> None:
    wire = [BlockStored([1], None, [0, 0], 2, "GPU"), BlockRemoved([2], "GPU"), AllBlocksCleared()]
    as_map = msgpack.unpackb(encode_batch(1.0, wire, None, "map"))
    as_array = msgpack.unpackb(encode_batch(1.0, wire, None, "array"))
    assert as_map[2] is None and as_array[2] is None  # the rank is always there
    assert [e["type"] for e in as_map[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert as_array[1] == [
        ["BlockStored", [1], None, [0, 0], 2, None, "GPU", None],
        ["BlockRemoved", [2], "GPU"],
        ["AllBlocksCleared"],
    ]
    with pytest.raises(ValueError, match="encoding must be 'map' or 'array'"):
        encode_batch(1.0, wire, None, "json")  # type: ignore[arg-type]


def test_hashes_above_2_63_pack_as_unsigned_64_bit() -> None:
    payload = encode_batch(1.0, [BlockRemoved([2**64 - 1, 2**63], "GPU")])
    assert b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff" in payload  # msgpack uint64
    assert decode_payload(0, payload).events[0]["block_hashes"] == [2**64 - 1, 2**63]


def test_decoder_rejects_what_routers_cannot_read() -> None:
    bad = [
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x00" * 8], "medium": "GPU"}], None],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}], None],
        [1.0, [["BlockStored", [1], None, [1], 2, None, "GPU", None]], None],
        [1.0, []],
    ]
    for body in bad:
        with pytest.raises(FormatError):
            decode_payload(0, msgpack.packb(body))


def test_fold_of_grouped_stream_equals_synthetic_truth() -> None:
    engine, index = SyntheticEngine(block_size=3, seed=4), Index()
    cleared = 0
    for seq in range(3000):
        events = engine.step()
        cleared += any(e.kind == "cleared" for e in events)
        wire = to_wire(events, 3)
        index.apply(decode_payload(seq, encode_batch(0.0, wire)))
        for medium in ("GPU", "CPU"):
            assert index.tier(medium) == engine.wire_truth(medium)
    assert cleared > 10 and engine.wire_truth("CPU")  # resets and a swap tier really happened
