"""A `pagedkv.Batch`'s block table kept on the device, and the CSR built from it there.

A persistent batch writes only the table entries that changed in a step (a new block every
`block_size` steps per row, a row that joins, leaves or moves) and logs them. `DeviceBlockTable`
applies that log as one small scatter, so the host uploads `O(changes)` ints per step instead of
the whole CSR, and `kv_indices` builds FlashInfer's `kv_indices` from the table on the device:
one Triton launch (`_csr_kernel`) on CUDA, torch ops elsewhere; either way the sizes are known
on the host, so nothing syncs the device.

    table = DeviceBlockTable(torch.device("cuda"))
    mgr.step_batch(batch, tokens)
    table.sync(batch)
    kv_indptr = torch.from_numpy(batch.kv_indptr).to(device)
    kv_indices = table.kv_indices(kv_indptr, nnz=int(batch.kv_indptr[-1]))

`PagedAttention.plan(batch, table=table)` does this for its backends.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from pagedkv._core import Batch
from pagedkv._device import resolve_device, upload_ints

# Table entries a program of the CSR kernel copies per loop step.
CSR_BLOCK = 128


class DeviceBlockTable:
    """A device copy of one batch's `[rows, width]` int32 block table (padded with -1).

    `triton` picks how `kv_indices` builds the CSR: Triton's kernel (True), torch ops (False),
    or the kernel on CUDA when Triton imports and torch ops otherwise (None, the default).
    """

    def __init__(self, device: torch.device | str, *, triton: bool | None = None) -> None:
        self._device = resolve_device(device)
        self._table: torch.Tensor | None = None
        self._max_block_id = -1
        self._kernel = _csr_kernel(self._device, triton)

    @property
    def device(self) -> torch.device:
        """Where the table lives."""
        return self._device

    @property
    def max_block_id(self) -> int:
        """The largest block id the table has held since its last full copy (-1: none), known
        on the host: what `PagedAttention` checks against the cache's size."""
        return self._max_block_id

    @property
    def table(self) -> torch.Tensor:
        """The device table: at least as many rows as the batch (spare rows hold -1)."""
        if self._table is None:
            raise RuntimeError("DeviceBlockTable.table: call sync(batch) first")
        return self._table

    def sync(self, batch: Batch) -> None:
        """Apply the batch's table updates since the last sync (and clear its log).

        One `DeviceBlockTable` follows one batch: the log is the batch's only record of what
        changed, so a second consumer of the same batch would miss updates.
        """
        full, index, blocks = batch.take_updates()
        rows, width = len(batch), batch.width
        table = self._table
        # A removal logs the vacated row, one past the length: room for it too.
        if full or table is None or table.shape[1] != width or table.shape[0] <= rows:
            self._upload(batch, rows, width)
            return
        if index.size == 0:
            return
        self._max_block_id = max(self._max_block_id, int(blocks.max()))
        # A position may repeat in the log; its last write wins.
        last = index.size - 1 - np.unique(index[::-1], return_index=True)[1]
        index_dev = upload_ints(index[last], self._device)
        table.view(-1).index_copy_(0, index_dev, upload_ints(blocks[last], self._device))

    def _upload(self, batch: Batch, rows: int, width: int) -> None:
        """Copy the whole table into a fresh device tensor with spare rows (-1)."""
        capacity = max(2 * rows, 16)
        table = torch.full((capacity, width), -1, dtype=torch.int32, device=self._device)
        host = batch.block_table
        if host.size:
            table[:rows].copy_(upload_ints(host, self._device))
        self._table = table
        self._max_block_id = int(host.max()) if host.size else -1

    def kv_indices(self, kv_indptr: torch.Tensor, nnz: int) -> torch.Tensor:
        """`[nnz]` int32 CSR pages: row `r`'s first `kv_indptr[r + 1] - kv_indptr[r]` entries,
        concatenated. `kv_indptr` is the batch's `[B + 1]` int32 offsets, on this device; `nnz`
        its last value, known on the host."""
        table = self.table
        if self._kernel is not None:
            out = torch.empty(nnz, dtype=torch.int32, device=self._device)
            batch = kv_indptr.shape[0] - 1
            if batch and nnz:
                self._kernel[(batch,)](table, table.shape[1], kv_indptr, out, BLOCK=CSR_BLOCK)
            return out
        pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
        rows = torch.arange(pages.shape[0], device=self._device)
        row_of = torch.repeat_interleave(rows, pages, output_size=nnz)
        col = torch.arange(nnz, device=self._device) - kv_indptr[:-1].to(torch.int64)[row_of]
        return table[row_of, col]


def _csr_kernel(device: torch.device, triton: bool | None) -> Any:
    """The Triton CSR kernel to launch, or None for torch ops (see `DeviceBlockTable`)."""
    if triton is False or (triton is None and device.type != "cuda"):
        return None
    try:
        module = importlib.import_module("pagedkv.attention._csr_kernel")
    except ImportError:
        if triton:
            raise
        return None
    return module.csr_from_table_kernel
