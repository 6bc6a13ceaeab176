"""`backend="triton"` against dense attention, and its CUDA-graph buckets.

Without CUDA the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, set by conftest.py
before Triton is first imported), so CI executes the exact kernel code on the CPU; shapes are
small to keep that fast. With CUDA the same tests run the compiled kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_cases import MIXES, assert_close, expected_output, random_batch

from pagedkv.attention import PagedAttention, plan_from_tables
from pagedkv.kv_cache import KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_attention(
    hq: int, hkv: int, dim: int, bs: int, dtype: torch.dtype, **kwargs: object
) -> PagedAttention:
    return PagedAttention(hq, hkv, dim, bs, "triton", device=DEVICE, dtype=dtype, **kwargs)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_triton_matches_dense(mix: str, group: int, bs: int) -> None:
    hkv, dim, dtype = 2, 16, torch.float32
    batch = random_batch(
        bs * 5 + group, MIXES[mix], hq=hkv * group, hkv=hkv, dim=dim, bs=bs, dtype=dtype
    )
    attn = triton_attention(hkv * group, hkv, dim, bs, dtype)
    attn.plan(batch.plan)
    out = attn.run(batch.q.to(DEVICE), on_device(batch.cache), 0).cpu()
    assert_close(out, expected_output(batch, dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(dtype: torch.dtype) -> None:
    batch = random_batch(2, MIXES["mixed"], hq=8, hkv=2, dim=32, bs=16, dtype=dtype)
    attn = triton_attention(8, 2, 32, 16, dtype)
    attn.plan(batch.plan)
    out = attn.run(batch.q.to(DEVICE), on_device(batch.cache), 0).cpu()
    assert out.dtype == dtype
    assert_close(out, expected_output(batch, 32**-0.5), dtype)


def test_triton_scale_soft_cap_and_odd_head_dim() -> None:
    dim = 24  # not a power of two: the kernel pads it to 32 and masks
    batch = random_batch(4, MIXES["mixed"], hq=8, hkv=2, dim=dim, bs=16, dtype=torch.float32)
    batch.q *= 6  # large logits, so the cap matters
    for scale, cap in ((0.05, None), (0.3, 5.0)):
        attn = triton_attention(8, 2, dim, 16, torch.float32, sm_scale=scale, logits_soft_cap=cap)
        attn.plan(batch.plan)
        out = attn.run(batch.q.to(DEVICE), on_device(batch.cache), 0).cpu()
        assert_close(out, expected_output(batch, scale, cap), torch.float32)


def test_triton_long_prefill_spans_tiles() -> None:
    # 70 query tokens x group 4 = 280 rows: five 64-row tiles of one sequence, 3 KV chunks.
    batch = random_batch(6, [(150, 70), (9, 1)], hq=8, hkv=2, dim=16, bs=16, dtype=torch.float32)
    attn = triton_attention(8, 2, 16, 16, torch.float32)
    attn.plan(batch.plan)
    out = attn.run(batch.q.to(DEVICE), on_device(batch.cache), 0).cpu()
    assert_close(out, expected_output(batch, 0.25), torch.float32)


def test_graph_buckets_pad_decode_into_fixed_buffers() -> None:
    """Decode steps planned into a bucket reuse its buffers and match eager; others run eager."""
    hq, hkv, dim, bs, dtype = 8, 2, 16, 4, torch.float32
    attn = triton_attention(
        hq, hkv, dim, bs, dtype, cuda_graph_batch_sizes=(2, 4), cuda_graph_max_pages=64
    )
    eager = triton_attention(hq, hkv, dim, bs, dtype)
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(1, 40, bs, hkv, dim, dtype)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen))
    cache = on_device(cache)
    rng = np.random.default_rng(0)
    pointers = set()
    for batch_size in (3, 1, 4, 3):
        kv_lens = [int(x) for x in rng.integers(1, 30, batch_size)]
        tables = [rng.permutation(40)[:8] for _ in range(batch_size)]
        plan = plan_from_tables(tables, kv_lens, [1] * batch_size, bs)
        attn.plan(plan)
        padded = attn.graph_batch_size
        assert padded == (2 if batch_size == 1 else 4)
        q = torch.randn(batch_size, hq, dim, generator=gen)
        q_padded = torch.cat([q, torch.zeros(padded - batch_size, hq, dim)]).to(DEVICE)
        out = attn.run(q_padded, cache, 0)
        eager.plan(plan)
        want = eager.run(q.to(DEVICE), cache, 0)
        torch.testing.assert_close(out[:batch_size], want, atol=1e-6, rtol=1e-6)
        if padded == 4:
            pointers.add(attn._impl._step.kv_indices.data_ptr())  # type: ignore[attr-defined]
    assert len(pointers) == 1  # every size-4 step read the same fixed index buffer
    # Prefill and batches past the largest bucket run eagerly.
    attn.plan(plan_from_tables([[0, 1]], [5], [2], bs))
    assert attn.graph_batch_size is None
    attn.plan(plan_from_tables([[i] for i in range(5)], [1] * 5, [1] * 5, bs))
    assert attn.graph_batch_size is None


def test_triton_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        PagedAttention(4, 2, 16, 16, "triton", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="float64"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        PagedAttention(4, 2, 16, 16, "triton", device="cpu", dtype=torch.float64)
