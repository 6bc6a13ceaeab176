"""`BlockManager.take_event_batch`: the Rust encoding equals the Python one, byte for byte.

Two managers with one hash key run the same operations; one hands its events to
`pagedkv.events.to_wire` + `encode_batch`, the other encodes them in Rust.
"""

from __future__ import annotations

import random

import msgpack
import pytest
from kv_events_decoder import decode_payload

from pagedkv import BlockManager, OutOfBlocks
from pagedkv.events import encode_batch, to_wire

BS = 4
KEY = bytes(range(32))


def twins() -> tuple[BlockManager, BlockManager]:
    def make() -> BlockManager:
        return BlockManager(16, BS, num_cpu_blocks=8, hash_key=KEY, enable_events=True)

    return make(), make()


def drive(mgr: BlockManager, seed: int) -> None:
    """A few steps of admissions (salted, unsalted, bytes salts), swaps, frees, a reset."""
    rng = random.Random(seed)
    salts: list[bytes | str | None] = [None, "tenant", b"\xff\x00", ""]
    live: list[int] = []
    for sid in range(12):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(BS + 1, 4 * BS))]
        try:
            mgr.allocate(sid, prompt, salt=salts[sid % len(salts)])
            mgr.plan([sid], [len(prompt) - mgr.num_computed(sid)])
            mgr.commit([sid])
            live.append(sid)
        except OutOfBlocks:
            pass
        if live and rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            try:
                mgr.swap_out([victim])
                mgr.confirm_swap_out([victim])
            except OutOfBlocks:
                pass
            mgr.free(victim)
        if sid == 8:
            mgr.reset_prefix_cache()


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("seed", range(6))
def test_rust_bytes_equal_the_python_encoding(encoding: str, seed: int) -> None:
    py, rs = twins()
    drive(py, seed)
    drive(rs, seed)
    events = py.take_events()
    expected = encode_batch(2.5, to_wire(events, BS), 3, encoding)  # type: ignore[arg-type]
    got = rs.take_event_batch(2.5, encoding=encoding, data_parallel_rank=3)  # type: ignore[arg-type]
    assert got == expected
    assert any(e.cache_salt == "hex:ff00" for e in events)
    assert any(e.cache_salt == "tenant" for e in events)
    decode_payload(0, got)  # the independent decoder accepts it


def test_nothing_to_take_is_none_unless_a_resync_is_asked() -> None:
    mgr = BlockManager(8, BS, enable_events=True)
    assert mgr.take_event_batch(1.0) is None
    payload = mgr.take_event_batch(1.0, cleared_first=True, encoding="array")
    assert payload is not None
    assert msgpack.unpackb(payload) == [1.0, [["AllBlocksCleared"]], None]
    mgr.allocate(0, list(range(2 * BS + 1)))
    mgr.plan([0], [2 * BS + 1])
    mgr.commit([0])
    payload = mgr.take_event_batch(1.0, cleared_first=True)
    assert payload is not None
    kinds = [e["type"] for e in msgpack.unpackb(payload)[1]]
    assert kinds == ["AllBlocksCleared", "BlockStored"]
    assert mgr.take_event_batch(1.0) is None, "taken once"


def test_bad_arguments_raise_and_take_nothing() -> None:
    mgr = BlockManager(8, BS, enable_events=True)
    mgr.allocate(0, list(range(BS + 1)))
    mgr.plan([0], [BS + 1])
    mgr.commit([0])
    with pytest.raises(ValueError, match="encoding must be 'map' or 'array'"):
        mgr.take_event_batch(1.0, encoding="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        mgr.take_event_batch(1.0, data_parallel_rank=-1)
    assert mgr.take_event_batch(1.0) is not None
