"""Drive pagedkv.BlockManager and the Python reference model side by side with Hypothesis.

The semantics are deterministic (rust/core/SEMANTICS.md), so after every operation both must
agree on everything observable: physical block ids, copies, swap pairs, plans, computed token
counts, statistics, events (up to the hash values, which only have to correspond one to one) and
errors. Pools are small so that eviction, copy-on-write and OutOfBlocks happen often; some
examples turn auto-commit off, so plans, commits and swap confirmations interleave freely.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference_manager import PLAN_ARRAYS, STATS_FIELDS, ReferenceBlockManager

from pagedkv import BlockManager, OutOfBlocks

KEY = bytes(range(32))
MAX_ID = 8
# Shared system prompts over a tiny alphabet: prefix hits and equal blocks under different
# parents are the common case, not the exception.
SYSTEM_PROMPTS = ([1, 2, 3, 1, 2, 3, 1, 2], [3, 3, 2, 2, 1, 1], [0, 1] * 5)
SALTS = (None, None, None, b"tenant-a", b"tenant-b")
token = st.integers(0, 3)


def error_kind(err: BaseException) -> str:
    """The API-level class of an error; anything else is a bug and propagates."""
    if isinstance(err, OutOfBlocks):
        return "OutOfBlocks"
    if isinstance(err, KeyError):
        return "KeyError"
    if isinstance(err, ValueError):
        return "ValueError"
    raise err


def chance(data: st.DataObject, percent: int) -> bool:
    """True with about `percent`% probability; shrinks towards False (the common case)."""
    return data.draw(st.integers(0, 99)) >= 100 - percent


def block_table_of(seq_id: int) -> Callable[[Any], Any]:
    """A call that reads one sequence's block table from either manager."""
    return lambda mgr: mgr.block_table(seq_id)


def as_container(tokens: list[int], how: str) -> Any:
    """The same token ids as a list or a numpy array of the given dtype."""
    return tokens if how == "list" else np.array(tokens, dtype=how)


