"""The Triton kernel behind `backend="triton"`: paged, causal, GQA flash attention.

One program handles one tile of up to `BLOCK_M` rows of one sequence and one KV head, where row
`r` is query token `r // GROUP` of the sequence and query head `kv_head * GROUP + r % GROUP`: a
decode step of a GQA model fills a tile with the query heads that share a KV head, so each KV
byte is read once per tile. The program streams the sequence's keys in chunks of `BLOCK_N`
positions, gathering each position from its page (`kv_indices[kv_indptr[b] + j // PAGE]`, slot
`j % PAGE`, so any page size works), and keeps an online softmax in float32. Query token `i`
at position `p = kv_len - q_len + i` sees positions `0 ..= p` (bottom-right causal), narrowed
to `p - WINDOW + 1 ..= p` with `HAS_WINDOW` and to `p // CHUNK * CHUNK ..= p` with `HAS_CHUNK`
(positions relative to the plan's first page, see `StepPlan`); the loop starts at the first key
the tile's first row reads. Every length is read from device memory, so a launch captured in a
CUDA graph stays right when a later plan changes them. With `HAS_SINKS`, each row's softmax
starts from its head's sink logit (running max = the sink, sum = 1) and the sink has no value:
the sink joins the denominator only.

Layouts are strides: a page's K/V index, token slot and head strides (`stride_kk`, `stride_ks`,
`stride_kh`) describe NHD and HND alike. `MLA` reads one latent row per token: its first
`HEAD_DIM` elements are K and V at once, the `ROPE_DIM` after them the rope part of K, matched
by the rope part of `q`. KV of another dtype (float8) is converted to q's dtype as it is loaded;
its scales are folded into the logits (`k_scale`, `pe_scale`, with `sm_scale`) and the output
(`v_scale`).

This module imports Triton at import time; `TRITON_INTERPRET=1` must be set before it is first
imported for the kernel to run in Triton's CPU interpreter. `DOT_FP32` upcasts the dot operands
to float32: the interpreter multiplies bfloat16 operands wrongly (Triton 3.x), so bfloat16 runs
in it that way; on a GPU the dots take the cache's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


# One program: one tile of rows of one sequence and one KV head (see the module docstring).
@triton.jit
def paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_lens_ptr,
    tile_seq_ptr,
    tile_row_ptr,
    sinks_ptr,
    window,
    chunk,
    k_scale,
    pe_scale,
    v_scale,
    soft_cap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kk,
    stride_ks,
    stride_kh,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MLA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + b)
    page_start = tl.load(kv_indptr_ptr + b)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len * GROUP
    qi = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    token = (q_start + qi).to(tl.int64)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    if MLA:
        r = tl.arange(0, BLOCK_R)
        r_valid = r < ROPE_DIM
        q_pe = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + HEAD_DIM + r[None, :],
            mask=row_valid[:, None] & r_valid[None, :],
            other=0.0,
        ).to(q.dtype)
    q_pos = kv_len - q_len + qi
    last_row = tl.minimum(row0 + BLOCK_M, q_len * GROUP) - 1
    hi = kv_len - q_len + last_row // GROUP + 1
    first_pos = kv_len - q_len + row0 // GROUP
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_CHUNK:
        lo = first_pos // chunk * chunk

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_valid = j < hi
        page = tl.load(kv_indices_ptr + page_start + j // PAGE, mask=j_valid, other=0)
        base = page.to(tl.int64) * stride_kb + (j % PAGE) * stride_ks + kv_head * stride_kh
        kv_mask = j_valid[:, None] & d_valid[None, :]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_scale
        if MLA:
            v = k
            k_pe = tl.load(
                kv_ptr + base[:, None] + HEAD_DIM + r[None, :],
                mask=j_valid[:, None] & r_valid[None, :],
                other=0.0,
            ).to(q.dtype)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION) * pe_scale
        else:
            v_ptrs = kv_ptr + stride_kk + base[:, None] + d[None, :]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        if HAS_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        allowed = (j[None, :] <= q_pos[:, None]) & j_valid[None, :]
        if HAS_WINDOW:
            allowed &= j[None, :] > (q_pos - window)[:, None]
        if HAS_CHUNK:
            allowed &= j[None, :] >= (q_pos // chunk * chunk)[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A padding row may see no key in a chunk; keep its exponentials at 0, never NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )
