"""Paged attention in plain torch: the reference every fast backend is checked against.

It consumes exactly the CSR plan FlashInfer gets, for every layout: NHD and HND gather K and V
per head; MLA gathers each token's latent row, uses all of it (latent and rope part) as the one
K head and its latent part as V, which is attention in MLA's absorbed form (the caller folds
the K up-projection into `q` and applies the V up-projection to the output). A float8 cache
is dequantized (`stored * scale`) as it is gathered. `plan` turns the page table into gather
indices and a mask once per step (causal, narrowed by the plan's sliding window or chunk, see
`StepPlan`); `run` gathers each sequence's K/V into a padded `[batch, max_kv_len]` block, attends
with all sequences at once (no Python loop per token or per sequence) in float32 (float64 for
float64 inputs), and scatters the rows back to plan order. Sinks join each row's softmax as one
more logit with no value, as gpt-oss's attention does.
Memory is `O(batch * max_q_len * max_kv_len * heads)`, which suits tests and checks, not serving.
"""

from __future__ import annotations

import torch

from pagedkv.attention._plan import StepPlan
from pagedkv.attention._spec import AttentionSpec


class _Gather:
    """Per-step index tensors, built once in `plan` and reused by every layer's `run`."""

    def __init__(self, step: StepPlan, device: torch.device) -> None:
        bs = step.block_size
        indptr = torch.from_numpy(step.kv_indptr).to(torch.int64)
        if step.device_kv_indices is None:
            indices = torch.from_numpy(step.kv_indices).to(torch.int64)
        else:  # the reference gathers on the host: a copy back, fine for a check
            indices = step.device_kv_indices.to("cpu", torch.int64)
        kv_lens = torch.from_numpy(step.kv_lens)
        q_lens = torch.from_numpy(step.q_lens)
        qo_indptr = torch.from_numpy(step.qo_indptr).to(torch.int64)
        batch, max_q, max_kv = step.batch_size, step.max_q_len, step.max_kv_len

        # KV side: logical position j of sequence b lives in page indices[indptr[b] + j // bs]
        # at offset j % bs. Padded positions point at the sequence's first page (always valid)
        # and are masked out below.
        j = torch.arange(max_kv)
        kv_valid = j[None, :] < kv_lens[:, None]
        page_pos = torch.where(kv_valid, indptr[:-1, None] + (j // bs)[None, :], indptr[:-1, None])
        pages = indices[page_pos]
        offsets = (j % bs).expand(batch, max_kv)

        # Query side: row i of sequence b is token qo_indptr[b] + i at position
        # kv_len - q_len + i (causal mask aligned bottom-right).
        i = torch.arange(max_q)
        q_valid = i[None, :] < q_lens[:, None]
        q_rows = torch.where(q_valid, qo_indptr[:-1, None] + i[None, :], 0)
        q_pos = (kv_lens - q_lens)[:, None] + i[None, :]
        key = j[None, None, :]
        allowed = (key <= q_pos[:, :, None]) & kv_valid[:, None, :]
        if step.window is not None:
            allowed &= key > (q_pos - step.window)[:, :, None]
        if step.chunk is not None:
            allowed &= key >= (q_pos // step.chunk * step.chunk)[:, :, None]
        # Padded query rows see every valid key so their softmax stays finite; they are dropped.
        allowed |= ~q_valid[:, :, None] & kv_valid[:, None, :]
        # Row b * max_q + i of the padded output is plan token qo_indptr[b] + i.
        token_b = torch.repeat_interleave(torch.arange(batch), q_lens)
        token_i = torch.arange(step.num_query_tokens) - qo_indptr[token_b]
        out_rows = token_b * max_q + token_i

        self.pages = pages.to(device)
        self.offsets = offsets.to(device)
        self.q_rows = q_rows.to(device)
        self.allowed = allowed.to(device)
        self.out_rows = out_rows.to(device)
        self.batch = batch
        self.max_q = max_q


class TorchReference:
    """Vectorised torch paged attention on any device; see the module docstring."""

    name = "torch"

    def __init__(self, spec: AttentionSpec) -> None:
        self._spec = spec
        self._gather: _Gather | None = None

    def plan(self, step: StepPlan, graph: bool) -> None:
        """Build this step's gather indices and mask on the spec's device.

        `graph` is always False: `PagedAttention` gives CUDA-graph buckets to GPU backends only.
        """
        self._gather = _Gather(step, self._spec.device)

    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        scales: tuple[float, float] | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend `q` `[tokens, qo_heads, qk_dim]` over the paged layer `kv`; `scales` are the
        layer's float8 scales (None for other dtypes), `sinks` the `[qo_heads]` sink logits."""
        g = self._gather
        if g is None:
            raise RuntimeError("plan() must be called before run()")
        spec = self._spec
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        hkv, group = spec.num_kv_heads, spec.group_size
        k, v = self._gather_kv(kv, g, compute, scales or (1.0, 1.0))  # [B, max_kv, hkv, dim]
        qp = q[g.q_rows].to(compute).view(g.batch, g.max_q, hkv, group, spec.qk_dim)

        logits = torch.einsum("bqhgd,bkhd->bhgqk", qp, k) * spec.sm_scale
        cap = spec.logits_soft_cap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        logits = logits.masked_fill(~g.allowed[:, None, None], float("-inf"))
        if sinks is not None:
            sink = sinks.to(compute).view(1, hkv, group, 1, 1).expand(*logits.shape[:-1], 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)
        out = out.reshape(g.batch * g.max_q, spec.num_qo_heads, spec.head_dim)[g.out_rows]
        return out.to(q.dtype)

    def _gather_kv(
        self, kv: torch.Tensor, g: _Gather, compute: torch.dtype, scales: tuple[float, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's K and V, `[batch, max_kv, kv_heads, dim]`, dequantized.

        Indexing a view gathers only the needed slots, never the whole cache.
        """
        layout = self._spec.layout
        if layout.is_mla:
            latent_scale, rope_scale = scales
            rows = kv[g.pages, g.offsets].to(compute)[:, :, None]  # [B, max_kv, 1, qk_dim]
            latent = rows[..., : layout.head_dim] * latent_scale
            k = torch.cat([latent, rows[..., layout.head_dim :] * rope_scale], dim=-1)
            return k, latent
        k_scale, v_scale = scales
        if layout.name == "HND":
            k, v = kv[:, 0][g.pages, :, g.offsets], kv[:, 1][g.pages, :, g.offsets]
        else:
            k, v = kv[:, 0][g.pages, g.offsets], kv[:, 1][g.pages, g.offsets]
        return k.to(compute) * k_scale, v.to(compute) * v_scale
