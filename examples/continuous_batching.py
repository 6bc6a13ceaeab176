"""Continuous batching with pagedkv: a `transformers` model's own weights on a paged KV cache.

Llama-style models keep per-head K and V (`PagedLlama`); DeepSeek-V3-style models keep MLA's
compressed latent and its rope part, one row per token, and attend in absorbed form
(`PagedDeepseek`). `kv_dtype=torch.float8_e4m3fn` (with `kv_scales`) stores either in float8.
Hybrid models (Gemma 3, gpt-oss, Llama 4: sliding-window or chunked layers beside full ones) run
on a `HybridManager`, one block table per KV-cache group, over a `GroupedKVCache`
(`hybrid_models.py`); windowed groups release the blocks their queries no longer read.

`generate(model, requests)` runs greedy decoding for many requests at once. Each step one batch
holds whatever is ready: new prompts (prefill, in chunks if asked), prompts that hit the prefix
cache (only their uncached tail is computed), and decoding sequences. Requests arrive and finish
between steps; a request with `num_samples > 1` is forked after its prefill, and the first append
to a shared partial block triggers copy-on-write. When the GPU pool runs out, the youngest
sequences are swapped to a CPU cache and swapped back in later. With a `store`
(`pagedkv.tier`), computed blocks are saved to it and prompts load the blocks it holds.

With `speculate=k` (greedy speculative decoding) a decoding sequence appends its last sampled
token and up to k draft tokens, and the target model verifies them all in one forward pass: the
longest prefix of drafts equal to the target's greedy choices is accepted, plus the target's
next token, and `BlockManager.rollback` drops the rejected drafts (uncommitted, so never shared).
`NgramDrafter` proposes by prompt lookup (what followed the sequence's last n-gram earlier in
its own tokens; no model). `ModelDrafter` runs a small draft model on its own `BlockManager` and
`KVCache`: a second manager rather than a second group in one, because its blocks have another
size in bytes and its tokens run ahead of the target's. It prefills each prompt once the target
has, forks with the request's samples (their first drafts copy the shared partial block), keeps
its proposals uncommitted (`auto_commit=False`) until the target has verified them, rolls back
the rejected ones and commits the rest. A swapped-out sequence frees its draft KV, which its
next proposal recomputes (mostly from the draft's prefix cache).

Run it: ``python examples/continuous_batching.py`` (a small random Llama, no download;
``--model deepseek`` a small random DeepSeek-V3 on an MLA cache, ``--kv-dtype fp8`` a float8
cache; ``--model gemma3``, ``gpt-oss`` or ``llama4`` a small random hybrid model);
``--redis redis://127.0.0.1:6379/0`` shares prefixes through a Redis server;
``--speculate 3 --drafter ngram`` (or ``model``: the target's first layer) decodes
speculatively and prints the acceptance rate.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hybrid_models import HybridModel, PagedHybrid, paged_hybrid
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

from pagedkv import BlockManager, Event, HybridManager, OutOfBlocks, Plan, Registration
from pagedkv.attention import BackendName, PagedAttention
from pagedkv.grouped_cache import GroupedKVCache
from pagedkv.kv_cache import KVCache
from pagedkv.kv_layout import Layout
from pagedkv.tier import KVTier, Store, TierStats


@dataclass(frozen=True)
class Request:
    """A prompt to continue greedily for `max_new_tokens`, arriving at step `arrival_step`."""

    prompt: Sequence[int]
    max_new_tokens: int
    arrival_step: int = 0
    num_samples: int = 1


@dataclass
class GenerationResult:
    """Generated tokens per request and sample, and what the run exercised."""

    tokens: list[list[list[int]]]
    steps: int = 0
    prefix_hit_tokens: int = 0
    copied_blocks: int = 0
    swapped_out_blocks: int = 0
    window_released_blocks: int = 0  # hybrid models: blocks that left a window or chunk
    mixed_steps: int = 0
    max_batch_size: int = 0
    tier: TierStats | None = None  # what the external KV tier did, when one was used
    proposed_drafts: int = 0  # speculative decoding: draft tokens the target verified
    accepted_drafts: int = 0
    draft_copied_blocks: int = 0  # copy-on-write in the draft model's cache

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts (0.0 when none were proposed)."""
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0


@dataclass(eq=False)  # identity: two samples may hold equal state
class _Sequence:
    seq_id: int
    request: int
    sample: int
    prompt: list[int]
    max_new_tokens: int
    computed: int = 0  # tokens whose K/V is in the cache (and that the manager holds)
    next_token: int | None = None  # sampled, appended at the next step
    generated: list[int] = field(default_factory=list)
    swapped_blocks: int = 0  # GPU blocks it held (all groups) when last swapped out

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


