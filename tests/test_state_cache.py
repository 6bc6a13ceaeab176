"""`pagedkv.state_cache`: state tensors per slot, a plan's copies and resets, the save segments.

The engine model of `rust/core/tests/state.rs`, on real tensors: each slot's state records the
tokens it summarizes, so every pass can check that its row starts from exactly the tokens before
its query, whether the state came from a reset, a checkpoint hit or a fork.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv import Attention, HybridManager, OutOfBlocks, StateCache, StateConfig
from pagedkv.state_cache import StateSegment, split_memory, state_segments, state_shapes


def fake_plan(
    q_lens: list[int] | None = None,
    slots: list[int] | None = None,
    copies: list[list[int]] | None = None,
    resets: list[int] | None = None,
    saves: list[list[int]] | None = None,
) -> Any:
    q = q_lens or []
    return SimpleNamespace(
        qo_indptr=np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
        state_slots=np.array(slots if slots is not None else range(len(q)), dtype=np.int32),
        state_copies=np.array(copies or [], dtype=np.int32).reshape(-1, 2),
        state_resets=np.array(resets or [], dtype=np.int32),
        state_saves=np.array(saves or [], dtype=np.int32).reshape(-1, 3),
    )


def test_shapes_dtypes_and_views() -> None:
    cache = StateCache(3, 5, [(6, 3), (2, 4, 4)], [torch.float16, torch.float32])
    conv, ssm = cache.layer(2)
    assert conv.shape == (5, 6, 3) and conv.dtype == torch.float16
    assert ssm.shape == (5, 2, 4, 4) and ssm.dtype == torch.float32
    assert cache.nbytes == 3 * 5 * (18 * 2 + 32 * 4)
    assert cache.slot_nbytes == 3 * (18 * 2 + 32 * 4)
    a, b = cache.states(1, 4)
    a.fill_(1.0)
    b.fill_(2.0)  # views: writing them writes the cache
    assert cache.layer(1)[0][4].eq(1).all() and cache.layer(1)[1][4].eq(2).all()
    assert cache.layer(1)[0][:4].eq(0).all() and cache.layer(0)[0].eq(0).all()
    cache.copy(1, 4, 0)
    assert cache.layer(1)[1][0].eq(2).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4, [(2,)]), "num_layers"),
        ((1, 0, [(2,)]), "num_slots"),
        ((1, 4, []), "at least one state"),
        ((1, 4, [(2, 0)]), "size >= 1"),
        ((1, 4, [()]), "size >= 1"),
    ],
)
def test_constructor_rejects_bad_sizes(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StateCache(*args)


def test_constructor_rejects_dtype_count() -> None:
    with pytest.raises(ValueError, match="2 dtypes for 1 states"):
        StateCache(1, 4, [(2,)], [torch.float32, torch.float32])


def test_out_of_range_layers_and_slots() -> None:
    cache = StateCache(2, 4, [(3,)])
    with pytest.raises(ValueError, match="layer 2 is out of range for 2 layers"):
        cache.layer(2)
    with pytest.raises(ValueError, match="slot 4 is out of range for 4 slots"):
        cache.states(0, 4)
    with pytest.raises(ValueError, match="dst slot -1"):
        cache.copy(0, 1, -1)
    with pytest.raises(ValueError, match="state_copies names slot 7"):
        cache.apply(fake_plan(copies=[[0, 1], [7, 2]]))
    with pytest.raises(ValueError, match="state_resets names slot -2"):
        cache.apply(fake_plan(resets=[-2]))
    with pytest.raises(ValueError, match=r"state_copies must have shape \[n, 2\]"):
        cache.apply(SimpleNamespace(state_copies=np.zeros(3), state_resets=np.zeros(0)))


@pytest.mark.parametrize("seed", range(20))
def test_apply_matches_in_order_reference(seed: int) -> None:
    """Copies in order (chains, repeated destinations), then resets, against plain lists."""
    rng = random.Random(seed)
    slots = 6
    cache = StateCache(2, slots, [(2,), (1, 3)])
    ref = [[float(10 * layer + s)] for layer in range(2) for s in range(slots)]
    for layer in range(2):
        for t in cache.layer(layer):
            for s in range(slots):
                t[s].fill_(10 * layer + s)
    pairs = [[rng.randrange(slots), rng.randrange(slots)] for _ in range(rng.randrange(5))]
    resets = rng.sample(range(slots), rng.randrange(3))
    for src, dst in pairs:
        for layer in range(2):
            ref[layer * slots + dst] = list(ref[layer * slots + src])
    for slot in resets:
        for layer in range(2):
            ref[layer * slots + slot] = [0.0]
    cache.apply(fake_plan(copies=pairs, resets=resets))
    for layer in range(2):
        for t in cache.layer(layer):
            got = [float(t[s].flatten()[0]) for s in range(slots)]
            assert got == [ref[layer * slots + s][0] for s in range(slots)]
            for s in range(slots):
                assert t[s].eq(got[s]).all()


def test_segments_cut_at_saves() -> None:
    saves = [[2, 8, 7], [0, 2, 4], [2, 4, 6], [2, 4, 9]]
    plan = fake_plan(q_lens=[5, 1, 8], slots=[3, 0, 2], saves=saves)
    assert state_segments(plan) == [
        StateSegment(0, 0, 2, 3, (4,)),
        StateSegment(0, 2, 5, 3),
        StateSegment(1, 5, 6, 0),
        StateSegment(2, 6, 10, 2, (6, 9)),  # a draft state and a checkpoint at one point
        StateSegment(2, 10, 14, 2, (7,)),  # a save at the end of the query: no segment after
    ]


@pytest.mark.parametrize(
    ("saves", "message"),
    [
        ([[2, 1, 5]], "names row 2 of a batch of 2"),
        ([[0, 0, 5]], "offset 0 is outside row 0's 3 queries"),
        ([[1, 2, 5]], "offset 2 is outside row 1's 1 queries"),
    ],
)
def test_segments_reject_bad_saves(saves: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        state_segments(fake_plan(q_lens=[3, 1], saves=saves))


def test_segments_reject_missing_slots() -> None:
    with pytest.raises(ValueError, match=r"state_slots must have shape \[2\]"):
        state_segments(fake_plan(q_lens=[3, 1], slots=[0]))


def test_state_shapes_match_the_models_layers() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3NextConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=0,
    )
    layers, shapes = state_shapes(config)
    assert layers == [0, 2]
    mixer = transformers.Qwen3NextForCausalLM(config).model.layers[0].linear_attn
    assert shapes == [(mixer.conv_dim, 3), (4, 8, 8)]
    mamba2 = {
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    for config, want_layers in [
        (
            transformers.BambaConfig(num_hidden_layers=3, attn_layer_indices=[1], **mamba2),
            [0, 2],
        ),
        (
            transformers.GraniteMoeHybridConfig(
                num_hidden_layers=3,
                layer_types=["mamba", "attention", "mamba"],
                num_local_experts=0,
                **mamba2,
            ),
            [0, 2],
        ),
        (
            transformers.FalconH1Config(num_hidden_layers=2, mamba_d_ssm=64, **mamba2),
            [0, 1],  # every layer runs attention and Mamba side by side
        ),
    ]:
        layers, shapes = state_shapes(config)
        assert layers == want_layers, type(config).__name__
        model = transformers.AutoModelForCausalLM.from_config(config)
        mixer = model.model.layers[0].mamba
        assert shapes == [(mixer.conv_dim, 3), (4, 16, 8)], type(config).__name__
    nemotron = transformers.NemotronHConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        hybrid_override_pattern="M*M-",
        num_hidden_layers=4,
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=1,
        ssm_state_size=8,
        conv_kernel=4,
        expand=2,
    )
    layers, shapes = state_shapes(nemotron)
    assert layers == [0, 2]
    mixer = transformers.NemotronHForCausalLM(nemotron).model.layers[0].mixer
    assert shapes == [(mixer.conv_dim, 3), (4, 16, 8)]
    with pytest.raises(ValueError, match="no recurrent layers known in a LlamaConfig"):
        state_shapes(transformers.LlamaConfig())


class Engine:
    """Runs plans on a `StateCache` whose state 0 records the tokens a slot summarizes and
    state 1 how many; each pass checks that its row starts from exactly the tokens before it."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.cache = StateCache(2, num_slots, [(max_len,), (1,)], torch.float64)
        self.mid_query_saves = 0  # saves that cut a row's query (the state taken mid-pass)

    def run(self, plan: Any, rows: list[list[int]]) -> None:
        self.cache.apply(plan)
        starts = [int(plan.positions[i]) for i in plan.qo_indptr[:-1]]
        for layer in range(2):
            for seg in state_segments(plan):
                tokens, count = self.cache.states(layer, seg.slot)
                row, first = seg.row, int(plan.qo_indptr[seg.row])
                begin = starts[row] + seg.start - first  # the segment's first position
                n = int(count.item())
                assert n == begin, f"row {row}'s state holds {n} tokens, not {begin}"
                have = tokens[:n].tolist()
                assert have == rows[row][:n], f"row {row}'s state is not its prefix"
                end = begin + seg.end - seg.start
                tokens[begin:end] = torch.tensor(rows[row][begin:end], dtype=torch.float64)
                count.fill_(end)
                for save_to in seg.save_to:
                    self.cache.copy(layer, seg.slot, save_to)
                    self.mid_query_saves += seg.end < plan.qo_indptr[row + 1]


