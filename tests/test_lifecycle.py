"""The KV lifecycle end to end: drivers that follow the README contract literally, on one manager.

A driver plans (or steps), applies ITS plan's copies, runs a "forward pass" and lets the next call
naming the sequence commit it. The forward pass writes into a slot model of the KV tensors: one
value per slot, the KV of position `p` being a hash of the sequence's tokens `0..p` (as a real
model's KV depends on the whole prefix). Then every sequence of the batch reads its KV back through
`kv_indices` / `kv_last_page_len` and must find exactly its own values. So these tests check what
the engine would compute, not only the shape of the API: a prefix hit on KV nobody wrote, a copy
applied by the wrong batch, or a block reused while a copy still has to read it, all show up as a
wrong value.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv import BlockManager, OutOfBlocks

MOD = 2**61 - 1
UNWRITTEN = -1


def kv_values(tokens: list[int]) -> list[int]:
    """The KV of every position: a hash of the tokens up to and including it."""
    out, value = [], 0
    for token in tokens:
        value = (value * 1_000_003 + token + 1) % MOD
        out.append(value)
    return out


class KVSlots:
    """The engine's GPU and CPU KV tensors, reduced to one value per slot."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.bs = block_size
        self.gpu = np.full((num_blocks, block_size), UNWRITTEN, dtype=np.int64)
        self.cpu = np.full((max(num_cpu_blocks, 1), block_size), UNWRITTEN, dtype=np.int64)

    def copy_blocks(self, pairs: Any) -> None:
        """Whole-block copies (src, dst), in order, as KVCache.copy_blocks does."""
        for src, dst in np.asarray(pairs).tolist():
            self.gpu[dst] = self.gpu[src]

    def copy_out(self, pairs: Any) -> None:
        """The copies of `swap_out`: (gpu, cpu) pairs."""
        for gpu, cpu in np.asarray(pairs).tolist():
            self.cpu[cpu] = self.gpu[gpu]

    def copy_in(self, pairs: Any) -> None:
        """The copies of `swap_in`: (cpu, gpu) pairs."""
        for cpu, gpu in np.asarray(pairs).tolist():
            self.gpu[gpu] = self.cpu[cpu]

    def read(self, plan: Any, row: int) -> list[int]:
        """Row `row`'s KV, gathered through the plan's page table."""
        pages = plan.kv_indices[plan.kv_indptr[row] : plan.kv_indptr[row + 1]]
        kv_len = (len(pages) - 1) * self.bs + int(plan.kv_last_page_len[row])
        values: list[int] = self.gpu[pages].reshape(-1)[:kv_len].tolist()
        return values

    def forward(self, plan: Any, batch: list[list[int]]) -> None:
        """Apply the plan's copies, write its queries' KV, then check every row reads its own."""
        self.copy_blocks(plan.copies)
        flat = self.gpu.reshape(-1)
        for row, tokens in enumerate(batch):
            values = kv_values(tokens)
            lo, hi = int(plan.qo_indptr[row]), int(plan.qo_indptr[row + 1])
            flat[plan.slot_mapping[lo:hi]] = [values[p] for p in plan.positions[lo:hi].tolist()]
        for row, tokens in enumerate(batch):
            assert self.read(plan, row) == kv_values(tokens), f"row {row} reads wrong KV"


@dataclass
class Pending:
    """A plan handed out and not run yet, with the tokens each row had when it was planned."""

    plan: Any
    batch: list[list[int]]


@dataclass
class Driver:
    """One engine loop on a shared manager: it knows its own sequences' tokens only."""

    mgr: BlockManager
    slots: KVSlots
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def admit(self, seq_id: int, prompt: list[int]) -> tuple[int, Pending]:
        """Allocate and plan the prefill of the tokens the prefix cache did not hold."""
        reused = self.mgr.allocate(seq_id, prompt)
        self.tokens[seq_id] = list(prompt)
        return reused, self.plan([seq_id], [len(prompt) - reused])

    def plan(self, seq_ids: list[int], query_lens: list[int]) -> Pending:
        plan = self.mgr.plan(seq_ids, query_lens)
        return Pending(plan, [list(self.tokens[s]) for s in seq_ids])

    def step(self, seq_ids: list[int], new_tokens: list[int]) -> Pending:
        plan = self.mgr.step(seq_ids, new_tokens)
        for seq_id, token in zip(seq_ids, new_tokens, strict=True):
            self.tokens[seq_id].append(token)
        return Pending(plan, [list(self.tokens[s]) for s in seq_ids])

    def forward(self, pending: Pending) -> None:
        self.slots.forward(pending.plan, pending.batch)

    def fork(self, parent: int, child: int) -> None:
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def free(self, seq_id: int) -> None:
        self.mgr.free(seq_id)
        del self.tokens[seq_id]

    def blocks(self) -> set[int]:
        """Every GPU block this driver's running sequences map."""
        held: set[int] = set()
        for seq_id in self.tokens:
            with contextlib.suppress(ValueError):  # swapped out
                held.update(self.mgr.block_table(seq_id).tolist())
        return held


