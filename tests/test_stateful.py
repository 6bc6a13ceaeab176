"""What only the Python binding can get wrong, driven by Hypothesis over random operation runs.

The semantics have one oracle, the Rust model test (rust/core/tests/model.rs). This machine
checks the layer above them, with no model of its own: two managers with the same key take the
same operations, one with plain lists and ints, the other with the same values as tuples, numpy
arrays and scalars of every integer dtype that holds them, and `__index__` objects; they must
agree on every result, error and event (conversions). Some calls get a bad argument, the same
for both: each must raise ValueError with the same message. A call refused for its arguments must
leave both managers exactly as they were (errors; one refused for lack of blocks keeps the
auto-commit it ran first, as SEMANTICS.md says). Plans and their
numpy views are kept alive at random, sometimes only a view without its plan: a live view must
never change however many later plans reuse the recycled buffers, and writing into one view
must not reach any other plan (numpy views, lifetimes). A persistent `Batch` kept across rules
must give the one-shot `step`'s inputs for its rows. The same machine runs on a
`HybridManager` of random groups (full attention with sliding windows or chunks), whose plans,
pairs and batches come one per group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from api_fields import PLAN_ARRAYS, STATS_FIELDS
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import Attention, Batch, BlockManager, HybridManager, OutOfBlocks

KEY = bytes(range(32))
MAX_ID = 8
SYSTEM_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
token = st.integers(0, 3)
# Containers that hold small non-negative ints; "index" wraps each value in an __index__ object.
CONTAINERS = ("tuple", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
SCALARS = ("int", "int64", "uint8", "int32", "index")
# Arguments both managers must refuse with the same ValueError.
BAD_IDS: tuple[Any, ...] = (-1, 2**64, 1.5, "3", None, np.float64(2.0))
BAD_TOKENS: tuple[Any, ...] = (
    [-1],
    [2**32],
    [1.0],
    "abc",
    b"ab",
    np.zeros((2, 2), dtype=np.int32),
    np.array([1.5]),
    [],
)


class Index:
    """An integer only through `__index__`, as numpy scalars and other int-likes are."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def as_scalar(value: int, how: str) -> Any:
    if how == "int":
        return value
    if how == "index":
        return Index(value)
    return np.dtype(how).type(value)


def as_container(values: list[int], how: str) -> Any:
    if how == "tuple":
        return tuple(values)
    if how == "index":
        return [Index(v) for v in values]
    return np.array(values, dtype=how)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", result) or (exception type name, message); a non-API exception propagates."""
    try:
        return "ok", call()
    except (OutOfBlocks, KeyError, ValueError) as err:
        return type(err).__name__, str(err)


def plain(value: Any) -> Any:
    """A result as plain Python values, for comparing two managers' results."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.tolist())
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if hasattr(value, "kv_indptr"):  # a Plan
        fields = {name: plain(getattr(value, name)) for name in PLAN_ARRAYS}
        sizes = value.batch_size, value.num_query_tokens, value.block_size
        return fields, sizes, value.attention
    return value


def snapshot(mgr: BlockManager | HybridManager) -> Any:
    """Everything observable about `mgr` but its events (for each group of a hybrid one)."""
    groups = range(mgr.num_groups) if isinstance(mgr, HybridManager) else [None]

    def tables(seq_id: int) -> Any:
        if isinstance(mgr, HybridManager):
            return [
                outcome(
                    lambda g=g: (mgr.first_block(seq_id, g), mgr.block_table(seq_id, g).tolist())
                )
                for g in groups
            ]
        return outcome(lambda: mgr.block_table(seq_id).tolist())

    seqs = []
    for seq_id in range(MAX_ID + 1):
        if seq_id not in mgr:
            seqs.append(None)
            continue
        tokens = mgr.token_ids(seq_id).tolist()
        seqs.append((tokens, mgr.num_tokens(seq_id), mgr.num_computed(seq_id), tables(seq_id)))
    stats = [mgr.stats(g) if isinstance(mgr, HybridManager) else mgr.stats() for g in groups]
    return len(mgr), seqs, [[getattr(st, name) for name in STATS_FIELDS] for st in stats]


def manager_kwargs(num_cpu_blocks: int, auto_commit: bool) -> dict[str, Any]:
    """The keyword arguments both machines build their managers with."""
    return {
        "num_cpu_blocks": num_cpu_blocks,
        "hash_key": KEY,
        "enable_events": True,
        "auto_commit": auto_commit,
        "watermark": 0.0,
    }


def machine_settings(max_examples: int) -> settings:
    """Hypothesis settings of a binding machine."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        # The explain phase imports libcst, whose DeprecationWarning breaks
        # `filterwarnings = error`.
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )


def step_inputs(source: Any) -> Any:
    """A step's attention inputs, from a plan or a batch (or a list of them, one per group)."""
    if isinstance(source, list):
        return [step_inputs(s) for s in source]
    fields = (*(f for f in PLAN_ARRAYS if f != "block_tables"), "block_size")
    return {name: plain(getattr(source, name)) for name in fields}


class BindingMachine(RuleBasedStateMachine):
    """Every rule runs on both managers; the invariant compares them and the kept views."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.swapped: set[int] = set()
        # Sequences whose swap waits for `confirm_swap_out` / `confirm_swap_in`.
        self.pending: dict[str, set[int]] = {"confirm_swap_out": set(), "confirm_swap_in": set()}
        # Plans kept alive (or only one view of each), with each view's values when handed out.
        self.kept: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []

    @initialize(
        num_blocks=st.integers(16, 48),
        block_size=st.sampled_from([1, 2, 3, 4, 16, 32]),
        num_cpu_blocks=st.sampled_from([32, 32, 0]),
        auto_commit=st.booleans(),
    )
    def setup(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int, auto_commit: bool
    ) -> None:
        kwargs = manager_kwargs(num_cpu_blocks, auto_commit)
        # Prompts and appends stretched to the block size, so that blocks of 16 or 32 tokens
        # fill, share and copy as often as small ones.
        self.stretch = max(1, block_size // 4)
        self.canon: Any = BlockManager(num_blocks, block_size, **kwargs)
        self.varied: Any = BlockManager(np.int64(num_blocks), Index(block_size), **kwargs)
        self.rows: Any = self.new_rows([])  # the varied manager's batch (see `step_batch`)

    def new_rows(self, seq_ids: list[int]) -> Any:
        """A persistent batch of `seq_ids` for the manager (one per group of a hybrid one)."""
        rows = Batch()
        for seq_id in seq_ids:
            rows.add(seq_id)
        return rows

    def batches(self) -> list[Batch]:
        """The varied manager's persistent batches (one, or one per group)."""
        return self.rows if isinstance(self.rows, list) else [self.rows]

    # ---- helpers ---------------------------------------------------------------------------

    def both(
        self, what: str, canon: Callable[[BlockManager], Any], varied: Any = None
    ) -> tuple[bool, Any]:
        """Runs `canon` on the canonical manager and `varied` (default: the same call) on the
        other; they must agree. A call refused for its arguments must change nothing (one
        refused for lack of blocks keeps the auto-commit it ran first, as SEMANTICS.md says).
        Returns whether the call succeeded, and the canonical manager's result."""
        self.compare_events()
        before = snapshot(self.canon)
        got = outcome(lambda: canon(self.canon))
        other = outcome(lambda: (varied or canon)(self.varied))
        event(f"{what}: {got[0]}")
        assert got[0] == other[0], (got, other)
        if got[0] != "ok":
            assert got[1] == other[1], (got, other)
            if got[0] != "OutOfBlocks":
                assert snapshot(self.canon) == before == snapshot(self.varied)
                assert self.canon.take_events() == [] and self.varied.take_events() == []
            return False, None
        assert plain(got[1]) == plain(other[1])
        for result in (got[1], other[1]):
            for plan in result if isinstance(result, list) else [result]:
                if hasattr(plan, "kv_indptr"):
                    self.check_plan_shape(plan)
        return True, got[1]

    def stretched(self, tokens: list[int]) -> list[int]:
        """Each token repeated `stretch` times."""
        return [t for t in tokens for _ in range(self.stretch)]

    def ids(self, data: st.DataObject, values: list[int]) -> Any:
        """The values in a drawn container that holds them."""
        top = max(values, default=0)
        fits = [h for h in CONTAINERS if h == "tuple" or np.iinfo(np.dtype(h)).max >= top]
        how = data.draw(st.sampled_from(("list", *fits, "index")))
        return list(values) if how == "list" else as_container(values, how)

    def scalar(self, data: st.DataObject, value: int) -> Any:
        return as_scalar(value, data.draw(st.sampled_from(SCALARS)))

    def seq(self, data: st.DataObject) -> int:
        """Mostly a live sequence, sometimes any id (KeyError or DuplicateSequence)."""
        if self.live and data.draw(st.integers(0, 9)):
            return data.draw(st.sampled_from(sorted(self.live)))
        return data.draw(st.integers(0, MAX_ID))

    def batch(self, data: st.DataObject, pool: set[int]) -> list[int]:
        if not pool:
            return [data.draw(st.integers(0, MAX_ID))]
        batch = data.draw(st.permutations(sorted(pool)))
        return batch[: data.draw(st.integers(1, len(batch)))]

    def drawn_rows(self, data: st.DataObject) -> list[int]:
        """Makes the persistent batch's rows a drawn batch of resident sequences (rows of freed
        or swapped ones stay until a drawn batch drops them), mostly prefilled; returns them
        in row order."""
        drawn = self.batch(data, self.live - self.swapped)
        for rows in self.batches():
            for seq_id in rows.seq_ids.tolist():
                if seq_id not in drawn:
                    rows.remove(seq_id)
            for seq_id in drawn:
                if seq_id not in rows:
                    rows.add(seq_id)
        order: list[int] = self.batches()[0].seq_ids.tolist()
        if data.draw(st.integers(0, 4)):
            self.prefill(data, order)
        return order

    def check_plan_shape(self, plan: Any) -> None:
        """The plan's attributes and arrays agree with each other (what the binding hands out)."""
        b, q = plan.batch_size, plan.num_query_tokens
        for name in PLAN_ARRAYS:
            assert getattr(plan, name).dtype == np.int32, name
        assert plan.kv_indptr.shape == plan.qo_indptr.shape == (b + 1,)
        assert plan.kv_last_page_len.shape == (b,)
        assert plan.slot_mapping.shape == plan.positions.shape == (q,)
        assert plan.qo_indptr[-1] == q and plan.kv_indptr[-1] == len(plan.kv_indices)
        assert plan.block_tables.shape[0] == b and plan.copies.shape[1:] == (2,)

    def keep(self, data: st.DataObject, plan: Any) -> None:
        """Keeps the plan, or only one of its views, or nothing, at random."""
        if isinstance(plan, list):
            plan = data.draw(st.sampled_from(plan))
        how = data.draw(st.sampled_from(["drop", "plan", "view"]))
        if plan is None or how == "drop":
            return
        views = {name: getattr(plan, name) for name in PLAN_ARRAYS if name != "block_tables"}
        if how == "view":
            name = data.draw(st.sampled_from(sorted(views)))
            views = {name: views[name]}
            plan = None  # only the view keeps the buffers alive now
        self.kept.append((plan, views, {name: v.copy() for name, v in views.items()}))

    # ---- rules -----------------------------------------------------------------------------

    @rule(data=st.data(), tail=st.lists(token, min_size=0, max_size=9), bad=st.integers(0, 19))
    def allocate(self, data: st.DataObject, tail: list[int], bad: int) -> None:
        seq_id = data.draw(st.integers(0, MAX_ID - 1))
        prompt = self.stretched((SYSTEM_PROMPT if data.draw(st.booleans()) else []) + tail)
        salt = data.draw(st.sampled_from([None, b"a", "a"]))
        if bad == 0:  # the same bad argument for both
            arg = data.draw(st.sampled_from(["id", "tokens", "salt"]))
            sid: Any = data.draw(st.sampled_from(BAD_IDS)) if arg == "id" else seq_id
            toks: Any = data.draw(st.sampled_from(BAD_TOKENS)) if arg == "tokens" else prompt
            bad_salt: Any = 3 if arg == "salt" else salt
            self.both("allocate bad", lambda m: m.allocate(sid, toks, salt=bad_salt))
            return
        sid, toks = self.scalar(data, seq_id), self.ids(data, prompt)
        done, _ = self.both(
            "allocate",
            lambda m: m.allocate(seq_id, prompt, salt=salt),
            lambda m: m.allocate(sid, toks, salt=salt),
        )
        if done:
            self.live.add(seq_id)

    @rule(data=st.data(), tail=st.lists(token, min_size=1, max_size=9), loadable=st.integers(0, 4))
    def allocate_loading(self, data: st.DataObject, tail: list[int], loadable: int) -> None:
        seq_id = data.draw(st.integers(0, MAX_ID - 1))
        prompt = self.stretched(SYSTEM_PROMPT + tail)
        sid, toks, n = (
            self.scalar(data, seq_id),
            self.ids(data, prompt),
            self.scalar(data, loadable),
        )
        done, _ = self.both(
            "allocate_loading",
            lambda m: m.allocate_loading(seq_id, prompt, loadable),
            lambda m: m.allocate_loading(sid, toks, n),
        )
        if done:
            self.live.add(seq_id)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), loaded=st.integers(0, 3))
    def confirm_loads(self, data: st.DataObject, loaded: int) -> None:
        seq_id = self.seq(data)
        sid, n = self.scalar(data, seq_id), self.scalar(data, loaded)
        self.both(
            "confirm_loads",
            lambda m: m.confirm_loads(seq_id, loaded),
            lambda m: m.confirm_loads(sid, n),
        )

    @rule(data=st.data(), tail=st.lists(token, min_size=0, max_size=9))
    def lookups(self, data: st.DataObject, tail: list[int]) -> None:
        prompt = self.stretched(SYSTEM_PROMPT + tail)
        toks = self.ids(data, prompt)
        for name in ("can_allocate", "cached_prefix_blocks", "block_hashes"):
            self.both(
                name,
                lambda m, name=name: getattr(m, name)(prompt),
                lambda m, name=name: getattr(m, name)(toks),
            )

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), tokens=st.lists(token, min_size=1, max_size=5), bad=st.integers(0, 9))
    def append(self, data: st.DataObject, tokens: list[int], bad: int) -> None:
        seq_id = self.seq(data)
        if bad == 0:
            toks = data.draw(st.sampled_from(BAD_TOKENS))
            self.both("append bad", lambda m: m.append(seq_id, toks))
            return
        tokens = self.stretched(tokens)
        sid, varied = self.scalar(data, seq_id), self.ids(data, tokens)
        self.both("append", lambda m: m.append(seq_id, tokens), lambda m: m.append(sid, varied))

    def prefill(self, data: st.DataObject, batch: list[int]) -> None:
        """Plans the tokens without computed KV of the batch's live members, as an engine does
        before their decode steps."""
        pending = {s: self.canon.num_tokens(s) - self.canon.num_computed(s) for s in batch}
        seqs = [s for s in batch if s in self.live and pending[s] > 0]
        if seqs:
            lens = [pending[s] for s in seqs]
            ids, varied = self.ids(data, seqs), self.ids(data, lens)
            self.both("prefill", lambda m: m.plan(seqs, lens), lambda m: m.plan(ids, varied))

    @precondition(lambda self: bool(self.live - self.swapped))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        batch = self.batch(data, self.live - self.swapped)
        if data.draw(st.integers(0, 4)):
            self.prefill(data, batch)
        tokens = data.draw(st.lists(token, min_size=len(batch), max_size=len(batch)))
        ids, toks = self.ids(data, batch), self.ids(data, tokens)
        _, plan = self.both("step", lambda m: m.step(batch, tokens), lambda m: m.step(ids, toks))
        self.keep(data, plan)

    @precondition(lambda self: bool(self.live - self.swapped))
    @rule(data=st.data())
    def step_batch(self, data: st.DataObject) -> None:
        """The varied manager decodes through its persistent batch, kept across rules (rows of
        freed or swapped sequences stay until a drawn batch drops them); the canonical one
        takes the one-shot `step` of the same rows in row order: the same result."""
        order = self.drawn_rows(data)
        tokens = data.draw(st.lists(token, min_size=len(order), max_size=len(order)))

        def stepped(m: BlockManager) -> dict[str, Any]:
            m.step_batch(self.rows, self.ids(data, tokens))
            return step_inputs(self.rows)

        self.both("step_batch", lambda m: step_inputs(m.step(order, tokens)), stepped)

    @precondition(lambda self: bool(self.live - self.swapped))
    @rule(data=st.data())
    def verify_and_roll_back(self, data: st.DataObject) -> None:
        """A speculative step: each row appends its drafts (`verify_batch`), through the
        varied manager's persistent batch and a new batch of the same rows on the canonical
        one; then both drop a drawn number of them (`rollback_batch` against `rollback`)."""
        order = self.drawn_rows(data)
        counts = data.draw(st.lists(st.integers(1, 4), min_size=len(order), max_size=len(order)))
        tokens = data.draw(st.lists(token, min_size=sum(counts), max_size=sum(counts)))

        def appended(m: BlockManager) -> dict[str, Any]:
            rows = self.new_rows(order)
            m.verify_batch(rows, tokens, counts)
            return step_inputs(rows)

        def verified(m: BlockManager) -> dict[str, Any]:
            m.verify_batch(self.rows, self.ids(data, tokens), self.ids(data, counts))
            return step_inputs(self.rows)

        done, _ = self.both("verify_batch", appended, verified)
        if not done:
            return
        rejected = [data.draw(st.integers(0, count - 1)) for count in counts]
        self.both(
            "rollback",
            lambda m: m.rollback(order, rejected),
            lambda m: m.rollback_batch(self.rows, self.ids(data, rejected)),
        )

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        batch = self.batch(data, self.live - self.swapped)
        lens = []
        for seq_id in batch:
            n = self.canon.num_tokens(seq_id) if seq_id in self.canon else 1
            pending = n - self.canon.num_computed(seq_id) if seq_id in self.canon else 1
            lens.append(
                max(1, pending) if data.draw(st.booleans()) else data.draw(st.integers(0, n))
            )
        ids, varied = self.ids(data, batch), self.ids(data, lens)
        _, plan = self.both("plan", lambda m: m.plan(batch, lens), lambda m: m.plan(ids, varied))
        self.keep(data, plan)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        batch = self.batch(data, self.live - self.swapped)
        ids = self.ids(data, batch)
        if data.draw(st.booleans()):
            self.both("commit", lambda m: m.commit(batch), lambda m: m.commit(ids))
            return
        counts = [
            data.draw(st.integers(0, self.canon.num_tokens(s) if s in self.canon else 1))
            for s in batch
        ]
        varied = self.ids(data, counts)
        self.both(
            "commit counts", lambda m: m.commit(batch, counts), lambda m: m.commit(ids, varied)
        )

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent, child = self.seq(data), data.draw(st.integers(0, MAX_ID - 1))
        p, c = self.scalar(data, parent), self.scalar(data, child)
        if self.both("fork", lambda m: m.fork(parent, child), lambda m: m.fork(p, c))[0]:
            self.live.add(child)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self.seq(data)
        sid = self.scalar(data, seq_id)
        if self.both("free", lambda m: m.free(seq_id), lambda m: m.free(sid))[0]:
            self.live.discard(seq_id)
            self.swapped.discard(seq_id)
            for waiting in self.pending.values():
                waiting.discard(seq_id)

    @precondition(lambda self: bool(self.live - self.swapped))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        batch = self.batch(data, self.live - self.swapped)
        if self.swap(data, "swap_out", batch):
            self.swapped.update(batch)
            self.pending["confirm_swap_out"].update(batch)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        confirmed = self.swapped - self.pending["confirm_swap_out"]
        batch = self.batch(
            data, confirmed if confirmed and data.draw(st.integers(0, 4)) else self.swapped
        )
        if self.swap(data, "swap_in", batch):
            self.swapped.difference_update(batch)
            self.pending["confirm_swap_in"].update(batch)

    def swap(self, data: st.DataObject, op: str, batch: list[int]) -> bool:
        ids = self.ids(data, batch)
        done, pairs = self.both(op, lambda m: getattr(m, op)(batch), lambda m: getattr(m, op)(ids))
        if done:
            for group_pairs in pairs if isinstance(pairs, list) else [pairs]:
                assert group_pairs.dtype == np.int32 and group_pairs.shape[1:] == (2,)
        return done

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), op=st.sampled_from(["confirm_swap_out", "confirm_swap_in"]))
    def confirm_swap(self, data: st.DataObject, op: str) -> None:
        """Mostly sequences waiting for this confirmation, sometimes any live ones."""
        waiting = self.pending[op] & self.live
        batch = self.batch(data, waiting if waiting and data.draw(st.integers(0, 4)) else self.live)
        ids = self.ids(data, batch)
        if self.both(op, lambda m: getattr(m, op)(batch), lambda m: getattr(m, op)(ids))[0]:
            self.pending[op].difference_update(batch)

    @rule(data=st.data())
    def write_a_view(self, data: st.DataObject) -> None:
        """Writes into one kept view: its plan's other views and every other plan stay as
        they were (each plan owns its buffers)."""
        if not self.kept:
            return
        index = data.draw(st.integers(0, len(self.kept) - 1))
        _, views, saved = self.kept[index]
        name = data.draw(st.sampled_from(sorted(views)))
        if views[name].size:
            views[name].flat[0] += 1
            saved[name].flat[0] += 1

    @rule(data=st.data())
    def drop_kept(self, data: st.DataObject) -> None:
        if self.kept:
            del self.kept[data.draw(st.integers(0, len(self.kept) - 1))]

    # ---- the comparison --------------------------------------------------------------------

    def compare_events(self) -> None:
        canon, varied = self.canon.take_events(), self.varied.take_events()
        assert [repr(e) for e in canon] == [repr(e) for e in varied]

    @invariant()
    def agree(self) -> None:
        self.canon.check()
        self.varied.check()
        assert snapshot(self.canon) == snapshot(self.varied)
        self.compare_events()
        for plan, views, saved in self.kept:
            for name, view in views.items():
                assert np.array_equal(view, saved[name]), name
            if plan is not None:
                # A kept plan hands out views of the same, unchanged buffers.
                for name in views:
                    assert np.array_equal(getattr(plan, name), saved[name]), name