def test_random_operations_keep_every_state_exact() -> None:
    resumed = mid_query_saves = 0
    for round_ in range(8):
        hits, saves = run_round(round_)
        resumed += hits
        mid_query_saves += saves
    assert resumed > 0, "no admission resumed from a checkpoint"
    assert mid_query_saves > 0, "no save cut a query"


def run_round(round_: int) -> tuple[int, int]:
    """Random admissions, decode steps, forks, frees and cache resets on a tight state pool;
    returns the prompt tokens resumed from checkpoints and the saves that cut a query."""
    rng = random.Random(round_)
    bs = 4
    config = StateConfig(
        6 + round_ % 4,
        max_checkpoints=3,
        checkpoint_interval=8 if round_ % 2 else 0,
        checkpoints_per_sequence=1 + round_ % 2,
    )
    mgr = HybridManager(
        200, bs, [Attention.full(), Attention.sliding_window(12)], watermark=0.0, state=config
    )
    engine = Engine(config.num_slots, 256)
    live: list[tuple[int, list[int]]] = []
    next_id = 0
    for _ in range(150):
        op = rng.randrange(10)
        if op <= 2:
            stem = rng.randrange(3)
            prompt = [stem * 100 + i for i in range(rng.randrange(40) + 1)]
            prompt += [90 + rng.randrange(4) for _ in range(rng.randrange(8))]
            next_id += 1
            try:
                reused = mgr.allocate(next_id, prompt)
            except OutOfBlocks:
                continue
            plan = mgr.plan([next_id], [len(prompt) - reused])[0]
            engine.run(plan, [prompt])
            live.append((next_id, prompt))
        elif op <= 5 and live:
            seqs = [s for s, _ in live]
            tokens = [rng.randrange(4) for _ in live]
            if any(len(t) >= 250 for _, t in live):
                continue
            try:
                plan = mgr.step(seqs, tokens)[0]
            except OutOfBlocks:
                continue
            for (_, t), token in zip(live, tokens, strict=True):
                t.append(token)
            engine.run(plan, [t for _, t in live])
        elif op == 6 and live:
            parent, tokens = live[rng.randrange(len(live))]
            next_id += 1
            try:
                mgr.fork(parent, next_id)
            except OutOfBlocks:
                continue
            live.append((next_id, list(tokens)))
        elif op <= 8 and live:
            seq, _ = live.pop(rng.randrange(len(live)))
            mgr.free(seq)
        elif rng.randrange(8) == 0:
            mgr.reset_prefix_cache()
        mgr.check()
    return int(mgr.state_stats().prefix_hit_tokens), engine.mid_query_saves // 2  # 2 layers


