"""The state group of `HybridManager` through the binding: a state machine drives admissions
(prompts sharing prefixes, some chunked), decode steps by `step` and `step_batch`, speculative
passes (`verify_batch`, `plan(..., drafts=)`) and rollbacks of their drafts, forks, frees, swaps,
commits and cache resets, and runs every plan on a model of the engine's state tensors (each slot
holds the tokens its state summarizes): every pass must start from the state of exactly the
tokens before it, whether from a reset, a checkpoint, a fork, a swap or a draft state a rollback
restored. Bad configurations name the argument."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import Attention, Batch, HybridManager, OutOfBlocks, StateConfig

BLOCK = 4


class StateEngine:
    """The engine's state tensors, modelled."""

    def __init__(self, num_slots: int) -> None:
        self.slots: list[list[int]] = [[] for _ in range(num_slots)]

    def run(self, plan: Any, rows: list[tuple[int, list[int]]], starts: list[int]) -> None:
        """Applies a plan's copies and resets, then each row's pass from `starts[row]`."""
        for src, dst in plan.state_copies.tolist():
            self.slots[dst] = list(self.slots[src])
        for slot in plan.state_resets.tolist():
            self.slots[slot] = []
        saves = plan.state_saves.tolist()
        assert plan.state_slots.tolist() == [self.working[seq] for seq, _ in rows]
        for row, ((seq, tokens), start) in enumerate(zip(rows, starts, strict=True)):
            working = self.working[seq]
            assert self.slots[working] == tokens[:start], f"sequence {seq} before its pass"
            for saved_row, after, slot in saves:
                if saved_row == row:
                    self.slots[slot] = tokens[: start + after]
            self.slots[working] = list(tokens)

    working: dict[int, int]