UniformModel = LlamaForCausalLM | DeepseekV3ForCausalLM  # every layer attends to every token
Model = UniformModel | HybridModel


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedLlama:
    """Runs a `LlamaForCausalLM`'s modules token-packed, with paged attention."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, attn: PagedAttention) -> None:
        self.model = model
        self.cache = cache
        self.attn = attn
        self.num_heads = attn.spec.num_qo_heads
        self.num_kv_heads = attn.spec.num_kv_heads
        self.head_dim = attn.spec.head_dim

    def forward(self, input_ids: torch.Tensor, plan: Plan, last_rows: torch.Tensor) -> torch.Tensor:
        """Logits at `last_rows` of the step's packed tokens; writes every token's K/V."""
        inner = self.model.model
        positions = torch.from_numpy(plan.positions).to(input_ids.device, torch.int64)
        n = input_ids.shape[0]
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, positions[None, :])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]
        slots = self.cache.slot_tensor(plan)  # converted once, used by every layer
        self.attn.plan(plan)
        for index, layer in enumerate(inner.layers):
            sa = layer.self_attn
            x = layer.input_layernorm(h)
            q = sa.q_proj(x).view(n, self.num_heads, self.head_dim)
            k = sa.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = sa.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.cache.write(index, k, v.contiguous(), slots)
            out = self.attn.run(q.contiguous(), self.cache, index)
            h = h + sa.o_proj(out.reshape(n, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits: torch.Tensor = self.model.lm_head(inner.norm(h[last_rows]))
        return logits


class PagedDeepseek:
    """Runs a `DeepseekV3ForCausalLM`'s modules token-packed, with MLA over a latent cache.

    Attention runs in absorbed form: each head's K up-projection is folded into its query
    (`q_nope @ W_UK`, latent-wide), so the cache holds only the normalized latent and the
    rotated rope part; the attention output, still a latent, goes through the V up-projection.
    """

    def __init__(self, model: DeepseekV3ForCausalLM, cache: KVCache, attn: PagedAttention) -> None:
        cfg = model.config
        self.model = model
        self.cache = cache
        self.attn = attn
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.rank = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.kv_lora_rank,
        )
        self.rotate = (
            deepseek.apply_rotary_pos_emb_interleave
            if cfg.rope_interleave
            else deepseek.apply_rotary_pos_emb
        )
        # Per layer: W_UK [heads, nope, rank] and W_UV [heads, v_head_dim, rank].
        self.up = [
            layer.self_attn.kv_b_proj.weight.view(self.num_heads, -1, self.rank).split(
                [self.nope, cfg.v_head_dim], dim=1
            )
            for layer in model.model.layers
        ]

    def forward(self, input_ids: torch.Tensor, plan: Plan, last_rows: torch.Tensor) -> torch.Tensor:
        """Logits at `last_rows` of the step's packed tokens; writes every token's latent."""
        inner = self.model.model
        positions = torch.from_numpy(plan.positions).to(input_ids.device, torch.int64)
        n = input_ids.shape[0]
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, positions[None, :])
        slots = self.cache.slot_tensor(plan)
        self.attn.plan(plan)
        for index, layer in enumerate(inner.layers):
            sa = layer.self_attn
            x = layer.input_layernorm(h)
            q = (
                sa.q_proj(x)
                if sa.q_lora_rank is None
                else sa.q_b_proj(sa.q_a_layernorm(sa.q_a_proj(x)))
            )
            q_nope, q_rot = q.view(n, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
            latent, k_rot = sa.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
            q_rot, k_rot = self.rotate(q_rot, k_rot[:, None], cos[0], sin[0], unsqueeze_dim=1)
            self.cache.write_latent(index, sa.kv_a_layernorm(latent), k_rot[:, 0], slots)
            w_uk, w_uv = self.up[index]
            q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
            out = self.attn.run(torch.cat([q_latent, q_rot], dim=-1), self.cache, index)
            values = torch.einsum("nhr,hvr->nhv", out, w_uv)
            h = h + sa.o_proj(values.reshape(n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits: torch.Tensor = self.model.lm_head(inner.norm(h[last_rows]))
        return logits


@dataclass(frozen=True)
class _CacheShape:
    """What a model's paged cache holds per token and layer."""

    num_kv_heads: int
    head_dim: int
    layout: Layout = "NHD"
    rope_dim: int = 0
    sm_scale: float | None = None


def _cache_shape(model: torch.nn.Module) -> _CacheShape:
    """An MLA latent for DeepSeek-V3 models, per-head K and V otherwise."""
    cfg = model.config
    if isinstance(model, DeepseekV3ForCausalLM):
        scaling = float(model.model.layers[0].self_attn.scaling)
        return _CacheShape(1, cfg.kv_lora_rank, "MLA", cfg.qk_rope_head_dim, scaling)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads  # None means MHA
    return _CacheShape(kv_heads, head_dim, sm_scale=head_dim**-0.5)


