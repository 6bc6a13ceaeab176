"""Sliding-window and chunked-local attention and attention sinks against dense attention.

The dense side builds its mask from absolute positions over each whole sequence. The plans list
only the pages from the first block a windowed manager still holds for the step's first query,
so the backends, which mask positions relative to the plan's first page, must agree with it.
Hand-built plans cover every combination of attention, sink, soft cap, GQA ratio and block size
on the torch reference, and a few on the Triton kernel (in Triton's CPU interpreter without
CUDA); a windowed `BlockManager` and a `HybridManager` drive the rest (chunked prefill, decode
after blocks leave the window, prefix hits, mixed batches).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from attention_cases import PrefixKV, allowed_keys, assert_close, full_plan, masked_dense

from pagedkv import Attention, Batch, BlockManager, HybridManager, Plan
from pagedkv.attention import (
    BackendName,
    DeviceBlockTable,
    PagedAttention,
    TablePlan,
    plan_from_tables,
)
from pagedkv.kv_cache import KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WINDOW = 11
# (sequence length, query tokens): decode, prefill, chunked prefill, in one mixed batch.
SHAPES = [(70, 1), (21, 21), (45, 9), (2, 1), (40, 40), (3, 2), (33, 1)]


def attention_of(kind: str, bs: int) -> Attention:
    """The attention `kind` names; a chunk is a multiple of the block size, as managers need."""
    if kind == "window":
        return Attention.sliding_window(WINDOW)
    if kind == "chunk":
        return Attention.chunked_local(bs * max(1, 24 // bs))
    return Attention.full()


@dataclass
class WindowedBatch:
    """Whole sequences' K/V in a paged cache and a plan listing only their live pages."""

    cache: KVCache
    plan: TablePlan
    q: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    shapes: Sequence[tuple[int, int]]
    first_blocks: list[int]

    def expected(
        self, scale: float, cap: float | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        outs, offset = [], 0
        for k, v, (length, q_len) in zip(self.k, self.v, self.shapes, strict=True):
            mask = allowed_keys(self.plan.attention, torch.arange(length - q_len, length), length)
            q = self.q[offset : offset + q_len]
            outs.append(masked_dense(q, k, v, mask, scale, cap, sinks))
            offset += q_len
        return torch.cat(outs)


def windowed_batch(
    seed: int,
    attention: Attention,
    shapes: Sequence[tuple[int, int]],
    *,
    hq: int,
    hkv: int,
    dim: int,
    bs: int,
    dtype: torch.dtype = torch.float32,
) -> WindowedBatch:
    """Sequences `(length, q_len)` on random blocks; the plan starts at the block holding the
    first key the step's first query reads, as a windowed manager's plan does."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = sum(math.ceil(length / bs) for length, _ in shapes) + 3
    order = [int(x) for x in rng.permutation(num_blocks)]
    tables = [[order.pop() for _ in range(math.ceil(length / bs))] for length, _ in shapes]
    k = [torch.randn(length, hkv, dim, generator=gen).to(dtype) for length, _ in shapes]
    v = [torch.randn(length, hkv, dim, generator=gen).to(dtype) for length, _ in shapes]
    cache = KVCache(1, num_blocks, bs, hkv, dim, dtype=dtype)
    lengths = [length for length, _ in shapes]
    cache.write(0, torch.cat(k), torch.cat(v), full_plan(tables, lengths, bs))
    firsts = [attention.first_key(length - q_len) // bs for length, q_len in shapes]
    plan = plan_from_tables(
        [t[f:] for t, f in zip(tables, firsts, strict=True)],
        [length - f * bs for length, f in zip(lengths, firsts, strict=True)],
        [q_len for _, q_len in shapes],
        bs,
        attention,
    )
    q = torch.randn(plan.positions.shape[0], hq, dim, generator=gen).to(dtype)
    return WindowedBatch(cache, plan, q, k, v, shapes, firsts)


def on_device(cache: KVCache) -> KVCache:
    if DEVICE == "cpu":
        return cache
    moved = KVCache(
        1,
        cache.num_blocks,
        cache.block_size,
        cache.num_kv_heads,
        cache.head_dim,
        cache.dtype,
        DEVICE,
    )
    moved.layer(0).copy_(cache.layer(0))
    return moved


@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("cap", [None, 4.0])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("kind", ["full", "window", "chunk"])
def test_reference_matches_masked_dense(
    kind: str, sink: bool, cap: float | None, group: int, bs: int
) -> None:
    hkv, dim = 2, 8
    attention = attention_of(kind, bs)
    batch = windowed_batch(bs + group, attention, SHAPES, hq=hkv * group, hkv=hkv, dim=dim, bs=bs)
    if kind != "full":
        assert sum(batch.first_blocks) > 0  # the plan really left blocks out
    batch.q *= 3  # logits large enough for the cap and the sinks to matter
    sinks = (
        torch.randn(hkv * group, generator=torch.Generator().manual_seed(bs)) * 2 if sink else None
    )
    attn = PagedAttention(
        hkv * group, hkv, dim, bs, "torch", dtype=torch.float32, logits_soft_cap=cap, sinks=sink
    )
    attn.plan(batch.plan)
    out = attn.run(batch.q, batch.cache, 0, sinks=sinks)
    assert_close(out, batch.expected(dim**-0.5, cap, sinks), torch.float32)


def test_sinks_take_weight_from_the_keys() -> None:
    """A large sink draws nearly all of the softmax, so the output goes to zero; a very negative
    one changes nothing (the mask test would pass if sinks were ignored, were they tiny)."""
    batch = windowed_batch(3, Attention.full(), [(9, 3)], hq=4, hkv=2, dim=8, bs=4)
    attn = PagedAttention(4, 2, 8, 4, "torch", dtype=torch.float32, sinks=True)
    plain = PagedAttention(4, 2, 8, 4, "torch", dtype=torch.float32)
    attn.plan(batch.plan)
    plain.plan(batch.plan)
    big = attn.run(batch.q, batch.cache, 0, sinks=torch.full((4,), 50.0))
    assert big.abs().max() < 1e-12
    tiny = attn.run(batch.q, batch.cache, 0, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(tiny, plain.run(batch.q, batch.cache, 0))


# (attention, sink, cap, GQA group, block size, dtype)
TRITON_CASES = [
    ("window", True, 4.0, 4, 16, torch.float32),
    ("chunk", True, None, 1, 1, torch.float32),
    ("window", False, None, 1, 32, torch.float32),
    ("chunk", False, 4.0, 4, 32, torch.float32),
    ("full", True, None, 4, 16, torch.float32),
    ("window", True, None, 4, 16, torch.float16),
]


@pytest.mark.parametrize(("kind", "sink", "cap", "group", "bs", "dtype"), TRITON_CASES)
def test_triton_matches_masked_dense(
    kind: str, sink: bool, cap: float | None, group: int, bs: int, dtype: torch.dtype
) -> None:
    hkv, dim = 2, 16
    attention = attention_of(kind, bs)
    batch = windowed_batch(
        7 + bs, attention, SHAPES, hq=hkv * group, hkv=hkv, dim=dim, bs=bs, dtype=dtype
    )
    batch.q *= 2
    sinks = torch.linspace(-1.0, 2.0, hkv * group) if sink else None
    attn = PagedAttention(
        hkv * group,
        hkv,
        dim,
        bs,
        "triton",
        device=DEVICE,
        dtype=dtype,
        logits_soft_cap=cap,
        sinks=sink,
    )
    attn.plan(batch.plan)
    out = attn.run(
        batch.q.to(DEVICE),
        on_device(batch.cache),
        0,
        sinks=None if sinks is None else sinks.to(DEVICE, dtype),
    ).cpu()
    want_sinks = None if sinks is None else sinks.to(dtype)
    assert_close(out, batch.expected(dim**-0.5, cap, want_sinks), dtype)


@pytest.mark.parametrize(
    "attention", [Attention.sliding_window(WINDOW), Attention.chunked_local(32)]
)
def test_triton_long_prefill_starts_each_tile_at_its_first_key(attention: Attention) -> None:
    # 70 query tokens x group 4 = 280 rows: five 64-row tiles, whose first keys differ.
    batch = windowed_batch(
        5, attention, [(150, 70), (9, 1)], hq=8, hkv=2, dim=16, bs=16, dtype=torch.float32
    )
    sinks = torch.linspace(-2.0, 1.0, 8)
    attn = PagedAttention(8, 2, 16, 16, "triton", device=DEVICE, dtype=torch.float32, sinks=True)
    attn.plan(batch.plan)
    out = attn.run(batch.q.to(DEVICE), on_device(batch.cache), 0, sinks=sinks.to(DEVICE)).cpu()
    assert_close(out, batch.expected(0.25, None, sinks), torch.float32)


def test_graph_buckets_serve_one_attention() -> None:
    """Windowed decode steps go through the graph buffers and match eager; a step of another
    attention runs eagerly, since a captured launch keeps its window."""
    hq, hkv, dim, bs = 8, 2, 16, 4
    window = Attention.sliding_window(6)
    sinks = torch.linspace(-1.0, 1.0, hq).to(DEVICE)

    def attention(**kw: object) -> PagedAttention:
        return PagedAttention(
            hq,
            hkv,
            dim,
            bs,
            "triton",
            device=DEVICE,
            dtype=torch.float32,
            sinks=True,
            **kw,  # type: ignore[arg-type]
        )

    graphed = attention(cuda_graph_batch_sizes=(4,), cuda_graph_max_pages=64)
    eager = attention()
    for seed in (1, 2):
        batch = windowed_batch(
            seed, window, [(30, 1), (7, 1), (13, 1)], hq=hq, hkv=hkv, dim=dim, bs=bs
        )
        cache = on_device(batch.cache)
        graphed.plan(batch.plan)
        assert graphed.graph_batch_size == 4
        q = batch.q.to(DEVICE)
        out = graphed.run(torch.cat([q, q.new_zeros(1, hq, dim)]), cache, 0, sinks=sinks)
        eager.plan(batch.plan)
        want = eager.run(q, cache, 0, sinks=sinks)
        torch.testing.assert_close(out[:3], want, atol=1e-6, rtol=1e-6)
        assert_close(out[:3].cpu(), batch.expected(dim**-0.5, None, sinks.cpu()), torch.float32)
    full = windowed_batch(3, Attention.full(), [(30, 1)], hq=hq, hkv=hkv, dim=dim, bs=bs)
    graphed.plan(full.plan)
    assert graphed.graph_batch_size is None


def test_bad_sinks_and_attention_name_the_argument() -> None:
    batch = windowed_batch(1, Attention.full(), [(5, 2)], hq=4, hkv=2, dim=8, bs=4)
    with_sinks = PagedAttention(4, 2, 8, 4, "torch", dtype=torch.float32, sinks=True)
    without = PagedAttention(4, 2, 8, 4, "torch", dtype=torch.float32)
    for attn in (with_sinks, without):
        attn.plan(batch.plan)
    with pytest.raises(ValueError, match="sinks"):
        with_sinks.run(batch.q, batch.cache, 0)
    with pytest.raises(ValueError, match="sinks"):
        without.run(batch.q, batch.cache, 0, sinks=torch.zeros(4))
    for bad in (torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="sinks"):
            with_sinks.run(batch.q, batch.cache, 0, sinks=bad)
    with pytest.raises(ValueError, match="attention"):
        PagedAttention(4, 2, 8, 4, dtype=torch.float32, attention="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sinks must be True or False"):
        PagedAttention(4, 2, 8, 4, dtype=torch.float32, sinks=torch.zeros(4))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Plans from real windowed managers: each group's attention over its own pages must equal dense
# masked attention over the whole sequence.

GROUPS = [Attention.full(), Attention.sliding_window(6), Attention.chunked_local(8)]


class Engine:
    """Runs every group's plans through `PagedAttention` and checks them against dense masked
    attention; layer `g` of the cache holds group `g`'s K/V (the groups share one block pool)."""

    def __init__(self, manager: BlockManager | HybridManager, backend: BackendName) -> None:
        self.manager = manager
        self.groups = manager.groups if isinstance(manager, HybridManager) else [manager.attention]
        self.bs, self.hkv, self.group, self.dim = 4, 2, 2, 8
        hq = self.hkv * self.group
        self.cache = KVCache(len(self.groups), 64, self.bs, self.hkv, self.dim, torch.float32)
        self.attns = [
            PagedAttention(
                hq,
                self.hkv,
                self.dim,
                self.bs,
                backend,
                dtype=torch.float32,
                attention=g,
                sinks=True,
                logits_soft_cap=5.0,
            )
            for g in self.groups
        ]
        self.kv = PrefixKV(len(self.groups), self.hkv, self.dim, seed=3)
        self.sinks = torch.linspace(-1.0, 1.5, hq)
        self.tokens: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.steps = 0

    def _plans(self, plans: Plan | list[Plan]) -> list[Plan]:
        return plans if isinstance(plans, list) else [plans]

    def plan(self, seqs: list[int], q_lens: list[int]) -> None:
        self.check(seqs, q_lens, self._plans(self.manager.plan(seqs, q_lens)))

    def step(self, seqs: list[int], new: list[int]) -> None:
        for s, t in zip(seqs, new, strict=True):
            self.tokens[s].append(t)
        self.check(seqs, [1] * len(seqs), self._plans(self.manager.step(seqs, new)))

    def check(
        self,
        seqs: list[int],
        q_lens: list[int],
        plans: Sequence[Plan | Batch],
        tables: Sequence[DeviceBlockTable] | None = None,
    ) -> None:
        hq = self.hkv * self.group
        q = torch.randn(sum(q_lens), hq, self.dim, generator=self.gen) * 3
        for g, (attention, plan, attn) in enumerate(
            zip(self.groups, plans, self.attns, strict=True)
        ):
            assert plan.attention == attention
            self.cache.copy_blocks(plan.copies)
            new_k, new_v, want, offset = [], [], [], 0
            for s, q_len in zip(seqs, q_lens, strict=True):
                k, v = self.kv.dense(self.tokens[s], g)
                new_k.append(k[-q_len:])
                new_v.append(v[-q_len:])
                length = len(self.tokens[s])
                mask = allowed_keys(attention, torch.arange(length - q_len, length), length)
                qs = q[offset : offset + q_len]
                want.append(masked_dense(qs, k, v, mask, self.dim**-0.5, 5.0, self.sinks))
                offset += q_len
            self.cache.write(g, torch.cat(new_k), torch.cat(new_v), plan)
            if tables is None:
                attn.plan(plan)
            else:
                assert isinstance(plan, Batch)
                attn.plan(plan, table=tables[g])
            out = attn.run(q, self.cache, g, sinks=self.sinks)
            assert_close(out, torch.cat(want), torch.float32)
        self.steps += 1
        self.manager.check()

    def first_blocks(self, seq: int) -> list[int]:
        m = self.manager
        if isinstance(m, HybridManager):
            return [m.first_block(seq, g) for g in range(m.num_groups)]
        return [m.first_block(seq)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["hybrid", "window"])
def test_manager_plans_match_dense_masked_attention(kind: str, backend: BackendName) -> None:
    if backend == "triton" and DEVICE == "cuda":
        pytest.skip("the engine runs on the CPU cache; test_triton_* cover CUDA")
    key = bytes(range(32))
    manager: BlockManager | HybridManager
    if kind == "hybrid":
        manager = HybridManager(64, 4, GROUPS, hash_key=key, watermark=0.0)
    else:
        manager = BlockManager(64, 4, attention=GROUPS[1], hash_key=key, watermark=0.0)
    engine = Engine(manager, backend)
    rng = np.random.default_rng(5)
    prompt = [int(x) for x in rng.integers(0, 50, 22)]
    # Prefill in two chunks, then decode until blocks leave the window.
    assert manager.allocate(1, prompt[:9]) == 0
    engine.tokens[1] = prompt[:9]
    engine.plan([1], [9])
    manager.append(1, prompt[9:])
    engine.tokens[1] = list(prompt)
    engine.plan([1], [13])
    for _ in range(6):
        engine.step([1], [int(rng.integers(0, 50))])
    assert max(engine.first_blocks(1)) > 0
    # A prefix hit on the first request's prompt, prefilled next to a decode of the first.
    second = prompt[:17] + [int(x) for x in rng.integers(0, 50, 6)]
    hit = manager.allocate(2, second)
    assert hit > 0
    engine.tokens[2] = list(second)
    token = int(rng.integers(0, 50))
    manager.append(1, [token])
    engine.tokens[1].append(token)
    engine.plan([1, 2], [1, len(second) - hit])
    for _ in range(4):
        engine.step([1, 2], [int(x) for x in rng.integers(0, 50, 2)])
    # The first request leaves; a third one resumes at the end of its prompt.
    manager.free(1)
    third = prompt + [int(x) for x in rng.integers(0, 50, 3)]
    hit = manager.allocate(3, third)
    assert hit >= 16
    engine.tokens[3] = list(third)
    engine.plan([3], [len(third) - hit])
    engine.step([2, 3], [int(x) for x in rng.integers(0, 50, 2)])
    assert engine.steps == 15


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_persistent_batches_of_every_group_with_device_tables(backend: BackendName) -> None:
    """`step_batch` keeps one `Batch` per group; each group's pages, built on the device from
    its table (which drops the blocks that left the window), give the dense masked output."""
    if backend == "triton" and DEVICE == "cuda":
        pytest.skip("the engine runs on the CPU cache; test_triton_* cover CUDA")
    manager = HybridManager(64, 4, GROUPS, hash_key=bytes(32), watermark=0.0)
    engine = Engine(manager, backend)
    rng = np.random.default_rng(9)
    for seq, n in ((1, 10), (2, 3)):
        engine.tokens[seq] = [int(x) for x in rng.integers(0, 50, n)]
        manager.allocate(seq, engine.tokens[seq])
    engine.plan([1, 2], [10, 3])
    batches = [Batch() for _ in GROUPS]
    tables = [DeviceBlockTable("cpu") for _ in GROUPS]
    for b in batches:
        b.add(1)
        b.add(2)
    for _ in range(12):
        new = [int(x) for x in rng.integers(0, 50, 2)]
        manager.step_batch(batches, new)
        for seq, t in zip((1, 2), new, strict=True):
            engine.tokens[seq].append(t)
        engine.check([1, 2], [1, 1], batches, tables)
    assert manager.first_block(1, 1) > 0 and manager.first_block(1, 2) > 0