class ManagerComparison(RuleBasedStateMachine):
    """Every rule runs on both managers; the invariant compares all observable state."""

    real: BlockManager
    ref: ReferenceBlockManager

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.swapped: set[int] = set()
        # Sequences whose swap-out / swap-in / external loads wait for a confirmation.
        self.out_pending: set[int] = set()
        self.in_pending: set[int] = set()
        self.loading: set[int] = set()
        self.real_to_ref: dict[int, int] = {}
        self.ref_to_real: dict[int, int] = {}
        self.seq_no_offset: int | None = None

    @initialize(
        num_blocks=st.integers(12, 32),
        block_size=st.integers(1, 4),
        num_cpu_blocks=st.sampled_from([32, 8, 0]),
        prefix_caching=st.sampled_from([True, True, True, False]),
        watermark=st.sampled_from([0.0, 0.01, 0.25]),
        auto_commit=st.sampled_from([True, True, False]),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int,
        prefix_caching: bool,
        watermark: float,
        auto_commit: bool,
    ) -> None:
        kwargs: dict[str, Any] = {
            "num_cpu_blocks": num_cpu_blocks,
            "enable_prefix_caching": prefix_caching,
            "watermark": watermark,
            "enable_events": True,
            "auto_commit": auto_commit,
        }
        event(f"auto_commit={auto_commit}")
        self.real = BlockManager(num_blocks, block_size, hash_key=KEY, **kwargs)
        self.ref = ReferenceBlockManager(num_blocks, block_size, **kwargs)
        assert self.real.auto_commit == auto_commit

    # ---- helpers ---------------------------------------------------------------------------

    def both(self, what: str, call: Callable[[Any], Any]) -> tuple[Any, Any] | None:
        """Run `call` on both managers: results if both succeed, None if both fail alike."""
        outcomes: list[tuple[str, Any]] = []
        for mgr in (self.real, self.ref):
            try:
                outcomes.append(("ok", call(mgr)))
            except Exception as err:
                outcomes.append((error_kind(err), err))
        (real_kind, real_out), (ref_kind, ref_out) = outcomes
        event(f"{what}: {real_kind}")
        assert real_kind == ref_kind, (
            f"real: {real_kind} {real_out!r}, reference: {ref_kind} {ref_out!r}"
        )
        if real_kind != "ok":
            return None
        return real_out, ref_out

    def running(self) -> list[int]:
        return sorted(self.live - self.swapped)

    def ready(self, data: st.DataObject) -> list[int]:
        """Mostly the running sequences whose tokens are all planned (a step or a fork can
        succeed), sometimes every running sequence."""
        if chance(data, 20):
            return self.running()
        seqs = self.ref._seqs  # the model's state, only to steer the drawing
        return [s for s in self.running() if seqs[s].planned == len(seqs[s].tokens)]

    def forget(self, seq_ids: list[int]) -> None:
        for tracked in (self.live, self.swapped, self.out_pending, self.in_pending, self.loading):
            tracked.difference_update(seq_ids)

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        start = data.draw(st.sampled_from(["system", "live", "fresh"]))
        prefix: list[int] = []
        if start == "system":
            prefix = list(data.draw(st.sampled_from(SYSTEM_PROMPTS)))
        elif start == "live" and self.live:
            seq_id = data.draw(st.sampled_from(sorted(self.live)))
            tokens = self.ref.token_ids(seq_id).tolist()
            prefix = tokens[: data.draw(st.integers(0, len(tokens)))]
        tail = data.draw(st.lists(token, min_size=0 if prefix else 1, max_size=8))
        return prefix + tail

    def draw_new_id(self, data: st.DataObject) -> int:
        """Usually an id that is not live; sometimes any id (DuplicateSequence)."""
        free_ids = [i for i in range(MAX_ID) if i not in self.live]
        if free_ids and not chance(data, 5):
            return data.draw(st.sampled_from(free_ids))
        return data.draw(st.integers(0, MAX_ID - 1))

    def draw_batch(self, data: st.DataObject, pool: list[int]) -> tuple[list[int], str | None]:
        """A shuffled subset of `pool`, possibly spoiled by exactly one kind of fault."""
        batch = data.draw(st.permutations(pool)) if pool else []
        batch = batch[: data.draw(st.integers(1 if batch else 0, len(batch)))]
        fault = (
            data.draw(st.sampled_from(["unknown", "swapped", "repeat"]))
            if chance(data, 20)
            else None
        )
        unknown = [i for i in range(MAX_ID) if i not in self.live]
        if fault == "unknown" and unknown:
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(unknown)))
        elif fault == "swapped" and self.swapped:
            batch.insert(data.draw(st.integers(0, len(batch))), min(self.swapped))
        elif fault == "repeat" and batch:
            batch.append(data.draw(st.sampled_from(batch)))
        else:
            fault = None
        return batch, fault

    def draw_confirm_batch(self, data: st.DataObject, pending: set[int], side: list[int]) -> Any:
        """Mostly sequences waiting for this confirmation; sometimes one on the right side
        that waits for nothing (ValueError)."""
        batch = data.draw(st.permutations(sorted(pending))) if pending else []
        batch = batch[: data.draw(st.integers(1 if batch else 0, len(batch)))]
        idle = [s for s in side if s not in pending]
        if idle and (not batch or chance(data, 15)):
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(idle)))
        return batch

    def compare_plans(self, plans: tuple[Any, Any] | None) -> None:
        if plans is None:
            return
        real, ref = plans
        for name in PLAN_ARRAYS:
            got, want = getattr(real, name), getattr(ref, name)
            assert got.dtype == np.int32, name
            assert got.shape == want.shape and np.array_equal(got, want), (name, got, want)
        for name in ("batch_size", "num_query_tokens", "block_size"):
            assert getattr(real, name) == getattr(ref, name), name
        if len(real.copies):
            event("plan with copies")

    def compare_pairs(self, pairs: tuple[Any, Any] | None) -> None:
        if pairs is None:
            return
        real, ref = pairs
        assert real.dtype == np.int32 and real.shape == ref.shape, (real, ref)
        assert np.array_equal(real, ref), (real, ref)

    def bind(self, real_hash: int | None, ref_hash: int | None) -> None:
        """Hashes must correspond one to one across the two managers."""
        assert (real_hash is None) == (ref_hash is None)
        if real_hash is None or ref_hash is None:
            return
        assert self.real_to_ref.setdefault(real_hash, ref_hash) == ref_hash
        assert self.ref_to_real.setdefault(ref_hash, real_hash) == real_hash

    # ---- admission -------------------------------------------------------------------------

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        seq_id = self.draw_new_id(data)
        prompt = self.draw_prompt(data)
        tokens = as_container(prompt, data.draw(st.sampled_from(["list", "int64", "int32"])))
        salt = data.draw(st.sampled_from(SALTS))
        out = self.both("allocate", lambda m: m.allocate(seq_id, tokens, salt=salt))
        if out is not None:
            assert out[0] == out[1]
            self.live.add(seq_id)

    @rule(data=st.data(), loadable=st.integers(0, 6))
    def allocate_loading(self, data: st.DataObject, loadable: int) -> None:
        seq_id = self.draw_new_id(data)
        prompt = self.draw_prompt(data)
        salt = data.draw(st.sampled_from(SALTS))
        out = self.both(
            "allocate_loading", lambda m: m.allocate_loading(seq_id, prompt, loadable, salt=salt)
        )
        if out is None:
            return
        (real_reused, real_loads), (ref_reused, ref_loads) = out
        assert real_reused == ref_reused
        assert real_loads.dtype == np.int32 and real_loads.tolist() == ref_loads.tolist()
        self.live.add(seq_id)
        if len(real_loads):
            event("allocate_loading: loads")
            self.loading.add(seq_id)

    @precondition(lambda self: bool(self.loading))
    @rule(data=st.data())
    def confirm_loads(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.loading)))
        if chance(data, 15):  # nothing to confirm: ValueError or KeyError
            seq_id = data.draw(st.sampled_from([*sorted(self.live - self.loading), MAX_ID]))
        num_loaded = data.draw(st.integers(0, 4))  # more than handed out: ValueError
        if self.both("confirm_loads", lambda m: m.confirm_loads(seq_id, num_loaded)) is not None:
            self.loading.discard(seq_id)

    @rule(data=st.data())
    def can_allocate(self, data: st.DataObject) -> None:
        prompt = self.draw_prompt(data)
        salt = data.draw(st.sampled_from(SALTS))
        out = self.both("can_allocate", lambda m: m.can_allocate(prompt, salt=salt))
        assert out is not None and out[0] == out[1]
        out = self.both("cached_prefix", lambda m: m.cached_prefix_blocks(prompt, salt=salt))
        assert out is not None and out[0] == out[1]
        hashes = self.both("block_hashes", lambda m: m.block_hashes(prompt, salt=salt))
        if hashes is not None:
            assert len(hashes[0]) == len(hashes[1])
            for real_hash, ref_hash in zip(*hashes, strict=True):
                self.bind(real_hash, ref_hash)

    # ---- tokens, plans, commits ------------------------------------------------------------

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), tokens=st.lists(token, min_size=1, max_size=6))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from([*sorted(self.live), MAX_ID]))
        self.both("append", lambda m: m.append(seq_id, tokens))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        batch, _ = self.draw_batch(data, self.ready(data))
        if not batch:
            return
        tokens = data.draw(st.lists(token, min_size=len(batch), max_size=len(batch)))
        how = data.draw(st.sampled_from(["list", "int64", "int32"]))
        ids: Any = batch if how == "list" else np.array(batch, dtype=np.int64)
        toks = as_container(tokens, how)
        self.compare_plans(self.both("step", lambda m: m.step(ids, toks)))

    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        batch, fault = self.draw_batch(data, sorted(set(self.running()) - self.loading))
        if not batch:
            return
        lens = []
        for s in batch:
            if s not in self.live:
                lens.append(1)
                continue
            length = self.ref.num_tokens(s)
            # Usually exactly the tokens without computed KV (a prefill or a decode), else
            # anything: a recompute of computed tokens, or a gap (ValueError).
            natural = max(1, length - self.ref.num_computed(s))
            lens.append(data.draw(st.integers(1, length)) if chance(data, 25) else natural)
        if fault is None:
            spoil = (
                data.draw(st.sampled_from(["zero", "long", "count"])) if chance(data, 10) else None
            )
            if spoil == "zero":
                lens[0] = 0
            elif spoil == "long" and batch[0] in self.live:
                lens[0] = self.ref.num_tokens(batch[0]) + 1
            elif spoil == "count":
                lens.append(1)
        self.compare_plans(self.both("plan", lambda m: m.plan(batch, lens)))

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        batch, fault = self.draw_batch(data, self.running())
        if not batch:
            return
        if not chance(data, 40):
            self.both("commit latest", lambda m: m.commit(batch))
            return
        upto = []
        for s in batch:
            seq = self.ref._seqs.get(s)  # the model's state, only to steer the drawing
            planned, length = (seq.planned, len(seq.tokens)) if seq else (0, 0)
            # Usually within the plan; sometimes beyond it (ValueError).
            upto.append(data.draw(st.integers(0, length)) if chance(data, 30) else planned)
        if fault is None and chance(data, 5):
            upto.append(0)
        self.both("commit counts", lambda m: m.commit(batch, np.array(upto, dtype=np.int64)))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.ready(data) or sorted(self.live)))
        child = self.draw_new_id(data)
        if self.both("fork", lambda m: m.fork(parent, child)) is not None:
            self.live.add(child)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        if chance(data, 5):
            seq_id = MAX_ID  # unknown: KeyError
        if self.both("free", lambda m: m.free(seq_id)) is not None:
            self.forget([seq_id])

    # ---- swaps -----------------------------------------------------------------------------

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        batch, _ = self.draw_batch(data, self.running())
        if not batch:
            return
        pairs = self.both("swap_out", lambda m: m.swap_out(batch))
        self.compare_pairs(pairs)
        if pairs is not None:
            self.swapped.update(batch)
            self.out_pending.update(batch)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def confirm_swap_out(self, data: st.DataObject) -> None:
        batch = self.draw_confirm_batch(data, self.out_pending, sorted(self.swapped))
        if chance(data, 10) and self.running():
            batch.append(self.running()[0])  # not swapped out: ValueError
        if self.both("confirm_swap_out", lambda m: m.confirm_swap_out(batch)) is not None:
            self.out_pending.difference_update(batch)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        confirmed = self.swapped - self.out_pending
        pool = sorted(self.swapped if chance(data, 15) or not confirmed else confirmed)
        batch = data.draw(st.permutations(pool))
        batch = batch[: data.draw(st.integers(1, len(batch)))]
        if chance(data, 10) and self.running():
            batch.append(self.running()[0])  # not swapped out: ValueError
        pairs = self.both("swap_in", lambda m: m.swap_in(batch))
        self.compare_pairs(pairs)
        if pairs is not None:
            self.swapped.difference_update(batch)
            self.in_pending.update(batch)

    @precondition(lambda self: bool(self.in_pending))
    @rule(data=st.data())
    def confirm_swap_in(self, data: st.DataObject) -> None:
        batch = self.draw_confirm_batch(data, self.in_pending, self.running())
        if chance(data, 10) and self.swapped:
            batch.append(min(self.swapped))  # swapped out: ValueError
        if self.both("confirm_swap_in", lambda m: m.confirm_swap_in(batch)) is not None:
            self.in_pending.difference_update(batch)

    @rule(data=st.data())
    def reset_prefix_cache(self, data: st.DataObject) -> None:
        # Rare: it wipes the prefix cache that most other rules are trying to exercise.
        if chance(data, 5):
            self.both("reset_prefix_cache", lambda m: m.reset_prefix_cache())

    # ---- the comparison --------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        real, ref = self.real, self.ref
        real.check()
        ref.check()
        assert len(real) == len(ref) == len(self.live)
        for seq_id in range(MAX_ID + 1):
            assert (seq_id in real) == (seq_id in ref) == (seq_id in self.live), seq_id
            if seq_id not in self.live:
                continue
            assert real.num_tokens(seq_id) == ref.num_tokens(seq_id)
            assert real.num_computed(seq_id) == ref.num_computed(seq_id), seq_id
            assert real.token_ids(seq_id).tolist() == ref.token_ids(seq_id).tolist()
            tables = self.both("block_table", block_table_of(seq_id))
            assert (tables is None) == (seq_id in self.swapped), seq_id
            if tables is not None:
                assert tables[0].dtype == np.int32
                assert tables[0].tolist() == tables[1].tolist(), seq_id
        real_stats, ref_stats = real.stats(), ref.stats()
        for name in STATS_FIELDS:
            got, want = getattr(real_stats, name), getattr(ref_stats, name)
            assert math.isclose(got, want, rel_tol=1e-9), (name, got, want)
        self.compare_events(real.take_events(), ref.take_events())

    def compare_events(self, real: list[Any], ref: list[Any]) -> None:
        assert [(e.kind, e.medium, e.block_id) for e in real] == [
            (e.kind, e.medium, e.block_id) for e in ref
        ]
        for got, want in zip(real, ref, strict=True):
            event(f"event {got.kind} {got.medium}")
            if self.seq_no_offset is None:
                self.seq_no_offset = got.seq_no - want.seq_no
            assert got.seq_no - want.seq_no == self.seq_no_offset
            if got.kind == "stored":
                assert list(got.token_ids) == want.token_ids
                self.bind(got.parent_hash, want.parent_hash)
            if got.kind in ("stored", "removed"):
                self.bind(got.block_hash, want.block_hash)
            else:
                assert got.block_hash is None


ManagerComparison.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # The explain phase imports libcst, whose DeprecationWarning breaks `filterwarnings = error`.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
)
TestManagerComparison = ManagerComparison.TestCase
