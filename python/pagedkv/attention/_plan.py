"""The host-side view of one step's plan that every attention backend consumes.

`BlockManager.plan` / `step` return a `Plan` of numpy int32 arrays. `StepPlan.from_plan` checks
those arrays once per step (vectorised numpy, no per-sequence Python loop) and derives the
per-sequence query and KV lengths that both backends need, so the FlashInfer path and the torch
reference see exactly the same, already validated, inputs. `StepPlan.from_device_csr` does the
same for a persistent batch whose CSR pages were built on the device (`DeviceBlockTable`): only
the row arrays are checked on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pagedkv._core import Attention
from pagedkv.kv_cache import check_block_size

IntArray = npt.NDArray[np.int32]
FULL_ATTENTION = Attention.full()


class PlanLike(Protocol):
    """Anything shaped like `pagedkv.Plan`: FlashInfer's CSR page table plus query offsets."""

    @property
    def kv_indptr(self) -> npt.NDArray[Any]:
        """`[B + 1]` offsets of each sequence's pages in `kv_indices`."""

    @property
    def kv_indices(self) -> npt.NDArray[Any]:
        """`[nnz]` physical block ids, sequence by sequence, in logical order."""

    @property
    def kv_last_page_len(self) -> npt.NDArray[Any]:
        """`[B]` tokens in each sequence's last page, `1 <= v <= block_size`."""

    @property
    def qo_indptr(self) -> npt.NDArray[Any]:
        """`[B + 1]` offsets of each sequence's query tokens in `q`."""

    @property
    def block_size(self) -> int:
        """Token slots per block of the manager that made the plan."""