def run(driver: Driver, pending: Pending) -> None:
    """Forward a plan right away."""
    driver.forward(pending)


def test_forked_drivers_get_exactly_their_own_copies() -> None:
    """Scenario 1: two drivers with forked sequences (copy-on-write), interleaved step by step.

    The old main recorded copies in one manager-wide list that `take_copies()` drained: driver B
    took A's copies with its own, so A's batch ran without them and read a destination block
    nobody filled. It also let go of a copy's source at the append, so once the parent was freed
    another driver could get that block and overwrite it before the copy read it.
    """
    mgr = BlockManager(24, 4)
    slots = KVSlots(24, 4)
    a, b = Driver(mgr, slots), Driver(mgr, slots)
    run(a, a.admit(1, [1, 2, 3, 4, 5, 6])[1])
    run(b, b.admit(11, [50, 51, 52, 53, 54, 55])[1])
    a.fork(1, 2)
    b.fork(11, 12)

    pa = a.step([1, 2], [7, 8])  # A plans
    pb = b.step([12, 11], [57, 58])  # B plans
    assert len(pa.plan.copies) == 2 and len(pb.plan.copies) == 2
    a_dst = {dst for _, dst in pa.plan.copies.tolist()}
    b_dst = {dst for _, dst in pb.plan.copies.tolist()}
    assert a_dst <= a.blocks() and b_dst <= b.blocks()
    assert not a_dst & b_dst and not a.blocks() & b.blocks()
    b.forward(pb)  # B forwards first
    a.forward(pa)

    # A forks again and prunes the parent while its child's copy is still to be applied.
    a.fork(2, 3)  # commits 2's step
    run(a, a.step([2], [9]))
    pa = a.step([3], [10])  # copy: 3's shared tail -> a fresh block
    (src, dst), *rest = pa.plan.copies.tolist()
    assert rest == [] and dst in a.blocks()
    a.free(2)  # 2 held `src` too; the pending copy still holds it
    # B admits and computes a prompt meanwhile: it must never get (and overwrite) `src`.
    _, pb = b.admit(13, [60, 61, 62])
    assert src not in b.blocks()
    b.forward(pb)
    pb = b.step([11, 12, 13], [63, 64, 65])
    assert len(pb.plan.copies) == 0  # A's copy is not B's to apply
    b.forward(pb)
    a.forward(pa)  # reads `src` now
    run(a, a.step([1, 3], [11, 12]))
    run(b, b.step([13, 12], [66, 67]))
    mgr.commit([1, 3, 11, 12, 13])
    assert mgr.stats().pending_tokens == 0
    mgr.check()


def test_prefix_is_shared_across_drivers_only_once_computed() -> None:
    """Scenario 2: a system prompt shared across drivers before and after its KV is computed.

    The old main registered a prompt's full blocks at `allocate`: driver A, admitted while C's
    prefill was only planned, was told 12 tokens were cached, planned only its last token and
    read slots C had not written yet.
    """
    mgr = BlockManager(32, 4)
    slots = KVSlots(32, 4)
    a, c = Driver(mgr, slots), Driver(mgr, slots)
    sysp = list(range(100, 112))  # three full blocks
    reused, pc = c.admit(1, [*sysp, 1])
    assert reused == 0
    assert mgr.cached_prefix_blocks([*sysp, 2]) == 0
    reused, pa = a.admit(2, [*sysp, 2])  # before C's forward pass and commit
    assert reused == 0
    assert pa.plan.positions.tolist() == list(range(13))
    a.forward(pa)  # A computes the whole prompt into its own blocks
    c.forward(pc)
    mgr.commit([1])
    assert mgr.cached_prefix_blocks([*sysp, 3]) == 3
    # A third admission (driver A again) hits C's blocks and reads the KV C wrote.
    reused, pa = a.admit(3, [*sysp, 3])
    assert reused == 12
    assert mgr.block_table(3).tolist()[:3] == mgr.block_table(1).tolist()[:3]
    assert pa.plan.positions.tolist() == [12]
    a.forward(pa)
    run(c, c.step([1], [4]))
    run(a, a.step([3, 2], [5, 6]))
    mgr.check()


