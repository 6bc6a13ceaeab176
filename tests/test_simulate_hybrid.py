"""Tests of the simulator's hybrid-model parts: per-layer needs and the bound, the long-prompt
and chat traces, conversations' tokens and prefix reuse, and the hybrid paged system over the
real `HybridManager`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
from test_simulate import UNIT_TIME

from pagedkv import Attention
from pagedkv.simulate import GPUS, MODELS, ConfigError, Request, SimulationConfig, simulate
from pagedkv.simulate.engine import Active, run
from pagedkv.simulate.hybrid import HybridPagedSystem
from pagedkv.simulate.paged import PagedSystem, PromptTokens
from pagedkv.simulate.presets import CHAT_TRACES, UNIFORM_TRACES, ChatTracePreset, ModelPreset
from pagedkv.simulate.report import format_table
from pagedkv.simulate.simulation import default_systems, system_label
from pagedkv.simulate.trace import chat_trace, final_histories, next_turns, uniform_trace

INF = math.inf
GEMMA = MODELS["gemma-3-27b"]


def test_hybrid_presets_match_their_configs() -> None:
    assert [i for i, a in enumerate(GEMMA.layers) if a.kind == "full"] == list(range(5, 62, 6))
    assert set(GEMMA.layers) == {Attention.full(), Attention.sliding_window(1024)}
    assert GEMMA.kv_bytes_per_token == 62 * 2 * 16 * 128 * 2
    oss = MODELS["gpt-oss-120b"]
    assert oss.layers[:2] == (Attention.sliding_window(128), Attention.full())
    assert oss.groups().layers_per_group == 18 and oss.groups().padding_layers == 0
    scout = MODELS["llama-4-scout"]
    assert [i for i, a in enumerate(scout.layers) if a.kind == "full"] == list(range(3, 48, 4))
    assert scout.layers[0] == Attention.chunked_local(8192)
    assert not MODELS["OPT-13B"].is_hybrid and all(m.is_hybrid for m in (GEMMA, oss, scout))
    with pytest.raises(ConfigError, match="2 layer attentions for 3 layers"):
        ModelPreset("x", 3, 1, 8, 1.0, 64, "", attention=(Attention.full(),) * 2)


def test_needed_slots_by_hand() -> None:
    lengths = np.array([100, 5000, 30000])
    # Gemma: 10 full layers hold every token, 52 sliding ones min(len, 1024 + 16).
    expected = (10 * lengths.sum() + 52 * (100 + 1040 + 1040)) / 62
    assert GEMMA.needed_slots(lengths, 16) == pytest.approx(expected)
    # Llama 4 Scout: 12 full layers, 36 chunked ones hold the current chunk of 8192.
    scout = MODELS["llama-4-scout"]
    current = np.array([100, 5000, 30000 - 3 * 8192])
    expected = (12 * lengths.sum() + 36 * current.sum()) / 48
    assert scout.needed_slots(lengths, 16) == pytest.approx(expected)
    assert scout.needed_slots(np.array([8192, 8193]), 16) == pytest.approx(
        (12 * (8192 + 8193) + 36 * (8192 + 1)) / 48
    )
    assert MODELS["OPT-13B"].needed_slots(lengths, 16) == lengths.sum()


def test_bound_is_capacity_over_needs_per_step() -> None:
    trace = [Request(10, 3)]
    system = PagedSystem(16, 4, trace, beam=False, seed=0, watermark=0.0)
    metrics = run(system, trace, width=1, timing=UNIT_TIME, include_drain=True)
    assert metrics.bound_seqs == pytest.approx(np.mean([64 / 11, 64 / 12, 64 / 13]))


def test_uniform_trace_draws_in_its_ranges() -> None:
    preset = UNIFORM_TRACES["long-16k-32k"]
    trace = uniform_trace(preset, 300, max_len=40000, rate=INF, seed=1)
    prompts = [r.prompt_len for r in trace]
    outputs = [r.output_len for r in trace]
    assert min(prompts) >= 16384 and max(prompts) <= 32768 and np.std(prompts) > 4000
    assert min(outputs) >= 128 and max(outputs) <= 512
    assert all(r.arrival == 0 for r in trace)
    assert trace == uniform_trace(preset, 300, max_len=40000, rate=INF, seed=1)
    with pytest.raises(ValueError, match="over the max length 32768"):
        uniform_trace(preset, 3, max_len=32768, rate=INF, seed=1)


def test_chat_trace_turns_extend_the_history() -> None:
    preset = CHAT_TRACES["chat"]
    trace = chat_trace(preset, 40, max_len=100000, rate=0.5, seed=3)
    assert len(trace) == 40
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(trace))
    sessions: dict[str, list[Request]] = {}
    for r in trace:
        assert r.conversation is not None
        sessions.setdefault(r.conversation, []).append(r)
    assert len(sessions) == 7 and sorted(len(s) for s in sessions.values()) == [4] + [6] * 6
    follows = next_turns(trace)
    for turns in sessions.values():
        assert turns[0].think is None
        for before, after in itertools.pairwise(turns):
            assert after.prompt_len > before.final_len  # history plus a new message
            assert after.arrival == before.arrival and after.think is not None
            assert follows[trace.index(before)] == trace.index(after)
    short = chat_trace(preset, 60, max_len=1500, rate=INF, seed=3)
    assert all(r.final_len <= 1500 for r in short) and len(short) < 60
    with pytest.raises(ValueError, match="request 0: a think time needs an earlier turn"):
        next_turns([Request(3, 3, conversation="a", think=1.0)])


def test_next_turn_arrives_a_think_time_after_the_previous_finishes() -> None:
    trace = [
        Request(4, 2, conversation="a"),
        Request(3, 1),
        Request(8, 3, conversation="a", think=5),
    ]
    system = PagedSystem(16, 4, trace, beam=False, seed=0, watermark=0.0)
    metrics = run(system, trace, width=1, timing=UNIT_TIME, include_drain=True)
    # Steps end at t = 1, 2 (turn 1 finishes); turn 2 arrives at 7, ends at 8, 9, 10.
    assert metrics.series_time.tolist() == [1.0, 2.0, 8.0, 9.0, 10.0]
    assert metrics.mean_latency_per_token == pytest.approx(np.mean([2 / 2, 1 / 1, 3 / 3]))


def test_conversation_tokens_continue_the_previous_turn() -> None:
    trace = [
        Request(5, 3, conversation="a"),
        Request(4, 2, conversation="b"),
        Request(10, 2, 1.0, conversation="a"),
    ]
    tokens = PromptTokens(trace, seed=0)
    first = tokens(0)
    outputs = tokens.generated(np.zeros(3, np.int64), np.array([7, 7, 7]), np.arange(5, 8))
    assert tokens(2)[:8].tolist() == [*first.tolist(), *outputs.tolist()]
    assert tokens(1).tolist() != tokens(0)[:4].tolist()


def test_final_histories() -> None:
    trace = [
        Request(10, 5, conversation="a"),
        Request(20, 5, conversation="b"),
        Request(30, 5, conversation="a", think=1.0),
        Request(7, 5),
    ]
    assert final_histories(trace) == [35, 25]


def test_uniform_paged_chat_hits_the_previous_history() -> None:
    model = MODELS["OPT-13B"]
    trace = chat_trace(CHAT_TRACES["chat"], 12, max_len=2048, rate=INF, seed=0)
    config = SimulationConfig(
        model, GPUS["A100-40GB"], kv_memory=10**10, max_len=2048, systems=("paged",)
    )
    result = simulate(trace, config)
    reuse = result.systems[0].prefix
    assert reuse is not None
    assert reuse.query_tokens == sum(r.prompt_len for r in trace)
    assert reuse.hit_tokens == reuse.full_group_tokens
    # Ample memory: every later turn reuses the previous turn's history but its last block.
    turns: dict[str, list[Request]] = {}
    for r in trace:
        turns.setdefault(str(r.conversation), []).append(r)
    least = sum((t.final_len // 16 - 1) * 16 for s in turns.values() for t in s[:-1])
    assert least <= reuse.hit_tokens <= sum(t.final_len for s in turns.values() for t in s[:-1])
    text = format_table(result)
    assert "prefix hits" in text and "histories at their last turn" in text
    with pytest.raises(ConfigError, match="one sequence per request"):
        simulate(trace, dataclasses.replace(config, n=2))


def test_default_systems_and_labels() -> None:
    assert default_systems(MODELS["OPT-13B"]) == ("paged", "max", "pow2", "oracle")
    assert default_systems(GEMMA) == ("hybrid", "paged", "max", "pow2", "oracle")
    assert system_label("paged", GEMMA) == "uniform paged (pagedkv)"
    assert system_label("paged", MODELS["OPT-13B"]) == "paged (pagedkv)"


def test_chat_preset_source_names_its_assumptions() -> None:
    preset: ChatTracePreset = CHAT_TRACES["chat"]
    assert preset.turns == 6 and "assumption" in preset.source


# --- the hybrid system (the real HybridManager) ----------------------------------------------

WINDOW = Attention.sliding_window(32)
TINY = ModelPreset(
    "tiny-hybrid", 4, 1, 8, 1e6, 4096, "test", attention=(WINDOW, Attention.full(), WINDOW, WINDOW)
)  # one layer per group: pages of 4 tokens x 32 bytes


def hybrid(pages: int, trace: list[Request], chunk: int = 16) -> HybridPagedSystem:
    return HybridPagedSystem(
        TINY, pages * 4 * 32, 4, trace, beam=False, seed=0, watermark=0.0, prefill_chunk=chunk
    )


def test_chunked_prefill_holds_at_most_a_chunk_and_a_window() -> None:
    trace = [Request(200, 3)]
    system = hybrid(1000, trace)
    assert system.groups.attention == (Attention.full(), WINDOW, WINDOW, WINDOW)
    manager = system.manager

    def tables() -> list[int]:
        return [len(manager.block_table(0, g)) for g in range(4)]

    assert system.peak_pages(200) == 50 + 3 * (12 + 1)
    assert system.admit(Active(0, trace[0], 1)) == 200
    held = tables()
    assert held[0] == 50 and max(held[1:]) <= (16 + 32) // 4 + 1
    assert manager.stats(0).num_held == sum(held)
    system.decode([Active(0, trace[0], 1)])
    after = tables()
    # The next query (position 200) reads from 169: blocks 42..50 of the window groups.
    assert after == [51, 9, 9, 9] and manager.first_block(0, 1) == 42
    manager.check()


def test_hybrid_against_uniform_and_the_bound_on_long_prompts() -> None:
    trace = uniform_trace(
        dataclasses.replace(UNIFORM_TRACES["long-16k-32k"], prompt=(400, 800), output=(8, 24)),
        40,
        max_len=1024,
        rate=INF,
        seed=0,
    )
    system = hybrid(3000, trace)
    metrics = run(
        system,
        trace,
        width=1,
        timing=UNIT_TIME,
        include_drain=False,
        need=lambda lengths: TINY.needed_slots(lengths, 4),
    )
    uniform = PagedSystem(3000 // 4, 4, trace, beam=False, seed=0, watermark=0.0)
    base = run(uniform, trace, width=1, timing=UNIT_TIME, include_drain=False)
    # A window group holds about 40 of ~600 tokens: 1 + 3 x 40 / 600 of a full layer's pages.
    assert metrics.mean_seqs > 2.5 * base.mean_seqs
    assert 0.8 * metrics.bound_seqs < metrics.mean_seqs <= metrics.bound_seqs
    assert system.manager.stats(0).num_held == 0
    system.manager.check()


def test_full_group_shows_what_an_evicted_window_cost() -> None:
    # A (200 tokens) finishes; a filler evicts A's mid-sequence window blocks (released ahead
    # of the rest); B = A's first 150 tokens still finds every full block (148 tokens) but
    # its windows' blocks before 148 are gone; D resumes at A's end, kept in every group.
    trace = [
        Request(200, 2, 0.0, conversation="a"),
        Request(120, 2, 100.0),
        Request(150, 2, 200.0, conversation="a"),
        Request(201, 2, 300.0, conversation="a"),
    ]
    reuse = []
    for pages in (220, 1000):
        system = hybrid(pages, trace)
        run(system, trace, width=1, timing=UNIT_TIME, include_drain=True)
        system.manager.check()
        reuse.append((system.prefix_reuse, system.manager.stats(0).evictions))
    (tight, evicted), (ample, none) = reuse
    assert evicted > 0 and none == 0
    assert ample.hit_tokens == ample.full_group_tokens == 148 + 200
    assert tight.full_group_tokens == 148 + 200
    assert 200 <= tight.hit_tokens < 148 + 200


def test_gemma_chat_hits_stay_with_the_full_group_under_pressure() -> None:
    trace = chat_trace(CHAT_TRACES["chat"], 60, max_len=4096, rate=INF, seed=0)
    config = SimulationConfig(
        GEMMA,
        GPUS["H200"],
        kv_memory=4 * 10**9,
        max_len=4096,
        systems=("hybrid", "paged"),
    )
    result = simulate(trace, config)
    histories = np.asarray(final_histories(trace))
    assert config.capacity < GEMMA.needed_slots(histories, 16)  # smaller than the histories
    hybrid_reuse, uniform_reuse = (m.prefix for m in result.systems)
    assert hybrid_reuse is not None and uniform_reuse is not None
    assert hybrid_reuse.hit_tokens <= hybrid_reuse.full_group_tokens
    assert hybrid_reuse.hit_tokens >= 0.9 * hybrid_reuse.full_group_tokens
    assert hybrid_reuse.hit_tokens > uniform_reuse.hit_tokens
    text = format_table(result)
    assert "hits are" in text and "hybrid / uniform paged mean batch" in text


def test_cli_prints_the_hybrid_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.cli import main

    args = ["simulate", "--model", "gemma-3-27b", "--gpu", "H200", "--trace", "long-16k-32k"]
    args += ["--num-requests", "6", "--kv-memory", "20GB", "--max-len", "33280", "--quiet"]
    assert main([*args, "--systems", "hybrid,paged"]) == 0
    out = capsys.readouterr().out
    assert "hybrid paged (pagedkv)" in out and "uniform paged (pagedkv)" in out
    assert "of the bound" in out and "hybrid / uniform paged mean batch" in out
    assert "13 groups of 5 layers (2 full, 11 sliding window 1024); 3 padding slots" in out
    assert main([*args, "--systems", "hybrid", "--json", "--layers-per-group", "10"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["layers_per_group"] == 10
    (system,) = result["systems"]
    assert system["mean_seqs"] <= system["bound_seqs"]
    assert system["prefix"]["hit_tokens"] == 0  # no prompt repeats


def test_hybrid_settings_are_checked() -> None:
    for bad, message in (
        ({"prefill_chunk": 0}, "prefill chunk must be positive, got 0"),
        ({"layers_per_group": 0}, "layers per group must be positive, got 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            SimulationConfig(GEMMA, GPUS["H200"], kv_memory=10**10, max_len=4096, **bad)  # type: ignore[arg-type]
