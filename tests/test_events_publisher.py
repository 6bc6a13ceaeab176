"""KVEventPublisher on real sockets (127.0.0.1 and ipc://), read by the independent decoder.

Fed by a synthetic per-block event source with known truth, so these tests do not depend on
the compiled core's event fields.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from events_synthetic import FakeEvent, SyntheticEngine
from kv_events_decoder import END_MARKER, Subscriber, decode_payload

from pagedkv.events import KVEventPublisher, binds

BS = 4


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "tcp":
        yield "tcp://127.0.0.1:*"
        return
    with tempfile.TemporaryDirectory(prefix="kvev") as tmp:  # short: ipc paths are limited
        yield f"ipc://{Path(tmp) / 'events'}"


def replay_address(endpoint: str) -> str:
    return endpoint + "-replay" if endpoint.startswith("ipc://") else "tcp://127.0.0.1:*"


def connected(pub: KVEventPublisher, **options: object) -> Subscriber:
    sub = Subscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, **options)  # type: ignore[arg-type]
    assert pub.wait_for_subscribers(1, timeout=10)
    return sub


def test_bind_rule_follows_vllm() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x")
    assert binds("inproc://x") and not binds("tcp://10.0.0.1:5557")


def test_index_follows_truth_after_every_step(endpoint: str) -> None:
    engine = SyntheticEngine(block_size=BS, seed=1)
    topic = "kv@pod-0@model"
    with KVEventPublisher(endpoint, block_size=BS, topic=topic, data_parallel_rank=2) as pub:
        sub = connected(pub, topic=topic.encode())
        try:
            published = 0
            for _ in range(400):
                events = engine.step()
                pub.publish(events)
                if not events:
                    continue  # empty steps publish nothing
                batch = sub.follow()
                assert batch.seq == published and batch.data_parallel_rank == 2
                published += 1
                assert sub.index.tier("GPU") == engine.wire_truth("GPU")
                assert sub.index.tier("CPU") == engine.wire_truth("CPU")
            assert sub.gaps == 0
            assert any(e["type"] == "AllBlocksCleared" for b in sub.batches for e in b.events)
        finally:
            sub.close()
    assert pub.sent == published and pub.dropped == 0


def test_array_encoding_and_no_rank(endpoint: str) -> None:
    with KVEventPublisher(endpoint, block_size=BS, encoding="array") as pub:
        sub = connected(pub)
        pub.publish([FakeEvent("stored", 2**100 + 9, None, [1, 2, 3, 4])])
        sub.sub.poll(5000)
        topic, seq, payload = sub.sub.recv_multipart()
        sub.close()
    assert topic == b"" and seq == bytes(8)
    import msgpack

    body = msgpack.unpackb(payload)
    assert body[1] == [["BlockStored", [9], None, [1, 2, 3, 4], BS, None, "GPU", None]]
    assert body[2] is None


def test_late_joiner_recovers_exact_index_through_replay(endpoint: str) -> None:
    engine = SyntheticEngine(block_size=BS, seed=2)
    with KVEventPublisher(endpoint, block_size=BS, replay_endpoint=replay_address(endpoint)) as pub:
        missed = 0
        for _ in range(200):  # nobody listens yet
            events = engine.step()
            missed += bool(events)
            pub.publish(events)
        deadline = time.monotonic() + 10
        while pub.sent < missed and time.monotonic() < deadline:  # all sent, to nobody
            time.sleep(0.001)
        sub = connected(pub)
        try:
            events: list[FakeEvent] = []
            while not events:
                events = engine.step()
            pub.publish(events)
            batch = sub.follow()
            assert batch.seq == missed and sub.gaps == 1  # it joined late, and noticed
            assert sub.index.tier("GPU") == engine.wire_truth("GPU")
            assert sub.index.tier("CPU") == engine.wire_truth("CPU")
            assert [b.seq for b in sub.batches] == list(range(batch.seq + 1))
        finally:
            sub.close()


def test_tiny_high_water_mark_gaps_are_recovered(endpoint: str) -> None:
    engine = SyntheticEngine(block_size=BS, seed=3)
    replay = replay_address(endpoint)
    with KVEventPublisher(endpoint, block_size=BS, replay_endpoint=replay, hwm=1) as pub:
        sub = connected(pub, rcvhwm=1)
        try:
            published = 0
            for _ in range(300):  # the subscriber does not read: most messages are dropped
                events = engine.step()
                published += bool(events)
                pub.publish(events)
            while True:  # read what got through
                try:
                    sub.follow(timeout_ms=300)
                except TimeoutError:
                    break
            pub.publish([FakeEvent("stored", 12345, None, [0] * BS)])  # a last, known batch
            engine.truth.add(("GPU", 12345))
            assert sub.follow().seq == published
            assert sub.gaps > 0  # the scenario happened
            assert sub.index.tier("GPU") == engine.wire_truth("GPU")
            assert sub.index.tier("CPU") == engine.wire_truth("CPU")
        finally:
            sub.close()


def test_replay_protocol_bounds_and_malformed_requests() -> None:
    with KVEventPublisher(
        "tcp://127.0.0.1:*", block_size=BS, replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3
    ) as pub:
        sub = connected(pub)
        for i in range(5):
            pub.publish([FakeEvent("removed", i)])
        for _ in range(5):
            sub.follow()
        assert [b.seq for b in sub.replay(0)] == [2, 3, 4]  # only the last 3 are kept
        assert [b.seq for b in sub.replay(4)] == [4]
        assert sub.replay(9) == []
        assert pub.replay_endpoint is not None
        dealer = sub.ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"\x01"])  # not 8 bytes: just the end marker
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", END_MARKER, b""]
        dealer.close(linger=0)
        sub.close()


def test_close_flushes_everything_enqueued() -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:*", block_size=BS)
    sub = connected(pub, rcvhwm=0)
    for i in range(2000):
        pub.publish([FakeEvent("removed", i)])
    pub.close()
    pub.close()  # idempotent
    seqs = [sub.follow().seq for _ in range(2000)]
    assert seqs == list(range(2000)) and pub.sent == 2000
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([FakeEvent("removed", 1)])
    sub.close()


def test_full_queue_drops_counts_and_resyncs_without_stale_blocks() -> None:
    engine = SyntheticEngine(block_size=BS, seed=5)
    pub = KVEventPublisher("tcp://127.0.0.1:*", block_size=BS, max_queue=2)
    sub = connected(pub, rcvhwm=0)
    enqueued = 0
    big = [FakeEvent("stored", (1 << 100) + i, None, [i] * BS) for i in range(300)]
    for _ in range(3000):  # faster than the thread encodes: the queue overflows
        events = engine.step() + big
        before = pub.dropped
        pub.publish(events)
        enqueued += pub.dropped == before
    pub.close()
    resync_at_close = pub.sent - enqueued  # 1 if the last batches were dropped
    assert pub.dropped > 0 and resync_at_close in (0, 1)  # counted, and nothing else lost
    batches = [sub.follow() for _ in range(pub.sent)]  # gapless numbers: follow() checks
    assert any(b.events[0]["type"] == "AllBlocksCleared" for b in batches[1:])
    # Every block the index holds is really there (it may miss some: never stale ones).
    big_hashes = {((1 << 100) + i) & (2**64 - 1) for i in range(300)}
    assert sub.index.tier("GPU") <= engine.wire_truth("GPU") | big_hashes
    assert sub.index.tier("CPU") <= engine.wire_truth("CPU")
    sub.close()


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        KVEventPublisher("tcp://127.0.0.1:*", block_size=0)
    with pytest.raises(ValueError, match="encoding must be"):
        KVEventPublisher("tcp://127.0.0.1:*", block_size=4, encoding="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queue"):
        KVEventPublisher("tcp://127.0.0.1:*", block_size=4, max_queue=0)
    with pytest.raises(ValueError, match="replay buffer"):
        KVEventPublisher("tcp://127.0.0.1:*", block_size=4, buffer_steps=0)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        KVEventPublisher("tcp://127.0.0.1:*", block_size=4, data_parallel_rank=-1)
    with KVEventPublisher("tcp://127.0.0.1:*", block_size=4) as pub:
        with pytest.raises(OSError, match="cannot bind"):
            KVEventPublisher(pub.endpoint.replace("127.0.0.1", "*"), block_size=4)
        with pytest.raises(OSError, match="cannot bind"):
            KVEventPublisher(
                "tcp://127.0.0.1:*", block_size=4, replay_endpoint="tcp://127.0.0.1:bad"
            )


def test_decode_of_replayed_payload_matches_live() -> None:
    with KVEventPublisher(
        "tcp://127.0.0.1:*", block_size=BS, replay_endpoint="tcp://127.0.0.1:*"
    ) as pub:
        sub = connected(pub)
        pub.publish([FakeEvent("stored", 77, 5, [1, 2, 3, 4], "CPU")])
        live = sub.follow()
        (again,) = sub.replay(0)
        assert again == live
        assert decode_payload(0, b"\x93\xcb" + bytes(8) + b"\x90\xc0").events == []
        sub.close()
