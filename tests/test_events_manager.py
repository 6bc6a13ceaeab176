"""The real manager's events on the wire: the stream's index equals the manager's tiers.

Written against the KV lifecycle contract (stored = computed, two-phase swaps, `Event.medium`,
`BlockManager.stored_hashes(medium)`, `BlockManager.events_enabled`).
"""

from __future__ import annotations

import random

import pytest
from kv_events_decoder import Subscriber

from pagedkv import BlockManager, OutOfBlocks
from pagedkv.events import KVEventPublisher

MASK = 2**64 - 1
BS = 4


def truth(mgr: BlockManager, medium: str) -> set[int]:
    return {h & MASK for h in mgr.stored_hashes(medium)}


def test_from_manager_needs_events_and_the_same_block_size() -> None:
    with pytest.raises(ValueError, match="enable_events=True"):
        KVEventPublisher.from_manager(BlockManager(8, BS), "tcp://127.0.0.1:*")
    mgr = BlockManager(8, BS, enable_events=True)
    with KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*") as pub:
        assert pub.block_size == BS
        with pytest.raises(ValueError, match="block size 2 is not the publisher's 4"):
            pub.publish_from(BlockManager(8, 2, enable_events=True))


class Engine:
    """A continuous-batching loop with shared prefixes, forks, swaps, evictions and resets."""

    def __init__(self, mgr: BlockManager, seed: int) -> None:
        self.mgr, self.rng = mgr, random.Random(seed)
        self.running: list[int] = []
        self.swapped: list[int] = []
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(1000) for _ in range(3 * BS)] for _ in range(4)]
        self.seen = {"swap_out": 0, "swap_in": 0, "fork": 0, "reset": 0, "preempt": 0}

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def step(self) -> None:
        mgr, rng = self.mgr, self.rng
        if rng.random() < 0.5:  # admit a request sharing a prefix
            sid = self.new_id()
            prompt = rng.choice(self.prefixes)[: rng.randrange(1, 3 * BS + 1)]
            prompt += [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            try:
                reused = mgr.allocate(sid, prompt)
                mgr.plan([sid], [len(prompt) - reused])
                self.running.append(sid)
            except OutOfBlocks:
                pass
        if self.running and rng.random() < 0.1:
            child = self.new_id()
            mgr.fork(rng.choice(self.running), child)
            self.running.append(child)
            self.seen["fork"] += 1
        if self.running and rng.random() < 0.08:
            sid = rng.choice(self.running)
            try:
                mgr.swap_out([sid])
                mgr.confirm_swap_out([sid])
                self.running.remove(sid)
                self.swapped.append(sid)
                self.seen["swap_out"] += 1
            except OutOfBlocks:
                pass
        if self.swapped and rng.random() < 0.15:
            sid = self.swapped[0]
            try:
                mgr.swap_in([sid])
                mgr.confirm_swap_in([sid])
                self.swapped.remove(sid)
                self.running.append(sid)
                self.seen["swap_in"] += 1
            except OutOfBlocks:
                pass
        while self.running:
            try:
                mgr.step(self.running, [rng.randrange(1000) for _ in self.running])
                break
            except OutOfBlocks:
                mgr.free(self.running.pop())
                self.seen["preempt"] += 1
        for sid in list(self.running):
            if rng.random() < 0.06:
                mgr.free(sid)
                self.running.remove(sid)
        if self.swapped and rng.random() < 0.02:
            mgr.free(self.swapped.pop())
        if rng.random() < 0.01:
            mgr.reset_prefix_cache()
            self.seen["reset"] += 1


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_stream_index_equals_manager_tiers_after_every_step(encoding: str) -> None:
    mgr = BlockManager(40, BS, num_cpu_blocks=40, enable_events=True)
    engine = Engine(mgr, seed=11)
    with KVEventPublisher.from_manager(
        mgr,
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        encoding=encoding,
        batch_interval=0,  # a batch per step
    ) as pub:
        sub = Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        assert pub.wait_for_subscribers(1, timeout=10)
        try:
            for _ in range(1500):
                engine.step()
                if pub.publish_from(mgr):
                    sub.follow()
                assert sub.index.tier("GPU") == truth(mgr, "GPU")
                assert sub.index.tier("CPU") == truth(mgr, "CPU")
                mgr.check()
            pub.close()  # joins the sender, so `sent` counts every batch
            assert sub.gaps == 0 and [b.seq for b in sub.batches] == list(range(pub.sent))
        finally:
            sub.close()
    assert all(count > 0 for count in engine.seen.values()), engine.seen
    assert mgr.stats().evictions > 0


def test_publish_from_drops_on_a_full_queue_and_resyncs() -> None:
    mgr = BlockManager(64, BS, num_cpu_blocks=16, enable_events=True)
    engine = Engine(mgr, seed=3)
    pub = KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*", max_queue=1, batch_interval=0)
    sub = Subscriber(pub.endpoint, rcvhwm=0)
    assert pub.wait_for_subscribers(1, timeout=10)
    try:
        taken = 0
        for _ in range(3000):  # faster than the thread sends: the queue overflows
            engine.step()
            taken += pub.publish_from(mgr)
        pub.close()
        assert pub.dropped > 0 and pub.sent >= taken - pub.dropped
        batches = [sub.follow() for _ in range(pub.sent)]  # gapless: follow() checks
        assert any(b.events[0]["type"] == "AllBlocksCleared" for b in batches[1:])
        assert sub.index.tier("GPU") <= truth(mgr, "GPU")  # a subset, never stale
        assert sub.index.tier("CPU") <= truth(mgr, "CPU")
    finally:
        sub.close()


def test_steps_within_the_batch_interval_share_a_batch_sent_without_another_call() -> None:
    mgr = BlockManager(64, BS, enable_events=True)
    engine = Engine(mgr, seed=4)
    with KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*", batch_interval=0.2) as pub:
        sub = Subscriber(pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout=10)
        try:
            while not mgr.stored_hashes():
                engine.step()
            assert pub.publish_from(mgr)  # the first batch goes at once
            sub.follow()
            for _ in range(5):  # steps within the interval only leave their events
                engine.step()
                assert not pub.publish_from(mgr)
            sub.follow()  # the thread sends them once the interval is over
            assert sub.index.tier("GPU") == truth(mgr, "GPU")
            with pytest.raises(ValueError, match="batch_interval must not be negative"):
                KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*", batch_interval=-1)
        finally:
            sub.close()