BindingMachine.TestCase.settings = machine_settings(150)
TestBindingMachine = BindingMachine.TestCase


class HybridBindingMachine(BindingMachine):
    """The same rules on two `HybridManager`s of random groups over one pool."""

    @initialize(
        num_blocks=st.integers(24, 64),
        block_size=st.sampled_from([1, 2, 4, 16]),
        num_cpu_blocks=st.sampled_from([64, 0]),
        auto_commit=st.booleans(),
        windows=st.lists(st.integers(1, 3), min_size=1, max_size=2),
        chunked=st.booleans(),
    )
    def setup_groups(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int,
        auto_commit: bool,
        windows: list[int],
        chunked: bool,
    ) -> None:
        kwargs = manager_kwargs(num_cpu_blocks, auto_commit)
        self.stretch = max(1, block_size // 4)
        # Windows of a few stretched tokens, so that blocks leave them within a run.
        groups = [Attention.full()]
        groups += [Attention.sliding_window(w * 3 * self.stretch) for w in windows]
        if chunked:
            groups.append(Attention.chunked_local(block_size * 2))
        self.canon = HybridManager(num_blocks, block_size, groups, **kwargs)
        self.varied = HybridManager(
            np.int64(num_blocks), Index(block_size), tuple(groups), **kwargs
        )
        self.rows = self.new_rows([])

    def setup(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Replaced by `setup_groups`."""

    def new_rows(self, seq_ids: list[int]) -> Any:
        return [super(HybridBindingMachine, self).new_rows(seq_ids) for _ in self.canon.groups]


HybridBindingMachine.TestCase.settings = machine_settings(80)
TestHybridBindingMachine = HybridBindingMachine.TestCase
