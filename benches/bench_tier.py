"""The external KV tier on Redis: save and load throughput against raw redis-py, and step cost.

In the same run, against the same server, with the same bytes:
- save: `KVTier.offer` of computed blocks until `flush` (device-to-host copy, header, XXH3-64
  checksum, pipelined SET) against raw redis-py pipelined SET of the already encoded values;
  raw calls go through the very client `RedisStore` uses (hiredis replies, zero-copy packing);
- load: `KVTier.admit` of a prompt whose blocks the store holds (EXISTS pipeline, MGETs of
  `load_chunk_blocks` keys, one ahead, checks, copy into the KV cache, confirm) against raw
  redis-py MGETs of the same keys in chunks of the same size, back to back;
- the decode loop of `examples/continuous_batching.py` (a tiny Llama) with the tier off and on:
  time per step.
The server it starts gets the last CPU and this process the others (`--share-cpus` to not),
as a server on its own machine would; raw and tier runs alike.
Target: tier throughput >= 80% of raw. Ratios are printed; `--enforce` makes a miss fail.

    python benches/bench_tier.py --quick                      # CI smoke run, own redis-server
    python benches/bench_tier.py                              # full run: own server, own CPU
    python benches/bench_tier.py --redis redis://host:6379/0  # a server of yours (FLUSHDB!)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import sys
import time
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import redis
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_server import start_redis_server

from pagedkv import BlockManager
from pagedkv.kv_cache import KVCache
from pagedkv.tier import KVTier
from pagedkv.tier.redis_store import RedisStore

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.8


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    blocks: int  # blocks moved per repetition
    batch: int  # blocks per offer (one pipelined put each)


@dataclasses.dataclass(frozen=True)
class Event:
    """A stored/GPU event, as `BlockManager.take_events` returns them."""

    block_hash: int
    block_id: int
    kind: str = "stored"
    medium: str = "GPU"


def load_example() -> ModuleType:
    examples = ROOT / "examples"
    spec = importlib.util.spec_from_file_location(
        "continuous_batching", examples / "continuous_batching.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    if str(examples) not in sys.path:  # the example imports its sibling hybrid_models.py
        sys.path.insert(0, str(examples))
    spec.loader.exec_module(module)
    return module


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best_of_interleaved(reps: int, first: Any, second: Any) -> tuple[float, float]:
    """The fastest of `reps` timed calls of each (each returns its own timed seconds).

    Calls alternate, so both see the same background load of a shared machine.
    """
    times = [(first(), second()) for _ in range(reps)]
    return min(t[0] for t in times), min(t[1] for t in times)


def bench_checksums(payload_size: int) -> None:
    data = np.random.default_rng(0).integers(0, 255, payload_size, dtype=np.uint8).tobytes()
    for name, fn in (
        ("xxh3-64 (used)", lambda: xxhash.xxh3_64_intdigest(data)),
        ("crc32", lambda: zlib.crc32(data)),
        ("blake2b-128", lambda: hashlib.blake2b(data, digest_size=16).digest()),
    ):
        n = max(1, (256 << 20) // payload_size)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        print(
            f"  checksum {name:13s} {gbps(n * payload_size, time.perf_counter() - start):6.2f} GB/s"
        )


def bench_throughput(url: str, shape: Shape, reps: int, device: str) -> list[float]:
    """Save and load GB/s, tier and raw; returns the two ratios."""
    bs = shape.block_size
    num_blocks = shape.blocks + 1
    mgr = BlockManager(num_blocks + 1, bs)
    cache = KVCache(
        shape.layers, num_blocks + 1, bs, shape.kv_heads, shape.head_dim, torch.float16, device
    )
    for layer in range(shape.layers):
        cache.layer(layer).normal_()
    store = RedisStore(url, timeout=60)
    raw = store.client()  # raw calls on the very client the store uses (same parser, packer)
    tier = KVTier(
        store, "bench", mgr, cache, timeout=60, save_timeout=60, max_pending_blocks=1 << 20
    )
    rng = np.random.default_rng(1)
    payload = tier.spec.payload_size
    nbytes = shape.blocks * payload
    print(
        f"blocks of {payload / 2**20:.2f} MiB ({shape.layers} layers, {shape.kv_heads} KV heads, "
        f"head dim {shape.head_dim}, block size {bs}, fp16), {shape.blocks} blocks "
        f"({nbytes / 2**20:.0f} MiB) per repetition, batches of {shape.batch}, on {device}; "
        f"replies parsed by {'hiredis' if redis.utils.HIREDIS_AVAILABLE else 'pure Python'}"
    )
    bench_checksums(payload)
    ids = np.arange(shape.blocks)

    def prompt() -> list[int]:
        return [int(t) for t in rng.integers(0, 32_000, shape.blocks * bs + 1)]

    saved: list[list[int]] = []

    def tier_save() -> float:
        tokens = prompt()  # fresh blocks: the tier offers each hash once
        saved.append(tokens)
        hashes = mgr.block_hashes(tokens)
        raw.flushdb()
        start = time.perf_counter()
        for lo in range(0, shape.blocks, shape.batch):
            hi = min(lo + shape.batch, shape.blocks)
            tier.offer([Event(hashes[i], int(ids[i])) for i in range(lo, hi)])
        assert tier.flush(600)
        seconds = time.perf_counter() - start
        stats = tier.stats()
        assert stats.failed_saves == stats.dropped_blocks == 0, stats
        assert raw.dbsize() == shape.blocks
        return seconds

    def raw_save(items: list[tuple[bytes, bytes]]) -> float:
        raw.flushdb()
        start = time.perf_counter()
        for lo in range(0, len(items), shape.batch):
            pipe = raw.pipeline(transaction=False)
            for key, value in items[lo : lo + shape.batch]:
                pipe.set(key, value)
            pipe.execute()
        return time.perf_counter() - start

    def tier_load(tokens: list[int]) -> float:
        start = time.perf_counter()
        computed = tier.admit(0, tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert computed == shape.blocks * bs, computed
        mgr.free(0)
        mgr.reset_prefix_cache()  # the next load must come from the store again
        return seconds

    def raw_load(keys: list[bytes]) -> float:
        # MGETs of the tier's chunk size, back to back: one MGET of everything is slower.
        chunk = tier.load_chunk_blocks
        start = time.perf_counter()
        values = [v for lo in range(0, len(keys), chunk) for v in raw.mget(keys[lo : lo + chunk])]
        seconds = time.perf_counter() - start
        assert len(values) == len(keys) and all(v is not None for v in values)
        return seconds

    tier_save()
    tokens = saved[-1]  # what the store holds now
    keys = tier.namespace.keys(mgr.block_hashes(tokens))
    items = list(zip(keys, raw.mget(keys), strict=True))  # the tier's encoded values
    save_tier, save_raw = best_of_interleaved(reps, tier_save, lambda: raw_save(items))
    raw_save(items)  # the store holds `tokens`' blocks again
    load_tier, load_raw = best_of_interleaved(
        reps, lambda: tier_load(tokens), lambda: raw_load(keys)
    )
    tier.close()
    ratios = [save_raw / save_tier, load_raw / load_tier]
    for name, t_tier, t_raw, ratio in (
        ("save", save_tier, save_raw, ratios[0]),
        ("load", load_tier, load_raw, ratios[1]),
    ):
        print(
            f"  {name}: tier {gbps(nbytes, t_tier):6.2f} GB/s   raw redis-py "
            f"{gbps(nbytes, t_raw):6.2f} GB/s   ratio {ratio:.2f} (target >= {TARGET_RATIO})"
        )
    return ratios


def bench_decode(url: str, quick: bool, device: str) -> None:
    """Time per engine step of the example's decode loop, tier off and on."""
    cb = load_example()
    model = cb.tiny_llama(seed=0).to(device)
    rng = np.random.default_rng(2)
    n, prompt_len, new = (8, 48, 16) if quick else (32, 96, 64)
    requests = [
        cb.Request([int(t) for t in rng.integers(1, 127, prompt_len)], new, arrival_step=i)
        for i in range(n)
    ]
    raw = redis.Redis.from_url(url)

    def per_step(store: Any) -> tuple[float, Any]:
        raw.flushdb()  # nothing to load: the same work with the tier on and off
        start = time.perf_counter()
        result = cb.generate(model, requests, block_size=16, num_blocks=512, store=store)
        return (time.perf_counter() - start) / result.steps, result

    reps = 2 if quick else 3
    off = min(per_step(None)[0] for _ in range(reps))
    runs = [per_step(RedisStore(url)) for _ in range(reps)]
    on = min(t for t, _ in runs)
    stats = runs[-1][1].tier
    print(
        f"decode loop ({n} requests, prompt {prompt_len}, {new} new tokens, tiny Llama): "
        f"tier off {off * 1e3:.2f} ms/step, on {on * 1e3:.2f} ms/step, "
        f"cost {(on - off) * 1e3:+.3f} ms/step ({on / off:.3f}x); saved {stats.saved_blocks} "
        f"blocks, dropped {stats.dropped_blocks}"
    )


