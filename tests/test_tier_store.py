"""The tier's value codec, keys and stores (in-process and a real redis-server), with faults."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest
import redis
from redis_server import RedisServer

from pagedkv.tier import BlockSpec, CorruptValue, MemoryStore, Namespace, StoreError, StoreTimeout
from pagedkv.tier.codec import HEADER_SIZE, decode, encode
from pagedkv.tier.redis_store import RedisStore
from pagedkv.tier.store import Store

SPEC = BlockSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
PAYLOAD = np.arange(SPEC.payload_size // 2, dtype=np.float16).tobytes()
HASH = (1 << 127) | 12345
FINGERPRINT = "00112233aabbccdd"


# ---- codec


def test_codec_round_trip() -> None:
    value = encode(SPEC, HASH, PAYLOAD)
    assert len(value) == HEADER_SIZE + SPEC.payload_size
    assert bytes(decode(SPEC, HASH, value)) == PAYLOAD


@pytest.mark.parametrize(
    "spec",
    [
        BlockSpec(3, 4, 2, 8, "float16"),  # layers
        BlockSpec(2, 8, 2, 8, "float16"),  # block size
        BlockSpec(2, 4, 1, 8, "float16"),  # kv heads
        BlockSpec(2, 4, 2, 4, "float16"),  # head dim
        BlockSpec(2, 4, 2, 8, "bfloat16"),  # dtype of the same width
        BlockSpec(2, 4, 2, 8, "float16", "HND"),  # layout of the same size
    ],
)
def test_codec_rejects_another_shape_or_dtype(spec: BlockSpec) -> None:
    value = encode(SPEC, HASH, PAYLOAD)
    with pytest.raises(CorruptValue, match="shape/dtype"):
        decode(spec, HASH, value)


def test_codec_rejects_corrupt_short_long_and_misplaced_values() -> None:
    value = encode(SPEC, HASH, PAYLOAD)
    flipped = bytearray(value)
    flipped[HEADER_SIZE + 17] ^= 0x01
    with pytest.raises(CorruptValue, match="checksum"):
        decode(SPEC, HASH, bytes(flipped))
    with pytest.raises(CorruptValue, match="payload is"):
        decode(SPEC, HASH, value[:-1])
    with pytest.raises(CorruptValue, match="payload is"):
        decode(SPEC, HASH, value + b"\0")
    with pytest.raises(CorruptValue, match="shorter than the header"):
        decode(SPEC, HASH, value[: HEADER_SIZE - 1])
    with pytest.raises(CorruptValue, match="magic"):
        decode(SPEC, HASH, b"XXXX" + value[4:])
    newer = bytearray(value)
    struct.pack_into("<H", newer, 4, 2)
    with pytest.raises(CorruptValue, match="version 2"):
        decode(SPEC, HASH, bytes(newer))
    with pytest.raises(CorruptValue, match="another block"):
        decode(SPEC, HASH + 1, value)
    # A wrong length field with a matching body length is caught too.
    lying = bytearray(value)
    struct.pack_into("<Q", lying, 24, SPEC.payload_size + 2)
    with pytest.raises(CorruptValue, match="header says"):
        decode(SPEC, HASH, bytes(lying))


def test_mla_payload_is_one_latent_row_per_token() -> None:
    spec = BlockSpec(2, 4, 1, 8, "float8_e4m3fn", "MLA", 4)
    assert spec.payload_size == 2 * 4 * (8 + 4)
    payload = bytes(range(spec.payload_size))
    assert bytes(decode(spec, HASH, encode(spec, HASH, payload))) == payload


def test_codec_and_spec_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="payload has 3 bytes"):
        encode(SPEC, HASH, b"abc")
    with pytest.raises(ValueError, match="dtype 'int8' cannot be stored"):
        BlockSpec(1, 1, 1, 1, "int8")
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        BlockSpec(1, 1, 1, 0, "float16")


# ---- keys


def test_key_layout() -> None:
    ns = Namespace("tiny-llama", SPEC, FINGERPRINT)
    key = ns.key(HASH).decode()
    prefix, version, digest, block = key.split(":")
    assert (prefix, version) == ("pagedkv", "v1")
    assert digest == ns.digest and len(digest) == 32 and set(digest) <= set("0123456789abcdef")
    assert block == f"{HASH:032x}"
    assert ns.keys([HASH, 7]) == [ns.key(HASH), ns.key(7)]
    assert ns.key(7).endswith(b":" + b"0" * 31 + b"7")


def test_namespace_covers_every_field() -> None:
    base = Namespace("tiny-llama", SPEC, FINGERPRINT)
    variants = [
        Namespace("tiny-llama-2", SPEC, FINGERPRINT),
        Namespace("tiny-llama", SPEC, "ffffffffffffffff"),
        Namespace("tiny-llama", BlockSpec(2, 4, 2, 8, "float16", "HND"), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 4, 1, 8, "float16", "MLA", 4), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 4, 1, 8, "float16", "MLA", 8), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 4, 2, 8, "float8_e4m3fn"), FINGERPRINT),
        Namespace(
            "tiny-llama",
            BlockSpec(2, 4, 2, 8, "float8_e4m3fn", scales=((1.0, 2.0), (1.0, 1.0))),
            FINGERPRINT,
        ),
        Namespace("tiny-llama", BlockSpec(3, 4, 2, 8, "float16"), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 8, 2, 8, "float16"), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 4, 1, 8, "float16"), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 4, 2, 4, "float16"), FINGERPRINT),
        Namespace("tiny-llama", BlockSpec(2, 4, 2, 8, "bfloat16"), FINGERPRINT),
    ]
    digests = {v.digest for v in variants}
    assert len(digests) == len(variants) and base.digest not in digests
    assert Namespace("tiny-llama", SPEC, FINGERPRINT).digest == base.digest
    with pytest.raises(ValueError, match="model_id"):
        Namespace("", SPEC, FINGERPRINT)


# ---- stores: the same behaviour from the in-process store and from redis-server


def check_store_semantics(store: Store) -> None:
    keys = [b"t:%d" % i for i in range(5)]
    assert store.exists_prefix(keys, 1.0) == 0
    assert store.exists_prefix([], 1.0) == 0
    store.put_many([(keys[0], b"v0"), (keys[1], b"v1"), (keys[3], b"v3")], 1.0)
    store.put_many([], 1.0)
    assert store.exists_prefix(keys, 1.0) == 2  # keys[2] is missing: the run stops there
    assert store.exists_prefix(keys[3:], 1.0) == 1
    assert store.get_many(keys, 1.0) == [b"v0", b"v1", None, b"v3", None]
    assert store.get_many([], 1.0) == []
    store.put_many([(keys[0], b"new")], 1.0)
    assert store.get_many(keys[:1], 1.0) == [b"new"]


def test_memory_store_semantics() -> None:
    check_store_semantics(MemoryStore())


def test_memory_store_faults() -> None:
    store = MemoryStore()
    store.down = True
    with pytest.raises(StoreError, match="down"):
        store.get_many([b"k"], 1.0)
    store.down = False
    store.latency = 0.5
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.exists_prefix([b"k"], 0.05)
    assert time.monotonic() - start < 0.4
    store.latency = 0.001
    assert store.get_many([b"k"], 1.0) == [None]


def test_redis_store_semantics(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, timeout=2.0)
    check_store_semantics(store)
    store.close()


def test_redis_store_ttl(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, ttl=60)
    store.put_many([(b"k", b"v")], 1.0)
    assert 0 < redis.Redis.from_url(redis_server.url).ttl(b"k") <= 60
    with pytest.raises(ValueError, match="ttl"):
        RedisStore(redis_server.url, ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        RedisStore(redis_server.url, timeout=0)


def test_redis_store_down_raises_store_error_quickly(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, timeout=1.0)
    store.put_many([(b"k", b"v")], 1.0)
    redis_server.kill()
    for call in (
        lambda: store.exists_prefix([b"k"], 0.5),
        lambda: store.get_many([b"k"], 0.5),
        lambda: store.put_many([(b"k", b"v")], 0.5),
    ):
        start = time.monotonic()
        with pytest.raises(StoreError):
            call()
        # Refused at once: no retries with backoff behind the caller's back.
        assert time.monotonic() - start < 0.5


def test_redis_store_slow_server_times_out(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    store.put_many([(b"k", b"v")], 1.0)
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    start = time.monotonic()
    with pytest.raises(StoreTimeout):
        store.get_many([b"k"], 0.1)
    assert time.monotonic() - start < 1.0
    admin.execute_command("CLIENT", "UNPAUSE")
    # The pool dropped the broken connection; the next call works.
    assert store.get_many([b"k"], 1.0) == [b"v"]


def test_redis_store_is_thread_safe(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(50):
                key = b"thread:%d:%d" % (t, i)
                store.put_many([(key, key)], 2.0)
                assert store.get_many([key], 2.0) == [key]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
