"""End to end: speculative decoding reproduces `model.generate` exactly, whatever the drafts.

`examples/continuous_batching.py` with `speculate=k` appends each decoding sequence's last token
and its drafts, verifies them in one forward pass of the target and rolls back the rejected
ones; its greedy tokens must equal `transformers`' greedy `generate` with drafts that are all
accepted (the draft is the target), almost none (another random model), and some (the target's
first layer; prompt lookup).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_llama_e2e import cb, check_tokens, greedy_reference

from pagedkv import Batch, BlockManager

SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # 13 tokens: 3 full blocks of 4
LOOP = [21, 22, 23, 24, 25] * 3  # repetitive: prompt lookup finds what follows


def requests() -> list[Any]:
    r = cb.Request
    return [
        r([*SHARED, 1, 2, 3], 12),
        r([5, 6, 7, 8, 9, 10, 11], 10, num_samples=2),  # forked after prefill
        r([*SHARED, 7], 9, arrival_step=2),  # prefix hit
        r(LOOP, 12, arrival_step=1),
    ]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m: torch.nn.Module = cb.tiny_llama(seed=0)
    return m


@pytest.fixture(scope="module")
def expected(model: torch.nn.Module) -> list[list[int]]:
    return [greedy_reference(model, list(r.prompt), r.max_new_tokens) for r in requests()]


def run(model: torch.nn.Module, k: int, draft: torch.nn.Module | None, **kw: Any) -> Any:
    kw = {"block_size": 4, "num_blocks": 96, "backend": "torch", **kw}
    return cb.generate(model, requests(), speculate=k, draft_model=draft, **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_draft_equal_to_target_is_always_accepted(
    model: torch.nn.Module, expected: list[list[int]], k: int
) -> None:
    result = run(model, k, model)
    check_tokens(result, expected)
    assert result.proposed_drafts > 0
    assert result.acceptance_rate == 1.0
    assert result.prefix_hit_tokens == 12
    assert result.copied_blocks > 0
    assert result.draft_copied_blocks > 0  # the forked samples' drafts share a partial block
    plain = cb.generate(model, requests(), block_size=4, num_blocks=96, backend="torch")
    assert result.steps < plain.steps


def test_unrelated_draft_is_rejected(model: torch.nn.Module, expected: list[list[int]]) -> None:
    result = run(model, 3, cb.tiny_llama(seed=1))
    check_tokens(result, expected)
    assert result.proposed_drafts > 0
    assert result.acceptance_rate < 0.2


@pytest.mark.parametrize("k", [1, 3])
def test_first_layer_draft_is_partly_accepted(
    model: torch.nn.Module, expected: list[list[int]], k: int
) -> None:
    result = run(model, k, cb.first_layers(model, 1))
    check_tokens(result, expected)
    assert 0 < result.acceptance_rate < 1


@pytest.mark.parametrize("k", [1, 3])
def test_prompt_lookup_is_partly_accepted(
    model: torch.nn.Module, expected: list[list[int]], k: int
) -> None:
    result = run(model, k, None)
    check_tokens(result, expected)
    assert 0 < result.acceptance_rate < 1


@pytest.mark.parametrize("draft", ["target", "ngram"])
def test_speculation_under_swaps_and_chunks(
    model: torch.nn.Module, expected: list[list[int]], draft: str
) -> None:
    # A pool too small for every sequence forces swaps (the draft KV of a swapped-out sequence
    # is freed and recomputed); chunked prompts mix prefill and verification in one step.
    result = run(
        model,
        3,
        model if draft == "target" else None,
        num_blocks=12,
        num_cpu_blocks=40,
        prefill_chunk=5,
    )
    check_tokens(result, expected)
    assert result.swapped_out_blocks > 0
    assert result.mixed_steps > 0
    assert result.acceptance_rate == 1.0 if draft == "target" else result.acceptance_rate > 0


def test_prompt_lookup_proposes_what_followed() -> None:
    lookup = cb.prompt_lookup
    assert lookup([1, 2, 3, 4, 1, 2], 3, 2) == [3, 4, 1]
    assert lookup([1, 2, 3, 9, 2], 3, 2) == [3, 9, 2]  # falls back to a shorter n-gram
    assert lookup([7, 1, 7, 2, 7], 2, 2) == [2, 7]  # the latest earlier occurrence
    assert lookup([1, 2, 3], 3, 2) == []


def test_verify_batch_then_rollback_batch_match_the_one_shot_calls() -> None:
    # The persistent-batch form of a verify step: each row appends its last token and drafts,
    # then drops its rejected drafts; the batch's inputs match a one-shot plan of the same.
    bs, rows = 4, 5
    one, persistent = BlockManager(64, bs), BlockManager(64, bs)
    batch = Batch()
    for seq in range(rows):
        for mgr in (one, persistent):
            prompt = list(range(100 * seq, 100 * seq + 3 + seq))
            mgr.plan([seq], [len(prompt) - mgr.allocate(seq, prompt)])
        batch.add(seq)
    ids = list(range(rows))
    rng = np.random.default_rng(0)
    for step in range(6):
        counts = rng.integers(1, 6, rows)  # last token + 0..4 drafts
        tokens = rng.integers(0, 1000, int(counts.sum()))
        persistent.verify_batch(batch, tokens, counts)
        ends = np.cumsum(counts)
        for seq in ids:
            one.append(seq, tokens[ends[seq] - counts[seq] : ends[seq]])
        plan = one.plan(ids, counts)
        for name in ("qo_indptr", "positions", "slot_mapping", "kv_indptr", "kv_last_page_len"):
            assert np.array_equal(getattr(batch, name), getattr(plan, name)), (step, name)
        assert np.array_equal(batch.kv_indices, plan.kv_indices), step
        rejected = rng.integers(0, counts)  # keep the last token and the accepted drafts
        persistent.rollback_batch(batch, rejected)
        one.rollback(ids, rejected)
        for seq in ids:
            assert np.array_equal(persistent.token_ids(seq), one.token_ids(seq))
            assert np.array_equal(persistent.block_table(seq), one.block_table(seq))
    for mgr in (one, persistent):
        assert mgr.stats().num_held == one.stats().num_held
        mgr.check()
