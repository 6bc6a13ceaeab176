"""Store keys: `pagedkv:v1:<namespace digest>:<32 hex digits of the block's chain hash>`.

The namespace digest covers everything that makes two engines' KV interchangeable: the model
id, the KV layout, dtype, block size, layers, KV heads, head dim (and MLA's rope part, float8
scales) and the fingerprint of the manager's hash key. Two engines share blocks exactly when
all of these agree. Salts (tenants) are already inside the chain hash, so two tenants never
share a key.

A hybrid model's KV-cache groups (`GroupKey`) each have a key space of their own: the group's
index, attention and model layers join the digest, with the group's `BlockSpec` (its float8
scales). A window group's block under a prompt's hash is other KV than the full group's, so no
two groups ever share a key, and a plain `BlockManager`'s keys stay what they were.

>>> ns = Namespace("llama-7b", BlockSpec(32, 16, 8, 128, "float16"), "0123456789abcdef")
>>> ns.key(255).decode()[-34:]
':000000000000000000000000000000ff'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pagedkv.tier.codec import BlockSpec

KEY_PREFIX = "pagedkv:v1:"
_HASH_MASK = (1 << 128) - 1


@dataclass(frozen=True)
class GroupKey:
    """What names one KV-cache group of a hybrid model: its index, its attention (as
    `repr(Attention)` writes it) and the model layer in each slot of its pages (-1: padding)."""

    index: int
    attention: str
    layers: tuple[int, ...]


@dataclass(frozen=True)
class Namespace:
    """The key space of one model, KV shape and hash key (and KV-cache group, if any)."""

    model_id: str
    spec: BlockSpec
    hash_key_fingerprint: str
    group: GroupKey | None = None

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")

    @property
    def digest(self) -> str:
        """32 hex digits naming this namespace (BLAKE2b of its fields)."""
        s = self.spec
        fields: tuple[object, ...] = (
            self.model_id,
            s.layout,
            s.dtype,
            s.block_size,
            s.num_layers,
            s.num_kv_heads,
            s.head_dim,
            self.hash_key_fingerprint,
        )
        # Appended only when set, so the keys of float NHD/HND caches stay what they were.
        if s.rope_dim:
            fields += (f"rope_dim={s.rope_dim}",)
        if s.scales:
            fields += (f"scales={s.scales!r}",)
        if self.group is not None:
            g = self.group
            fields += (f"group={g.index}", f"attention={g.attention}", f"layers={g.layers!r}")
        # Length-prefixed fields, so no two different tuples serialize alike.
        text = "".join(f"{len(str(f))}:{f};" for f in fields)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    @property
    def prefix(self) -> bytes:
        """What every key of this namespace starts with."""
        return f"{KEY_PREFIX}{self.digest}:".encode()

    def key(self, block_hash: int) -> bytes:
        """The store key of the block whose 128-bit chain hash is `block_hash`."""
        return self.prefix + f"{block_hash & _HASH_MASK:032x}".encode()

    def keys(self, block_hashes: list[int]) -> list[bytes]:
        """`key` of each hash, in order."""
        prefix = self.prefix
        return [prefix + f"{h & _HASH_MASK:032x}".encode() for h in block_hashes]
