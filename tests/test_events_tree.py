"""A router's radix tree, built from the manager's event stream, equals the manager's cache.

`RadixIndex` is written from the KV routers' semantics (Dynamo's indexer, llm-d), not from
pagedkv: a `BlockStored` links each block under its parent (the event's parent, then the run's
previous block) and is dropped, with the rest of its run, when the tree lacks that parent; a
`BlockRemoved` drops the block and everything below it; `AllBlocksCleared` empties the tree.
Queries are hashed by the router itself, as vLLM keys blocks: a block's key is its tokens and
its extra keys (the LoRA adapter, the multimodal items it holds, and for a sequence's first
block the salt; the stream carries them in `extra_keys`, the salt also as `cache_salt` in the
map encoding). After every step the tree must hold exactly `stored_hashes`, and answer every
prompt as `cached_prefix_blocks`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from kv_events_decoder import decode_payload

from pagedkv import BlockManager, OutOfBlocks

MASK = 2**64 - 1
BS = 4
Key = tuple[tuple[int, ...], tuple[str, ...]]
Span = tuple[int, int, str]


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    salt: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Span, ...] = ()

    def block_keys(self, i: int) -> tuple[str, ...]:
        """What a router adds to block `i`'s tokens, computed from the request."""
        held = [k for start, end, k in self.extra_keys if start < (i + 1) * BS and end > i * BS]
        lora = [self.lora_name] if self.lora_name is not None else []
        salt = [self.salt] if self.salt is not None and i == 0 else []
        return (*lora, *held, *salt)

    def kwargs(self) -> dict[str, Any]:
        return {"salt": self.salt, "lora_name": self.lora_name, "extra_keys": self.extra_keys}


@dataclass
class Node:
    parent: int | None
    key: Key
    children: dict[Key, int] = field(default_factory=dict)