def test_swaps_are_deferred_until_confirmed() -> None:
    """Scenario 3: swaps whose copies run later, while another driver keeps allocating.

    The old main released a swap-out's GPU blocks at `swap_out`: driver B's next allocation got
    one and overwrote it before A's copy read it, so A came back with B's KV. It also registered
    swapped-in blocks at `swap_in`, so driver C hit blocks whose copy-in had not run.
    """
    mgr = BlockManager(8, 4, num_cpu_blocks=8)
    slots = KVSlots(8, 4, 8)
    a, b, c = Driver(mgr, slots), Driver(mgr, slots), Driver(mgr, slots)
    prompt = list(range(1, 11))  # blocks 0, 1 (full) and 2 (partial)
    run(a, a.admit(1, prompt)[1])
    out = mgr.swap_out([1])
    sources = {gpu for gpu, _ in out.tolist()}
    assert sources == {0, 1, 2}
    # B allocates and computes before A's copy-out runs: never on a source block.
    _, pb = b.admit(2, [60, 61, 62])
    assert not b.blocks() & sources
    b.forward(pb)
    slots.copy_out(out)  # the deferred copy reads A's KV, intact
    mgr.confirm_swap_out([1])
    b.free(2)
    # B's long prompt takes every GPU block, evicting A's cached GPU copies.
    _, pb = b.admit(3, list(range(200, 229)))
    b.forward(pb)
    b.free(3)  # never committed: its blocks go back unregistered
    assert mgr.cached_prefix_blocks([*prompt[:8], 99]) == 0

    into = mgr.swap_in([1])
    targets = {gpu for _, gpu in into.tolist()}
    # C admits A's prefix before A's copy-in ran: no hit on the uncopied blocks.
    reused, pc = c.admit(4, [*prompt[:8], 99])
    assert reused == 0 and not c.blocks() & targets
    c.forward(pc)
    slots.copy_in(into)
    mgr.confirm_swap_in([1])
    # Now A's blocks are shared: a new admission hits them and reads the swapped-in KV.
    reused, pc = c.admit(5, [*prompt[:8], 98])
    assert reused == 8
    assert mgr.block_table(5).tolist()[:2] == mgr.block_table(1).tolist()[:2]
    c.forward(pc)
    run(a, a.step([1], [11]))  # A reads its whole KV back
    run(c, c.step([4, 5], [7, 8]))
    mgr.check()


# ---- threads --------------------------------------------------------------------------------

NUM_THREADS = 4
BLOCK_SIZE = 4
NUM_BLOCKS = 160
NUM_CPU_BLOCKS = 96
OPS_PER_THREAD = 250
DEADLINE_S = 4.0
SYSTEM_PROMPT = [7000 + i for i in range(20)]


@dataclass
class Tally:
    """What one thread saw happen."""

    reused: int = 0
    copies: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    out_of_blocks: int = 0