def _paged_runner(
    model: Model,
    num_blocks: int,
    block_size: int,
    backend: BackendName,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
) -> Runner:
    """`model` on a paged cache of `num_blocks` blocks on `device` (`runner.cache`); a hybrid
    model on a `GroupedKVCache`, in its own dtype."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    if isinstance(model, HybridModel):
        if kv_dtype not in (None, dtype) or kv_scales is not None:
            raise ValueError("a hybrid model keeps its KV in the model's dtype")
        return paged_hybrid(model, num_blocks, block_size, backend, device)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    shape = _cache_shape(model)
    heads, dim = shape.num_kv_heads, shape.head_dim
    cache = KVCache(
        cfg.num_hidden_layers,
        num_blocks,
        block_size,
        heads,
        dim,
        kv_dtype,
        device,
        layout=shape.layout,
        rope_dim=shape.rope_dim,
        scales=kv_scales,
    )
    attn = PagedAttention(
        cfg.num_attention_heads,
        heads,
        dim,
        block_size,
        backend,
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype,
        layout=shape.layout,
        rope_dim=shape.rope_dim,
        sm_scale=shape.sm_scale,
    )
    if shape.layout == "MLA":
        return PagedDeepseek(model, cache, attn)  # type: ignore[arg-type]
    return PagedLlama(model, cache, attn)  # type: ignore[arg-type]


Runner = PagedLlama | PagedDeepseek | PagedHybrid


def _forward(
    runner: Runner,
    plan: Plan | list[Plan],
    tokens: list[int],
    rows: list[int],
    device: torch.device,
) -> list[int]:
    """The greedy next token at each packed row in `rows` of a step over `tokens` (`plan`: one
    per KV-cache group for a hybrid model)."""
    # This plan's copy-on-write pairs (each group's), before new K/V.
    if isinstance(plan, list):
        runner.cache.copy_blocks([p.copies for p in plan])  # type: ignore[arg-type]
    else:
        runner.cache.copy_blocks(plan.copies)  # type: ignore[arg-type]
    input_ids = torch.tensor(tokens, device=device)
    last_rows = torch.tensor(rows, device=device, dtype=torch.int64)
    logits = runner.forward(input_ids, plan, last_rows)  # type: ignore[arg-type]
    greedy: list[int] = logits.argmax(dim=-1).tolist()
    return greedy


class Drafter(Protocol):
    """Proposes draft tokens for speculative decoding and follows the sequences' lifecycle."""

    copied_blocks: int  # copy-on-write in its own cache, if it has one

    def propose(self, seqs: list[_Sequence], counts: list[int]) -> list[list[int]]:
        """At most `counts[i]` tokens that may follow all of `seqs[i].tokens`."""
        ...

    def verified(self, seqs: list[_Sequence], drafts: list[list[int]], accepted: list[int]) -> None:
        """The target accepted the first `accepted[i]` of `drafts[i]`."""
        ...

    def prefilled(self, seqs: list[_Sequence]) -> None:
        """`seqs` just finished their prompts' prefill (before their first token is emitted)."""
        ...

    def fork(self, parent: _Sequence, child: _Sequence) -> None: ...

    def drop(self, seq: _Sequence) -> None:
        """`seq` finished or left the GPU: forget its state."""
        ...

    def check(self) -> None:
        """Audits its state after a run (every sequence dropped)."""
        ...


def prompt_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to `k` drafts: what followed the latest earlier occurrence of the last n tokens (the
    longest n up to `max_ngram` that occurs)."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + k])
    return []


