"""The external KV tier end to end: real `BlockManager`s, a real `redis-server`, the example engine.

Two "machines" (separate Python processes, managers and caches) share one Redis: B loads the
prefix A computed and its greedy tokens still equal `model.generate`. Faults (server killed
mid-run, a value corrupted by hand) cost recomputation, never a wrong token; other tenants
(salt) and other hash keys never hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from redis_server import RedisServer
from test_llama_e2e import cb, greedy_reference
from tier_node import HASH_KEY, OTHER_SYSTEM, SYSTEM, requests_for, run

from pagedkv import BlockManager
from pagedkv.kv_cache import KVCache
from pagedkv.tier import KVTier, Namespace
from pagedkv.tier.codec import HEADER_SIZE
from pagedkv.tier.lanes import block_spec
from pagedkv.tier.redis_store import RedisStore

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m: torch.nn.Module = cb.tiny_llama(seed=0)
    return m


@pytest.fixture(scope="module")
def expected(model: torch.nn.Module) -> dict[str, list[list[int]]]:
    return {
        role: [
            greedy_reference(model, list(r.prompt), r.max_new_tokens) for r in requests_for(role)
        ]
        for role in ("A", "B")
    }


def run_node(url: str, role: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *sys.path])
    done = subprocess.run(
        [sys.executable, str(TESTS / "tier_node.py"), "--redis", url, "--role", role],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def prefilled(result: dict[str, Any]) -> int:
    return int(result["prompt_tokens"] - result["prefix_hit_tokens"])


@pytest.mark.slow
def test_two_machines_share_a_prefix(
    redis_server: RedisServer, expected: dict[str, list[list[int]]]
) -> None:
    a = run_node(redis_server.url, "A")
    assert a["tokens"] == expected["A"]
    assert a["tier"]["saved_blocks"] >= 6 + 4  # both system prompts' blocks
    b = run_node(redis_server.url, "B")
    assert b["tokens"] == expected["B"]
    assert b["tier"]["hit_blocks"] == 6 + 4  # each system prompt loaded once, then GPU hits
    assert b["tier"]["corrupt_blocks"] == b["tier"]["errors"] == b["tier"]["timeouts"] == 0
    assert prefilled(b) < 0.3 * b["prompt_tokens"]


class KillingStore:
    """A `RedisStore` whose server is killed right after the first load returns."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.inner = RedisStore(server.url, timeout=2.0)

    def exists_prefix(self, keys: Sequence[bytes], timeout: float) -> int:
        return self.inner.exists_prefix(keys, timeout)

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]], timeout: float) -> None:
        self.inner.put_many(items, timeout)

    def get_many(self, keys: Sequence[bytes], timeout: float) -> list[bytes | None]:
        values = self.inner.get_many(keys, timeout)
        self.server.kill()
        return values


@pytest.mark.slow
def test_server_killed_mid_run_keeps_tokens_exact(
    redis_server: RedisServer, expected: dict[str, list[list[int]]]
) -> None:
    assert run("A", RedisStore(redis_server.url))["tokens"] == expected["A"]
    b = run("B", KillingStore(redis_server))
    assert redis_server.process.poll() is not None
    assert b["tokens"] == expected["B"]
    tier = b["tier"]
    assert tier["hit_blocks"] == 6  # the first system prompt, before the kill
    assert tier["errors"] >= 1  # the other prompt's lookup (and the saves) found no server
    assert prefilled(b) > len(OTHER_SYSTEM)  # so that prompt was recomputed


@pytest.mark.slow
def test_corrupt_value_is_recomputed(
    redis_server: RedisServer, expected: dict[str, list[list[int]]]
) -> None:
    assert run("A", RedisStore(redis_server.url))["tokens"] == expected["A"]
    # Flip one byte of the payload of the system prompt's third block.
    probe = BlockManager(8, 16, hash_key=HASH_KEY)
    cache = KVCache(2, 1, 16, 2, 16, dtype=torch.float32)
    ns = Namespace("tiny-llama", block_spec(cache), probe.hash_key_fingerprint)
    key = ns.key(probe.block_hashes(SYSTEM)[2])
    admin = redis.Redis.from_url(redis_server.url)
    value = admin.get(key)
    assert value is not None
    admin.setrange(key, HEADER_SIZE + 100, bytes([value[HEADER_SIZE + 100] ^ 0x40]))
    b = run("B", RedisStore(redis_server.url))
    assert b["tokens"] == expected["B"]
    assert b["tier"]["corrupt_blocks"] >= 1
    assert b["tier"]["hit_blocks"] == 2 + 4  # the run up to the corrupt block, the other prompt


# ---- tenants and hash keys, on the bare manager


def save_blocks(store: RedisStore, tokens: list[int], salt: str) -> tuple[KVCache, np.ndarray]:
    """Compute (here: fill at random) and commit `tokens` on one machine; save via its tier."""
    mgr = BlockManager(32, 16, hash_key=HASH_KEY, enable_events=True)
    cache = KVCache(2, 32, 16, 2, 8, dtype=torch.float32)
    for layer in range(cache.num_layers):
        cache.layer(layer).copy_(torch.randn(cache.layer(layer).shape))
    reused = mgr.allocate(0, tokens, salt=salt)
    mgr.plan([0], [len(tokens) - reused])
    mgr.commit([0])
    with KVTier(store, "m", mgr, cache) as tier:
        tier.offer(mgr.take_events())
        assert tier.flush(10)
        assert tier.stats().saved_blocks == len(tokens) // 16
    return cache, mgr.block_table(0)


def test_only_the_same_tenant_and_hash_key_hit(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    tokens = list(range(1, 51))  # 3 full blocks, all hittable
    src, src_table = save_blocks(store, tokens, salt="tenant-a")
    cases: list[tuple[bytes | None, str | None, int]] = [
        (HASH_KEY, "tenant-a", 3),  # the same tenant: hits, and the KV is A's
        (HASH_KEY, "tenant-b", 0),
        (HASH_KEY, None, 0),
        (bytes(32), "tenant-a", 0),  # another hash key
        (None, "tenant-a", 0),  # a random hash key
    ]
    for hash_key, salt, hits in cases:
        mgr = BlockManager(32, 16, hash_key=hash_key)
        cache = KVCache(2, 32, 16, 2, 8, dtype=torch.float32)
        with KVTier(store, "m", mgr, cache) as tier:
            computed = tier.admit(7, tokens, salt=salt)
            assert (computed, tier.stats().hit_blocks) == (hits * 16, hits), (hash_key, salt)
        assert mgr.num_computed(7) == hits * 16
        if hits:
            ids = mgr.block_table(7)[:hits]
            src_ids = src_table[:hits].astype(np.int64)
            for layer in range(cache.num_layers):
                got = cache.layer(layer)[torch.from_numpy(ids.astype(np.int64))]
                assert torch.equal(got, src.layer(layer)[torch.from_numpy(src_ids)])
        stats = mgr.stats()
        assert stats.external_hit_tokens == hits * 16
