"""End to end: hybrid models on KV-cache groups reproduce `model.generate` exactly.

Small seeded random Gemma 3, gpt-oss and Llama 4 text models (no download; windows and chunks
of 8 tokens, blocks of 4) run their own weights through `HybridManager` + `GroupedKVCache` +
one `PagedAttention` per group in `examples/continuous_batching.py`, with continuous batching,
prompts up to 4 windows long, prefix hits, forks and swaps; greedy tokens must equal
`transformers`' greedy `generate` (eager attention) for every prompt and sample. Two engines
sharing an external KV store (in-process, and Redis) load every group's blocks of a prefix.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from redis_server import RedisServer
from test_llama_e2e import cb, check_tokens, greedy_reference

from pagedkv.tier import MemoryStore, Store
from pagedkv.tier.redis_store import RedisStore

FAMILIES = {"gemma3": cb.tiny_gemma3, "gpt-oss": cb.tiny_gpt_oss, "llama4": cb.tiny_llama4}
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50]  # 4 blocks and 1
# A pool this small swaps sequences out once they grow, yet admits the prefix's second user
# while the windowed groups still cache the blocks its first queries read.
SMALL_POOL = {"num_blocks": 34, "num_cpu_blocks": 64, "prefill_chunk": 12}


def requests() -> list[Any]:
    r = cb.Request
    return [
        r([*SHARED, 1, 2, 3, 4, 5, 6, 7], 16),  # 24 tokens: 3 windows
        r([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 16, num_samples=2),  # forked after prefill
        r([*SHARED, 7, 8, 9], 14, arrival_step=1),  # prefix hit, joins mid-decode
        r(list(range(40, 70)), 6, arrival_step=3),
        r([99], 20, arrival_step=4),
    ]


@functools.cache
def family(name: str) -> tuple[torch.nn.Module, list[list[int]]]:
    """The seeded model of family `name` and its `generate` tokens for `requests()`."""
    torch.set_num_threads(1)
    model: torch.nn.Module = FAMILIES[name]()
    expected = [greedy_reference(model, list(r.prompt), r.max_new_tokens) for r in requests()]
    return model, expected


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_tokens_equal_generate(name: str) -> None:
    model, expected = family(name)
    result = cb.generate(model, requests(), block_size=4, num_blocks=96, backend="torch")
    check_tokens(result, expected)
    assert result.prefix_hit_tokens == 16  # the shared 4 blocks, served by every group
    assert result.window_released_blocks > 0  # prompts and decodes left the window
    assert result.copied_blocks > 0  # the forked samples diverged from a shared partial block
    assert result.mixed_steps > 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_preemption_by_swap_keeps_tokens_exact(name: str) -> None:
    model, expected = family(name)
    result = cb.generate(model, requests(), block_size=4, backend="torch", **SMALL_POOL)
    check_tokens(result, expected)
    assert result.swapped_out_blocks > 0
    assert result.prefix_hit_tokens == 8  # within the first 12-token chunk
    assert result.window_released_blocks > 0


def share_through(store: Store, name: str) -> None:
    """Machine A computes a prompt four windows long and saves every group's blocks to `store`;
    machine B, with an empty GPU pool, loads the prefix from it and must generate the same
    tokens."""
    model, _ = family(name)
    prompt = [*SHARED, *range(100, 113)]  # 30 tokens: 7 blocks a hit may cover
    expected = [greedy_reference(model, prompt, 8)]
    kw: dict[str, Any] = {"block_size": 4, "num_blocks": 96, "backend": "torch"}
    kw |= {"store": store, "model_id": name, "hash_key": bytes(range(32))}
    a = cb.generate(model, [cb.Request(prompt, 8)], **kw)
    check_tokens(a, expected)
    assert a.tier.saved_blocks > 0 and a.tier.hit_blocks == 0
    b = cb.generate(model, [cb.Request(prompt, 8)], **kw)
    check_tokens(b, expected)
    assert b.prefix_hit_tokens == 7 * 4  # all loaded: B's pool started empty
    assert all(blocks > 0 for blocks in b.tier.group_hit_blocks), b.tier
    assert b.tier.corrupt_blocks == b.tier.errors == 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_two_machines_share_every_groups_blocks_through_a_store(name: str) -> None:
    share_through(MemoryStore(), name)


def test_two_machines_share_a_hybrid_prefix_through_redis(redis_server: RedisServer) -> None:
    share_through(RedisStore(redis_server.url), "gemma3")


@pytest.mark.slow  # about 15 s each in Triton's interpreter
@pytest.mark.parametrize("name", ["gpt-oss", "llama4"])  # windows and sinks; chunks and NoPE
def test_triton_kernel_serves_hybrid_models(name: str) -> None:
    # Without CUDA, conftest.py runs the kernel in Triton's CPU interpreter.
    model, expected = family(name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = cb.generate(
        copy.deepcopy(model).to(device), requests(), block_size=4, backend="triton", **SMALL_POOL
    )
    check_tokens(result, expected)
    assert result.swapped_out_blocks > 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_speculative_decoding_rolls_back_in_every_group(name: str) -> None:
    # Prompt lookup drafts; the rejected ones are rolled back in the windowed groups too.
    model, expected = family(name)
    result = cb.generate(
        model, requests(), block_size=4, backend="torch", speculate=3, **SMALL_POOL
    )
    check_tokens(result, expected)
    assert 0 < result.accepted_drafts < result.proposed_drafts