class RadixIndex:
    """One worker's blocks of one medium, as a router holds them."""

    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.roots: dict[Key, int] = {}
        self.dropped = 0  # stores whose parent the tree did not hold

    def store(self, event: dict[str, Any]) -> None:
        hashes, tokens = event["block_hashes"], event["token_ids"]
        extra = event.get("extra_keys") or [None] * len(hashes)
        parent = event["parent_block_hash"]
        for i, h in enumerate(hashes):
            if parent is not None and parent not in self.nodes:
                self.dropped += 1
                return
            keys = tuple(extra[i] or ())
            if "cache_salt" in event and parent is None:
                assert keys[-1:] == (event["cache_salt"],), "cache_salt and extra_keys disagree"
            key: Key = (tuple(tokens[i * BS : (i + 1) * BS]), keys)
            siblings = self.roots if parent is None else self.nodes[parent].children
            assert h not in self.nodes, "a block stored twice"
            assert key not in siblings, "two blocks the router cannot tell apart"
            siblings[key] = h
            self.nodes[h] = Node(parent, key)
            parent = h

    def remove(self, h: int) -> None:
        node = self.nodes.get(h)
        if node is None:
            return
        siblings = self.roots if node.parent is None else self.nodes[node.parent].children
        del siblings[node.key]
        below = [h]
        while below:
            below.extend(self.nodes.pop(below.pop()).children.values())

    def match(self, prompt: Prompt) -> int:
        """Full blocks of the prompt found from the root, as the router hashes a query."""
        level, found, tokens = self.roots, 0, prompt.tokens
        for i in range(len(tokens) // BS):
            h = level.get((tuple(tokens[i * BS : (i + 1) * BS]), prompt.block_keys(i)))
            if h is None:
                break
            level, found = self.nodes[h].children, found + 1
        return found


class Router:
    """A router's view of one worker: a tree per medium, fed with encoded batches."""

    def __init__(self) -> None:
        self.tiers = {"GPU": RadixIndex(), "CPU": RadixIndex()}

    def apply(self, payload: bytes) -> None:
        for event in decode_payload(0, payload).events:
            if event["type"] == "BlockStored":
                self.tiers[event["medium"]].store(event)
            elif event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    self.tiers[event["medium"]].remove(h)
            else:
                self.tiers = {"GPU": RadixIndex(), "CPU": RadixIndex()}


class Harness:
    """A manager, a router following its stream, and the prompts to query after each step."""

    def __init__(self, encoding: str, num_blocks: int = 24, num_cpu_blocks: int = 16) -> None:
        self.mgr = BlockManager(num_blocks, BS, num_cpu_blocks=num_cpu_blocks, enable_events=True)
        self.encoding = encoding
        self.router = Router()
        self.prompts: list[Prompt] = []

    def prefill(self, seqs: dict[int, Prompt]) -> None:
        """Admit these sequences in one step (one plan), then commit their prefill."""
        for sid, prompt in seqs.items():
            self.mgr.allocate(sid, prompt.tokens, **prompt.kwargs())
            self.prompts.append(prompt)
        ids = list(seqs)
        self.mgr.plan(ids, [self.mgr.num_tokens(s) - self.mgr.num_computed(s) for s in ids])
        self.mgr.commit(ids)
        self.sync()

    def sync(self) -> None:
        """Deliver the step's batch and check the router against the manager."""
        payload = self.mgr.take_event_batch(0.0, encoding=self.encoding)
        if payload is not None:
            self.router.apply(payload)
        mgr = self.mgr
        for medium, index in self.router.tiers.items():
            truth = {h & MASK for h in mgr.stored_hashes(medium)}  # type: ignore[arg-type]
            assert set(index.nodes) == truth, f"{medium} tree != stored_hashes"
        gpu = self.router.tiers["GPU"]
        for prompt in self.prompts:
            expected = mgr.cached_prefix_blocks([*prompt.tokens, 0], **prompt.kwargs())
            assert gpu.match(prompt) == expected, f"query {prompt}"
        mgr.check()


ENCODINGS = ["map", "array"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_salted_prefix_is_routed_to_its_tenant_only(encoding: str) -> None:
    h = Harness(encoding)
    prompt = Prompt(tokens(1, 3 * BS + 1), "tenant-a")
    h.prefill({1: prompt})
    others = [Prompt(prompt.tokens), Prompt(prompt.tokens, "tenant-b")]
    h.prompts += others
    h.sync()
    gpu = h.router.tiers["GPU"]
    assert gpu.match(prompt) == 3
    assert gpu.match(others[0]) == gpu.match(others[1]) == 0


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_reset_while_running_leaves_no_block_under_a_withdrawn_parent(encoding: str) -> None:
    h = Harness(encoding)
    h.prefill({1: Prompt(tokens(2, 2 * BS + 1))})
    h.mgr.reset_prefix_cache()
    h.sync()
    for t in range(3 * BS):  # sequence 1 fills blocks 2, 3 and 4 after the reset
        h.mgr.step([1], [t])
        h.sync()
    h.mgr.commit([1])
    h.sync()
    assert h.mgr.stored_hashes() == []
    # The chain registers again once a sequence computes it again, and routes again.
    again = Prompt(h.mgr.token_ids(1).tolist())
    h.prefill({2: again})
    assert h.router.tiers["GPU"].match(again) == len(again.tokens) // BS


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_prefix_computed_twice_in_one_step_then_evicted(encoding: str) -> None:
    h = Harness(encoding, num_blocks=12)
    shared = tokens(3, 2 * BS)
    a, b = shared + tokens(4, BS + 1), shared + tokens(5, BS + 1)
    h.prefill({1: Prompt(a), 2: Prompt(b)})  # both compute `shared`; only 1's copy registers
    h.mgr.free(1)
    h.sync()
    filler = 10
    while h.mgr.stats().evictions < 3:  # evict sequence 1's blocks while 2 still runs
        h.prefill({filler: Prompt(tokens(filler, BS + 1))})
        h.mgr.free(filler)
        filler += 1
    for t in range(2 * BS):
        h.mgr.step([2], [t])
        h.sync()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_swap_in_that_finds_the_old_copy_then_evicted(encoding: str) -> None:
    h = Harness(encoding, num_blocks=10, num_cpu_blocks=8)
    h.prefill({1: Prompt(tokens(6, 3 * BS + 1))})
    h.mgr.swap_out([1])
    h.mgr.confirm_swap_out([1])
    h.sync()
    h.prefill({2: Prompt(tokens(7, 2 * BS + 1))})  # evicts the old copy's tail, not its head
    h.mgr.free(2)
    h.mgr.swap_in([1])
    h.mgr.confirm_swap_in([1])
    h.sync()
    filler = 10
    while h.mgr.stats().evictions < 6:
        h.prefill({filler: Prompt(tokens(filler, BS + 1))})
        h.mgr.free(filler)
        filler += 1
    for t in range(BS):
        h.mgr.step([1], [t])
        h.sync()


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_trace_keeps_router_and_manager_equal(encoding: str, seed: int) -> None:
    rng = random.Random(seed)
    h = Harness(encoding, num_blocks=40, num_cpu_blocks=24)
    mgr = h.mgr
    prefixes = [tokens(100 + i, 3 * BS) for i in range(4)]
    salts = [None, None, "tenant-a", "tenant-b"]
    loras = [None, None, "adapter-1"]
    running: list[int] = []
    swapped: list[int] = []
    seen = dict.fromkeys(["duplicates", "reset", "swap_in", "fork", "salted", "keyed"], 0)
    next_id = 0
    for _ in range(400):
        admit = {}
        for _ in range(rng.choice([0, 0, 1, 2, 3])):  # several at once: duplicate prefixes
            next_id += 1
            prompt = rng.choice(prefixes)[: rng.randrange(1, 3 * BS + 1)]
            prompt += tokens(next_id, rng.randrange(1, 6))
            image = rng.randrange(len(prompt))  # an image's placeholder tokens, sometimes
            spans = ((image, min(len(prompt), image + 3), f"img-{image % 3}"),)
            admit[next_id] = Prompt(
                prompt, rng.choice(salts), rng.choice(loras), spans if rng.random() < 0.3 else ()
            )
        try:
            h.prefill(admit)
            running += list(admit)
            seen["duplicates"] += len(admit) > 1
            seen["salted"] += any(p.salt for p in admit.values())
            seen["keyed"] += any(p.lora_name or p.extra_keys for p in admit.values())
        except OutOfBlocks:
            for sid in admit:
                if sid in mgr:
                    mgr.free(sid)
            h.sync()
        if running and rng.random() < 0.1:
            next_id += 1
            mgr.fork(rng.choice(running), next_id)
            running.append(next_id)
            seen["fork"] += 1
        if running and rng.random() < 0.08:
            sid = rng.choice(running)
            try:
                mgr.swap_out([sid])
                mgr.confirm_swap_out([sid])
                running.remove(sid)
                swapped.append(sid)
            except OutOfBlocks:
                pass
        if swapped and rng.random() < 0.2:
            try:
                mgr.swap_in([swapped[0]])
                mgr.confirm_swap_in([swapped[0]])
                running.append(swapped.pop(0))
                seen["swap_in"] += 1
            except OutOfBlocks:
                pass
        while running:
            try:
                mgr.step(running, [rng.randrange(1000) for _ in running])
                break
            except OutOfBlocks:
                mgr.free(running.pop())
        for sid in list(running):
            if rng.random() < 0.08:
                mgr.free(sid)
                running.remove(sid)
        if rng.random() < 0.02:
            mgr.reset_prefix_cache()
            seen["reset"] += 1
        h.sync()
    assert all(count > 0 for count in seen.values()), seen
    assert mgr.stats().evictions > 0


def test_the_index_drops_orphans_and_removes_subtrees() -> None:
    index = RadixIndex()
    chain = {"block_hashes": [1, 2, 3], "parent_block_hash": None, "token_ids": list(range(12))}
    index.store(chain)
    index.store({"block_hashes": [4], "parent_block_hash": 9, "token_ids": [0] * BS})
    assert set(index.nodes) == {1, 2, 3} and index.dropped == 1
    index.remove(2)
    assert set(index.nodes) == {1} and index.match(Prompt(list(range(12)))) == 1
