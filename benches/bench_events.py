"""KV events on the wire: encoding and publisher throughput, and the cost per decode step.

1. Encoding: a manager records rounds of block events (8192 stores and as many evictions a
   round, 16-token blocks); `take_event_batch` takes and encodes each round in Rust, on the
   calling thread. Events per second, against the Python encoding (`take_events`, `to_wire`,
   `encode_batch`) of a twin manager's same events in this run.
2. Publisher: batches of per-block `stored` events (Python objects, chains of 16-token blocks)
   go through `KVEventPublisher.publish` (group, encode, number, send on a PUB socket over tcp
   127.0.0.1, with a replay buffer); events per second until `close()` has flushed.
3. Cost per decode step: the same seeded continuous-batching loop over `BlockManager` (shared
   prefixes, one token per sequence per step, frees and re-admissions that evict), run with
   events off and no publisher, then with events on and `publish_from` after every step,
   alternately, `--repeats` times each in this run; prints the medians and their ratio.

    python benches/bench_events.py            # full run
    python benches/bench_events.py --quick    # a few seconds (CI smoke run)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

import zmq

from pagedkv import BlockManager, OutOfBlocks
from pagedkv.events import KVEventPublisher, encode_batch, to_wire

BLOCK = 16


@dataclass(frozen=True)
class BlockEvent:
    """A per-block event with `pagedkv.Event`'s fields, for the throughput part."""

    kind: str
    block_hash: int
    parent_hash: int | None
    token_ids: list[int] = field(default_factory=list)
    medium: str = "GPU"


def record_round(mgr: BlockManager, round_no: int, blocks: int) -> None:
    """Admit and compute `blocks` fresh full blocks (evicting the last round's), then free."""
    rng = random.Random(round_no)
    seqs = range(blocks // 128)
    for sid in seqs:
        mgr.allocate(sid, [rng.randrange(32000) for _ in range(128 * BLOCK)])
    mgr.plan(list(seqs), [128 * BLOCK] * len(seqs))
    mgr.commit(list(seqs))
    for sid in seqs:
        mgr.free(sid)


def encoding_rates(rounds: int, blocks: int) -> tuple[float, float]:
    """Block events per second encoded by `take_event_batch` and by the Python path."""
    key = bytes(32)
    rust = BlockManager(blocks, BLOCK, hash_key=key, enable_events=True)
    python = BlockManager(blocks, BLOCK, hash_key=key, enable_events=True)
    rust_s = python_s = 0.0
    events = 0
    for r in range(rounds):
        record_round(rust, r, blocks)
        record_round(python, r, blocks)
        start = time.perf_counter()
        payload = rust.take_event_batch(time.time())
        rust_s += time.perf_counter() - start
        start = time.perf_counter()
        taken = python.take_events()
        expected = encode_batch(time.time(), to_wire(taken, BLOCK))
        python_s += time.perf_counter() - start
        assert payload is not None and len(payload) == len(expected)
        events += len(taken)
    return events / rust_s, events / python_s


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
    """Seconds per step of a decode loop; steps; batches published (0 when off)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(64, 512))] for _ in range(8)]
    mgr = BlockManager(2048, BLOCK, enable_events=publish)
    pub = KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*") if publish else None

    waiting = list(range(requests))
    running: dict[int, int] = {}  # sequence -> tokens left to decode
    steps = 0
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
            pub.publish_from(mgr)
        elapsed += time.perf_counter() - start
        steps += 1
    if pub is not None:
        pub.close()
        assert pub.dropped == 0
    return elapsed / steps, steps, pub.sent if pub is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=5, help="decode loop runs of each kind")
    args = parser.parse_args()
    batches, per_batch, requests = (300, 64, 150) if args.quick else (5000, 64, 1500)
    rounds, blocks = (3, 2048) if args.quick else (20, 8192)

    rust, python = encoding_rates(rounds, blocks)
    print(f"encoding, {rounds} rounds of {blocks} stores + evictions (one thread):")
    print(f"  Rust (take_event_batch): {rust:12,.0f} block events/s")
    print(f"  Python (to_wire, encode_batch): {python:5,.0f} block events/s")
    print(f"  ratio Rust/Python: {rust / python:.1f}x")
    rate = throughput(batches, per_batch)
    print(f"publisher: {rate:,.0f} events/s encoded and sent ({batches} batches of {per_batch})")
    offs, ons = [], []
    for _ in range(args.repeats):
        off, steps, _ = decode_loop(requests, publish=False)
        on, steps_on, sent = decode_loop(requests, publish=True)
        assert steps == steps_on  # the same decisions with events on
        offs.append(off)
        ons.append(on)
    off, on = statistics.median(offs), statistics.median(ons)
    print(f"decode loop, {steps} steps, {sent} batches published, median of {args.repeats}:")
    print(f"  publisher off: {off * 1e6:8.1f} us/step")
    print(f"  publisher on:  {on * 1e6:8.1f} us/step (engine thread: take, encode, enqueue)")
    print(f"  ratio on/off: {on / off:.2f}x ({(on - off) * 1e6:+.1f} us/step)")


if __name__ == "__main__":
    main()
