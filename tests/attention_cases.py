"""Shared attention test data: random paged batches and dense attention to check them against.

Used by `test_attention.py` (the torch reference, FlashInfer), `test_triton_attention.py`,
`test_attention_windows.py` and `test_grouped_cache.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv import Attention
from pagedkv.attention import TablePlan, plan_from_tables
from pagedkv.kv_cache import FP8_DTYPES, KVCache
from pagedkv.kv_layout import Layout

TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def full_plan(tables: Sequence[Sequence[int]], kv_lens: Sequence[int], bs: int) -> TablePlan:
    """A plan whose queries are every KV token: its slot_mapping writes whole sequences."""
    return plan_from_tables(tables, kv_lens, kv_lens, bs)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal (bottom-right) attention of `q` `[q, hq, d]` over `k` `[kv, hkv, d]` and `v`
    `[kv, hkv, dv]`, in float64."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.double().transpose(0, 1)  # [hq, q, d]
    kh = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vh = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    i = torch.arange(q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    mask = j <= kv_len - q_len + i
    if soft_cap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        logits = soft_cap * torch.tanh(qh @ kh.transpose(1, 2) * scale / soft_cap)
        out = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1) @ vh
    return out.transpose(0, 1)


def allowed_keys(attention: Attention, q_pos: torch.Tensor, length: int) -> torch.Tensor:
    """`[q, length]`: which absolute key positions each query position reads."""
    t = torch.arange(length)[None, :]
    p = q_pos[:, None]
    mask = t <= p
    if attention.window is not None:
        mask &= p - t < attention.window
    if attention.chunk is not None:
        mask &= t // attention.chunk == p // attention.chunk
    return mask


def masked_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q` `[q, hq, d]` over `k`, `v` `[kv, hkv, d]` under `mask` `[q, kv]`, in
    float64; `sinks` `[hq]` join each head's softmax as a logit without a value (gpt-oss)."""
    group = q.shape[1] // k.shape[1]
    kh = k.double().repeat_interleave(group, dim=1)
    vh = v.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    logits = logits.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, vh)


@dataclass
class Batch:
    """Random dense K/V placed in a paged cache, and the step plan that queries it."""

    cache: KVCache
    plan: TablePlan
    q: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence, per layer 0
    dense_v: list[torch.Tensor]
    q_lens: list[int]


def as_stored(
    x: torch.Tensor, dtype: torch.dtype, kv_dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """`x` in the query dtype, as a `kv_dtype` cache gives it back (float8: saturated, rounded
    and scaled back), in float64: what dense attention on the dequantized KV reads."""
    x = x.to(dtype)
    if kv_dtype in FP8_DTYPES:
        limit = torch.finfo(kv_dtype).max
        x = (x.double() / scale).clamp(-limit, limit).to(kv_dtype).double() * scale
    return x.double()


def random_batch(
    seed: int,
    shapes: Sequence[tuple[int, int]],
    *,
    hq: int,
    hkv: int,
    dim: int,
    bs: int,
    dtype: torch.dtype,
    shared_prefix_blocks: int = 0,
    layout: Layout = "NHD",
    kv_dtype: torch.dtype | None = None,
    rope_dim: int = 0,
    scales: tuple[float, float] = (1.0, 1.0),
) -> Batch:
    """Sequences `(kv_len, q_len)` on randomly permuted blocks; optionally sharing prefix blocks.

    With `shared_prefix_blocks = s`, every sequence long enough reuses sequence 0's first `s`
    physical blocks and their K/V, as a prefix cache hit would. `layout`, `kv_dtype` (default
    `dtype`), `rope_dim` and `scales` (of a float8 cache) pick the cache; for MLA, `hkv` is 1, K
    is the latent and its rope part and V the latent. The dense K/V are what the cache holds,
    dequantized.
    """
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    needed = sum(math.ceil(kv / bs) for kv, _ in shapes) + 3
    num_blocks = needed + 5
    order = [int(x) for x in rng.permutation(num_blocks)]
    tables: list[list[int]] = []
    raw_k: list[torch.Tensor] = []
    raw_v: list[torch.Tensor] = []
    for b, (kv_len, _) in enumerate(shapes):
        n = math.ceil(kv_len / bs)
        k = torch.randn(kv_len, hkv, dim + rope_dim, generator=gen)
        v = torch.randn(kv_len, hkv, dim, generator=gen)
        shared = min(shared_prefix_blocks, (kv_len - 1) // bs, shapes[0][0] // bs) if b else 0
        table = tables[0][:shared] if shared else []
        if shared:
            k[: shared * bs] = raw_k[0][: shared * bs]
            v[: shared * bs] = raw_v[0][: shared * bs]
        table = table + [order.pop() for _ in range(n - shared)]
        tables.append(table)
        raw_k.append(k)
        raw_v.append(v)
    fp8 = kv_dtype in FP8_DTYPES
    cache = KVCache(
        1,
        num_blocks,
        bs,
        hkv,
        dim,
        dtype=kv_dtype,
        layout=layout,
        rope_dim=rope_dim,
        scales=[scales] if fp8 else None,
    )
    kv_lens = [kv for kv, _ in shapes]
    k_all, v_all = torch.cat(raw_k).to(dtype), torch.cat(raw_v).to(dtype)
    full = full_plan(tables, kv_lens, bs)
    if layout == "MLA":
        cache.write_latent(0, k_all[:, 0, :dim], k_all[:, 0, dim:], full)
        dense_k = [
            torch.cat(
                [
                    as_stored(k[..., :dim], dtype, kv_dtype, scales[0]),
                    as_stored(k[..., dim:], dtype, kv_dtype, scales[1]),
                ],
                dim=-1,
            )
            for k in raw_k
        ]
        dense_v = [k[..., :dim] for k in dense_k]
    else:
        cache.write(0, k_all, v_all, full)
        dense_k = [as_stored(k, dtype, kv_dtype, scales[0]) for k in raw_k]
        dense_v = [as_stored(v, dtype, kv_dtype, scales[1]) for v in raw_v]
    q_lens = [q for _, q in shapes]
    plan = plan_from_tables(tables, kv_lens, q_lens, bs)
    q = torch.randn(sum(q_lens), hq, dim + rope_dim, generator=gen).to(dtype)
    return Batch(cache, plan, q, dense_k, dense_v, q_lens)


class PrefixKV:
    """K/V of position p = a fixed random vector picked by a rolling hash of tokens[: p + 1]."""

    def __init__(self, layers: int, hkv: int, dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(layers, 2, 4099, hkv, dim, generator=gen)

    def dense(self, tokens: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, h = [], 0
        for t in tokens:
            h = (h * 1_000_003 + t + 1) % 4099
            keys.append(h)
        idx = torch.tensor(keys)
        return self.table[layer, 0, idx], self.table[layer, 1, idx]


def expected_output(batch: Batch, scale: float, soft_cap: float | None = None) -> torch.Tensor:
    outs = []
    offset = 0
    for k, v, q_len in zip(batch.dense_k, batch.dense_v, batch.q_lens, strict=True):
        outs.append(dense_attention(batch.q[offset : offset + q_len], k, v, scale, soft_cap))
        offset += q_len
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


MIXES = {
    "decode": [(37, 1), (1, 1), (64, 1), (5, 1)],
    "prefill": [(13, 13), (1, 1), (40, 40)],
    "chunked": [(50, 7), (33, 33), (17, 16)],
    "mixed": [(70, 1), (21, 21), (45, 9), (2, 1), (16, 16), (3, 2)],
}
