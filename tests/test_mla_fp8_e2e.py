"""End to end on other KV layouts and dtypes, through `examples/continuous_batching.py`.

A small random DeepSeek-V3 (MLA, MoE; no download) served on an MLA latent cache reproduces
`model.generate` greedily, with prefix hits, forks (copy-on-write), chunked prefill, mixed
batches and swaps. A float8 (e4m3) cache on the Llama example gives logits close to the bfloat16
cache's: at most 0.02 apart (the logits' spread is about 0.16) and under 5% relative L2 error.
"""

from __future__ import annotations

import pytest
import torch
from test_llama_e2e import cb, check_tokens, greedy_reference, requests


@pytest.fixture(scope="module")
def deepseek() -> torch.nn.Module:
    m: torch.nn.Module = cb.tiny_deepseek(seed=0)
    return m


@pytest.fixture(scope="module")
def deepseek_expected(deepseek: torch.nn.Module) -> list[list[int]]:
    return [greedy_reference(deepseek, list(r.prompt), r.max_new_tokens) for r in requests()]


@pytest.mark.parametrize(("num_blocks", "prefill_chunk"), [(96, None), (96, 5), (10, 5)])
def test_deepseek_on_an_mla_cache_equals_generate(
    deepseek: torch.nn.Module,
    deepseek_expected: list[list[int]],
    num_blocks: int,
    prefill_chunk: int | None,
) -> None:
    result = cb.generate(
        deepseek,
        requests(),
        block_size=4,
        num_blocks=num_blocks,
        num_cpu_blocks=40,
        prefill_chunk=prefill_chunk,
        backend="torch",
    )
    check_tokens(result, deepseek_expected)
    assert result.prefix_hit_tokens > 0 and result.copied_blocks > 0 and result.mixed_steps > 0
    assert (result.swapped_out_blocks > 0) == (num_blocks == 10)


def prompt_logits(model: torch.nn.Module, kv_dtype: torch.dtype | None) -> torch.Tensor:
    """Logits at every position of one prompt, prefilled in two chunks (the second reads the
    first's KV from the cache)."""
    engine = cb._Engine(
        model,
        [],
        block_size=4,
        num_blocks=32,
        num_cpu_blocks=1,
        prefill_chunk=None,
        backend="torch",
        device=torch.device("cpu"),
        kv_dtype=kv_dtype,
    )
    prompt = list(range(3, 40))
    mgr = engine.mgr
    mgr.allocate(0, prompt[:20])
    outs = []
    with torch.inference_mode():
        for lo, hi in ((0, 20), (20, len(prompt))):
            if lo:
                mgr.append(0, prompt[lo:hi])
            plan = mgr.plan([0], [hi - lo])
            ids = torch.tensor(prompt[lo:hi])
            outs.append(engine.runner.forward(ids, plan, torch.arange(hi - lo)).float())
    return torch.cat(outs)


def test_float8_cache_logits_stay_close_to_bfloat16() -> None:
    model = cb.tiny_llama(seed=0).to(torch.bfloat16)
    bf16 = prompt_logits(model, None)
    fp8 = prompt_logits(model, torch.float8_e4m3fn)
    assert (fp8 - bf16).abs().max() <= 0.02
    assert torch.linalg.norm(fp8 - bf16) / torch.linalg.norm(bf16) < 0.05
    assert not torch.equal(fp8, bf16)  # the cache really held float8
