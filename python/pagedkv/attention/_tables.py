"""A `Plan`-shaped step built from explicit block tables, without a `BlockManager`.

Tests and benchmarks use it to place sequences on chosen blocks; an engine that keeps its own
block tables can use it to drive `PagedAttention` and `KVCache.write` directly.

>>> plan = plan_from_tables([[4, 2], [0]], kv_lens=[5, 3], q_lens=[1, 3], block_size=4)
>>> plan.kv_indices.tolist(), plan.kv_last_page_len.tolist(), plan.slot_mapping.tolist()
([4, 2, 0], [1, 3], [8, 0, 1, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pagedkv._core import Attention
from pagedkv.attention._plan import FULL_ATTENTION, IntArray


@dataclass
class TablePlan:
    """The fields of `pagedkv.Plan` that `PagedAttention` and `KVCache` read."""

    kv_indptr: IntArray
    kv_indices: IntArray
    kv_last_page_len: IntArray
    qo_indptr: IntArray
    slot_mapping: IntArray
    positions: IntArray
    block_size: int
    block_tables: IntArray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    copies: IntArray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    attention: Attention = FULL_ATTENTION


def plan_from_tables(
    tables: Sequence[Sequence[int] | npt.NDArray[np.integer]],
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    block_size: int,
    attention: Attention = FULL_ATTENTION,
) -> TablePlan:
    """The plan `BlockManager.plan` would return for these block tables (see SEMANTICS.md).

    Sequence `b` holds `kv_lens[b]` tokens in `tables[b]` (which may be longer than needed);
    its query is its last `q_lens[b]` tokens. With a windowed `attention`, a table starts at
    the sequence's first live block (for chunked attention, a chunk boundary) and `kv_lens`
    and `positions` count from there.
    """
    kv = np.asarray(kv_lens, dtype=np.int64)
    q = np.asarray(q_lens, dtype=np.int64)
    if not (len(tables) == kv.shape[0] == q.shape[0]) or (q > kv).any() or (q < 1).any():
        raise ValueError("need one table, kv_len and 1 <= q_len <= kv_len per sequence")
    pages = (kv + block_size - 1) // block_size
    arrays = [np.asarray(t, dtype=np.int64) for t in tables]
    if any(a.shape[0] < n for a, n in zip(arrays, pages, strict=True)):
        raise ValueError("a block table is shorter than its sequence")
    indices = np.concatenate([a[:n] for a, n in zip(arrays, pages, strict=True)])
    indptr = np.concatenate([[0], np.cumsum(pages)])
    qo = np.concatenate([[0], np.cumsum(q)])
    # Query token i of sequence b sits at position kv - q + i, in page indptr[b] + pos // bs.
    seq = np.repeat(np.arange(kv.shape[0]), q)
    positions = (kv - q)[seq] + np.arange(int(qo[-1])) - qo[:-1][seq]
    slots = indices[indptr[:-1][seq] + positions // block_size] * block_size
    slots += positions % block_size
    width = max((a.shape[0] for a in arrays), default=0)
    padded = np.full((len(arrays), width), -1, np.int64)
    for b, a in enumerate(arrays):
        padded[b, : a.shape[0]] = a

    def i32(a: npt.NDArray[np.integer]) -> IntArray:
        return np.ascontiguousarray(a, dtype=np.int32)

    return TablePlan(
        kv_indptr=i32(indptr),
        kv_indices=i32(indices),
        kv_last_page_len=i32(kv - (pages - 1) * block_size),
        qo_indptr=i32(qo),
        slot_mapping=i32(slots),
        positions=i32(positions),
        block_size=block_size,
        block_tables=i32(padded),
        attention=attention,
    )


def random_tables(
    kv_lens: Sequence[int], block_size: int, num_blocks: int, seed: int
) -> list[npt.NDArray[np.int64]]:
    """Block tables on distinct blocks of `num_blocks`, picked at random (a fragmented pool)."""
    pages = (np.asarray(kv_lens, dtype=np.int64) + block_size - 1) // block_size
    if int(pages.sum()) > num_blocks:
        raise ValueError(f"the tables need {int(pages.sum())} blocks, the pool has {num_blocks}")
    order = np.random.default_rng(seed).permutation(num_blocks)[: int(pages.sum())]
    return np.split(order, np.cumsum(pages)[:-1])