def _int32_vector(name: str, array: npt.NDArray[Any]) -> IntArray:
    """Return `array` as a contiguous 1-D int32 array, or raise naming the field."""
    arr = np.asarray(array)
    if arr.ndim != 1:
        raise ValueError(f"plan.{name} must be 1-D, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"plan.{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        info = np.iinfo(np.int32)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise ValueError(f"plan.{name} has values outside int32")
        arr = arr.astype(np.int32)
    arr = np.ascontiguousarray(arr)
    # torch.from_numpy warns on a read-only array; a copy of B or nnz ints is cheap.
    return arr if arr.flags.writeable else arr.copy()


@dataclass(frozen=True)
class StepPlan:
    """A validated plan: the CSR arrays plus derived per-sequence lengths.

    Sequence `b` has `q_lens[b]` query tokens that are its last `q_lens[b]` KV positions, so query
    token `i` of `b` sits at position `p = kv_lens[b] - q_lens[b] + i` and (causally) sees KV
    positions `0 ..= p`; with a `window`, only `p - window + 1 ..= p`; with a `chunk`, only
    `p // chunk * chunk ..= p`.

    Positions are relative to the plan's first page. A windowed manager's plan lists pages from
    the sequence's first live block, which is a block boundary and, for chunked attention, a
    chunk boundary (the chunk is a multiple of the block size), so these masks on relative
    positions are the masks on absolute ones.
    """

    kv_indptr: IntArray
    kv_indices: IntArray
    kv_last_page_len: IntArray
    qo_indptr: IntArray
    q_lens: npt.NDArray[np.int64]
    kv_lens: npt.NDArray[np.int64]
    block_size: int
    max_q_len: int
    max_kv_len: int
    max_block_id: int
    device_kv_indices: torch.Tensor | None = None
    """The `[nnz]` pages already on the attention device (a persistent batch's CSR built by
    `DeviceBlockTable`); `kv_indices` is then empty and unused."""
    attention: Attention = FULL_ATTENTION
    """The plan's `attention` (full for a plan without one, such as a `TablePlan`)."""

    @property
    def window(self) -> int | None:
        """The sliding window in tokens, or None."""
        return self.attention.window

    @property
    def chunk(self) -> int | None:
        """The chunk of chunked-local attention in tokens, or None."""
        return self.attention.chunk

    @property
    def nnz(self) -> int:
        """Pages of the whole batch."""
        return int(self.kv_indptr[-1])

    @property
    def batch_size(self) -> int:
        """Number of sequences in the step."""
        return int(self.q_lens.shape[0])

    @property
    def num_query_tokens(self) -> int:
        """Total query tokens, the first dimension of `q` and of the output."""
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        """True when every sequence has exactly one query token."""
        return self.max_q_len == 1

    def padded_to(self, batch: int) -> StepPlan:
        """This decode step with sequences appended up to `batch`, for a CUDA-graph bucket.

        Each padding sequence has one query token and one KV token in block 0 (every cache has
        it); its output rows are computed and ignored.
        """
        pad = batch - self.batch_size
        if pad < 0 or not self.is_decode:
            raise ValueError(f"cannot pad a step of {self.batch_size} sequences to {batch}")
        nnz = int(self.kv_indptr[-1])
        ones = np.ones(pad, dtype=np.int64)

        def grow(a: IntArray, tail: npt.NDArray[Any]) -> IntArray:
            return np.concatenate([a, tail.astype(np.int32)])

        device = self.device_kv_indices
        if device is not None:
            device = torch.cat([device, device.new_zeros(pad)])
        return replace(
            self,
            kv_indptr=grow(self.kv_indptr, nnz + np.cumsum(ones)),
            kv_indices=self.kv_indices if device is not None else grow(self.kv_indices, 0 * ones),
            device_kv_indices=device,
            kv_last_page_len=grow(self.kv_last_page_len, ones),
            qo_indptr=grow(self.qo_indptr, self.batch_size + np.cumsum(ones)),
            q_lens=np.concatenate([self.q_lens, ones]),
            kv_lens=np.concatenate([self.kv_lens, ones]),
        )

    @classmethod
    def from_plan(cls, plan: PlanLike, block_size: int) -> StepPlan:
        """Validate `plan` against `block_size`; raise `ValueError` naming the first problem."""
        kv_indices = _int32_vector("kv_indices", plan.kv_indices)

        def max_block_id() -> int:
            if int(kv_indices.min()) < 0:
                raise ValueError("plan.kv_indices holds a negative block id")
            return int(kv_indices.max())

        return cls._validated(plan, block_size, kv_indices, kv_indices.shape[0], max_block_id)

    @classmethod
    def from_device_csr(
        cls, plan: PlanLike, block_size: int, kv_indices: torch.Tensor, max_block_id: int
    ) -> StepPlan:
        """The step of `plan`'s row arrays whose `[nnz]` CSR pages are already on the device
        (`kv_indices`, int32), with `max_block_id` the largest block they may hold."""
        if kv_indices.dtype != torch.int32 or kv_indices.dim() != 1:
            raise ValueError("device kv_indices must be a 1-D int32 tensor")
        empty = np.zeros(0, dtype=np.int32)
        nnz = kv_indices.shape[0]
        return cls._validated(plan, block_size, empty, nnz, lambda: max_block_id, kv_indices)

    @classmethod
    def _validated(
        cls,
        plan: PlanLike,
        block_size: int,
        kv_indices: IntArray,
        nnz: int,
        max_block_id: Callable[[], int],
        device_kv_indices: torch.Tensor | None = None,
    ) -> StepPlan:
        """The step of `plan`, for a CSR of `nnz` pages: every row array is checked here, the
        page ids by `max_block_id` (called once the rows are valid)."""
        kv_indptr = _int32_vector("kv_indptr", plan.kv_indptr)
        last = _int32_vector("kv_last_page_len", plan.kv_last_page_len)
        qo_indptr = _int32_vector("qo_indptr", plan.qo_indptr)

        batch = last.shape[0]
        if batch == 0:
            raise ValueError("plan has an empty batch")
        check_block_size(plan, block_size, "this PagedAttention")
        if kv_indptr.shape[0] != batch + 1:
            raise ValueError(
                f"plan.kv_indptr has {kv_indptr.shape[0]} entries, expected batch + 1 = {batch + 1}"
            )
        if qo_indptr.shape[0] != batch + 1:
            raise ValueError(
                f"plan.qo_indptr has {qo_indptr.shape[0]} entries, expected batch + 1 = {batch + 1}"
            )
        if kv_indptr[0] != 0 or qo_indptr[0] != 0:
            raise ValueError("plan.kv_indptr and plan.qo_indptr must start at 0")
        num_pages = np.diff(kv_indptr).astype(np.int64)
        q_lens = np.diff(qo_indptr).astype(np.int64)
        if (num_pages < 1).any():
            raise ValueError("plan.kv_indptr: every sequence needs at least one page")
        if (q_lens < 1).any():
            raise ValueError("plan.qo_indptr: every sequence needs at least one query token")
        if int(kv_indptr[-1]) != nnz:
            raise ValueError(
                f"plan.kv_indptr[-1] = {int(kv_indptr[-1])} but plan.kv_indices has {nnz} entries"
            )
        if ((last < 1) | (last > block_size)).any():
            raise ValueError(f"plan.kv_last_page_len must lie in [1, block_size={block_size}]")
        attention = getattr(plan, "attention", None)
        if attention is None:
            attention = FULL_ATTENTION
        elif not isinstance(attention, Attention):
            raise ValueError(
                f"plan.attention must be a pagedkv.Attention, got {type(attention).__name__}"
            )
        kv_lens = (num_pages - 1) * block_size + last.astype(np.int64)
        if (kv_lens < q_lens).any():
            b = int(np.argmax(kv_lens < q_lens))
            raise ValueError(
                f"sequence {b} of the plan has {int(q_lens[b])} query tokens but only "
                f"{int(kv_lens[b])} KV tokens; the query must be the tail of the KV"
            )
        return cls(
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_len=last,
            qo_indptr=qo_indptr,
            q_lens=q_lens,
            kv_lens=kv_lens,
            block_size=block_size,
            max_q_len=int(q_lens.max()),
            max_kv_len=int(kv_lens.max()),
            max_block_id=max_block_id(),
            device_kv_indices=device_kv_indices,
            attention=attention,
        )