class StateGroupMachine(RuleBasedStateMachine):
    @initialize(
        num_slots=st.integers(3, 8),
        interval=st.sampled_from([0, BLOCK, 3 * BLOCK]),
        cap=st.integers(1, 2),
        window=st.booleans(),
        auto_commit=st.booleans(),
    )
    def setup(
        self, num_slots: int, interval: int, cap: int, window: bool, auto_commit: bool
    ) -> None:
        groups = [Attention.full()] + ([Attention.sliding_window(6)] if window else [])
        state = StateConfig(
            num_slots,
            max_checkpoints=num_slots // 2,
            checkpoint_interval=interval,
            checkpoints_per_sequence=cap,
            num_cpu_slots=2,
        )
        self.mgr = HybridManager(
            200,
            BLOCK,
            groups,
            num_cpu_blocks=200,
            watermark=0.0,
            auto_commit=auto_commit,
            state=state,
        )
        self.cpu = StateEngine(2)
        self.swapped: dict[int, list[int]] = {}
        self.auto_commit = auto_commit
        self.engine = StateEngine(num_slots)
        self.engine.working = {}
        self.live: dict[int, list[int]] = {}
        self.next_id = 0
        self.batches: list[Batch] | None = None

    def _refresh_slots(self) -> None:
        self.engine.working = {seq: self.mgr.state_slot(seq) for seq in self.live}

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(stem=st.integers(0, 2), length=st.integers(1, 30), tail=st.lists(st.integers(0, 3)))
    def allocate(self, stem: int, length: int, tail: list[int]) -> None:
        prompt = [stem * 100 + i for i in range(length)] + [50 + t for t in tail]
        seq = self._new_id()
        try:
            reused = self.mgr.allocate(seq, prompt[: max(1, len(prompt) // 2)])
        except OutOfBlocks:
            assert seq not in self.mgr
            return
        self.live[seq] = prompt[: max(1, len(prompt) // 2)]
        self._refresh_slots()
        # A chunked prefill: the first half planned, the rest appended and planned.
        plans = self.mgr.plan([seq], [len(self.live[seq]) - reused])
        self.engine.run(plans[0], [(seq, self.live[seq])], [reused])
        rest = prompt[len(self.live[seq]) :]
        if rest:
            start = len(self.live[seq])
            self.mgr.append(seq, rest)
            self.live[seq] = prompt
            plans = self.mgr.plan([seq], [len(rest)])
            self.engine.run(plans[0], [(seq, prompt)], [start])
        self.batches = None

    @precondition(lambda self: self.live)
    @rule(tokens=st.lists(st.integers(0, 3), min_size=8, max_size=8), persistent=st.booleans())
    def step(self, tokens: list[int], persistent: bool) -> None:
        seqs = sorted(self.live)
        step_tokens = tokens[: len(seqs)] + [0] * max(0, len(seqs) - len(tokens))
        if persistent:
            if self.batches is None:
                self.batches = [Batch() for _ in self.mgr.groups]
                for batch in self.batches:
                    for seq in seqs:
                        batch.add(seq)
            try:
                self.mgr.step_batch(self.batches, step_tokens)
            except OutOfBlocks:
                return
            plan: Any = self.batches[0]
            order = self.batches[0].seq_ids.tolist()
        else:
            try:
                plan = self.mgr.step(seqs, step_tokens)[0]
            except OutOfBlocks:
                return
            order = seqs
        by_seq = dict(zip(seqs, step_tokens, strict=True))
        for seq in order:
            self.live[seq].append(by_seq[seq])
        rows = [(seq, self.live[seq]) for seq in order]
        self.engine.run(plan, rows, [len(t) - 1 for _, t in rows])

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, 3), max_size=3),
        persistent=st.booleans(),
    )
    def speculate(self, data: st.DataObject, drafts: list[int], persistent: bool) -> None:
        """A pass over the last sampled token and `drafts`, then a rollback of the rejected."""
        seq = data.draw(st.sampled_from(sorted(self.live)))
        new = [data.draw(st.integers(0, 3)), *drafts]
        start = len(self.live[seq])
        batches = [Batch() for _ in self.mgr.groups]
        for batch in batches:
            batch.add(seq)
        plan: Any
        if persistent:
            try:
                self.mgr.verify_batch(batches, new, [len(new)])
            except OutOfBlocks:
                return
            plan = batches[0]
        else:
            try:
                self.mgr.append(seq, new)
            except OutOfBlocks:
                return
            try:
                plan = self.mgr.plan([seq], [len(new)], drafts=[len(drafts)])[0]
            except OutOfBlocks:  # no slots for the draft states: drop what was appended
                self.mgr.rollback([seq], [len(new)])
                assert self.mgr.num_tokens(seq) == start
                return
        self.live[seq] = self.live[seq] + new
        self.engine.run(plan, [(seq, self.live[seq])], [start])
        rejected = data.draw(st.integers(0, len(drafts)))
        if persistent:
            self.mgr.rollback_batch(batches, [rejected])
        else:
            self.mgr.rollback([seq], [rejected])
        del self.live[seq][len(self.live[seq]) - rejected :]
        self._refresh_slots()
        if rejected < len(new) - 1:  # a rollback below the pass's first draft state
            with pytest.raises(ValueError, match=r"not kept|left the attention window"):
                self.mgr.rollback([seq], [len(new) - rejected])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.live)))
        child = self._new_id()
        self.mgr.commit([parent])
        try:
            self.mgr.fork(parent, child)
        except OutOfBlocks:
            assert child not in self.mgr
            return
        self.live[child] = list(self.live[parent])
        self._refresh_slots()
        self.batches = None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        pool = sorted(self.live) + sorted(self.swapped)
        seq = data.draw(st.sampled_from(pool))
        self.mgr.free(seq)
        self.live.pop(seq, None)
        self.swapped.pop(seq, None)
        self._refresh_slots()
        self.batches = None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)))
        try:
            pairs = self.mgr.swap_out([seq])
        except (OutOfBlocks, ValueError):
            return  # no CPU slot, or its state still queued: nothing changed
        for gpu, cpu in pairs[-1].tolist():
            self.cpu.slots[cpu] = list(self.engine.slots[gpu])
        self.mgr.confirm_swap_out([seq])
        self.swapped[seq] = self.live.pop(seq)
        self._refresh_slots()
        self.batches = None

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        try:
            pairs = self.mgr.swap_in([seq])
        except OutOfBlocks:
            return
        for cpu, gpu in pairs[-1].tolist():
            self.engine.slots[gpu] = list(self.cpu.slots[cpu])
        self.mgr.confirm_swap_in([seq])
        self.live[seq] = self.swapped.pop(seq)
        self._refresh_slots()
        self.batches = None

    @precondition(lambda self: self.live)
    @rule()
    def commit(self) -> None:
        self.mgr.commit(sorted(self.live))

    @rule()
    def reset(self) -> None:
        self.mgr.reset_prefix_cache()

    @invariant()
    def checked(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check()
            stats = self.mgr.state_stats()
            assert stats.num_working == len(self.live)
            assert stats.num_cpu_free == 2 - len(self.swapped)
            assert stats.num_checkpoints + stats.num_saving <= stats.num_slots // 2


StateGroupMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None
)
TestStateGroupMachine = StateGroupMachine.TestCase


def test_a_shared_system_prompt_hits_from_the_third_request() -> None:
    """900 shared tokens, block 16: the second request saves where it branched off (896), so
    every later one resumes there."""
    mgr = HybridManager(512, 16, [Attention.full()], state=StateConfig(8, max_checkpoints=4))
    system = list(range(1000, 1900))
    reused = []
    for seq in range(6):
        prompt = system + [seq * 100 + i for i in range(40)]
        reused.append(mgr.allocate(seq, prompt))
        mgr.plan([seq], [len(prompt) - reused[-1]])
        mgr.commit([seq])
        mgr.free(seq)
    assert reused == [0, 0, 896, 896, 896, 896]
    stats = mgr.state_stats()
    assert stats.prefix_hit_tokens == 4 * 896
    assert stats.num_checkpoints <= 4