def separate_cpus(server_pid: int) -> None:
    """Pin the server to the last CPU and this process (threads started from now on too) to
    the others, as if the server ran on its own machine: otherwise, on a small machine, the
    client's work and the server's steal each other's cores. Raw and tier runs alike."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("one CPU: server and client share it")
        return
    os.sched_setaffinity(server_pid, {cpus[-1]})
    os.sched_setaffinity(0, set(cpus[:-1]))
    print(f"redis-server pinned to CPU {cpus[-1]}, this process to CPUs {cpus[:-1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", metavar="URL", help="server to use (its db is flushed)")
    parser.add_argument("--quick", action="store_true", help="small CI smoke run (seconds)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--enforce", action="store_true", help="fail when a ratio misses 0.8")
    parser.add_argument(
        "--share-cpus",
        action="store_true",
        help="let our redis-server and this process share every CPU (default: apart)",
    )
    args = parser.parse_args()
    server = None if args.redis else start_redis_server()
    url = args.redis or server.url  # type: ignore[union-attr]
    if server is not None and not args.share_cpus:
        separate_cpus(server.process.pid)
    try:
        if args.quick:
            shape = Shape(layers=8, kv_heads=8, head_dim=128, block_size=16, blocks=64, batch=16)
        else:
            shape = Shape(layers=32, kv_heads=8, head_dim=128, block_size=16, blocks=256, batch=32)
        ratios = bench_throughput(url, shape, 5 if args.quick else 9, args.device)
        bench_decode(url, args.quick, args.device)
    finally:
        if server is not None:
            server.kill()
    if args.enforce and min(ratios) < TARGET_RATIO:
        print(f"FAIL: a tier/raw ratio is below {TARGET_RATIO}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