class NgramDrafter:
    """Prompt lookup (`prompt_lookup`) over the sequence's own tokens; no model."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self.copied_blocks = 0

    def propose(self, seqs: list[_Sequence], counts: list[int]) -> list[list[int]]:
        return [
            prompt_lookup(seq.tokens, k, self.max_ngram)
            for seq, k in zip(seqs, counts, strict=True)
        ]

    def verified(self, seqs: list[_Sequence], drafts: list[list[int]], accepted: list[int]) -> None:
        pass

    def prefilled(self, seqs: list[_Sequence]) -> None:
        pass

    def fork(self, parent: _Sequence, child: _Sequence) -> None:
        pass

    def drop(self, seq: _Sequence) -> None:
        pass

    def check(self) -> None:
        pass


class ModelDrafter:
    """A draft model on its own `BlockManager` and `KVCache` (see the module's docstring).

    A sequence's draft KV covers its tokens up to `mgr.num_tokens(seq_id)`, committed between
    steps; a proposal first appends the tokens the target produced since (its last sampled
    token, and an accepted last draft), then one draft token per further forward pass.
    """

    def __init__(
        self,
        model: UniformModel,
        *,
        num_blocks: int,
        block_size: int,
        backend: BackendName,
        device: torch.device,
    ) -> None:
        self.mgr = BlockManager(num_blocks, block_size, auto_commit=False)
        self.runner = _paged_runner(model, num_blocks, block_size, backend, device)
        self.device = device
        self.copied_blocks = 0

    def _extend(self, seqs: list[_Sequence], news: list[list[int]]) -> list[int | None]:
        """Appends `news[i]` to `seqs[i]`'s draft (allocating it when absent) and runs the draft
        model over them: the greedy next token of each, None where the pool had no room."""
        ran: list[_Sequence] = []
        q_lens: list[int] = []
        tokens: list[int] = []
        for seq, new in zip(seqs, news, strict=True):
            try:
                if seq.seq_id in self.mgr:
                    self.mgr.append(seq.seq_id, new)
                    q = len(new)
                else:
                    known = seq.tokens + new
                    q = len(known) - self.mgr.allocate(seq.seq_id, known)
            except OutOfBlocks:
                self.drop(seq)  # no drafts for it this step
                continue
            ran.append(seq)
            q_lens.append(q)
            tokens += self.mgr.token_ids(seq.seq_id)[-q:].tolist()
        if not ran:
            return [None] * len(seqs)
        plan = self.mgr.plan([s.seq_id for s in ran], q_lens)
        self.copied_blocks += len(plan.copies)
        rows = (plan.qo_indptr[1:] - 1).tolist()
        greedy = dict(zip(ran, _forward(self.runner, plan, tokens, rows, self.device), strict=True))
        return [greedy.get(seq) for seq in seqs]

    def prefilled(self, seqs: list[_Sequence]) -> None:
        self._extend(seqs, [[] for _ in seqs])
        self.mgr.commit([s.seq_id for s in seqs if s.seq_id in self.mgr])

    def propose(self, seqs: list[_Sequence], counts: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(counts) if k > 0]
        # Catch up on what the target produced since the last proposal, then draft.
        news = [seqs[i].tokens[self._known(seqs[i]) :] for i in live]
        while live:
            greedy = self._extend([seqs[i] for i in live], news)
            for i, token in zip(live, greedy, strict=True):
                if token is not None:
                    drafts[i].append(token)
            live = [
                i
                for i, t in zip(live, greedy, strict=True)
                if t is not None and len(drafts[i]) < counts[i]
            ]
            news = [[drafts[i][-1]] for i in live]
        return drafts

    def _known(self, seq: _Sequence) -> int:
        return self.mgr.num_tokens(seq.seq_id) if seq.seq_id in self.mgr else len(seq.tokens)

    def verified(self, seqs: list[_Sequence], drafts: list[list[int]], accepted: list[int]) -> None:
        # The draft KV holds every draft but the last; keep the accepted ones.
        ids, dropped = [], []
        for seq, draft, a in zip(seqs, drafts, accepted, strict=True):
            if draft and seq.seq_id in self.mgr:
                ids.append(seq.seq_id)
                dropped.append(len(draft) - 1 - min(a, len(draft) - 1))
        self.mgr.rollback(ids, dropped)
        self.mgr.commit(ids)

    def fork(self, parent: _Sequence, child: _Sequence) -> None:
        if parent.seq_id in self.mgr:
            self.mgr.fork(parent.seq_id, child.seq_id)

    def drop(self, seq: _Sequence) -> None:
        if seq.seq_id in self.mgr:
            self.mgr.free(seq.seq_id)

    def check(self) -> None:
        assert len(self.mgr) == 0, "every draft sequence is freed"
        self.mgr.check()


class _Engine:
    """The scheduler state of one `generate` call."""

    def __init__(
        self,
        model: Model,
        requests: Sequence[Request],
        *,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int,
        prefill_chunk: int | None,
        backend: BackendName,
        device: torch.device,
        store: Store | None = None,
        model_id: str = "",
        hash_key: bytes | None = None,
        kv_dtype: torch.dtype | None = None,
        kv_scales: Sequence[tuple[float, float]] | None = None,
        speculate: int = 0,
        drafter: Drafter | None = None,
    ) -> None:
        self.runner = _paged_runner(
            model, num_blocks, block_size, backend, device, kv_dtype, kv_scales
        )
        self.gpu = self.runner.cache
        self.mgr: BlockManager | HybridManager
        self.cpu: KVCache | GroupedKVCache
        pin = device.type == "cuda"
        if isinstance(self.gpu, GroupedKVCache):
            self.mgr = HybridManager(
                num_blocks,
                block_size,
                self.gpu.groups.attention,
                num_cpu_blocks=num_cpu_blocks,
                hash_key=hash_key,
                block_feed=store is not None,  # the tier saves every group's blocks
            )
            pool = self.gpu.pool
            self.cpu = GroupedKVCache(
                self.gpu.groups,
                max(num_cpu_blocks, 1),
                block_size,
                pool.num_kv_heads,
                pool.head_dim,
                pool.dtype,
                "cpu",
                pin_memory=pin,
            )
        else:
            self.mgr = BlockManager(
                num_blocks,
                block_size,
                num_cpu_blocks=num_cpu_blocks,
                hash_key=hash_key,
                enable_events=store is not None,
            )
            self.cpu = KVCache(
                self.gpu.num_layers,
                max(num_cpu_blocks, 1),
                block_size,
                self.gpu.num_kv_heads,
                self.gpu.head_dim,
                self.gpu.dtype,
                "cpu",
                layout=self.gpu.layout,
                rope_dim=self.gpu.rope_dim,
                scales=kv_scales,
                pin_memory=pin,
            )
        # Each step a running sequence may grow by a block in every group.
        self.num_groups = self.mgr.num_groups if isinstance(self.mgr, HybridManager) else 1
        self.speculate = speculate
        self.drafter = drafter if speculate else None
        self.tier = KVTier(store, model_id, self.mgr, self.gpu) if store is not None else None
        self.device = device
        self.block_size = block_size
        self.requests = list(requests)
        self.chunk = prefill_chunk
        self.waiting = sorted(range(len(requests)), key=lambda r: requests[r].arrival_step)
        self.running: list[_Sequence] = []  # oldest admission first
        self.swapped: list[_Sequence] = []
        self.next_id = 0
        self.result = GenerationResult(
            tokens=[[[] for _ in range(r.num_samples)] for r in requests]
        )

    def _computed_blocks(self) -> list[Event] | list[Registration]:
        """What the tier saves from: a hybrid manager's every group's registrations, else the
        events."""
        if isinstance(self.mgr, HybridManager):
            return self.mgr.take_registrations()
        return self.mgr.take_events()

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _available(self) -> int:
        # A hybrid manager's groups share one pool: any group's stats count all of it.
        stats = self.mgr.stats(0) if isinstance(self.mgr, HybridManager) else self.mgr.stats()
        return int(stats.num_free + stats.num_cached)

    def _prompt_blocks(self, num_tokens: int) -> int:
        """Blocks a prompt chunk of `num_tokens` tokens may hold: all of them in every group
        (its queries together read every one of its tokens, whatever the window)."""
        return self.num_groups * -(-num_tokens // self.block_size)

    def _has_room(self, num_blocks: int) -> bool:
        """Room for `num_blocks` more plus a block of growth per group and running sequence."""
        return self._available() - num_blocks > len(self.running) * self.num_groups

    def _swap_in(self) -> None:
        """Bring swapped sequences back, oldest first, while they fit with room to grow."""
        while self.swapped:
            seq = self.swapped[0]
            if not self._has_room(seq.swapped_blocks):
                return
            self.gpu.swap_in(self.cpu, self.mgr.swap_in([seq.seq_id]))  # type: ignore[arg-type]
            # The copy is queued on the device's stream ahead of the next forward pass.
            self.mgr.confirm_swap_in([seq.seq_id])
            self.running.append(self.swapped.pop(0))

    def _admit(self, step: int) -> list[_Sequence]:
        """Admit arrived requests in order while they fit; none while any sequence is swapped."""
        admitted: list[_Sequence] = []
        while self.waiting and not self.swapped:
            r = self.waiting[0]
            req = self.requests[r]
            if req.arrival_step > step:
                break
            prompt = [int(t) for t in req.prompt]
            first = prompt[: self.chunk] if self.chunk else prompt
            fits = self._has_room(self._prompt_blocks(len(first)))
            if not (fits and self.mgr.can_allocate(first)):
                break
            seq = _Sequence(self._new_id(), r, 0, prompt, req.max_new_tokens)
            if self.tier is not None:  # GPU prefix hit, then the blocks the store holds
                seq.computed = self.tier.admit(seq.seq_id, first)
            else:
                seq.computed = self.mgr.allocate(seq.seq_id, first)
            self.result.prefix_hit_tokens += seq.computed
            self.running.append(seq)
            admitted.append(seq)
            self.waiting.pop(0)
        return admitted

    def _swap_out(self, seq: _Sequence) -> None:
        pairs = self.mgr.swap_out([seq.seq_id])  # a hybrid manager's: one array per group
        self.gpu.swap_out(self.cpu, pairs)  # type: ignore[arg-type]
        self.mgr.confirm_swap_out([seq.seq_id])  # the GPU blocks may be reused from here on
        seq.swapped_blocks = sum(map(len, pairs)) if isinstance(pairs, list) else len(pairs)
        self.result.swapped_out_blocks += seq.swapped_blocks
        if self.drafter is not None:
            self.drafter.drop(seq)
        self.running.remove(seq)
        self.swapped.insert(0, seq)

    def _grow(self, seq: _Sequence, batch: list[_Sequence], draft: list[int]) -> int:
        """Append `seq`'s next prompt chunk or sampled token (and `draft`); returns its query
        length.

        When the pool is full, the youngest sequences not yet in this step's batch are swapped
        out to make room; failing those, `seq` itself is (and 0 is returned), unless it is the
        only sequence left to run.
        """
        if seq.prefilling:
            end = len(seq.prompt) if not self.chunk else seq.computed + self.chunk
            new = seq.prompt[seq.computed : end]
        else:
            assert seq.next_token is not None
            new = [seq.next_token, *draft]
        while True:
            try:
                self.mgr.append(seq.seq_id, new)
                return len(new)
            except OutOfBlocks:
                victims = [s for s in self.running if s is not seq and s not in batch]
                if victims:
                    self._swap_out(victims[-1])
                elif batch:
                    self._swap_out(seq)
                    return 0
                else:
                    raise

    def _propose(self) -> dict[_Sequence, list[int]]:
        """Draft tokens for each decoding sequence, never more than it has left to generate."""
        if self.drafter is None:
            return {}
        seqs = [s for s in self.running if not s.prefilling]
        counts = [min(self.speculate, s.max_new_tokens - len(s.generated) - 1) for s in seqs]
        return dict(zip(seqs, self.drafter.propose(seqs, counts), strict=True))

    def step(self, step: int) -> None:
        """One engine step: swap in, draft, grow the running sequences, admit, compute (and
        verify the drafts), sample."""
        self._swap_in()
        drafts = self._propose()
        batch: list[_Sequence] = []
        q_lens: list[int] = []
        for seq in list(self.running):
            if seq not in self.running:  # swapped out to make room for an older sequence
                continue
            q = self._grow(seq, batch, drafts.get(seq, []))
            if q:
                q_lens.append(q)
                batch.append(seq)
        # Admitted after the others grew: a sequence admitted now is not a swap victim before
        # its prefill runs (the manager would refuse to share its pending KV anyway).
        for seq in self._admit(step):
            q_lens.append(self.mgr.num_tokens(seq.seq_id) - seq.computed)
            batch.append(seq)
        if not batch:
            # Nothing runs, so nothing will change: a due request or a swapped-out sequence
            # that does not fit now never will.
            due = any(self.requests[r].arrival_step <= step for r in self.waiting)
            if self.swapped or due:
                raise RuntimeError(
                    f"a pool of {self.mgr.num_blocks} blocks cannot hold the next sequence"
                )
            return
        ids = [s.seq_id for s in batch]
        # Planning commits each sequence's previous forward pass (auto-commit) and hands back
        # the copy-on-write pairs this batch must apply before its own forward pass.
        plan = self.mgr.plan(ids, q_lens)  # a hybrid manager's: one per group
        plans = plan if isinstance(plan, list) else [plan]
        self.result.copied_blocks += sum(len(p.copies) for p in plans)
        tokens: list[int] = []
        rows: list[int] = []  # a prefill's last row; every row of a decode and its drafts
        for seq, q, end in zip(batch, q_lens, plans[0].qo_indptr[1:].tolist(), strict=True):
            tokens += self.mgr.token_ids(seq.seq_id)[-q:].tolist()
            rows += range(end - q, end) if not seq.prefilling else [end - 1]
        greedy = iter(_forward(self.runner, plan, tokens, rows, self.device))
        if self.tier is not None:  # save the blocks this step's commit made computed
            self.tier.offer(self._computed_blocks())

        self.result.steps += 1
        self.result.max_batch_size = max(self.result.max_batch_size, len(batch))
        if any(s.prefilling for s in batch) and any(not s.prefilling for s in batch):
            self.result.mixed_steps += 1
        prefilled: list[_Sequence] = []
        emits: list[tuple[_Sequence, list[int]]] = []
        checked: list[tuple[_Sequence, list[int], int]] = []  # (sequence, drafts, accepted)
        for seq, q in zip(batch, q_lens, strict=True):
            if seq.prefilling:
                seq.computed += q
                token = next(greedy)
                if not seq.prefilling:
                    prefilled.append(seq)
                    emits.append((seq, [token]))
                continue
            # Verify: the target's greedy tokens after the last sampled one and each draft.
            target = [next(greedy) for _ in range(q)]
            draft = drafts.get(seq, [])
            accepted = 0
            while accepted < len(draft) and draft[accepted] == target[accepted]:
                accepted += 1
            seq.computed += 1 + accepted
            emits.append((seq, target[: accepted + 1]))  # the accepted drafts and one more
            if draft:
                checked.append((seq, draft, accepted))
        self._settle(checked, prefilled)
        for seq, new in emits:
            self._emit(seq, new)

    def _settle(
        self, checked: list[tuple[_Sequence, list[int], int]], prefilled: list[_Sequence]
    ) -> None:
        """Rolls back the rejected drafts (target and drafter) and counts acceptance."""
        if self.drafter is None:
            return
        rejected = [(s.seq_id, len(d) - a) for s, d, a in checked if len(d) > a]
        if rejected:
            self.mgr.rollback([i for i, _ in rejected], [n for _, n in rejected])
        for _, draft, accepted in checked:
            self.result.proposed_drafts += len(draft)
            self.result.accepted_drafts += accepted
        self.drafter.verified(
            [c[0] for c in checked], [c[1] for c in checked], [c[2] for c in checked]
        )
        if prefilled:
            self.drafter.prefilled(prefilled)

    def _emit(self, seq: _Sequence, tokens: list[int]) -> None:
        req = self.requests[seq.request]
        first = not seq.generated
        seq.generated += tokens
        seq.next_token = tokens[-1]
        if first and seq.sample == 0:
            # Parallel samples share the prompt's blocks, the partial last one included.
            for sample in range(1, req.num_samples):
                child = _Sequence(
                    self._new_id(),
                    seq.request,
                    sample,
                    seq.prompt,
                    seq.max_new_tokens,
                    seq.computed,
                    seq.next_token,
                    list(seq.generated),
                )
                self.mgr.fork(seq.seq_id, child.seq_id)
                if self.drafter is not None:
                    self.drafter.fork(seq, child)
                self.running.append(child)
                self._finish_if_done(child)
        self._finish_if_done(seq)

    def _finish_if_done(self, seq: _Sequence) -> None:
        if len(seq.generated) >= seq.max_new_tokens:
            self.result.tokens[seq.request][seq.sample] = list(seq.generated)
            if isinstance(self.mgr, HybridManager):
                self.result.window_released_blocks += sum(
                    self.mgr.first_block(seq.seq_id, g) for g in range(self.num_groups)
                )
            self.mgr.free(seq.seq_id)
            if self.drafter is not None:
                self.drafter.drop(seq)
            self.running.remove(seq)

    def run(self) -> GenerationResult:
        step = 0
        while self.waiting or self.running or self.swapped:
            self.step(step)
            step += 1
        if self.tier is not None:
            self.tier.offer(self._computed_blocks())
            self.tier.close()
            self.result.tier = self.tier.stats()
        self.mgr.check()
        if self.drafter is not None:
            self.drafter.check()
            self.result.draft_copied_blocks = self.drafter.copied_blocks
        return self.result


@torch.inference_mode()
def generate(
    model: Model,
    requests: Sequence[Request],
    *,
    block_size: int = 16,
    num_blocks: int = 256,
    num_cpu_blocks: int = 64,
    prefill_chunk: int | None = None,
    backend: BackendName = "auto",
    device: torch.device | str | None = None,
    store: Store | None = None,
    model_id: str = "tiny-llama",
    hash_key: bytes | None = None,
    kv_dtype: torch.dtype | None = None,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    speculate: int = 0,
    draft_model: UniformModel | None = None,
) -> GenerationResult:
    """Greedy continuous-batching generation of `requests` with `model`'s weights.

    `kv_dtype` (default: the model's dtype) and `kv_scales` (per layer, for float8) pick the
    cache's dtype; a DeepSeek-V3 model gets an MLA cache. A hybrid model (`HybridModel`) runs
    on a `HybridManager` over a `GroupedKVCache` in its own dtype, without a `draft_model`
    (prompt lookup drafts for it); a `store` then saves and loads every group's blocks.

    `prefill_chunk` caps the prompt tokens a sequence brings to one step (prefix-cache hits are
    then looked up within its first chunk). `device` defaults to the model's. With a `store`,
    computed blocks are saved there under `model_id` and admissions load what it holds; engines
    share blocks only when they also share the manager's `hash_key` (32 bytes; None is random).

    `speculate=k` verifies up to k draft tokens per sequence and step, proposed by `draft_model`
    (on a draft cache of `num_blocks` blocks) or, without one, by prompt lookup; the tokens are
    the same as without speculation.
    """
    for req in requests:
        if not req.prompt or req.max_new_tokens < 1 or req.num_samples < 1:
            raise ValueError(
                f"a request needs a prompt, max_new_tokens >= 1 and num_samples >= 1: {req}"
            )
    if isinstance(model, HybridModel) and draft_model is not None:
        raise ValueError("a hybrid model runs without a draft model")
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    drafter: Drafter = (
        NgramDrafter()
        if draft_model is None
        else ModelDrafter(
            draft_model, num_blocks=num_blocks, block_size=block_size, backend=backend, device=dev
        )
    )
    engine = _Engine(
        model,
        requests,
        block_size=block_size,
        num_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks,
        prefill_chunk=prefill_chunk,
        backend=backend,
        device=dev,
        store=store,
        model_id=model_id,
        hash_key=hash_key,
        kv_dtype=kv_dtype,
        kv_scales=kv_scales,
        speculate=speculate,
        drafter=drafter,
    )
    return engine.run()


def tiny_llama(seed: int = 0, vocab_size: int = 128) -> LlamaForCausalLM:
    """A small, randomly initialised Llama (2 layers, GQA 4:2), built offline and seeded."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return _seeded(LlamaForCausalLM, config, seed)


def tiny_deepseek(seed: int = 0, vocab_size: int = 128) -> DeepseekV3ForCausalLM:
    """A small, randomly initialised DeepSeek-V3 (MLA, one dense and one MoE layer), seeded."""
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return _seeded(DeepseekV3ForCausalLM, config, seed)


def _hybrid_fields(vocab_size: int) -> dict[str, Any]:
    """Config fields the tiny hybrid models share: 4 heads over 2 KV heads of 16, eager
    attention in `transformers` (the reference the paged run must equal)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "attn_implementation": "eager",
    }


def tiny_gemma3(seed: int = 0, vocab_size: int = 128, window: int = 8) -> Gemma3ForCausalLM:
    """A small random Gemma 3 (text): sliding-window and full layers alternating, a local rope
    base of its own, a softmax scale other than 1/sqrt(head_dim), a final logit soft cap."""
    config = Gemma3TextConfig(
        intermediate_size=128,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=32,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        **_hybrid_fields(vocab_size),
    )
    return _seeded(Gemma3ForCausalLM, config, seed)


def tiny_gpt_oss(seed: int = 0, vocab_size: int = 128, window: int = 8) -> GptOssForCausalLM:
    """A small random gpt-oss: sliding-window and full layers alternating, sinks, YaRN rope,
    4 experts (2 per token)."""
    config = GptOssConfig(
        intermediate_size=64,
        sliding_window=window,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
        **_hybrid_fields(vocab_size),
    )
    return _seeded(GptOssForCausalLM, config, seed)


def tiny_llama4(seed: int = 0, vocab_size: int = 128, window: int = 8) -> Llama4ForCausalLM:
    """A small random Llama 4 (text): chunked-local layers (rope) and full layers (NoPE, their
    queries scaled by `1 + log1p(floor((pos + 1) / 4))`) alternating; MoE every other layer."""
    config = Llama4TextConfig(
        intermediate_size=64,
        intermediate_size_mlp=128,
        attention_chunk_size=window,
        no_rope_layers=[1, 0, 1, 0],  # 1: rope and a chunk; 0: no rope, full attention
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        floor_scale=4,
        attn_scale=1.0,
        **_hybrid_fields(vocab_size),
    )
    return _seeded(Llama4ForCausalLM, config, seed)


def first_layers(model: Any, num_layers: int) -> Any:
    """A copy of `model` that keeps only its first `num_layers` decoder layers (a draft that
    shares the target's embeddings, first layers and head)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    return draft


def _seeded(model_class: Any, config: Any, seed: int) -> Any:
    """`model_class(config)` with its random weights drawn from `seed`, in eval mode."""
    torch.manual_seed(seed)
    model = model_class(config)
    model.eval()
    return model


TINY_MODELS: dict[str, Callable[[], Model]] = {
    "llama": tiny_llama,
    "deepseek": tiny_deepseek,
    "gemma3": tiny_gemma3,
    "gpt-oss": tiny_gpt_oss,
    "llama4": tiny_llama4,
}


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "flashinfer"])
    parser.add_argument("--model", default="llama", choices=sorted(TINY_MODELS))
    parser.add_argument("--kv-dtype", default="model", choices=["model", "fp8"])
    parser.add_argument("--redis", metavar="URL", help="share computed blocks through Redis")
    parser.add_argument(
        "--speculate", metavar="K", type=int, default=0, help="verify up to K drafts a step"
    )
    parser.add_argument(
        "--drafter",
        default="ngram",
        choices=["ngram", "model"],
        help="prompt lookup, or a draft model: the target's first layer",
    )
    parser.add_argument(
        "--hash-key",
        metavar="HEX",
        default="00" * 32,
        help="the 32-byte prefix hash key, shared by every engine that shares blocks",
    )
    args = parser.parse_args()
    store = None
    if args.redis:
        from pagedkv.tier.redis_store import RedisStore

        store = RedisStore(args.redis)
    model = TINY_MODELS[args.model]().to(args.device)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else None
    draft = first_layers(model, 1) if args.speculate and args.drafter == "model" else None
    shared = list(range(1, 40))
    requests = [
        Request([*shared, 50, 51], 12),
        Request([*shared, 60], 12, arrival_step=3),
        Request(list(range(70, 95)), 10, arrival_step=1, num_samples=3),
        Request([7, 8, 9], 16, arrival_step=5),
    ]
    result = generate(
        model,
        requests,
        backend=args.backend,
        block_size=4,  # the hybrid models' windows are 8 tokens
        store=store,
        model_id=f"tiny-{args.model}",  # each model's blocks in a key space of its own
        hash_key=bytes.fromhex(args.hash_key),
        kv_dtype=kv_dtype,
        speculate=args.speculate,
        draft_model=draft,
    )
    for i, samples in enumerate(result.tokens):
        print(f"request {i}: {samples}")
    print(
        f"steps={result.steps} prefix_hit_tokens={result.prefix_hit_tokens} "
        f"copied_blocks={result.copied_blocks} swapped_out_blocks={result.swapped_out_blocks} "
        f"mixed_steps={result.mixed_steps} max_batch={result.max_batch_size} "
        f"window_released_blocks={result.window_released_blocks}"
    )
    if args.speculate:
        print(
            f"speculate={args.speculate} drafter={args.drafter} "
            f"accepted={result.accepted_drafts}/{result.proposed_drafts} drafts "
            f"(acceptance rate {result.acceptance_rate:.2f})"
        )
    if result.tier is not None:
        print(f"tier: {result.tier}")


if __name__ == "__main__":
    _main()
