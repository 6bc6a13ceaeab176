"""Salts, LoRA adapters and per-block extra keys: part of each block's hash, hits and events.

A block binds its sequence's salt and LoRA adapter (through the chain's root) and the extra
keys of the spans it holds (`extra_keys=[(start, end, key)]`, e.g. an image's content hash
over its placeholder tokens); the events carry them as vLLM does.
"""

from __future__ import annotations

import re

import msgpack
import pytest

from pagedkv import BlockManager

BS = 4
PROMPT = list(range(3 * BS + 1))
IMAGE = [(5, 7, "img-a")]  # tokens 5 and 6: block 1


def computed(mgr: BlockManager, sid: int, tokens: list[int], **keys: object) -> None:
    mgr.allocate(sid, tokens, **keys)  # type: ignore[arg-type]
    mgr.plan([sid], [len(tokens) - mgr.num_computed(sid)])
    mgr.commit([sid])


def test_lora_and_extra_keys_change_exactly_the_blocks_that_bind_them() -> None:
    mgr = BlockManager(16, BS)
    plain = mgr.block_hashes(PROMPT)
    lora = mgr.block_hashes(PROMPT, lora_name="adapter")
    image = mgr.block_hashes(PROMPT, extra_keys=IMAGE)
    assert all(a != b for a, b in zip(plain, lora, strict=True))
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]
    assert mgr.block_hashes(PROMPT, extra_keys=[(5, 7, "img-b")])[1] != image[1]
    assert mgr.block_hashes(PROMPT, extra_keys=[(4, 5, "img-a")])[1] == image[1]  # same block
    assert mgr.block_hashes(PROMPT, salt="t", lora_name="adapter") != lora


def test_a_hit_needs_the_same_adapter_and_extra_keys() -> None:
    mgr = BlockManager(32, BS)
    computed(mgr, 1, PROMPT, lora_name="adapter", extra_keys=IMAGE)
    assert mgr.cached_prefix_blocks(PROMPT, lora_name="adapter", extra_keys=IMAGE) == 3
    assert mgr.cached_prefix_blocks(PROMPT, lora_name="adapter") == 1  # block 1 holds the image
    assert mgr.cached_prefix_blocks(PROMPT, extra_keys=IMAGE) == 0
    other = [(5, 7, "img-b")]
    assert mgr.cached_prefix_blocks(PROMPT, lora_name="adapter", extra_keys=other) == 1
    assert mgr.allocate(2, PROMPT, lora_name="adapter", extra_keys=IMAGE) == 3 * BS
    assert mgr.can_allocate(PROMPT, lora_name="adapter", extra_keys=IMAGE)
    mgr.check()


def test_appended_extra_keys_bind_the_blocks_they_fill() -> None:
    mgr = BlockManager(32, BS)
    computed(mgr, 1, PROMPT[:6])
    mgr.append(1, PROMPT[6:], extra_keys=[(9, 11, "img-c")])  # block 2
    mgr.commit([1], [mgr.plan([1], [len(PROMPT) - 6]).qo_indptr[-1] + 6])
    assert mgr.cached_prefix_blocks(PROMPT, extra_keys=[(9, 11, "img-c")]) == 3
    assert mgr.cached_prefix_blocks(PROMPT) == 2


def test_events_carry_the_adapter_extra_keys_and_salt() -> None:
    mgr = BlockManager(16, BS, enable_events=True)
    computed(mgr, 1, PROMPT, salt=b"\xfe", lora_name="adapter", extra_keys=IMAGE)
    events = mgr.take_events()
    assert [e.extra_keys for e in events] == [[], ["img-a"], []]
    assert {(e.lora_name, e.cache_salt) for e in events} == {("adapter", "hex:fe")}
    computed(mgr, 2, list(range(100, 100 + BS + 1)), lora_name="adapter")
    payload = mgr.take_event_batch(0.0, encoding="array")
    assert payload is not None
    (event,) = msgpack.unpackb(payload)[1]
    assert event[7] == "adapter" and event[8] == [["adapter"]]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"extra_keys": [(3, 3, "x")]}, "extra_keys: the span 3..3"),
        ({"extra_keys": [(0, 99, "x")]}, "within the tokens 0..13"),
        ({"extra_keys": [(0, 1)]}, "extra_keys must be a sequence of"),
        ({"extra_keys": [(0, 1, 5)]}, "extra_keys must be a sequence of"),
        ({"extra_keys": "abc"}, "extra_keys must be a sequence of"),
        ({"extra_keys": [(-1, 1, "x")]}, "start"),
        ({"lora_name": b"adapter"}, "lora_name must be a str"),
    ],
)
def test_bad_keys_raise_value_errors_and_change_nothing(
    keys: dict[str, object], message: str
) -> None:
    mgr = BlockManager(16, BS)
    with pytest.raises(ValueError, match=re.escape(message)):
        mgr.allocate(1, PROMPT, **keys)  # type: ignore[arg-type]
    assert 1 not in mgr and mgr.stats().num_free == 16
    with pytest.raises(ValueError, match=re.escape(message.split(" the span")[0])):
        mgr.cached_prefix_blocks(PROMPT, **keys)  # type: ignore[arg-type]


def test_append_refuses_spans_outside_the_new_tokens() -> None:
    mgr = BlockManager(16, BS)
    mgr.allocate(1, PROMPT[:6])
    with pytest.raises(ValueError, match=re.escape("within the tokens 6..8")):
        mgr.append(1, [1, 2], extra_keys=[(5, 7, "x")])
    assert mgr.num_tokens(1) == 6


def test_a_rollback_forgets_the_extra_keys_of_dropped_tokens() -> None:
    mgr = BlockManager(32, BS)
    computed(mgr, 1, PROMPT[:6])
    mgr.append(1, [7, 8], extra_keys=[(6, 8, "img-d")])  # a rejected draft with a key
    mgr.rollback([1], [2])
    mgr.append(1, [7, 8, 9, 10])
    mgr.plan([1], [4])
    mgr.commit([1])
    tokens = [*PROMPT[:6], 7, 8, 9, 10, 0]
    assert mgr.cached_prefix_blocks(tokens) == 2
    assert mgr.cached_prefix_blocks(tokens, extra_keys=[(6, 8, "img-d")]) == 1
