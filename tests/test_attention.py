"""PagedAttention against dense attention over the unpaged K/V.

Hand-built plans cover the plan semantics on their own (random block placement, GQA, block
sizes, decode / prefill / chunked prefill / mixed batches, soft cap, validation); a random
engine simulation drives the real `BlockManager` (prefix hits, forks with copy-on-write, swaps)
and checks every step. CUDA tests compare FlashInfer with the reference and skip without CUDA or
FlashInfer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_cases import (
    MIXES,
    PrefixKV,
    assert_close,
    dense_attention,
    expected_output,
    full_plan,
    random_batch,
)

from pagedkv.attention import PagedAttention, TablePlan, plan_from_tables
from pagedkv.kv_cache import KVCache

# Every batch shape in float32; the half-precision dtypes on the mixed batch, which has them all.
DTYPE_MIXES = [(torch.float32, mix) for mix in sorted(MIXES)] + [
    (torch.float16, "mixed"),
    (torch.bfloat16, "mixed"),
]


@pytest.mark.parametrize(("dtype", "mix"), DTYPE_MIXES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_reference_matches_dense(dtype: torch.dtype, group: int, bs: int, mix: str) -> None:
    hkv, dim = 2, 16
    batch = random_batch(
        bs * 7 + group, MIXES[mix], hq=hkv * group, hkv=hkv, dim=dim, bs=bs, dtype=dtype
    )
    attn = PagedAttention(hkv * group, hkv, dim, bs, backend="torch", dtype=dtype)
    attn.plan(batch.plan)
    out = attn.run(batch.q, batch.cache, 0)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_close(out, expected_output(batch, 1 / math.sqrt(dim)), dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches_with_shared_prefix(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 16, 32]))
    group = int(rng.choice([1, 4, 8]))
    shapes = []
    for _ in range(int(rng.integers(1, 9))):
        kv_len = int(rng.integers(1, 120))
        q_len = 1 if rng.random() < 0.5 else int(rng.integers(1, kv_len + 1))
        shapes.append((kv_len, q_len))
    batch = random_batch(
        seed, shapes, hq=2 * group, hkv=2, dim=8, bs=bs, dtype=torch.float32, shared_prefix_blocks=3
    )
    attn = PagedAttention(2 * group, 2, 8, bs, backend="torch", dtype=torch.float32)
    attn.plan(batch.plan)
    assert_close(attn.run(batch.q, batch.cache, 0), expected_output(batch, 8**-0.5), torch.float32)


def test_sm_scale_and_soft_cap() -> None:
    shapes = MIXES["mixed"]
    batch = random_batch(3, shapes, hq=8, hkv=2, dim=16, bs=16, dtype=torch.float32)
    batch.q *= 6  # large logits, so the cap changes the result
    for scale, cap in ((0.05, None), (0.3, 5.0), (None, 2.0)):
        attn = PagedAttention(
            8, 2, 16, 16, backend="torch", dtype=torch.float32, sm_scale=scale, logits_soft_cap=cap
        )
        attn.plan(batch.plan)
        want = expected_output(batch, scale if scale is not None else 0.25, cap)
        assert_close(attn.run(batch.q, batch.cache, 0), want, torch.float32)
    uncapped = expected_output(batch, 0.3)
    assert not torch.allclose(uncapped, expected_output(batch, 0.3, 5.0), atol=1e-3)


def test_one_plan_serves_every_layer() -> None:
    bs, hkv, dim = 4, 1, 8
    tables, kv_lens, q_lens = [[2, 0], [1]], [6, 3], [2, 1]
    cache = KVCache(2, 3, bs, hkv, dim, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    dense = {}
    for layer in range(2):
        k = torch.randn(9, hkv, dim, generator=gen)
        v = torch.randn(9, hkv, dim, generator=gen)
        cache.write(layer, k, v, full_plan(tables, kv_lens, bs))
        dense[layer] = (k, v)
    plan = plan_from_tables(tables, kv_lens, q_lens, bs)
    attn = PagedAttention(2, hkv, dim, bs, backend="torch", dtype=torch.float32)
    attn.plan(plan)
    q = torch.randn(3, 2, dim, generator=gen)
    for layer, (k, v) in dense.items():
        want = torch.cat(
            [
                dense_attention(q[:2], k[:6], v[:6], dim**-0.5),
                dense_attention(q[2:], k[6:], v[6:], dim**-0.5),
            ]
        )
        assert_close(attn.run(q, cache, layer), want, torch.float32)


def test_padded_rows_and_positions_are_not_mixed_between_sequences() -> None:
    # Equal queries over different KV must give different outputs: a gather that ignored the
    # page table would not notice.
    bs = 2
    batch = random_batch(11, [(5, 2), (5, 2)], hq=1, hkv=1, dim=4, bs=bs, dtype=torch.float32)
    batch.q[2:] = batch.q[:2]
    attn = PagedAttention(1, 1, 4, bs, backend="torch", dtype=torch.float32)
    attn.plan(batch.plan)
    out = attn.run(batch.q, batch.cache, 0)
    assert not torch.allclose(out[:2], out[2:])
    assert_close(out, expected_output(batch, 0.5), torch.float32)


class TestValidation:
    def attn(self) -> PagedAttention:
        return PagedAttention(4, 2, 8, 4, backend="torch", dtype=torch.float32)

    def plan(self) -> TablePlan:
        return plan_from_tables([[0, 1], [2]], [6, 3], [2, 1], 4)

    def test_constructor(self) -> None:
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            PagedAttention(6, 4, 8, 16)
        with pytest.raises(ValueError, match="head_dim"):
            PagedAttention(4, 4, 0, 16)
        with pytest.raises(ValueError, match="backend"):
            PagedAttention(4, 4, 8, 16, backend="cuda")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="logits_soft_cap"):
            PagedAttention(4, 4, 8, 16, logits_soft_cap=0.0)
        with pytest.raises(ValueError, match="sm_scale"):
            PagedAttention(4, 4, 8, 16, sm_scale=-1.0)
        with pytest.raises(ValueError, match="CUDA"):
            PagedAttention(4, 4, 8, 16, backend="flashinfer", device="cpu")

    def test_run_before_plan(self) -> None:
        cache = KVCache(1, 3, 4, 2, 8, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="plan"):
            self.attn().run(torch.zeros(3, 4, 8), cache, 0)

    @pytest.mark.parametrize(
        ("field_name", "value", "message"),
        [
            ("kv_last_page_len", [5, 3], "kv_last_page_len"),
            ("kv_last_page_len", [0, 3], "kv_last_page_len"),
            ("kv_indptr", [0, 2, 2], "at least one page"),
            ("kv_indptr", [0, 2, 4], "kv_indices"),
            ("qo_indptr", [0, 2, 2], "query token"),
            ("qo_indptr", [0, 2], "batch"),
            ("qo_indptr", [0, 2, 6], "tail of the KV"),
            ("kv_indices", [0, -1, 2], "negative"),
            ("kv_indices", [0.0, 1.0, 2.0], "integers"),
        ],
    )
    def test_bad_plans(self, field_name: str, value: list[float], message: str) -> None:
        plan = self.plan()
        setattr(plan, field_name, np.asarray(value))
        with pytest.raises(ValueError, match=message):
            self.attn().plan(plan)

    def test_run_checks_inputs(self) -> None:
        attn = self.attn()
        attn.plan(self.plan())
        cache = KVCache(1, 3, 4, 2, 8, dtype=torch.float32)
        with pytest.raises(ValueError, match="shape"):
            attn.run(torch.zeros(4, 4, 8), cache, 0)
        with pytest.raises(ValueError, match="float16"):
            attn.run(torch.zeros(3, 4, 8, dtype=torch.float16), cache, 0)
        with pytest.raises(ValueError, match="block_size"):
            attn.run(torch.zeros(3, 4, 8), KVCache(1, 3, 8, 2, 8, dtype=torch.float32), 0)
        with pytest.raises(ValueError, match="references block 2"):
            attn.run(torch.zeros(3, 4, 8), KVCache(1, 2, 4, 2, 8, dtype=torch.float32), 0)
        with pytest.raises(IndexError, match="layer 1"):
            attn.run(torch.zeros(3, 4, 8), cache, 1)


# ---------------------------------------------------------------------------------------------
# The real BlockManager: a random engine whose KV for a token is a function of its prefix, as a
# model's is, so prefix-cache hits, copy-on-write and swaps must all preserve it exactly.


def test_block_manager_engine_with_prefix_hits_forks_and_swaps() -> None:
    from pagedkv import BlockManager, OutOfBlocks

    bs, hkv, group, dim, layers = 4, 2, 4, 8, 2
    mgr = BlockManager(48, bs, num_cpu_blocks=32, watermark=0.0)
    gpu = KVCache(layers, 48, bs, hkv, dim, dtype=torch.float32)
    cpu = KVCache(layers, 32, bs, hkv, dim, dtype=torch.float32)
    attn = PagedAttention(hkv * group, hkv, dim, bs, backend="torch", dtype=torch.float32)
    kv = PrefixKV(layers, hkv, dim, seed=1)
    rng = np.random.default_rng(7)
    prefixes = [list(rng.integers(0, 50, 9)), list(rng.integers(0, 50, 13))]
    tokens: dict[int, list[int]] = {}
    pending: dict[int, int] = {}  # sequence -> query tokens it brings to the next step
    swapped: set[int] = set()
    next_id = 0
    seen = {"hit": 0, "cow": 0, "swap": 0, "fork": 0, "steps": 0}

    for _ in range(40):
        running = [s for s in tokens if s not in swapped]
        # Admissions: prompts often start with a shared prefix.
        for _ in range(int(rng.integers(0, 3))):
            prompt = list(prefixes[int(rng.integers(0, 2))]) if rng.random() < 0.7 else []
            prompt += [int(x) for x in rng.integers(0, 50, int(rng.integers(1, 8)))]
            if not mgr.can_allocate(prompt):
                break
            hit = mgr.allocate(next_id, prompt)
            seen["hit"] += hit
            tokens[next_id] = prompt
            pending[next_id] = len(prompt) - hit
            next_id += 1
        # A fork shares every block, the partial last one included.
        if running and rng.random() < 0.3:
            parent = int(rng.choice(running))
            if parent not in pending:
                mgr.fork(parent, next_id)
                tokens[next_id] = list(tokens[parent])
                seen["fork"] += 1
                next_id += 1
        # Swap one running sequence out, or one back in.
        if swapped and rng.random() < 0.5:
            seq = swapped.pop()
            try:
                pairs = mgr.swap_in([seq])
            except OutOfBlocks:
                swapped.add(seq)
            else:
                gpu.swap_in(cpu, pairs)
                mgr.confirm_swap_in([seq])
        elif running and rng.random() < 0.2:
            seq = int(rng.choice(running))
            if seq not in pending:
                pairs = mgr.swap_out([seq])
                gpu.swap_out(cpu, pairs)
                mgr.confirm_swap_out([seq])
                swapped.add(seq)
                seen["swap"] += 1
        # Retire some sequences.
        for seq in list(tokens):
            if seq not in pending and seq not in swapped and rng.random() < 0.08:
                mgr.free(seq)
                del tokens[seq]
        # Everyone on the GPU without pending prefill grows by 1 (decode) or a chunk.
        batch = [s for s in tokens if s not in swapped]
        for seq in batch:
            if seq in pending:
                continue
            grow = 1 if rng.random() < 0.7 else int(rng.integers(2, 6))
            new = [int(x) for x in rng.integers(0, 50, grow)]
            try:
                mgr.append(seq, new)
            except OutOfBlocks:
                continue
            tokens[seq] += new
            pending[seq] = grow
        batch = [s for s in batch if s in pending]
        if not batch:
            continue
        q_lens = [pending.pop(s) for s in batch]
        plan = mgr.plan(batch, q_lens)
        seen["cow"] += len(plan.copies)
        gpu.copy_blocks(plan.copies)
        attn.plan(plan)
        seen["steps"] += 1
        total = sum(q_lens)
        q = torch.from_numpy(rng.standard_normal((total, hkv * group, dim))).float()
        for layer in range(layers):
            new_k, new_v = [], []
            for seq, q_len in zip(batch, q_lens, strict=True):
                k, v = kv.dense(tokens[seq], layer)
                new_k.append(k[-q_len:])
                new_v.append(v[-q_len:])
            gpu.write(layer, torch.cat(new_k), torch.cat(new_v), plan)
            out = attn.run(q, gpu, layer)
            offset, want = 0, []
            for seq, q_len in zip(batch, q_lens, strict=True):
                k, v = kv.dense(tokens[seq], layer)
                want.append(dense_attention(q[offset : offset + q_len], k, v, dim**-0.5))
                offset += q_len
            assert_close(out, torch.cat(want), torch.float32)
        mgr.check()

    assert seen["hit"] > 0 and seen["cow"] > 0 and seen["swap"] > 0 and seen["fork"] > 0
    assert seen["steps"] > 20


# ---------------------------------------------------------------------------------------------
# CUDA: FlashInfer against the reference on the same plan.

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("cap", [None, 30.0])
def test_flashinfer_matches_reference(mix: str, cap: float | None) -> None:
    pytest.importorskip("flashinfer")
    hq, hkv, dim, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    batch = random_batch(5, MIXES[mix], hq=hq, hkv=hkv, dim=dim, bs=bs, dtype=dtype)
    cache = KVCache(1, batch.cache.num_blocks, bs, hkv, dim, dtype=dtype, device="cuda")
    cache.layer(0).copy_(batch.cache.layer(0))
    q = batch.q.cuda()
    outs = {}
    for backend in ("flashinfer", "torch"):
        attn = PagedAttention(
            hq, hkv, dim, bs, backend=backend, device="cuda", dtype=dtype, logits_soft_cap=cap
        )
        attn.plan(batch.plan)
        outs[backend] = attn.run(q, cache, 0).float()
    fi, ref = outs["flashinfer"], outs["torch"]
    assert not torch.isnan(fi).any()
    assert (fi - ref).norm() / ref.norm() < 1e-2


def test_plan_from_tables_matches_the_manager() -> None:
    from pagedkv import BlockManager
    from pagedkv.attention import random_tables

    mgr = BlockManager(32, 4)
    mgr.allocate(1, list(range(9)))
    mgr.allocate(2, list(range(50, 53)))
    real = mgr.plan([1, 2], [9, 3])
    tables = [mgr.block_table(1), mgr.block_table(2)]
    built = plan_from_tables(tables, [9, 3], [9, 3], 4)
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "qo_indptr", "slot_mapping"):
        assert np.array_equal(getattr(built, name), getattr(real, name)), name
    assert np.array_equal(built.positions, real.positions)
    with pytest.raises(ValueError, match="1 <= q_len <= kv_len"):
        plan_from_tables([[0]], [3], [4], 4)
    with pytest.raises(ValueError, match="shorter"):
        plan_from_tables([[0]], [5], [1], 4)
    with pytest.raises(ValueError, match="the pool has 2"):
        random_tables([9], 4, 2, seed=0)
    spread = random_tables([9, 1], 4, 10, seed=0)
    assert [len(t) for t in spread] == [3, 1] and len(set(np.concatenate(spread))) == 4
