"""`GroupedKVCache`: a hybrid model's layers in one pool, driven by a `HybridManager`'s groups.

An engine over a 7-layer model of full, sliding-window and chunked layers (one padded group)
runs prefill, decode past the window, a prefix hit, a fork with copy-on-write and a swap out and
back in; every layer's attention must equal dense masked attention over the whole sequence.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from attention_cases import PrefixKV, allowed_keys, assert_close, masked_dense

import pagedkv.grouped_cache
from pagedkv import Attention, HybridManager, Plan
from pagedkv.attention import PagedAttention
from pagedkv.grouped_cache import GroupedKVCache
from pagedkv.groups import KVGroups

W, F, C = Attention.sliding_window(6), Attention.full(), Attention.chunked_local(8)
LAYERS = [W, F, C, W, F, C, W]
BS, HKV, GROUP, DIM = 4, 2, 2, 8


def test_module_example() -> None:
    assert doctest.testmod(pagedkv.grouped_cache).failed == 0


def test_layers_map_to_their_groups_slots() -> None:
    groups = KVGroups.from_layers(LAYERS, layers_per_group=2)
    assert groups.layers == ((1, 4), (0, 3), (6, -1), (2, 5))
    cache = GroupedKVCache(groups, 16, BS, HKV, DIM, torch.float32)
    assert cache.pool.num_layers == 2 and cache.num_groups == 4
    assert [cache.locate(layer) for layer in range(7)] == [
        (1, 0), (0, 0), (3, 0), (1, 1), (0, 1), (3, 1), (2, 0)
    ]  # fmt: skip
    assert cache.layer(3) is cache.pool.layer(1)
    # A write lands in the layer's slot, in its group's blocks only.
    mgr = HybridManager(16, BS, groups.attention, watermark=0.0)
    mgr.allocate(1, [1, 2, 3, 4, 5])
    plans = mgr.plan([1], [5])
    cache.write(3, torch.ones(5, HKV, DIM), 2 * torch.ones(5, HKV, DIM), plans)
    written = torch.nonzero(cache.pool.layer(1).flatten(1).any(dim=1)).flatten().tolist()
    assert written == sorted(mgr.block_table(1, 1).tolist())
    assert not cache.pool.layer(0).any()


class Engine:
    def __init__(self) -> None:
        self.groups = KVGroups.from_layers(LAYERS, layers_per_group=2)
        attention = self.groups.attention
        key = bytes(range(32))
        self.mgr = HybridManager(96, BS, attention, num_cpu_blocks=64, hash_key=key, watermark=0.0)
        self.gpu = GroupedKVCache(self.groups, 96, BS, HKV, DIM, torch.float32)
        self.cpu = GroupedKVCache(self.groups, 64, BS, HKV, DIM, torch.float32)
        hq = HKV * GROUP
        self.attns = [
            PagedAttention(hq, HKV, DIM, BS, "torch", dtype=torch.float32, attention=a, sinks=True)
            for a in attention
        ]
        self.sinks = [torch.linspace(-1.0, 1.0, hq) * (layer + 1) for layer in range(len(LAYERS))]
        self.kv = PrefixKV(len(LAYERS), HKV, DIM, seed=11)
        self.tokens: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.copies = 0

    def plan(self, seqs: list[int], q_lens: list[int]) -> None:
        self.check(seqs, q_lens, self.mgr.plan(seqs, q_lens))

    def step(self, seqs: list[int], new: list[int]) -> None:
        for s, t in zip(seqs, new, strict=True):
            self.tokens[s].append(t)
        self.check(seqs, [1] * len(seqs), self.mgr.step(seqs, new))

    def check(self, seqs: list[int], q_lens: list[int], plans: list[Plan]) -> None:
        self.copies += sum(len(p.copies) for p in plans)
        self.gpu.copy_blocks([p.copies for p in plans])
        slots = self.gpu.slot_tensors(plans)
        for attn, plan in zip(self.attns, plans, strict=True):
            attn.plan(plan)
        q = torch.randn(sum(q_lens), HKV * GROUP, DIM, generator=self.gen) * 2
        for layer in range(len(LAYERS)):
            group, slot = self.gpu.locate(layer)
            new_k, new_v, want, offset = [], [], [], 0
            for s, q_len in zip(seqs, q_lens, strict=True):
                k, v = self.kv.dense(self.tokens[s], layer)
                new_k.append(k[-q_len:])
                new_v.append(v[-q_len:])
                n = len(self.tokens[s])
                mask = allowed_keys(LAYERS[layer], torch.arange(n - q_len, n), n)
                qs = q[offset : offset + q_len]
                want.append(masked_dense(qs, k, v, mask, DIM**-0.5, None, self.sinks[layer]))
                offset += q_len
            self.gpu.write(layer, torch.cat(new_k), torch.cat(new_v), slots)
            out = self.attns[group].run(
                q, self.gpu.group_cache(group), slot, sinks=self.sinks[layer]
            )
            assert_close(out, torch.cat(want), torch.float32)
        self.mgr.check()


def test_engine_with_prefix_hits_forks_and_swaps() -> None:
    engine = Engine()
    mgr = engine.mgr
    rng = np.random.default_rng(2)

    def tokens(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, 50, n)]

    prompt = tokens(14)
    engine.tokens[1] = list(prompt)
    assert mgr.allocate(1, prompt) == 0
    engine.plan([1], [14])
    for _ in range(7):
        engine.step([1], tokens(1))
    assert mgr.first_block(1, 1) > 0  # blocks left the window
    # A prefix hit, prefilled next to the first request's decode.
    second = prompt[:12] + tokens(3)
    hit = mgr.allocate(2, second)
    assert hit > 0
    engine.tokens[2] = second
    new = tokens(1)
    mgr.append(1, new)
    engine.tokens[1] += new
    engine.plan([1, 2], [1, len(second) - hit])
    # A fork shares the partial last block: the child's next token copies it.
    mgr.fork(1, 3)
    engine.tokens[3] = list(engine.tokens[1])
    for _ in range(3):
        engine.step([1, 2, 3], tokens(3))
    assert engine.copies > 0
    # Swap the second request out and back in; its KV must come back intact.
    pairs = mgr.swap_out([2])
    engine.gpu.swap_out(engine.cpu, pairs)
    mgr.confirm_swap_out([2])
    # Blocks only the swapped sequence held may now be reused: wipe them.
    for g, group_pairs in enumerate(pairs):
        others = {b for s in (1, 3) for b in mgr.block_table(s, g).tolist()}
        gone = [b for b in group_pairs[:, 0].tolist() if b not in others]
        for slot in range(engine.gpu.pool.num_layers):
            engine.gpu.pool.layer(slot)[gone] = 0
    engine.step([1, 3], tokens(2))
    pairs = mgr.swap_in([2])
    assert sum(len(p) for p in pairs) > 0
    engine.gpu.swap_in(engine.cpu, pairs)
    mgr.confirm_swap_in([2])
    for _ in range(3):
        engine.step([1, 2, 3], tokens(3))


def test_bad_input_names_the_argument() -> None:
    groups = KVGroups.from_layers(LAYERS, layers_per_group=2)
    cache = GroupedKVCache(groups, 16, BS, HKV, DIM, torch.float32)
    mgr = HybridManager(16, BS, groups.attention, watermark=0.0)
    mgr.allocate(1, [1, 2, 3])
    plans = mgr.plan([1], [3])
    k = torch.ones(3, HKV, DIM)
    with pytest.raises(ValueError, match="plans: expected 4"):
        cache.write(0, k, k, plans[:3])
    with pytest.raises(ValueError, match=r"plans\[0\] is a plan of Attention.chunked_local"):
        cache.write(0, k, k, plans[::-1])
    with pytest.raises(ValueError, match="layer: 7"):
        cache.write(7, k, k, plans)
    with pytest.raises(ValueError, match="pairs"):
        cache.copy_blocks(np.zeros((0, 2), np.int32))  # type: ignore[arg-type]
    other = GroupedKVCache(KVGroups.from_layers(LAYERS), 16, BS, HKV, DIM, torch.float32)
    with pytest.raises(ValueError, match="cpu_cache"):
        cache.swap_out(other, [np.zeros((0, 2), np.int32)] * 4)
    with pytest.raises(ValueError, match=r"pairs\[1\]"):
        cache.swap_out(cache, [np.zeros((0, 2), np.int32), np.zeros(3, np.int32)] * 2)
    with pytest.raises(ValueError, match="groups"):
        GroupedKVCache(LAYERS, 16, BS, HKV, DIM)  # type: ignore[arg-type]


def fp8_engine_step(scales: list[list[float]] | None) -> tuple[list[torch.Tensor], GroupedKVCache]:
    """One prefill of every layer through a float8 pool with `scales`; each layer's K/V has
    its own magnitude (layer `l`: about 100 * (l + 1)), out of e4m3's range (448) unscaled."""
    groups = KVGroups.from_layers(LAYERS, layers_per_group=2)
    fp8 = GroupedKVCache(groups, 16, BS, HKV, DIM, torch.float8_e4m3fn, scales=scales)
    mgr = HybridManager(16, BS, groups.attention, watermark=0.0)
    mgr.allocate(1, list(range(11)))
    plans = mgr.plan([1], [11])
    slots = fp8.slot_tensors(plans)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(11, HKV * GROUP, DIM, generator=gen)
    outs = []
    for layer in range(len(LAYERS)):
        group, slot = fp8.locate(layer)
        k, v = (torch.randn(11, HKV, DIM, generator=gen) * 100 * (layer + 1) for _ in range(2))
        fp8.write(layer, k, v, slots)
        attn = PagedAttention(
            HKV * GROUP,
            HKV,
            DIM,
            BS,
            "torch",
            dtype=torch.float32,
            kv_dtype=torch.float8_e4m3fn,
            attention=groups.attention[group],
            sm_scale=1e-3 / (layer + 1),  # keeps the softmax soft at these magnitudes
        )
        attn.plan(plans[group])
        out = attn.run(q, fp8.group_cache(group), slot)
        n = torch.arange(11)
        mask = allowed_keys(LAYERS[layer], n, 11)
        want = masked_dense(q, k, v, mask, 1e-3 / (layer + 1), None, None)
        outs.append((out - want).norm() / want.norm())
    return outs, fp8


