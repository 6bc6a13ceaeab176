"""`KVEventPublisher`: an engine's KV events, published over ZeroMQ in vLLM's format.

Concurrency: the engine's thread only appends to a bounded queue: the batch the manager
encoded in Rust without the GIL (`publish_from`), or `(ts, events)` to encode (`publish`). One
background thread owns both sockets, and it alone encodes those, numbers, sends, keeps the
replay buffer and answers replay requests. Its work per batch holds the GIL, so `publish_from`
takes at most one batch per `batch_interval`; the thread takes a batch the engine left waiting
when the engine has not come back for another interval. Takes hold `_take_lock`, so batches
enter the queue in order. A batch that finds the queue full is dropped and counted, never
waited for, and never gets a sequence number: the numbers on the wire stay gapless. The next
batch after a drop starts with `AllBlocksCleared`, so the router's view of this engine is a
subset of the truth (never stale) until the blocks are stored again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import zmq

from pagedkv.events.chains import CoreEvent, to_wire
from pagedkv.events.replay import ReplayBuffer, answer_request
from pagedkv.events.wire import ENCODINGS, AllBlocksCleared, Encoding, encode_batch

if TYPE_CHECKING:
    from pagedkv import BlockManager

_STOP = None
# The thread wakes on this period and drains the queue, rather than blocking on it: a blocked
# consumer is woken by every `put`, and each wake-up makes the engine's thread wait for the GIL.
# It idles in the sockets' poll, without the GIL, so a replay request is answered at once,
# for a batch interval (the engine takes no batch sooner) within these bounds.
_MIN_IDLE_POLL_MS, _MAX_IDLE_POLL_MS = 1, 5
_LINGER_MS = 2000  # on close, how long queued messages may take to leave


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (vLLM's rule) rather than connects to it."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


_Item = bytes | tuple[float, Sequence[CoreEvent], bool] | None


class KVEventPublisher:
    """Publishes KV event batches on a ZeroMQ PUB socket, with optional replay.

    Example:
        >>> from pagedkv import BlockManager
        >>> mgr = BlockManager(64, 16, enable_events=True)
        >>> with KVEventPublisher.from_manager(mgr, "tcp://127.0.0.1:*") as pub:
        ...     mgr.allocate(0, list(range(40)))  # then, after each engine step:
        ...     pub.publish_from(mgr)
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        block_size: int,
        topic: str = "",
        replay_endpoint: str | None = None,
        data_parallel_rank: int | None = None,
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
        encoding: Encoding = "map",
        batch_interval: float = 0.005,
    ) -> None:
        if batch_interval < 0:
            raise ValueError(f"batch_interval must not be negative, got {batch_interval}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        if hwm < 0:
            raise ValueError(f"hwm must not be negative, got {hwm}")
        if data_parallel_rank is not None and data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must not be negative, got {data_parallel_rank}")
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
        self.block_size = block_size
        self.topic = topic
        self.encoding: Encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self._buffer = ReplayBuffer(buffer_steps)
        self._queue: queue.Queue[_Item] = queue.Queue(max_queue)
        self.batch_interval = batch_interval
        self._take_lock = threading.Lock()
        self._next_take = 0.0  # monotonic time before which `publish_from` defers
        self._deferred: BlockManager | None = None  # a manager whose take was deferred
        self._dropped = 0  # written under _take_lock
        self._failed = 0  # written by the background thread only
        self._lost = False  # a batch was dropped since the last one enqueued (_take_lock)
        self._sent = 0
        self._subscriptions = 0
        self._subscribed = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False

        self._ctx = zmq.Context(io_threads=1)
        try:
            # XPUB sends exactly as PUB does, and also tells us when a subscriber arrives.
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._pub.setsockopt(zmq.LINGER, _LINGER_MS)
            self._replay: zmq.Socket[bytes] | None = None
            self.endpoint = _open(self._pub, endpoint, bind=binds(endpoint))
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)  # a whole replay fits
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _open(self._replay, replay_endpoint, bind=True)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        # From here on the sockets belong to the thread (thread start is the memory barrier).
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def from_manager(
        cls, manager: BlockManager, endpoint: str = "tcp://*:5557", **options: Any
    ) -> KVEventPublisher:
        """A publisher for `manager`'s events, with its block size; see `publish_from`."""
        if not manager.events_enabled:
            raise ValueError("the manager records no events: build it with enable_events=True")
        return cls(endpoint, block_size=manager.block_size, **options)

    def publish_from(self, manager: BlockManager) -> bool:
        """Publish the events `manager` recorded since the last take (call once per step).

        The manager groups and encodes them in Rust, without the GIL; this only enqueues the
        bytes. Within `batch_interval` of the last take it only notes the manager, whose events
        then go out in the next batch (taken by the next call after the interval, or by the
        background thread if no call comes within two intervals). Never blocks; a full queue
        drops the batch, as in `publish`. Returns whether it enqueued a batch.
        """
        if self._closed:
            raise RuntimeError("the publisher is closed")
        if manager.block_size != self.block_size:
            raise ValueError(
                f"the manager's block size {manager.block_size} is not the publisher's "
                f"{self.block_size}"
            )
        if time.monotonic() < self._next_take:
            self._deferred = manager
            return False
        return self._take(manager)

    def _take(self, manager: BlockManager) -> bool:
        """Take `manager`'s events as one encoded batch and enqueue it."""
        with self._take_lock:
            self._deferred = None
            self._next_take = time.monotonic() + self.batch_interval
            payload = manager.take_event_batch(
                time.time(),
                encoding=self.encoding,
                data_parallel_rank=self.data_parallel_rank,
                cleared_first=self._lost,
            )
            return payload is not None and self._enqueue(payload)

    def publish(self, events: Sequence[CoreEvent]) -> None:
        """Enqueue one step's events as one batch; never blocks. Empty steps publish nothing.

        Like vLLM, a step without events sends no batch. When the queue is full the batch is
        dropped and counted in `dropped`.
        """
        if self._closed:
            raise RuntimeError("the publisher is closed")
        if events:
            with self._take_lock:
                self._enqueue((time.time(), events, self._lost))

    def _enqueue(self, item: _Item) -> bool:
        """Enqueue `item` (under `_take_lock`), or drop and count it; whether it went in."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1
            self._lost = True
            return False
        self._lost = False
        return True

    @property
    def dropped(self) -> int:
        """Batches not sent: the queue was full (or, a bug, they failed to encode)."""
        return self._dropped + self._failed

    @property
    def sent(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._sent

    def wait_for_subscribers(self, count: int = 1, timeout: float | None = None) -> bool:
        """Wait until `count` subscriptions have arrived; False if `timeout` passed first.

        A subscriber misses what was sent before its subscription reached us; waiting for it
        (or replay) closes that window.
        """
        with self._subscribed:
            return self._subscribed.wait_for(lambda: self._subscriptions >= count, timeout)

    def close(self) -> None:
        """Send every enqueued batch, then close the sockets (idempotent).

        If the last batches were dropped, a final batch with `AllBlocksCleared` goes out first.
        """
        if self._closed:
            return
        if self._deferred is not None:
            self._take(self._deferred)
        self._closed = True
        if self._lost:  # the last batches were dropped: tell the router to forget, too
            self._queue.put((time.time(), [], True))
        while self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=_MIN_IDLE_POLL_MS / 1000)
                break
            except queue.Full:
                continue
        self._thread.join()
        self._ctx.destroy(linger=_LINGER_MS)
        if self._error is not None:
            raise RuntimeError("the KV event publisher thread failed") from self._error

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a bug of ours or a dead context: report it on close
            self._error = exc

    def _loop(self) -> None:
        topic = self.topic.encode()
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        resync = False  # batches were lost: the next one sent starts with AllBlocksCleared
        idle_ms = round(self.batch_interval * 1000)
        idle_ms = min(max(idle_ms, _MIN_IDLE_POLL_MS), _MAX_IDLE_POLL_MS)
        idle = False
        while True:
            self._serve(poller, idle_ms if idle else 0)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                deferred = self._deferred
                # An engine that is still stepping takes it first; one that stopped does not.
                if (
                    deferred is not None
                    and time.monotonic() >= self._next_take + self.batch_interval
                ):
                    self._take(deferred)
                else:
                    idle = True
                continue
            idle = False
            if item is _STOP:
                self._serve(poller, 0)
                return
            if isinstance(item, bytes):  # encoded by the manager
                # A batch of ours failed to encode: the router forgets first.
                cleared = self._encode(time.time(), [], True) if resync else None
                if cleared is not None:
                    self._send(topic, cleared)
                payload: bytes | None = item
            else:
                ts, events, lost = item
                payload = self._encode(ts, events, resync or lost)
            if payload is None:
                resync = True
                continue
            resync = False
            self._send(topic, payload)

    def _encode(self, ts: float, events: Sequence[CoreEvent], resync: bool) -> bytes | None:
        """A batch of `events`, after `AllBlocksCleared` if `resync`; None if it failed."""
        try:
            wire = to_wire(events, self.block_size)
            if resync:
                wire.insert(0, AllBlocksCleared())
            return encode_batch(ts, wire, self.data_parallel_rank, self.encoding)
        except Exception as exc:  # a bug of ours: keep the engine running, report on close
            self._error = self._error or exc
            self._failed += 1
            return None

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = self._sent.to_bytes(8, "big")
        self._pub.send_multipart([topic, seq, payload])
        self._buffer.append(self._sent, payload)
        self._sent += 1

    def _serve(self, poller: zmq.Poller, timeout_ms: int) -> None:
        """Take subscription messages and answer replay requests, waiting up to `timeout_ms`."""
        for socket, _ in poller.poll(timeout_ms):
            if socket is self._pub:
                while self._pub.poll(0):
                    if self._pub.recv()[:1] == b"\x01":
                        with self._subscribed:
                            self._subscriptions += 1
                            self._subscribed.notify_all()
            elif self._replay is not None:
                while self._replay.poll(0):
                    answer_request(self._replay, self._buffer)


def _open(socket: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> str:
    """Bind or connect `socket`; the address it got (a `*` port resolved)."""
    try:
        if bind:
            socket.bind(endpoint)
            return str(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        socket.connect(endpoint)
        return endpoint
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect to"
        raise OSError(f"cannot {verb} {endpoint!r}: {exc}") from None
