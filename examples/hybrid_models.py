"""Hybrid `transformers` models on KV-cache groups: Gemma 3 (text), gpt-oss and Llama 4 (text).

Their layers attend differently (a sliding window or a chunk, and full attention), so their KV
lives in a `HybridManager`'s groups (`pagedkv.groups.kv_groups(config)`): one block table per
group, one pool of pages (`GroupedKVCache`), and one `PagedAttention` per group, planned with
that group's `Plan`. `GroupedAttention` holds those; each `Paged*` runner runs its model's own
modules token-packed and reproduces the model's attention exactly as `transformers` computes it:

- Gemma 3: query and key RMS norms, `query_pre_attn_scalar ** -0.5` as the softmax scale, a
  rope base per layer type (local layers use their own), norms after attention and the MLP,
  and the final logit soft cap (the config's `attn_logit_softcapping` is not applied by
  `transformers`' Gemma 3 attention, so it is not here either).
- gpt-oss: YaRN rope on every layer, per-head attention sinks, and its mixture of experts run
  by the model's own module.
- Llama 4: chunked-local layers with rope and a weightless query/key norm; full-attention
  layers without rope (NoPE) whose queries are scaled by the attention temperature of their
  position; the MoE (routed and shared experts) run by the model's own module.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Gemma3ForCausalLM, GptOssForCausalLM, Llama4ForCausalLM
from transformers.models.gemma3 import modeling_gemma3 as gemma3
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
from transformers.models.llama4 import modeling_llama4 as llama4

from pagedkv import Plan
from pagedkv.attention import BackendName, PagedAttention
from pagedkv.grouped_cache import GroupedKVCache
from pagedkv.groups import KVGroups, kv_groups
from pagedkv.kv_cache import SlotIndex

HybridModel = Gemma3ForCausalLM | GptOssForCausalLM | Llama4ForCausalLM


class GroupedAttention:
    """The KV of every group of a model's layers in one pool, and one `PagedAttention` per
    group: `plan` takes a step's plans (one per group, in group order), `attend` writes a
    layer's new K/V into its group's blocks and attends over them."""

    def __init__(
        self,
        model: HybridModel,
        num_blocks: int,
        block_size: int,
        backend: BackendName,
        device: torch.device,
        *,
        sm_scale: float,
        sinks: bool = False,
    ) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.groups: KVGroups = kv_groups(cfg)
        self.cache = GroupedKVCache(
            self.groups,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        self.attns = [
            PagedAttention(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                block_size,
                backend,
                device=device,
                dtype=dtype,
                sm_scale=sm_scale,
                attention=attention,
                sinks=sinks,
            )
            for attention in self.groups.attention
        ]

    def plan(self, plans: list[Plan]) -> list[SlotIndex]:
        """Plans every group's attention; returns the step's slots for `attend`."""
        for attn, plan in zip(self.attns, plans, strict=True):
            attn.plan(plan)
        return self.cache.slot_tensors(plans)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: list[SlotIndex],
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Model layer `layer`'s attention output `[tokens, heads * head_dim]`, after storing
        its new `k` and `v`."""
        self.cache.write(layer, k, v.contiguous(), slots)
        group, slot = self.cache.locate(layer)
        out = self.attns[group].run(q.contiguous(), self.cache.pool, slot, sinks=sinks)
        return out.reshape(q.shape[0], -1)


