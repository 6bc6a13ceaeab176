"""Continuous batching of a hybrid recurrent model: a `transformers` Qwen3-Next on pagedkv.

Qwen3-Next interleaves full-attention layers with Gated DeltaNet layers (linear attention: a
causal convolution and a recurrent state per sequence, no KV). `HybridManager` runs one KV
group (`Attention.full()`) for the attention layers and a state group for the recurrent ones:
each sequence has a working state slot, and prompts leave checkpoints (the state after a
block-aligned prefix) that a later prompt with the same prefix resumes from.

`PagedQwen3Next` runs the model's own weights and torch math token-packed: attention layers
write and read K/V through `KVCache` + `PagedAttention` with group 0's plan; recurrent layers
run each row's query on its state slot in a `StateCache`, cut where the plan saves a
checkpoint (`state_segments`), after `StateCache.apply` made the plan's state copies (prefix
hits, forks) and resets (new prompts).

`generate(model, requests)` decodes greedily for many requests at once: arrivals between steps,
prefills (in chunks if asked) mixed with decodes, prefix hits resumed from checkpoints, parallel
samples forked after the prefill (the child's state arrives as a plan's state copy), and, when
the KV pool or the state slots run out, preemption: the youngest sequence is swapped out (its
KV blocks and its state to CPU pools, `cpu_blocks=`) or freed and later admitted again with its
generated tokens as prompt (mostly a prefix hit). With `speculate=K`, decodes verify up to K
drafts proposed by prompt lookup (what followed the sequence's last tokens earlier on): the pass
plans them with `drafts=`, so the state group saves the state after each token before a draft,
and `rollback` of the rejected drafts makes the last accepted token's state the working slot.

Run it: ``python examples/recurrent_batching.py`` (a small random Qwen3-Next, no download;
``--checkpoint-interval 8`` also saves a checkpoint every 8 tokens of a prompt, ``--speculate 3``
verifies up to 3 drafts a step).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from continuous_batching import Request, prompt_lookup
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.activations import ACT2FN
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from pagedkv import Attention, HybridManager, OutOfBlocks, Plan, StateConfig, StateStats
from pagedkv.attention import BackendName, PagedAttention
from pagedkv.kv_cache import KVCache
from pagedkv.state_cache import StateCache, state_segments, state_shapes


@dataclass
class GenerationResult:
    """Generated tokens per request and sample, and what the run exercised."""

    tokens: list[list[list[int]]]
    steps: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens `allocate` reused (KV and state)
    hits: list[int] = field(default_factory=list)  # per admission, in admission order
    state_copies: int = 0
    state_saves: int = 0
    split_rows: int = 0  # rows whose query a save cut in two
    preempted: int = 0
    swapped_out: int = 0  # preemptions that moved the KV blocks and the state to the CPU
    mixed_steps: int = 0
    max_batch_size: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    unverified_drafts: int = 0  # dropped before their pass: no slots for their states
    restored_states: int = 0  # rollbacks that made a draft state the working state
    state: StateStats | None = None


@dataclass(eq=False)  # identity: two samples may hold equal state
class _Sequence:
    seq_id: int
    request: int
    sample: int
    prompt: list[int]
    max_new_tokens: int
    context: list[int]  # what its prefill computes: the prompt, or more after a preemption
    computed: int = 0
    next_token: int | None = None
    generated: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # appended after `next_token` this step

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.context)


class PagedQwen3Next:
    """Runs a `Qwen3NextForCausalLM`'s modules token-packed: full attention over a paged KV
    cache, Gated DeltaNet over state slots."""

    def __init__(
        self, model: Qwen3NextForCausalLM, kv: KVCache, attn: PagedAttention, states: StateCache
    ) -> None:
        cfg = model.config
        self.model = model
        self.kv = kv
        self.attn = attn
        self.states = states
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # Model layer -> its layer in the KV cache or in the state cache.
        self.index: list[int] = []
        counts = {"full_attention": 0, "linear_attention": 0}
        for kind in cfg.layer_types or []:
            self.index.append(counts[kind])
            counts[kind] += 1

    def forward(self, input_ids: torch.Tensor, plan: Plan, last_rows: torch.Tensor) -> torch.Tensor:
        """Logits at `last_rows` of the step's packed tokens; writes every token's K/V and
        advances every row's state (saving where the plan says)."""
        inner = self.model.model
        positions = torch.from_numpy(plan.positions).to(input_ids.device, torch.int64)
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, positions[None, :])
        slots = self.kv.slot_tensor(plan)
        self.attn.plan(plan)
        segments = state_segments(plan)
        for layer, index in zip(inner.layers, self.index, strict=True):
            x = layer.input_layernorm(h)
            if layer.block_type == "full_attention":
                h = h + self._attention(layer.self_attn, x, cos[0], sin[0], slots, index)
            else:
                out = torch.empty_like(h)
                for seg in segments:
                    conv, recurrent = self.states.states(index, seg.slot)
                    out[seg.start : seg.end] = self._delta_net(
                        layer.linear_attn, x[seg.start : seg.end], conv, recurrent
                    )
                    for save_to in seg.save_to:
                        self.states.copy(index, seg.slot, save_to)
                h = h + out
            mlp = layer.mlp(layer.post_attention_layernorm(h)[None])
            h = h + (mlp[0] if isinstance(mlp, tuple) else mlp)[0]
        logits: torch.Tensor = self.model.lm_head(inner.norm(h[last_rows]))
        return logits

    def _attention(
        self,
        sa: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: Any,
        index: int,
    ) -> torch.Tensor:
        """Gated attention: a query-sized sigmoid gate on the output, q/k norms, partial RoPE."""
        n = x.shape[0]
        q, gate = sa.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = sa.q_norm(q)
        k = sa.k_norm(sa.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = sa.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = qwen3_next.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # type: ignore[no-untyped-call]
        self.kv.write(index, k.contiguous(), v.contiguous(), slots)
        out = self.attn.run(q.contiguous(), self.kv, index).reshape(n, -1)
        result: torch.Tensor = sa.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))
        return result

    @staticmethod
    def _delta_net(
        la: Any, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's `L` tokens through a Gated DeltaNet layer from its states, which are
        updated in place: the model's own math, with the cached state where `transformers`
        keeps it in its cache (chunked for a prefill, recurrent for one token, as `generate`)."""
        length = x.shape[0]
        qkvz, ba = la.in_proj_qkvz(x[None]), la.in_proj_ba(x[None])
        query, key, value, z, b, a = la.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([t.reshape(1, length, -1) for t in (query, key, value)], dim=-1)
        # The causal convolution over the state's last kernel - 1 inputs and the new ones.
        inputs = torch.cat([conv_state[None], mixed.transpose(1, 2)], dim=-1)
        conv_state.copy_(inputs[0, :, inputs.shape[-1] - conv_state.shape[-1] :])
        mixed = F.conv1d(inputs, la.conv1d.weight, la.conv1d.bias, groups=la.conv_dim)
        mixed = ACT2FN[la.activation](mixed).transpose(1, 2)
        query, key, value = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        query = query.reshape(1, length, -1, la.head_k_dim)
        key = key.reshape(1, length, -1, la.head_k_dim)
        value = value.reshape(1, length, -1, la.head_v_dim)
        beta = b.sigmoid()
        g = -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias)
        rule = (
            qwen3_next.torch_recurrent_gated_delta_rule
            if length == 1
            else qwen3_next.torch_chunk_gated_delta_rule
        )
        out, state = rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=recurrent_state[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        recurrent_state.copy_(state[0])
        out = la.norm(out.reshape(-1, la.head_v_dim), z.reshape(-1, la.head_v_dim))
        result: torch.Tensor = la.out_proj(out.reshape(length, -1))
        return result


def paged_runner(
    model: Qwen3NextForCausalLM,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    backend: BackendName,
    device: torch.device,
) -> PagedQwen3Next:
    """`model` on a KV cache of `num_blocks` blocks and a state cache of `num_slots` slots."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    attention_layers = (cfg.layer_types or []).count("full_attention")
    kv = KVCache(
        attention_layers,
        num_blocks,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
        dtype,
        device,
    )
    attn = PagedAttention(
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        block_size,
        backend,
        device=device,
        dtype=dtype,
    )
    layers, shapes = state_shapes(cfg)
    # The recurrent state stays float32, as the model's own delta rule computes it.
    states = StateCache(len(layers), num_slots, shapes, [dtype, torch.float32], device)
    return PagedQwen3Next(model, kv, attn, states)


class _Engine:
    """The scheduler state of one `generate` call."""

    def __init__(
        self,
        model: Qwen3NextForCausalLM,
        requests: Sequence[Request],
        *,
        block_size: int,
        num_blocks: int,
        state: StateConfig,
        cpu_blocks: int,
        prefill_chunk: int | None,
        speculate: int,
        backend: BackendName,
        device: torch.device,
    ) -> None:
        self.speculate = speculate
        self.mgr = HybridManager(
            num_blocks, block_size, [Attention.full()], num_cpu_blocks=cpu_blocks, state=state
        )
        self.runner = paged_runner(model, num_blocks, block_size, state.num_slots, backend, device)
        kv, states = self.runner.kv, self.runner.states
        # Swap preemption: CPU copies of both caches (the state's with `num_cpu_slots` rows).
        self.cpu_kv = KVCache(
            kv.num_layers, max(1, cpu_blocks), block_size, kv.num_kv_heads, kv.head_dim, kv.dtype
        )
        self.cpu_states = StateCache(
            states.num_layers, max(1, state.num_cpu_slots), states.shapes, states.dtypes
        )
        self.swapped: list[_Sequence] = []  # swapped out, brought back first, oldest first
        self.device = device
        self.block_size = block_size
        self.chunk = prefill_chunk
        self.requests = list(requests)
        self.waiting = sorted(range(len(requests)), key=lambda r: requests[r].arrival_step)
        self.preempted: list[_Sequence] = []  # recomputed first, oldest first
        self.running: list[_Sequence] = []  # oldest admission first
        self.next_id = 0
        self.result = GenerationResult(
            tokens=[[[] for _ in range(r.num_samples)] for r in requests]
        )

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _has_room(self, num_tokens: int) -> bool:
        """Room for `num_tokens` more plus one block of growth per running sequence."""
        stats = self.mgr.stats(0)
        needed = -(-num_tokens // self.block_size)
        return int(stats.num_free + stats.num_cached) - needed > len(self.running)

    def _admit(self, step: int) -> list[_Sequence]:
        """Preempted sequences, then arrived requests, in order while they fit."""
        admitted: list[_Sequence] = []
        while self.preempted or self.waiting:
            if self.preempted:
                seq = self.preempted[0]
            else:
                r = self.waiting[0]
                req = self.requests[r]
                if req.arrival_step > step:
                    break
                prompt = [int(t) for t in req.prompt]
                seq = _Sequence(-1, r, 0, prompt, req.max_new_tokens, prompt)
            first = seq.context[: self.chunk] if self.chunk else seq.context
            if not self._has_room(len(first)):
                break
            seq.seq_id = self._new_id()
            try:
                seq.computed = self.mgr.allocate(seq.seq_id, first)
            except OutOfBlocks:  # no state slot, or no block after all: wait
                break
            if self.preempted:
                self.preempted.pop(0)
            else:
                self.waiting.pop(0)
            self.result.prefix_hit_tokens += seq.computed
            self.result.hits.append(seq.computed)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _swap_in(self) -> None:
        """Bring swapped-out sequences back, oldest first, while the pools hold them."""
        while self.swapped:
            seq = self.swapped[0]
            if not self._has_room(self.mgr.num_tokens(seq.seq_id)):
                return
            try:
                pairs = self.mgr.swap_in([seq.seq_id])  # each group's, then the state's
            except OutOfBlocks:
                return
            self.runner.kv.swap_in(self.cpu_kv, pairs[0])
            self.cpu_states.swap(self.runner.states, pairs[-1])
            self.mgr.confirm_swap_in([seq.seq_id])
            self.swapped.pop(0)
            self.running.append(seq)

    def _preempt(self, seq: _Sequence) -> None:
        """Swap `seq` out to the CPU pools; or, when they cannot take it (or its state is still
        to be copied in by the next plan), free it: it is admitted again later and recomputes
        what it had."""
        pairs = None
        if self.mgr.num_cpu_blocks:
            try:
                pairs = self.mgr.swap_out([seq.seq_id])
            except (OutOfBlocks, ValueError):
                pairs = None
        if pairs is not None:
            self.runner.kv.swap_out(self.cpu_kv, pairs[0])
            self.runner.states.swap(self.cpu_states, pairs[-1])
            self.mgr.confirm_swap_out([seq.seq_id])
            self.running.remove(seq)
            self.swapped.append(seq)
            self.result.swapped_out += 1
            return
        self.mgr.free(seq.seq_id)
        self.running.remove(seq)
        seq.context = seq.prompt + seq.generated
        seq.computed, seq.next_token = 0, None
        self.preempted.insert(0, seq)
        self.result.preempted += 1

    def _grow(self, seq: _Sequence, batch: list[_Sequence]) -> int:
        """Append `seq`'s next prompt chunk or sampled token; returns its query length. When
        the pool is full the youngest sequence not yet in the batch is preempted; failing that,
        `seq` itself (and 0 is returned), unless it is the only one left to run."""
        if seq.prefilling:
            end = len(seq.context) if not self.chunk else seq.computed + self.chunk
            new = seq.context[seq.computed : end]
        else:
            assert seq.next_token is not None
            left = seq.max_new_tokens - len(seq.generated) - 1
            history = seq.prompt + seq.generated
            seq.drafts = prompt_lookup(history, min(self.speculate, left)) if left > 0 else []
            new = [seq.next_token, *seq.drafts]
        while True:
            try:
                self.mgr.append(seq.seq_id, new)
                return len(new)
            except OutOfBlocks:
                victims = [s for s in self.running if s is not seq and s not in batch]
                if victims:
                    self._preempt(victims[-1])
                elif batch:
                    self._preempt(seq)
                    return 0
                else:
                    raise

    def step(self, step: int) -> None:
        """One engine step: swap in, grow the running sequences, admit, compute, sample."""
        self._swap_in()
        batch: list[_Sequence] = []
        q_lens: list[int] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted to make room for an older sequence
                continue
            q = self._grow(seq, batch)
            if q:
                batch.append(seq)
                q_lens.append(q)
        for seq in self._admit(step):
            batch.append(seq)
            q_lens.append(self.mgr.num_tokens(seq.seq_id) - seq.computed)
        if not batch:
            due = any(self.requests[r].arrival_step <= step for r in self.waiting)
            if self.preempted or self.swapped or due:
                raise RuntimeError("the pools cannot hold the next sequence")
            return
        plan = self._plan(batch, q_lens)
        self.result.state_copies += len(plan.state_copies)
        self.result.state_saves += len(plan.state_saves)
        self.result.split_rows += sum(t < q_lens[row] for row, t, _ in plan.state_saves.tolist())
        self.runner.kv.copy_blocks(plan.copies)
        self.runner.states.apply(plan)
        tokens: list[int] = []
        for seq, q in zip(batch, q_lens, strict=True):
            tokens += self.mgr.token_ids(seq.seq_id)[-q:].tolist()
        input_ids = torch.tensor(tokens, device=self.device)
        # A prefill's last row; every row of a decode (its last sampled token, then its drafts).
        rows: list[int] = []
        for seq, q, end in zip(batch, q_lens, plan.qo_indptr[1:].tolist(), strict=True):
            rows += range(end - q, end) if not seq.prefilling else [end - 1]
        last_rows = torch.tensor(rows, device=self.device)
        logits = self.runner.forward(input_ids, plan, last_rows)
        greedy = iter(logits.argmax(dim=-1).tolist())
        self.result.steps += 1
        self.result.max_batch_size = max(self.result.max_batch_size, len(batch))
        if any(s.prefilling for s in batch) and any(not s.prefilling for s in batch):
            self.result.mixed_steps += 1
        emits: list[tuple[_Sequence, list[int]]] = []
        rejected: list[tuple[int, int]] = []
        for seq, q in zip(batch, q_lens, strict=True):
            if seq.prefilling:
                seq.computed += q
                token = next(greedy)
                if not seq.prefilling:
                    emits.append((seq, [token]))
                continue
            # The target's greedy token after the last sampled one and after each draft.
            target = [next(greedy) for _ in range(q)]
            accepted = 0
            while accepted < len(seq.drafts) and seq.drafts[accepted] == target[accepted]:
                accepted += 1
            self.result.proposed_drafts += len(seq.drafts)
            self.result.accepted_drafts += accepted
            if accepted < len(seq.drafts):
                rejected.append((seq.seq_id, len(seq.drafts) - accepted))
            seq.computed += 1 + accepted
            seq.drafts = []
            emits.append((seq, target[: accepted + 1]))
        if rejected:
            # Back to the state after the last accepted token: a draft state of this pass.
            self.mgr.rollback([i for i, _ in rejected], [n for _, n in rejected])
            self.result.restored_states += len(rejected)
        for seq, new in emits:
            for token in new:
                self._emit(seq, token)

    def _plan(self, batch: list[_Sequence], q_lens: list[int]) -> Plan:
        """Plans the pass, keeping its drafts' states for a rollback (planning commits each
        sequence's previous pass and hands out the copies of KV blocks and state slots and the
        resets this pass applies first). Without slots for those states the drafts are dropped
        instead and `q_lens` shrinks with them."""
        ids = [s.seq_id for s in batch]
        drafts = [len(s.drafts) for s in batch]
        try:
            return self.mgr.plan(ids, q_lens, drafts=drafts)[0]
        except OutOfBlocks:
            if not any(drafts):
                raise
        # Drafts are appended but not planned yet: rolling them back leaves the state alone.
        self.mgr.rollback(ids, drafts)
        for row, seq in enumerate(batch):
            q_lens[row] -= len(seq.drafts)
            self.result.unverified_drafts += len(seq.drafts)
            seq.drafts = []
        return self.mgr.plan(ids, q_lens)[0]

    def _emit(self, seq: _Sequence, token: int) -> None:
        req = self.requests[seq.request]
        first = not seq.generated
        seq.generated.append(token)
        seq.next_token = token
        if first and seq.sample == 0:
            # Parallel samples share the prompt's KV blocks; each gets its own state slot,
            # filled by a state copy from the parent's in the next plan.
            for sample in range(1, req.num_samples):
                child = _Sequence(
                    self._new_id(),
                    seq.request,
                    sample,
                    seq.prompt,
                    seq.max_new_tokens,
                    seq.context,
                    seq.computed,
                    token,
                    [token],
                )
                try:
                    self.mgr.fork(seq.seq_id, child.seq_id)
                except OutOfBlocks:  # no state slot now: recompute it later
                    child.context = child.prompt + child.generated
                    child.computed, child.next_token = 0, None
                    self.preempted.append(child)
                    continue
                self.running.append(child)
                self._finish_if_done(child)
        self._finish_if_done(seq)

    def _finish_if_done(self, seq: _Sequence) -> None:
        if len(seq.generated) >= seq.max_new_tokens:
            self.result.tokens[seq.request][seq.sample] = list(seq.generated)
            self.mgr.free(seq.seq_id)
            self.running.remove(seq)

    def run(self) -> GenerationResult:
        step = 0
        while self.waiting or self.running or self.preempted or self.swapped:
            self.step(step)
            step += 1
        self.mgr.check()
        self.result.state = self.mgr.state_stats()
        return self.result


@torch.inference_mode()
def generate(
    model: Qwen3NextForCausalLM,
    requests: Sequence[Request],
    *,
    block_size: int = 16,
    num_blocks: int = 256,
    num_slots: int = 16,
    max_checkpoints: int | None = None,
    checkpoint_interval: int = 0,
    checkpoints_per_sequence: int = 1,
    cpu_blocks: int = 0,
    prefill_chunk: int | None = None,
    speculate: int = 0,
    backend: BackendName = "auto",
    device: torch.device | str | None = None,
) -> GenerationResult:
    """Greedy continuous-batching generation of `requests` with a Qwen3-Next's weights.

    `num_slots` state slots hold the running sequences' states and up to `max_checkpoints`
    checkpoints (default: what the running sequences leave); `checkpoint_interval` (a
    multiple of `block_size`) also checkpoints every that many tokens, of which a sequence keeps
    its last `checkpoints_per_sequence` (its prompt end counted). With `cpu_blocks` > 0 a
    preemption swaps the sequence's KV blocks and state to CPU pools of that many blocks and
    `num_slots` slots (else, or when they are full, it recomputes). `prefill_chunk` caps the
    prompt tokens a sequence brings to one step. `speculate` > 0 verifies up to that many prompt
    lookup drafts per decode (their states take slots too). `device` defaults to the model's.
    """
    for req in requests:
        if not req.prompt or req.max_new_tokens < 1 or req.num_samples < 1:
            raise ValueError(
                f"a request needs a prompt, max_new_tokens >= 1 and num_samples >= 1: {req}"
            )
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    state = StateConfig(
        num_slots,
        max_checkpoints=max_checkpoints,
        checkpoint_interval=checkpoint_interval,
        checkpoints_per_sequence=checkpoints_per_sequence,
        num_cpu_slots=num_slots if cpu_blocks else 0,
    )
    engine = _Engine(
        model,
        requests,
        block_size=block_size,
        num_blocks=num_blocks,
        state=state,
        cpu_blocks=cpu_blocks,
        prefill_chunk=prefill_chunk,
        speculate=speculate,
        backend=backend,
        device=dev,
    )
    return engine.run()


def tiny_qwen3_next(seed: int = 0, vocab_size: int = 128) -> Qwen3NextForCausalLM:
    """A small, randomly initialised Qwen3-Next (4 layers: Gated DeltaNet and gated attention
    alternating, GQA 4:2, MoE MLPs), built offline and seeded."""
    config = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--checkpoint-interval", metavar="N", type=int, default=0)
    parser.add_argument("--cpu-blocks", metavar="N", type=int, default=0, help="swap pool")
    parser.add_argument("--speculate", metavar="K", type=int, default=0, help="drafts a step")
    args = parser.parse_args()
    model = tiny_qwen3_next().to(args.device)
    shared = list(range(1, 40))
    requests = [
        Request([*shared, *range(50, 60)], 12),  # checkpoints its prompt point, 48
        Request([*shared, 60], 12, arrival_step=3),  # KV hit 32, no state there: saves at 32
        Request([*shared, 70, 71, 72], 10, arrival_step=6),  # resumes from that checkpoint
        Request(list(range(70, 95)), 10, arrival_step=1, num_samples=3),
        Request([7, 8, 9], 16, arrival_step=5),
    ]
    result = generate(
        model,
        requests,
        block_size=16,
        checkpoint_interval=args.checkpoint_interval,
        cpu_blocks=args.cpu_blocks,
        speculate=args.speculate,
        backend=args.backend,
    )
    for i, (req, samples) in enumerate(zip(requests, result.tokens, strict=True)):
        ids = torch.tensor([list(req.prompt)], device=args.device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.max_new_tokens,
                do_sample=False,
            )
        same = all(s == out[0, ids.shape[1] :].tolist() for s in samples)
        print(f"request {i}: {samples} (equal to model.generate: {same})")
    print(
        f"steps={result.steps} prefix_hits={result.hits} state_copies={result.state_copies} "
        f"state_saves={result.state_saves} mixed_steps={result.mixed_steps} "
        f"max_batch={result.max_batch_size} drafts={result.accepted_drafts}/"
        f"{result.proposed_drafts} accepted"
    )
    print(f"state: {result.state}")


if __name__ == "__main__":
    _main()
