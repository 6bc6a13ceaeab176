"""The Triton kernel that builds FlashInfer's CSR pages from a persistent batch's block table.

One program per row copies the row's first `kv_indptr[r + 1] - kv_indptr[r]` table entries to
`kv_indices[kv_indptr[r]:]`, `BLOCK` at a time: one launch per step, whatever the batch. Like
`_triton_kernel`, this module imports Triton at import time (`TRITON_INTERPRET=1` before the
first import runs it in Triton's CPU interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def csr_from_table_kernel(table_ptr, width, kv_indptr_ptr, kv_indices_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + row)
    pages = tl.load(kv_indptr_ptr + row + 1) - start
    src = table_ptr + row.to(tl.int64) * width
    for first in range(0, pages, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        keep = cols < pages
        tl.store(kv_indices_ptr + start + cols, tl.load(src + cols, mask=keep), mask=keep)
