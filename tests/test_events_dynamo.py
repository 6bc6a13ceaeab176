"""A real router: NVIDIA Dynamo's radix tree, fed with the manager's stream, answers every
prompt as the manager does.

Dynamo's vLLM relay turns each `BlockStored` block into `(block_hash, tokens_hash)`, the local
hash the router also computes for a query (`compute_block_hash_for_seq`, here with the LoRA
adapter and the salt as its cache namespace). Its tree refuses a store whose parent it lacks.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
import pytest

from pagedkv import BlockManager, OutOfBlocks

dynamo = pytest.importorskip("dynamo._core")

BS = 4
WORKER = 7


def local_hashes(tokens: list[int], salt: str | None, lora: str | None) -> list[int]:
    hashes: list[int] = dynamo.compute_block_hash_for_seq(
        tokens, BS, lora_name=lora, cache_namespace=salt
    )
    return hashes


class DynamoRouter:
    """A `RadixTree` fed as Dynamo's relay feeds it."""

    def __init__(self) -> None:
        self.tree = dynamo.RadixTree()
        self.event_id = 0

    def apply(self, payload: bytes) -> None:
        for event in msgpack.unpackb(payload)[1]:
            kind = event["type"]
            if kind == "BlockStored":
                tokens = event["token_ids"]
                local = local_hashes(tokens, event.get("cache_salt"), event["lora_name"])
                blocks = [
                    {"block_hash": h, "tokens_hash": t}
                    for h, t in zip(event["block_hashes"], local, strict=True)
                ]
                data: Any = {
                    "stored": {"parent_hash": event["parent_block_hash"], "blocks": blocks}
                }
            elif kind == "BlockRemoved":
                data = {"removed": {"block_hashes": event["block_hashes"]}}
            else:
                data = "cleared"
            self.event_id += 1
            # Raises if a store's parent is missing: the stream must be a tree.
            self.tree.apply_event(
                WORKER, json.dumps({"event_id": self.event_id, "data": data}).encode()
            )

    def match(self, tokens: list[int], salt: str | None, lora: str | None) -> int:
        scores = self.tree.find_matches(local_hashes(tokens, salt, lora)).scores
        return int(scores.get((WORKER, 0), 0))


def test_dynamos_radix_tree_answers_every_prompt_as_the_manager() -> None:
    rng = random.Random(0)
    mgr = BlockManager(40, BS, enable_events=True)
    router = DynamoRouter()
    prefixes = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(4)]
    prompts: list[tuple[list[int], str | None, str | None]] = []
    running: list[int] = []
    sid = 0
    for step in range(300):
        admit = []
        for _ in range(rng.choice([0, 1, 2, 3])):  # several at once: duplicate prefixes
            sid += 1
            prompt = rng.choice(prefixes)[: rng.randrange(1, 3 * BS + 1)]
            prompt += [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
            salt, lora = rng.choice([None, None, "tenant-a"]), rng.choice([None, "ad"])
            try:
                mgr.allocate(sid, prompt, salt=salt, lora_name=lora)
            except OutOfBlocks:
                continue
            admit.append(sid)
            prompts.append((prompt, salt, lora))
        if admit:
            mgr.plan(admit, [mgr.num_tokens(s) for s in admit])
            mgr.commit(admit)
            running += admit
        while running:
            try:
                mgr.step(running, [rng.randrange(1000) for _ in running])
                break
            except OutOfBlocks:
                mgr.free(running.pop())
        for s in list(running):
            if rng.random() < 0.1:
                mgr.free(s)
                running.remove(s)
        if step % 97 == 96:
            mgr.reset_prefix_cache()
        payload = mgr.take_event_batch(0.0)
        if payload is not None:
            router.apply(payload)
        for prompt, salt, lora in prompts[-40:]:
            expected = mgr.cached_prefix_blocks([*prompt, 0], salt=salt, lora_name=lora)
            assert router.match(prompt, salt, lora) == expected
    assert mgr.stats().evictions > 0
