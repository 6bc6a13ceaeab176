"""KV events on the wire: publisher throughput, and its cost per decode step against none.

1. Throughput: batches of per-block `stored` events (chains of 16-token blocks) go through
   `KVEventPublisher` (group, encode, number, send on a PUB socket over tcp 127.0.0.1, with a
   replay buffer); events per second from the first `publish` until `close()` has flushed.
2. Cost per decode step: the same seeded continuous-batching loop over `BlockManager` (shared
   prefixes, one token per sequence per step, frees and re-admissions that evict), run with
   events off and no publisher, then with events on and `publish_from` after every step, in
   this run; prints both and their ratio.

    python benches/bench_events.py            # full run
    python benches/bench_events.py --quick    # a few seconds (CI smoke run)
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import zmq

from pagedkv import BlockManager, OutOfBlocks
from pagedkv.events import KVEventPublisher

BLOCK = 16


@dataclass(frozen=True)
class BlockEvent:
    """A per-block event with `pagedkv.Event`'s fields, for the throughput part."""

    kind: str
    block_hash: int
    parent_hash: int | None
    token_ids: list[int] = field(default_factory=list)
    medium: str = "GPU"


def throughput(batches: int, events_per_batch: int) -> float:
    """Events per second through publish, grouping, encoding and send, until flushed."""
    rng = random.Random(0)
    steps = []
    for _ in range(batches):
        parent, batch = None, []
        for _ in range(events_per_batch):
            h = rng.getrandbits(128)
            batch.append(BlockEvent("stored", h, parent, [rng.randrange(32000)] * BLOCK))
            parent = h if rng.random() < 0.9 else None
        steps.append(batch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = KVEventPublisher(
        "tcp://127.0.0.1:*", block_size=BLOCK, replay_endpoint="tcp://127.0.0.1:*"
    )
    sub.connect(pub.endpoint)
    pub.wait_for_subscribers(1, timeout=10)
    start = time.perf_counter()
    for batch in steps:
        pub.publish(batch)
    pub.close()
    elapsed = time.perf_counter() - start
    ctx.destroy(linger=0)
    assert pub.dropped == 0 and pub.sent == batches
    return batches * events_per_batch / elapsed


def decode_loop(requests: int, *, publish: bool, seed: int = 0) -> tuple[float, int, int]:
    """Seconds per step of a decode loop; steps; events taken (0 when off)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(64, 512))] for _ in range(8)]
    mgr = BlockManager(2048, BLOCK, enable_events=publish)
    pub = KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*") if publish else None
    waiting = list(range(requests))
    running: dict[int, int] = {}  # sequence -> tokens left to decode
    steps = events = 0
    elapsed = 0.0
    while waiting or running:
        start = time.perf_counter()
        while waiting and len(running) < 64:
            sid = waiting[-1]
            prompt = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(32)]
            try:
                reused = mgr.allocate(sid, prompt)
            except OutOfBlocks:
                break
            mgr.plan([sid], [len(prompt) - reused])
            running[sid] = rng.randrange(16, 256)
            waiting.pop()
        ids = list(running)
        try:
            mgr.step(ids, [rng.randrange(32000) for _ in ids])
        except OutOfBlocks:
            victim = ids[-1]
            mgr.free(victim)
            del running[victim]
            waiting.append(victim)
            continue
        for sid in ids:
            running[sid] -= 1
            if running[sid] == 0:
                mgr.free(sid)
                del running[sid]
        if pub is not None:
            taken = mgr.take_events()
            events += len(taken)
            pub.publish(taken)
        elapsed += time.perf_counter() - start
        steps += 1
    if pub is not None:
        pub.close()
        assert pub.dropped == 0
    return elapsed / steps, steps, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    args = parser.parse_args()
    batches, per_batch, requests = (300, 64, 150) if args.quick else (5000, 64, 1500)

    rate = throughput(batches, per_batch)
    print(f"publisher: {rate:,.0f} events/s encoded and sent ({batches} batches of {per_batch})")
    off, steps, _ = decode_loop(requests, publish=False)
    on, steps_on, events = decode_loop(requests, publish=True)
    assert steps == steps_on  # the same decisions with events on
    print(f"decode loop, {steps} steps, {events} events ({events / steps:.1f} per step):")
    print(f"  publisher off: {off * 1e6:8.1f} us/step")
    print(f"  publisher on:  {on * 1e6:8.1f} us/step (engine thread: take + enqueue)")
    print(f"  ratio on/off: {on / off:.2f}x ({(on - off) * 1e6:+.1f} us/step)")
    print(
        f"  publisher capacity / events per step: {rate / max(events / steps, 1e-9):,.0f} steps/s"
    )


if __name__ == "__main__":
    main()