@pytest.mark.parametrize(
    ("state", "field"),
    [
        (lambda: StateConfig(0), "state.num_slots"),
        (lambda: StateConfig(4, max_checkpoints=4), "state.max_checkpoints"),
        (lambda: StateConfig(4, checkpoint_interval=6), "state.checkpoint_interval"),
        (lambda: StateConfig(-1), "num_slots"),
        (lambda: StateConfig(4, checkpoints_per_sequence="2"), "checkpoints_per_sequence"),
    ],
)
def test_bad_state_configs_name_the_argument(state: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        HybridManager(64, 4, [Attention.full()], state=state())


def test_out_of_state_slots_is_out_of_blocks_and_changes_nothing() -> None:
    mgr = HybridManager(64, 4, [Attention.full()], state=StateConfig(2, max_checkpoints=1))
    mgr.allocate(1, [1, 2, 3])
    mgr.allocate(2, [4, 5, 6])
    mgr.plan([1], [3])
    mgr.commit([1])  # a parent forks once its tokens are computed
    before = mgr.stats(0)
    with pytest.raises(OutOfBlocks, match="state slots"):
        mgr.allocate(3, [7, 8, 9])
    with pytest.raises(OutOfBlocks, match="state slots"):
        mgr.fork(1, 4)
    assert 3 not in mgr and 4 not in mgr
    assert mgr.stats(0).num_held == before.num_held
    mgr.check()


def test_state_refusals_name_the_call() -> None:
    mgr = HybridManager(64, 4, [Attention.full()], num_cpu_blocks=8, state=StateConfig(4))
    mgr.allocate(1, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="plan it before swapping it out"):
        mgr.swap_out([1])
    mgr.plan([1], [5])
    with pytest.raises(ValueError, match="its state after them was not kept"):
        mgr.rollback([1], [1])  # a pass planned without drafts keeps no earlier state
    with pytest.raises(OutOfBlocks, match="state slots"):
        mgr.swap_out([1])  # no CPU state slot
    with pytest.raises(ValueError, match="3 drafts in a query of 3 tokens"):
        mgr.plan([1], [3], drafts=[3])
    with pytest.raises(ValueError, match="1 sequences but 2 draft counts"):
        mgr.plan([1], [3], drafts=[1, 1])
    with pytest.raises(ValueError, match="no state group"):
        HybridManager(64, 4, [Attention.full()]).state_stats()
    assert mgr.num_tokens(1) == 5
    mgr.check()


def test_a_state_recompute_writes_no_cached_kv() -> None:
    """A prompt whose KV is cached further than its state's checkpoint: the KV groups reuse it,
    the plan recomputes the state from the checkpoint with slot -1 over the cached KV, and
    `KVCache.write` leaves those blocks as they are."""
    torch = pytest.importorskip("torch")
    from pagedkv import KVCache

    mgr = HybridManager(64, 4, [Attention.full()], state=StateConfig(4, max_checkpoints=2))
    cache = KVCache(1, 64, 4, 1, 2, dtype=torch.float32)
    first = list(range(10))
    mgr.allocate(1, first)
    plan = mgr.plan([1], [10])[0]
    cache.write(0, torch.ones(10, 1, 2), torch.ones(10, 1, 2), plan)
    for t in (50, 51, 52):  # the KV grows past the prompt's checkpoint at 8
        plan = mgr.step([1], [t])[0]
        cache.write(0, torch.ones(1, 1, 2), torch.ones(1, 1, 2), plan)
    history = [*first, 50, 51, 52]
    mgr.free(1)
    before = cache.layer(0).clone()
    prompt = [*history, 70, 71]
    assert mgr.allocate(2, prompt) == 8  # the state resumes at the prompt's checkpoint
    assert mgr.stats(0).prefix_hit_tokens == 12  # the KV at 12 (3 computed full blocks)
    plan = mgr.plan([2], [len(prompt) - 8])[0]
    assert plan.slot_mapping.tolist()[:4] == [-1] * 4
    assert (plan.slot_mapping[4:] >= 0).all()
    cache.write(0, torch.full((7, 1, 2), 9.0), torch.full((7, 1, 2), 9.0), plan)
    table = mgr.block_table(2, 0).tolist()
    assert torch.equal(cache.layer(0)[table[:3]], before[table[:3]])
    assert (cache.layer(0)[table[3]][:, :, 1:] == 9.0).all()
    with pytest.raises(ValueError, match="-1"):
        cache.slot_tensor(np.array([-2, 0]))
    mgr.check()
