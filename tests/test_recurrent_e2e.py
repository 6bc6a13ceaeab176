"""End to end: a hybrid recurrent model on pagedkv's state group reproduces `model.generate`.

A small, seeded, randomly initialised Qwen3-Next (Gated DeltaNet and gated attention layers, no
download) runs its own weights through `HybridManager` (a full-attention KV group and a state
group) + `KVCache` + `PagedAttention` + `StateCache` in `examples/recurrent_batching.py`; greedy
tokens must equal `transformers`' greedy `generate` for every prompt and every parallel sample,
whether a state came from a reset, a checkpoint, a fork's copy, a recompute, a swap or a
rollback of rejected drafts to a draft state.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from test_llama_e2e import greedy_reference

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "recurrent_batching.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recurrent_batching", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    if str(EXAMPLE.parent) not in sys.path:  # it imports its sibling continuous_batching.py
        sys.path.insert(0, str(EXAMPLE.parent))
    spec.loader.exec_module(module)
    return module


rb = load_example()
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: 3 full blocks of 4


def requests() -> list[Any]:
    r = rb.Request
    return [
        r([*SHARED, 1, 2, 3], 9),  # checkpoints at its prompt point, 16
        r([5, 6, 7, 8, 9, 10, 11], 11, arrival_step=0, num_samples=3),  # forked after prefill
        r([*SHARED, 7], 8, arrival_step=2),  # KV hit 12, no state there: saves at 12
        r(list(range(40, 59)), 6, arrival_step=3),
        r([*SHARED, 100, 101, 102, 103, 104], 7, arrival_step=6),  # resumes from that save
        r([99], 12, arrival_step=4),
    ]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    m: torch.nn.Module = rb.tiny_qwen3_next(seed=0)
    return m


@pytest.fixture(scope="module")
def expected(model: torch.nn.Module) -> list[list[int]]:
    return [greedy_reference(model, list(r.prompt), r.max_new_tokens) for r in requests()]


def check_tokens(result: Any, expected: list[list[int]]) -> None:
    for i, (samples, want) in enumerate(zip(result.tokens, expected, strict=True)):
        for s, got in enumerate(samples):
            assert got == want, f"request {i} sample {s}: {got} != {want}"


def test_greedy_tokens_equal_generate(model: torch.nn.Module, expected: list[list[int]]) -> None:
    result = rb.generate(model, requests(), block_size=4, num_blocks=96, backend="torch")
    check_tokens(result, expected)
    # Request 2 saved the state at its branch point (12 tokens); request 4 resumes there.
    assert result.hits == [0, 0, 0, 0, 0, 12]
    assert result.state.prefix_hit_tokens == 12
    assert result.state_copies >= 3  # two forked samples and one checkpoint hit
    assert result.split_rows > 0  # a save cut a row's query: the state was taken mid-pass
    assert result.mixed_steps > 0
    assert result.max_batch_size >= 4


@pytest.mark.parametrize(
    ("options", "hit_tokens"),
    [
        ({"prefill_chunk": 5}, 8),  # chunks append to the prompt: points follow them
        # Request 0 keeps 8 and its prompt end (16): request 2 resumes at 8, request 4 at 12.
        ({"checkpoint_interval": 8, "checkpoints_per_sequence": 2}, 20),
        ({"checkpoint_interval": 8}, 12),  # one kept: 16 replaces 8, request 2 recomputes
        # Too few slots to fork (the samples recompute) or to keep checkpoints: saves skipped.
        ({"num_slots": 4}, None),
    ],
)
def test_checkpoints_chunks_and_tight_slots(
    model: torch.nn.Module,
    expected: list[list[int]],
    options: dict[str, int],
    hit_tokens: int | None,
) -> None:
    result = rb.generate(model, requests(), block_size=4, num_blocks=96, backend="torch", **options)
    check_tokens(result, expected)
    if hit_tokens is None:
        assert result.state.skipped > 0
        return
    assert result.state.prefix_hit_tokens == hit_tokens
    assert sum(result.hits) >= hit_tokens


@pytest.mark.parametrize("cpu_blocks", [0, 64])
@pytest.mark.parametrize(("num_blocks", "prefill_chunk"), [(14, None), (12, 5)])
def test_preemption_keeps_tokens_exact(
    model: torch.nn.Module,
    expected: list[list[int]],
    num_blocks: int,
    prefill_chunk: int | None,
    cpu_blocks: int,
) -> None:
    # A KV pool too small for every sequence at once: the youngest are freed and recomputed,
    # or, with CPU pools behind it, swapped out (KV blocks and states to the CPU and back).
    result = rb.generate(
        model,
        requests(),
        block_size=4,
        num_blocks=num_blocks,
        cpu_blocks=cpu_blocks,
        prefill_chunk=prefill_chunk,
        backend="torch",
    )
    check_tokens(result, expected)
    if not cpu_blocks:
        assert result.preempted > 0
        return
    assert result.swapped_out > 0
    assert result.state is not None and result.state.num_cpu_free == result.state.num_cpu_slots


@pytest.mark.parametrize(
    "options",
    [
        {"num_blocks": 96},
        # Tight: preemptions by swapping, and slots too few for every draft state at times.
        {"num_blocks": 14, "cpu_blocks": 64, "num_slots": 9, "checkpoint_interval": 4},
        # Too few slots for some passes' draft states: those drafts are rolled back unplanned.
        {"num_blocks": 96, "num_slots": 6},
    ],
)
def test_speculative_decoding_restores_the_accepted_state(
    model: torch.nn.Module, expected: list[list[int]], options: dict[str, int]
) -> None:
    # Prompt lookup drafts verified in one pass; a rollback of the rejected ones makes the state
    # after the last accepted token (a draft state of that pass) the working state.
    result = rb.generate(model, requests(), block_size=4, backend="torch", speculate=3, **options)
    check_tokens(result, expected)
    assert 0 < result.accepted_drafts < result.proposed_drafts
    assert result.restored_states > 0
    assert result.state is not None and result.state.num_drafts == 0
    if options.get("cpu_blocks"):
        assert result.swapped_out > 0
    if options.get("num_slots") == 6:
        assert result.unverified_drafts > 0


def test_random_workload_on_another_model() -> None:
    # Prompts branching off two stems at random lengths, arriving over time, on a tight pool
    # with chunked prefill and interval checkpoints: every way a state is made, at once.
    rng = random.Random(7)
    model = rb.tiny_qwen3_next(seed=1)
    reqs = []
    for i in range(8):
        base = rng.randrange(2) * 50
        stem = [base + t for t in range(rng.randrange(4, 30))]
        tail = [rng.randrange(128) for _ in range(rng.randrange(4))]
        reqs.append(rb.Request([*stem, *tail], rng.randrange(3, 9), i, 1 + (i % 3 == 0)))
    result = rb.generate(
        model,
        reqs,
        block_size=4,
        num_blocks=12,
        num_slots=8,
        checkpoint_interval=4,
        prefill_chunk=10,
        backend="torch",
    )
    for i, r in enumerate(reqs):
        want = greedy_reference(model, list(r.prompt), r.max_new_tokens)
        for s, got in enumerate(result.tokens[i]):
            assert got == want, f"request {i} sample {s}: {got} != {want}"
    assert result.state.prefix_hit_tokens > 0
    assert result.preempted > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda(model: torch.nn.Module, expected: list[list[int]]) -> None:
    # float32 on the GPU: the state cache, the KV cache and attention all on the device.
    result = rb.generate(
        model.cuda(), requests(), block_size=4, num_blocks=96, prefill_chunk=5, device="cuda"
    )
    model.cpu()
    check_tokens(result, expected)
    assert result.state.prefix_hit_tokens > 0
