"""End to end: continuous batching over a paged KV cache reproduces `model.generate` exactly.

A small, seeded, randomly initialised Llama (no download) runs its own weights through
`BlockManager` + `KVCache` + `PagedAttention` in `examples/continuous_batching.py`; greedy tokens
must equal `transformers`' greedy `generate` for every prompt and every parallel sample.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "continuous_batching.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("continuous_batching", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    if str(EXAMPLE.parent) not in sys.path:  # the example imports its sibling hybrid_models.py
        sys.path.insert(0, str(EXAMPLE.parent))
    spec.loader.exec_module(module)
    return module


cb = load_example()
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: 3 full blocks of 4


def requests() -> list[Any]:
    r = cb.Request
    return [
        r([*SHARED, 1, 2, 3], 9),  # owns the shared prefix blocks
        r([5, 6, 7, 8, 9, 10, 11], 11, arrival_step=0, num_samples=3),  # forked after prefill
        r([*SHARED, 7], 8, arrival_step=2),  # prefix hit, joins mid-decode (mixed batch)
        r(list(range(40, 59)), 6, arrival_step=3),
        r([*SHARED, 100, 101, 102, 103, 104], 7, arrival_step=6),
        r([99], 12, arrival_step=4),
    ]


def greedy_reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    assert len(tokens) == n
    return tokens


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m: torch.nn.Module = cb.tiny_llama(seed=0)
    return m


@pytest.fixture(scope="module")
def expected(model: torch.nn.Module) -> list[list[int]]:
    return [greedy_reference(model, list(r.prompt), r.max_new_tokens) for r in requests()]


def check_tokens(result: object, expected: list[list[int]]) -> None:
    for i, (samples, want) in enumerate(zip(result.tokens, expected, strict=True)):  # type: ignore[attr-defined]
        for s, got in enumerate(samples):
            assert got == want, f"request {i} sample {s}: {got} != {want}"


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_greedy_tokens_equal_generate(
    model: torch.nn.Module, expected: list[list[int]], prefill_chunk: int | None
) -> None:
    result = cb.generate(
        model, requests(), block_size=4, num_blocks=96, prefill_chunk=prefill_chunk, backend="torch"
    )
    check_tokens(result, expected)
    # Two later prompts reuse the 3 shared blocks; with chunks of 5 tokens, prefix lookup sees
    # only the first chunk, so each reuses 1 block.
    assert result.prefix_hit_tokens == (2 * 12 if prefill_chunk is None else 2 * 4)
    assert result.copied_blocks > 0  # forked samples diverged from a shared partial block
    assert result.mixed_steps > 0
    assert result.max_batch_size >= 4


@pytest.mark.parametrize(("num_blocks", "prefill_chunk"), [(12, None), (10, 5)])
def test_preemption_by_swap_keeps_tokens_exact(
    model: torch.nn.Module, expected: list[list[int]], num_blocks: int, prefill_chunk: int | None
) -> None:
    # A pool too small for every sequence at once forces swaps out and back in.
    result = cb.generate(
        model,
        requests(),
        block_size=4,
        num_blocks=num_blocks,
        num_cpu_blocks=40,
        prefill_chunk=prefill_chunk,
        backend="torch",
    )
    check_tokens(result, expected)
    assert result.swapped_out_blocks > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda(model: torch.nn.Module, expected: list[list[int]]) -> None:
    # float32 runs the reference backend on the GPU: exercises device placement end to end.
    result = cb.generate(
        model.cuda(), requests(), block_size=4, num_blocks=96, prefill_chunk=5, device="cuda"
    )
    model.cpu()
    check_tokens(result, expected)
