"""The stored value of one block: a fixed header, then the block's K and V for every layer.

Layout (little-endian): magic `b"PKVB"`, format version (u16), dtype code (u8), KV layout code
(u8: 0 NHD, 1 HND, 2 MLA), layers, block size, KV heads, head dim (u32 each), payload length
(u64), XXH3-64 of the payload (u64; 40 GB/s here, where CRC-32 does 4), the block's 128-bit
chain hash, zero padding to 64 bytes; then the payload, `[layers, *page_shape]` of the dtype
(`pagedkv.kv_layout`: NHD `[layers, 2, block_size, kv_heads, head_dim]`, index 0 of the second
dimension K and 1 V; MLA `[layers, block_size, head_dim + rope_dim]`). A float8 payload holds
the stored values; its scales are part of the namespace (`Namespace`). The padding keeps the
payload aligned for every dtype, so a block can be copied straight into place behind room left
for its header (`encode_into`): building a value copies nothing.

A value is only KV when every header field matches what the reader expects, the length is
exact and the checksum agrees; anything else is `CorruptValue` (a miss, never KV). The chain
hash in the header catches a value stored under the wrong key.

>>> import numpy as np
>>> spec = BlockSpec(num_layers=1, block_size=2, num_kv_heads=1, head_dim=2, dtype="float32")
>>> payload = np.arange(8, dtype=np.float32).tobytes()
>>> decode(spec, 7, encode(spec, 7, payload)) == payload
True
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import xxhash

from pagedkv.kv_layout import LAYOUTS, KVLayout, Layout

MAGIC = b"PKVB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBB4IQQ16s8x")
HEADER_SIZE = _HEADER.size
_HASH_MASK = (1 << 128) - 1


class CorruptValue(ValueError):
    """A stored value that is not the expected block: wrong header, length or checksum."""


# dtype name (as torch spells it after "torch.") -> (code in the header, bytes per element).
DTYPES = {
    "float16": (1, 2),
    "bfloat16": (2, 2),
    "float32": (3, 4),
    "float64": (4, 8),
    "float8_e4m3fn": (5, 1),
    "float8_e5m2": (6, 1),
}


@dataclass(frozen=True)
class BlockSpec:
    """What one stored block holds: its shape, dtype (a key of `DTYPES`) and KV layout, and
    the float8 scales (`[layers][2]`, empty for other dtypes) its values are read with."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: Layout = "NHD"
    rope_dim: int = 0
    scales: tuple[tuple[float, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} cannot be stored; known: {sorted(DTYPES)}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        KVLayout(self.layout, self.num_kv_heads, self.head_dim, self.rope_dim)  # validates

    @property
    def dtype_code(self) -> int:
        """The dtype's code in the header."""
        return DTYPES[self.dtype][0]

    @property
    def layout_code(self) -> int:
        """The layout's code in the header."""
        return LAYOUTS.index(self.layout)

    @property
    def payload_size(self) -> int:
        """Bytes of every layer of one block."""
        kv = KVLayout(self.layout, self.num_kv_heads, self.head_dim, self.rope_dim)
        return self.block_size * kv.bytes_per_token(self.num_layers, DTYPES[self.dtype][1])


def encode_into(spec: BlockSpec, block_hash: int, value: memoryview) -> None:
    """Write the header of block `block_hash` into `value`, whose payload is in place already.

    `value` is writable, `HEADER_SIZE` bytes of room followed by the payload.
    """
    payload_len = len(value) - HEADER_SIZE
    if payload_len != spec.payload_size:
        raise ValueError(
            f"payload has {payload_len} bytes, a block of {spec} has {spec.payload_size}"
        )
    _HEADER.pack_into(
        value,
        0,
        MAGIC,
        FORMAT_VERSION,
        spec.dtype_code,
        spec.layout_code,
        spec.num_layers,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        spec.payload_size,
        xxhash.xxh3_64_intdigest(value[HEADER_SIZE:]),
        (block_hash & _HASH_MASK).to_bytes(16, "little"),
    )


def encode(spec: BlockSpec, block_hash: int, payload: bytes | memoryview) -> bytes:
    """The stored value of block `block_hash`: header, then `payload` (a copy of it)."""
    value = bytearray(HEADER_SIZE) + payload
    encode_into(spec, block_hash, memoryview(value))
    return bytes(value)


def decode(spec: BlockSpec, block_hash: int, value: bytes) -> memoryview:
    """The payload of `value`, checked against `spec` and `block_hash`; else `CorruptValue`."""
    if len(value) < HEADER_SIZE:
        raise CorruptValue(f"value of {len(value)} bytes is shorter than the header")
    (magic, version, dtype, layout, layers, bs, heads, dim, length, checksum, stored_hash) = (
        _HEADER.unpack_from(value)
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptValue(f"not a pagedkv block value (magic {magic!r}, version {version})")
    got = (layers, bs, heads, dim, dtype, layout)
    want = (
        spec.num_layers,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype_code,
        spec.layout_code,
    )
    if got != want:
        raise CorruptValue(f"block shape/dtype {got} != expected {want}")
    if int.from_bytes(stored_hash, "little") != block_hash & _HASH_MASK:
        raise CorruptValue("value holds another block (chain hash mismatch)")
    if length != spec.payload_size or len(value) - HEADER_SIZE != length:
        raise CorruptValue(
            f"payload is {len(value) - HEADER_SIZE} bytes, header says {length}, "
            f"expected {spec.payload_size}"
        )
    payload = memoryview(value)[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptValue("payload checksum mismatch")
    return payload