class ThreadDriver(Driver):
    """A driver with its own random schedule: admissions, steps, forks, frees and swaps whose
    copies run a few operations later."""

    def __init__(self, mgr: BlockManager, slots: KVSlots, worker: int) -> None:
        super().__init__(mgr, slots)
        self.rng = random.Random(worker)
        self.next_id = worker * 1_000_000
        self.running: set[int] = set()
        self.swapped: set[int] = set()
        self.out_pending: list[tuple[list[int], Any]] = []  # (seq ids, pairs) to copy out
        self.in_pending: list[tuple[list[int], Any]] = []
        self.tally = Tally()

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def one_op(self) -> None:
        rng = self.rng
        op = rng.choice(
            ["admit", "admit", "step", "step", "step", "fork", "free", "swap", "confirm"]
        )
        if op == "admit" or not self.running:
            prompt = SYSTEM_PROMPT[: rng.randrange(4, 21)] if rng.random() < 0.7 else []
            prompt = prompt + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            seq_id = self.new_id()
            reused, pending = self.admit(seq_id, prompt)
            self.tally.reused += reused
            self.running.add(seq_id)
            self.forward(pending)
        elif op == "step":
            batch = rng.sample(sorted(self.running), k=rng.randrange(1, len(self.running) + 1))
            pending = self.step(batch, [rng.randrange(50) for _ in batch])
            self.tally.copies += len(pending.plan.copies)
            self.forward(pending)
        elif op == "fork":
            child = self.new_id()
            self.fork(rng.choice(sorted(self.running)), child)
            self.running.add(child)
        elif op == "free":
            self.drop(rng.choice(sorted(self.running | self.swapped)))
        elif op == "swap":
            self.swap(rng)
        else:
            self.confirm()

    def swap(self, rng: random.Random) -> None:
        ready = sorted(self.swapped - {s for ids, _ in self.out_pending for s in ids})
        if ready and rng.random() < 0.5:
            batch = rng.sample(ready, k=rng.randrange(1, len(ready) + 1))
            self.in_pending.append((batch, self.mgr.swap_in(batch)))
            self.swapped.difference_update(batch)
            self.tally.swapped_in += len(batch)
            return
        batch = rng.sample(sorted(self.running), k=rng.randrange(1, min(3, len(self.running)) + 1))
        self.out_pending.append((batch, self.mgr.swap_out(batch)))
        self.running.difference_update(batch)
        self.swapped.update(batch)
        self.tally.swapped_out += len(batch)

    def confirm(self) -> None:
        """Run the oldest deferred swap copies and confirm them."""
        if self.out_pending:
            self.confirm_out(self.out_pending[0])
        if self.in_pending:
            self.confirm_in(self.in_pending[0])

    def confirm_out(self, entry: tuple[list[int], Any]) -> None:
        self.out_pending.remove(entry)
        self.slots.copy_out(entry[1])
        self.mgr.confirm_swap_out(entry[0])

    def confirm_in(self, entry: tuple[list[int], Any]) -> None:
        self.in_pending.remove(entry)
        self.slots.copy_in(entry[1])
        self.mgr.confirm_swap_in(entry[0])
        self.running.update(entry[0])

    def drop(self, seq_id: int) -> None:
        # A swap in flight finishes first: once the sequence is freed its blocks may be reused,
        # so its copies must not run later.
        for entry in [e for e in self.out_pending if seq_id in e[0]]:
            self.confirm_out(entry)
        for entry in [e for e in self.in_pending if seq_id in e[0]]:
            self.confirm_in(entry)
        self.free(seq_id)
        self.running.discard(seq_id)
        self.swapped.discard(seq_id)

    def drain(self) -> None:
        while self.out_pending or self.in_pending:
            self.confirm()


def test_threads_share_one_manager_with_correct_kv() -> None:
    mgr = BlockManager(NUM_BLOCKS, BLOCK_SIZE, num_cpu_blocks=NUM_CPU_BLOCKS, watermark=0.0)
    slots = KVSlots(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
    drivers = [ThreadDriver(mgr, slots, w) for w in range(NUM_THREADS)]
    barrier = threading.Barrier(NUM_THREADS)
    errors: list[BaseException] = []

    def work(driver: ThreadDriver) -> None:
        try:
            barrier.wait()
            deadline = time.monotonic() + DEADLINE_S
            for _ in range(OPS_PER_THREAD):
                if time.monotonic() > deadline:
                    break
                try:
                    driver.one_op()
                except OutOfBlocks:  # make room, as a scheduler would by preempting
                    driver.tally.out_of_blocks += 1
                    driver.drain()
                    if driver.running:
                        driver.drop(min(driver.running))
            driver.drain()
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(d,)) for d in drivers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]

    mgr.check()
    tallies = [d.tally for d in drivers]
    assert sum(t.reused for t in tallies) > 0
    assert sum(t.copies for t in tallies) > 0
    assert sum(t.swapped_out for t in tallies) > 0 and sum(t.swapped_in for t in tallies) > 0
    # Every sequence still reads exactly its own KV: the running ones, then, one at a time in
    # the room they leave, the swapped-out ones.
    for driver in drivers:
        if driver.running:
            group = sorted(driver.running)
            driver.forward(driver.plan(group, [1] * len(group)))  # needs no block
            for seq_id in group:
                driver.free(seq_id)
    for driver in drivers:
        for seq_id in sorted(driver.swapped):
            slots.copy_in(mgr.swap_in([seq_id]))
            mgr.confirm_swap_in([seq_id])
            driver.forward(driver.plan([seq_id], [1]))
            driver.free(seq_id)
    mgr.check()
    assert len(mgr) == 0
    assert mgr.stats().num_held == 0
