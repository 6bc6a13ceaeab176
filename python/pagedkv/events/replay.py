"""The replay service: recent batches, answered on a ROUTER socket to subscribers with gaps.

A client (DEALER or REQ) sends `[b"", start_seq]`, the sequence number as 8 bytes big-endian.
The answer, per buffered batch from `start_seq` on, is `[b"", seq, payload]`, then the end
marker `[b"", END_SEQ, b""]`; a DEALER client sees those three frames. This is vLLM's replay
protocol: the first frame is the empty envelope delimiter, which a REQ client needs.
"""

from __future__ import annotations

from collections import deque

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ReplayBuffer:
    """The last `capacity` encoded batches, by sequence number."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the replay buffer must hold at least 1 batch, got {capacity}")
        self._batches: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    def append(self, seq: int, payload: bytes) -> None:
        """Keep batch `seq` (one more than the last appended), dropping the oldest if full."""
        self._batches.append((seq, payload))

    def since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Buffered batches with sequence numbers `>= start_seq`, oldest first."""
        if not self._batches:
            return []
        first = self._batches[0][0]
        skip = max(0, start_seq - first)
        return list(self._batches)[skip:]


def answer_request(socket: zmq.Socket[bytes], buffer: ReplayBuffer) -> bool:
    """Answer one waiting request on ROUTER `socket`; False if it was malformed (ignored)."""
    frames = socket.recv_multipart(zmq.NOBLOCK)
    if len(frames) != 3 or frames[1] != b"":
        return False
    identity, _, start = frames
    if len(start) == 8:
        for seq, payload in buffer.since(int.from_bytes(start, "big")):
            socket.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
    # A request that is not 8 bytes still gets the end marker, so its client does not hang.
    socket.send_multipart([identity, b"", END_SEQ, b""])
    return len(start) == 8