def test_swap_copies_slots_to_another_cache_and_back() -> None:
    gpu = StateCache(2, 4, [(3,), (2, 2)])
    cpu = StateCache(2, 2, [(3,), (2, 2)])
    for layer in range(2):
        for t in gpu.layer(layer):
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
    gpu.swap(cpu, np.array([[3, 1]], dtype=np.int32))  # swap_out's state pairs
    for layer in range(2):
        for ours, theirs in zip(gpu.layer(layer), cpu.layer(layer), strict=True):
            assert torch.equal(theirs[1], ours[3])
            assert not theirs[0].any()
    cpu.swap(gpu, np.array([[1, 0]], dtype=np.int32))  # swap_in's
    assert torch.equal(gpu.layer(1)[1][0], gpu.layer(1)[1][3])
    with pytest.raises(ValueError, match="different layers or states"):
        gpu.swap(StateCache(1, 2, [(3,), (2, 2)]), np.zeros((0, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="out of range"):
        gpu.swap(cpu, np.array([[0, 2]]))


def test_split_memory_gives_pages_and_slots() -> None:
    # 8 GB, Qwen3-Next-80B-like: 12 full layers' page of 16 tokens, 38.25 MiB of state.
    page, slot = 12 * 2 * 2 * 256 * 2 * 16, 40_108_032
    blocks, slots = split_memory(8 * 10**9, page, slot)
    assert slots == 4 * 10**9 // slot == 99
    assert blocks == (8 * 10**9 - 99 * slot) // page
    assert blocks * page + slots * slot <= 8 * 10**9
    for args, name in [
        ((8 * 10**9, page, 0), "slot_bytes"),
        ((0, page, slot), "memory_bytes"),
        ((8 * 10**9, page, slot, 1.0), "state_fraction"),
        ((10**6, page, slot), r"slot_bytes \(40108032\) is beyond"),
        ((10**6, 10**6, 10), r"page_bytes \(1000000\) is beyond"),
    ]:
        with pytest.raises(ValueError, match=name):
            split_memory(*args)
