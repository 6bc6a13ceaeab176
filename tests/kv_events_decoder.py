"""An independent KV event subscriber, written from the wire format, not from pagedkv.events.

Format (vLLM's `kv_events`): three frames per message: topic, sequence number (8 bytes
big-endian, from 0, gapless), msgpack payload `[ts, events, data_parallel_rank]`. An event is a
map tagged by "type" or an array whose first element is the tag:
  BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
    then optionally extra_keys (one entry per block: None or a list) and, in a map, cache_salt
  BlockRemoved: block_hashes, medium
  AllBlocksCleared: no fields
Hashes are 64-bit integers. Replay: send `[b"", start_seq]` to the ROUTER socket; each buffered
batch comes back as `[b"", seq, payload]`, then `[b"", -1 as 8 signed bytes, b""]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

END_MARKER = (-1).to_bytes(8, "big", signed=True)
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class FormatError(AssertionError):
    """A message that does not follow the wire format."""


def decode_event(raw: Any) -> dict[str, Any]:
    """One event as a dict with "type", from either encoding; checks the field types."""
    if isinstance(raw, dict):
        event = dict(raw)
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        names = FIELDS.get(raw[0])
        if names is None:
            raise FormatError(f"unknown event tag {raw[0]!r}")
        if len(raw) - 1 > len(names):
            raise FormatError(f"{raw[0]} has {len(raw) - 1} fields, at most {len(names)}")
        event = {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    else:
        raise FormatError(f"an event must be a map or a tagged array, got {raw!r}")
    kind = event.get("type")
    if kind not in FIELDS:
        raise FormatError(f"unknown event type {kind!r}")
    if kind == "AllBlocksCleared":
        return event
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list) or not hashes:
        raise FormatError(f"{kind} needs a non-empty block_hashes list")
    for h in hashes:
        _check_hash(h)
    if event.get("medium") not in ("GPU", "CPU"):
        raise FormatError(f"unexpected medium {event.get('medium')!r}")
    if kind == "BlockStored":
        if event.get("parent_block_hash") is not None:
            _check_hash(event["parent_block_hash"])
        size = event.get("block_size")
        tokens = event.get("token_ids")
        if not isinstance(size, int) or size < 1:
            raise FormatError(f"bad block_size {size!r}")
        if not isinstance(tokens, list) or len(tokens) != size * len(hashes):
            raise FormatError("token_ids must hold block_size tokens per block")
        if event.get("lora_id") is not None:
            raise FormatError("pagedkv sets no lora_id (it names adapters by lora_name)")
        if not isinstance(event.get("lora_name", ""), str | None):
            raise FormatError(f"lora_name must be a string, got {event['lora_name']!r}")
        extra = event.get("extra_keys")
        if extra is not None and (
            not isinstance(extra, list)
            or len(extra) != len(hashes)
            or not all(e is None or isinstance(e, list) for e in extra)
        ):
            raise FormatError(f"extra_keys must hold None or a list per block, got {extra!r}")
        if not isinstance(event.get("cache_salt", ""), str):
            raise FormatError(f"cache_salt must be a string, got {event['cache_salt']!r}")
    return event


def _check_hash(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise FormatError(f"a block hash must be an unsigned 64-bit integer, got {value!r}")


@dataclass
class Batch:
    """One decoded message."""

    seq: int
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None


def decode_payload(seq: int, payload: bytes) -> Batch:
    """The batch in a message payload."""
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(body, list) or len(body) != 3:
        raise FormatError(f"a batch is [ts, events, data_parallel_rank], got {body!r}")
    ts, events, rank = body
    if not isinstance(ts, float) or not isinstance(events, list):
        raise FormatError(f"bad batch header {ts!r}, {type(events)}")
    if rank is not None and not isinstance(rank, int):
        raise FormatError(f"bad data_parallel_rank {rank!r}")
    return Batch(seq, ts, [decode_event(e) for e in events], rank)


@dataclass
class Index:
    """What a router knows: (medium, hash) of every block announced and not removed."""

    blocks: set[tuple[str, int]] = field(default_factory=set)

    def apply(self, batch: Batch) -> None:
        for event in batch.events:
            if event["type"] == "BlockStored":
                self.blocks.update((event["medium"], h) for h in event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                self.blocks.difference_update((event["medium"], h) for h in event["block_hashes"])
            else:
                self.blocks.clear()

    def tier(self, medium: str) -> set[int]:
        return {h for m, h in self.blocks if m == medium}


class Subscriber:
    """A SUB socket that decodes, checks sequence numbers and recovers gaps through replay."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: bytes = b"",
        bind: bool = False,
        replay_endpoint: str | None = None,
        rcvhwm: int = 1000,
    ) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sub.bind(endpoint)
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.index = Index()
        self.expected = 0  # next sequence number to apply
        self.gaps = 0  # gaps found (and recovered)
        self.batches: list[Batch] = []

    def receive(self, timeout_ms: int = 5000) -> Batch:
        """The next message (raises on timeout or a bad message); applies nothing."""
        if not self.sub.poll(timeout_ms):
            raise TimeoutError(f"no message in {timeout_ms} ms (expecting seq {self.expected})")
        frames = self.sub.recv_multipart()
        if len(frames) != 3:
            raise FormatError(f"a message has 3 frames, got {len(frames)}")
        topic, seq, payload = frames
        if topic != self.topic or len(seq) != 8:
            raise FormatError(f"bad topic {topic!r} or sequence frame {seq!r}")
        return decode_payload(int.from_bytes(seq, "big"), payload)

    def follow(self, timeout_ms: int = 5000) -> Batch:
        """Receive and apply the next batch, first replaying any batches missed before it."""
        batch = self.receive(timeout_ms)
        while batch.seq < self.expected:  # already applied through a replay
            batch = self.receive(timeout_ms)
        if batch.seq > self.expected:
            self.gaps += 1
            if self.replay_endpoint is None:
                raise FormatError(f"gap: expected seq {self.expected}, got {batch.seq}")
            missed = [b for b in self.replay(self.expected) if b.seq < batch.seq]
            if [b.seq for b in missed] != list(range(self.expected, batch.seq)):
                raise FormatError(f"replay cannot fill {self.expected}..{batch.seq - 1}")
            for old in missed:
                self._apply(old)
        self._apply(batch)
        return batch

    def _apply(self, batch: Batch) -> None:
        self.index.apply(batch)
        self.batches.append(batch)
        self.expected = batch.seq + 1

    def replay(self, start_seq: int, timeout_ms: int = 5000) -> list[Batch]:
        """Every batch the replay server still holds from `start_seq` on."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            out = []
            while True:
                if not dealer.poll(timeout_ms):
                    raise TimeoutError("replay server did not answer")
                frames = dealer.recv_multipart()
                if len(frames) != 3 or frames[0] != b"":
                    raise FormatError(f"a replay answer is [b'', seq, payload], got {frames!r}")
                if frames[1] == END_MARKER:
                    if frames[2] != b"":
                        raise FormatError("the end marker has an empty payload")
                    return out
                out.append(decode_payload(int.from_bytes(frames[1], "big"), frames[2]))
        finally:
            dealer.close()

    def close(self) -> None:
        self.ctx.destroy(linger=0)
