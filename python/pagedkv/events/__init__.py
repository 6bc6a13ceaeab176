"""KV events on the wire: a pagedkv engine, routable by Dynamo's and llm-d's KV routers.

`KVEventPublisher` sends the manager's prefix-cache events over ZeroMQ in the format vLLM
publishes (`pagedkv.events.wire`), with a replay socket for subscribers that missed batches.
Needs the `events` extra: `pip install 'pagedkv[events]'` (pyzmq and msgpack).
"""

from pagedkv.events.chains import CoreEvent, to_wire
from pagedkv.events.publisher import KVEventPublisher, binds
from pagedkv.events.replay import END_SEQ, ReplayBuffer
from pagedkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
    WireEvent,
    encode_batch,
    wire_hash,
)

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CoreEvent",
    "Encoding",
    "KVEventPublisher",
    "ReplayBuffer",
    "WireEvent",
    "binds",
    "encode_batch",
    "to_wire",
    "wire_hash",
]