class PagedHybrid:
    """A hybrid model's own modules run token-packed on `kv` (`cache` is the pool the engine
    copies and swaps); each family's subclass has its `forward`."""

    def __init__(self, model: Any, kv: GroupedAttention) -> None:
        self.model = model
        self.kv = kv
        self.cache = kv.cache

    def forward(
        self, input_ids: torch.Tensor, plans: list[Plan], last_rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits at `last_rows` of the step's packed tokens; writes every token's K/V."""
        raise NotImplementedError


class PagedGemma3(PagedHybrid):
    """Runs a `Gemma3ForCausalLM`'s modules token-packed over its sliding and full groups."""

    def forward(
        self, input_ids: torch.Tensor, plans: list[Plan], last_rows: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.model.config
        inner = self.model.model
        positions = _positions(plans, input_ids.device)
        n = input_ids.shape[0]
        h = inner.embed_tokens(input_ids)
        kinds = {layer.self_attn.layer_type for layer in inner.layers}
        rope = {kind: inner.rotary_emb(h, positions, kind) for kind in kinds}
        slots = self.kv.plan(plans)
        for index, layer in enumerate(inner.layers):
            sa = layer.self_attn
            x = layer.input_layernorm(h)
            q = sa.q_norm(sa.q_proj(x).view(n, -1, cfg.head_dim))
            k = sa.k_norm(sa.k_proj(x).view(n, -1, cfg.head_dim))
            v = sa.v_proj(x).view(n, -1, cfg.head_dim)
            cos, sin = rope[sa.layer_type]
            q, k = gemma3.apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
            out = self.kv.attend(index, q, k, v, slots)
            h = h + layer.post_attention_layernorm(sa.o_proj(out))
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        logits: torch.Tensor = self.model.lm_head(inner.norm(h[last_rows]))
        cap = cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class PagedGptOss(PagedHybrid):
    """Runs a `GptOssForCausalLM`'s modules token-packed: sinks in every layer's attention."""

    def forward(
        self, input_ids: torch.Tensor, plans: list[Plan], last_rows: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.model.config
        inner = self.model.model
        positions = _positions(plans, input_ids.device)
        n = input_ids.shape[0]
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, positions)
        slots = self.kv.plan(plans)
        for index, layer in enumerate(inner.layers):
            sa = layer.self_attn
            x = layer.input_layernorm(h)
            q = sa.q_proj(x).view(n, -1, cfg.head_dim)
            k = sa.k_proj(x).view(n, -1, cfg.head_dim)
            v = sa.v_proj(x).view(n, -1, cfg.head_dim)
            q, k = gpt_oss.apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
            h = h + sa.o_proj(self.kv.attend(index, q, k, v, slots, sinks=sa.sinks))
            experts, _ = layer.mlp(layer.post_attention_layernorm(h)[None])
            h = h + experts[0]
        logits: torch.Tensor = self.model.lm_head(inner.norm(h[last_rows]))
        return logits


class PagedLlama4(PagedHybrid):
    """Runs a `Llama4ForCausalLM`'s modules token-packed over its chunked and full groups."""

    def forward(
        self, input_ids: torch.Tensor, plans: list[Plan], last_rows: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.model.config
        inner = self.model.model
        positions = _positions(plans, input_ids.device)
        n = input_ids.shape[0]
        h = inner.embed_tokens(input_ids)
        freqs = inner.rotary_emb(h, positions)  # complex: one rotation per pair of channels
        slots = self.kv.plan(plans)
        for index, layer in enumerate(inner.layers):
            sa = layer.self_attn
            x = layer.input_layernorm(h)
            q = sa.q_proj(x).view(1, n, -1, cfg.head_dim)
            k = sa.k_proj(x).view(1, n, -1, cfg.head_dim)
            v = sa.v_proj(x).view(n, -1, cfg.head_dim)
            if sa.use_rope:
                q, k = llama4.apply_rotary_emb(q, k, freqs)
            if hasattr(sa, "qk_norm"):
                q, k = sa.qk_norm(q), sa.qk_norm(k)
            if sa.attn_temperature_tuning and not sa.use_rope:
                floors = torch.floor((positions[0].float() + 1.0) / sa.floor_scale)
                scales = torch.log1p(floors) * sa.attn_scale + 1.0
                q = (q * scales[None, :, None, None]).to(q.dtype)
            h = h + sa.o_proj(self.kv.attend(index, q[0], k[0], v, slots))
            ff = layer.feed_forward(layer.post_attention_layernorm(h))
            h = h + (ff[0] if layer.is_moe_layer else ff)
        logits: torch.Tensor = self.model.lm_head(inner.norm(h[last_rows]))
        return logits


RUNNERS: dict[type, type[PagedHybrid]] = {
    Gemma3ForCausalLM: PagedGemma3,
    GptOssForCausalLM: PagedGptOss,
    Llama4ForCausalLM: PagedLlama4,
}


def paged_hybrid(
    model: HybridModel,
    num_blocks: int,
    block_size: int,
    backend: BackendName,
    device: torch.device,
) -> PagedHybrid:
    """`model` on a grouped paged cache of `num_blocks` pages on `device` (`runner.cache`)."""
    runner = RUNNERS.get(type(model))
    if runner is None:
        raise ValueError(f"not a hybrid model this example serves: {type(model).__name__}")
    kv = GroupedAttention(
        model,
        num_blocks,
        block_size,
        backend,
        device,
        sm_scale=float(model.model.layers[0].self_attn.scaling),  # the same in every layer
        sinks=isinstance(model, GptOssForCausalLM),
    )
    return runner(model, kv)


def _positions(plans: list[Plan], device: torch.device) -> torch.Tensor:
    """The step's token positions, `[1, tokens]` (every group's plan has the same)."""
    return torch.from_numpy(plans[0].positions).to(device, torch.int64)[None, :]
