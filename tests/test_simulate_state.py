"""Tests of the simulator's recurrent-state parts: the Qwen3-Next preset, the split of the
memory between pages and state slots, admission and forks that need a slot, the checkpoint
counters, the chat target against full attention everywhere and the shared system prompt."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from test_simulate import UNIT_TIME

from pagedkv.simulate import GPUS, MODELS, ConfigError, Request, SimulationConfig, simulate
from pagedkv.simulate.engine import Active, run
from pagedkv.simulate.hybrid import HybridPagedSystem
from pagedkv.simulate.presets import CHAT_TRACES, ModelPreset, gated_deltanet_state_bytes
from pagedkv.simulate.report import format_table
from pagedkv.simulate.simulation import build_system, default_systems, system_label
from pagedkv.simulate.trace import chat_trace, final_histories

INF = math.inf
QWEN = MODELS["qwen3-next-80b"]
# One full-attention layer of 32 bytes per token; a state of 64 tokens' KV.
TINY = ModelPreset(
    "tiny-recurrent", 1, 1, 8, 1e6, 4096, "test", num_state_layers=3, state_bytes=2048
)


def tiny_config(pages: int, slots: int, **settings: object) -> SimulationConfig:
    """TINY in `pages` pages of 4 tokens (128 bytes) and `slots` state slots."""
    kv_memory = pages * 128 + slots * 2048
    return SimulationConfig(
        TINY,
        GPUS["H200"],
        kv_memory=kv_memory,
        block_size=4,
        watermark=0.0,
        systems=("hybrid", "paged"),
        state_memory=(slots * 2048 + 1) / kv_memory,
        **settings,  # type: ignore[arg-type]
    )


def test_qwen3_next_preset_matches_its_config() -> None:
    # 36 Gated DeltaNet layers: conv state (2 x 16 x 128 + 32 x 128) channels x kernel 4, and
    # a recurrent state of 32 value heads x 128 x 128, in bf16.
    per_layer = (8192 * 4 + 32 * 128 * 128) * 2
    assert per_layer == 1_114_112
    assert QWEN.state_bytes == 36 * per_layer == 40_108_032
    assert QWEN.state_bytes == 36 * gated_deltanet_state_bytes(
        num_key_heads=16,
        num_value_heads=32,
        key_head_dim=128,
        value_head_dim=128,
        conv_kernel=4,
        dtype_bytes=2,
    )
    assert (QWEN.num_layers, QWEN.num_state_layers) == (12, 36)
    assert QWEN.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24576
    assert QWEN.state_token_slots == 1632
    assert QWEN.has_state and not QWEN.is_hybrid and not MODELS["OPT-13B"].has_state
    full = QWEN.full_attention_everywhere()
    assert (full.num_layers, full.kv_bytes_per_token, full.has_state) == (48, 98304, False)
    assert "Qwen3-Next-80B-A3B-Instruct/blob/main/config.json" in QWEN.source
    assert QWEN.max_len == 262144 and QWEN.num_params == 80e9
    with pytest.raises(ConfigError, match="3 recurrent layers with a state of 0 bytes"):
        ModelPreset("x", 1, 1, 8, 1.0, 64, "", num_state_layers=3)


def test_needs_count_each_sequence_state() -> None:
    lengths = np.array([100, 300])
    assert TINY.needed_slots(lengths, 4) == 400 + 2 * 64
    assert QWEN.needed_slots(lengths, 16) == pytest.approx(400 + 2 * 1632)


def test_systems_and_labels_for_a_recurrent_model() -> None:
    assert default_systems(QWEN) == ("hybrid", "paged")
    assert system_label("paged", QWEN) == "full-attention paged (pagedkv)"
    config = SimulationConfig(QWEN, GPUS["H200"], kv_memory=8 * 10**9, systems=("hybrid", "paged"))
    assert config.system_model("paged").num_layers == 48
    assert config.system_model("hybrid") is QWEN


def test_memory_split_between_pages_and_state_slots() -> None:
    config = SimulationConfig(QWEN, GPUS["H200"], kv_memory=8 * 10**9, systems=("hybrid", "paged"))
    assert config.num_state_slots == 4 * 10**9 // 40_108_032 == 99
    state = config.state_config()
    assert state is not None
    assert (state.num_slots, state.max_checkpoints) == (99, 98)
    assert (state.checkpoint_interval, state.checkpoints_per_sequence) == (16, 1)
    trace = [Request(100, 4)]
    hybrid = build_system("hybrid", trace, config)
    assert isinstance(hybrid, HybridPagedSystem)
    page = 12 * 16 * 2048
    assert hybrid.num_pages == (8 * 10**9 - 99 * 40_108_032) // page
    # Capacity in token slots of the KV layers: the pages' and the state slots' 1632 each.
    assert hybrid.capacity == hybrid.num_pages * 16 + 99 * 1632
    paged = build_system("paged", trace, config)
    assert paged.capacity == 8 * 10**9 // (98304 * 16) * 16
    quarter = dataclasses.replace(config, state_memory=0.25, checkpoint_interval=0)
    assert quarter.num_state_slots == 49 and quarter.interval == 0


def test_composition_counts_working_states_as_tokens() -> None:
    config = tiny_config(80, 4)
    trace = [Request(10, 3)]
    system = build_system("hybrid", trace, config)
    assert isinstance(system, HybridPagedSystem)
    assert (config.num_state_slots, system.num_pages) == (4, 80)
    active = Active(0, trace[0], 1)
    assert system.admit(active) == 10
    system.decode([active])
    active.generated += 1
    comp = system.composition([active])
    assert comp.capacity == system.capacity == 80 * 4 + 4 * 64
    assert comp.token == 11 + 64  # its tokens and its working state
    assert comp.reserved == 1 and comp.internal == 0
    system.manager.check()


def test_admission_waits_for_a_state_slot() -> None:
    # Two slots and ample pages: at most two sequences run at once.
    config = tiny_config(1000, 2)
    assert config.num_state_slots == 2
    trace = [Request(8 + i, 5) for i in range(5)]
    system = build_system("hybrid", trace, config)
    metrics = run(system, trace, width=1, timing=UNIT_TIME, include_drain=True)
    assert metrics.peak_seqs == 2 and metrics.preemptions == 0
    assert isinstance(system, HybridPagedSystem)
    system.manager.check()


def test_forks_wait_for_their_slots() -> None:
    # Six slots: a request of three samples runs alone (its prefill saves two checkpoints);
    # the next cannot fork and waits.
    config = tiny_config(1000, 6, n=3)
    trace = [Request(10, 6), Request(12, 6)]
    system = build_system("hybrid", trace, config)
    metrics = run(system, trace, width=3, timing=UNIT_TIME, include_drain=True)
    assert metrics.peak_seqs == 3
    assert isinstance(system, HybridPagedSystem)
    use = system.state_use
    assert use is not None and use.num_slots == 6
    system.manager.check()
    assert system.manager.state_stats().num_working == 0


def test_beams_keep_their_own_without_a_slot() -> None:
    config = tiny_config(1000, 6, beam_width=3)
    trace = [Request(10, 30)]
    system = build_system("hybrid", trace, config)
    run(system, trace, width=3, timing=UNIT_TIME, include_drain=True)
    assert isinstance(system, HybridPagedSystem)
    system.manager.check()


def test_checkpoints_cost_one_save_per_block_of_decode() -> None:
    trace = [Request(10, 41), Request(30, 40, 1000.0)]
    for interval, saves in ((4, 20), (8, 10), (0, 0)):
        config = tiny_config(1000, 20, checkpoint_interval=interval)
        system = build_system("hybrid", trace, config)
        run(system, trace, width=1, timing=UNIT_TIME, include_drain=True)
        assert isinstance(system, HybridPagedSystem)
        use = system.state_use
        assert use is not None and use.checkpoint_interval == interval
        assert use.decode_tokens == 81
        # Decode crosses 10 blocks of 4 per request (positions 10..50, 30..69).
        assert use.decode_saves == saves
        assert use.saves_per_decode_token == pytest.approx(saves / 81)
        system.manager.check()


def test_next_turn_resumes_at_the_previous_turns_end() -> None:
    # Each turn ends where the next one's KV hit ends: with a checkpoint every block the
    # state hit is the same, every full block of the history.
    trace = [
        Request(10, 11, conversation="a"),
        Request(30, 5, conversation="a", think=1.0),
        Request(40, 5, conversation="a", think=1.0),
    ]
    config = tiny_config(1000, 20)
    system = build_system("hybrid", trace, config)
    run(system, trace, width=1, timing=UNIT_TIME, include_drain=True)
    assert isinstance(system, HybridPagedSystem)
    reuse = system.prefix_reuse
    assert reuse.hit_tokens == reuse.full_group_tokens == 20 + 32
    use = system.state_use
    assert use is not None and use.hit_copies == 2 and use.hit_tokens == 52


def test_chat_hit_rate_against_full_attention_everywhere() -> None:
    trace = chat_trace(CHAT_TRACES["chat"], 60, max_len=QWEN.max_len, rate=INF, seed=0)
    config = SimulationConfig(
        QWEN, GPUS["H200"], kv_memory=40 * 10**9, systems=("hybrid", "paged"), seed=0
    )
    result = simulate(trace, config, trace_name="chat")
    hybrid, full = result.systems
    assert hybrid.prefix is not None and full.prefix is not None
    assert full.prefix.hit_rate > 0.5
    assert hybrid.prefix.hit_rate >= 0.8 * full.prefix.hit_rate
    assert hybrid.state is not None and hybrid.state.peak_checkpoints <= 249
    text = " ".join(format_table(result).split())
    assert "hybrid hit rate / full attention everywhere: " in text
    assert "hybrid hits / its full-attention layers' cached prefixes: " in text
    assert "498 state slots take 19.97 GB (0.5 of the memory, --state-memory)" in text
    assert "checkpoints held: mean " in text and "peak " in text
    assert "per decode token" in text
    assert "full-attention paged: the same model with its 36 recurrent layers" in text
    histories = np.asarray(final_histories(trace))
    assert config.capacity > QWEN.needed_slots(histories, 16)  # ample memory


def test_shared_system_prompt_hits_from_the_third_request() -> None:
    # A 900-token system prompt, then different messages; one request at a time.
    trace = [
        Request(900 + 20 + 7 * i, 8, 100.0 * i, prefix_id="system", prefix_len=900)
        for i in range(8)
    ]
    config = SimulationConfig(QWEN, GPUS["H200"], kv_memory=8 * 10**9, systems=("hybrid",))
    system = build_system("hybrid", trace, config)
    assert isinstance(system, HybridPagedSystem)
    hits = []
    for i, request in enumerate(trace):
        active = Active(i, request, 1)
        computed = system.admit(active)
        assert computed is not None
        hits.append(request.prompt_len - computed)
        for _ in range(request.output_len):
            system.decode([active])
            active.generated += 1
        system.release(active)
    assert hits[0] == 0, hits
    assert min(hits[2:]) >= 896, hits
    system.manager.check()


def test_state_settings_are_checked() -> None:
    base = {"kv_memory": 8 * 10**9, "systems": ("hybrid", "paged")}
    for bad, message in (
        (
            {"kv_memory": 60 * 10**6},
            "the state memory .* holds no recurrent state of "
            "qwen3-next-80b \\(40108032 bytes per sequence\\)",
        ),
        ({"state_memory": 1.0}, "state memory must be a fraction in \\(0, 1\\), got 1.0"),
        (
            {"checkpoint_interval": 24},
            "checkpoint interval must be a multiple of the block size 16, got 24",
        ),
        ({"checkpoints_per_sequence": 0}, "checkpoints per sequence must be positive, got 0"),
        ({"systems": ("hybrid", "max")}, "'max' does not model \\(choose from hybrid, paged\\)"),
    ):
        with pytest.raises(ConfigError, match=message):
            SimulationConfig(QWEN, GPUS["H200"], **{**base, **bad})  # type: ignore[arg-type]


def test_cli_prints_the_state_group(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.cli import main

    args = ["simulate", "--model", "qwen3-next-80b", "--gpu", "H200", "--trace", "chat"]
    args += ["--num-requests", "24", "--kv-memory", "20GB", "--quiet"]
    assert main([*args, "--checkpoint-interval", "32", "--state-memory", "0.25"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hybrid paged (pagedkv)" in out and "full-attention paged (pagedkv)" in out
    assert "124 state slots take 4.97 GB (0.25 of the memory" in out
    assert "every 32 tokens" in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["state_slots"] == 249
    assert result["config"]["checkpoint_interval"] == 16
    hybrid = result["systems"][0]
    assert hybrid["state"]["num_slots"] == 249
    assert hybrid["state"]["saves_per_decode_token"] > 0
    assert main([*args, "--checkpoint-interval", "20"]) == 1
    assert "multiple of the block size" in capsys.readouterr().err


def test_chat_under_pressure_evicts_checkpoints() -> None:
    # 16 slots for 10 conversations' resume points, the running sequences and their saves:
    # checkpoints are evicted; every hit still needs the full-attention group's blocks.
    trace = chat_trace(CHAT_TRACES["chat"], 60, max_len=QWEN.max_len, rate=INF, seed=0)
    config = SimulationConfig(
        QWEN, GPUS["H200"], kv_memory=1_300_000_000, systems=("hybrid", "paged")
    )
    assert config.num_state_slots == 16
    result = simulate(trace, config, trace_name="chat")
    hybrid = result.systems[0]
    assert hybrid.state is not None and hybrid.prefix is not None
    assert hybrid.state.evictions > 0 and hybrid.state.skipped > 0
    assert hybrid.state.peak_checkpoints <= 15  # the slots no live sequence holds
    assert hybrid.prefix.hit_tokens <= hybrid.prefix.full_group_tokens
    assert hybrid.state.hit_tokens == hybrid.prefix.hit_tokens