def test_float8_pool_reads_and_writes_each_layer_with_its_scales() -> None:
    # Layers sharing a slot (layers 0 and 1 sit in slot 0 of groups 1 and 0) get other scales.
    scales = [[2.0 * (layer + 1), 3.0 * (layer + 1)] for layer in range(len(LAYERS))]
    errors, cache = fp8_engine_step(scales)
    assert max(errors) < 0.05, errors  # e4m3 keeps 3 mantissa bits
    assert cache.scales(3) == (8.0, 12.0) and cache.group_cache(1).scales(1) == (8.0, 12.0)
    assert cache.group_cache(2).scales(1) == (1.0, 1.0)  # group 2's padding slot
    assert cache.pool.scales(0) == (1.0, 1.0)
    # Without the scales, the larger layers saturate: the scales are what keeps them right.
    unscaled, _ = fp8_engine_step(None)
    assert max(unscaled) > 0.3, unscaled


def test_float8_scales_are_checked_and_follow_swaps() -> None:
    groups = KVGroups.from_layers(LAYERS, layers_per_group=2)
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"scales must have shape \[num_layers, 2\] = \[7, 2\]"):
        GroupedKVCache(groups, 16, BS, HKV, DIM, fp8, scales=[[1.0, 1.0]] * 2)
    with pytest.raises(ValueError, match="positive and finite"):
        GroupedKVCache(groups, 16, BS, HKV, DIM, fp8, scales=[[1.0, -1.0]] * 7)
    with pytest.raises(ValueError, match="float8 caches only"):
        GroupedKVCache(groups, 16, BS, HKV, DIM, torch.float32, scales=[[1.0, 1.0]] * 7)
    with pytest.raises(ValueError, match="group: 4 out of range"):
        GroupedKVCache(groups, 16, BS, HKV, DIM, fp8).group_cache(4)
    gpu = GroupedKVCache(groups, 16, BS, HKV, DIM, fp8, scales=[[2.0, 2.0]] * 7)
    other = GroupedKVCache(groups, 16, BS, HKV, DIM, fp8, scales=[[4.0, 2.0]] * 7)
    with pytest.raises(ValueError, match="other scales"):
        gpu.swap_out(other, [np.zeros((0, 2), np.int32)] * 4)
    same = GroupedKVCache(groups, 16, BS, HKV, DIM, fp8, scales=[[2.0, 2.0]] * 7)
    gpu.swap_out(same, [np.array([[1, 2]])] + [np.zeros((0, 2), np.int32)] * 3)
