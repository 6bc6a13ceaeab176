"""Several Python threads drive one BlockManager at once, each through its own sequences.

The threads share system prompts, so prefix hits, registrations (at the commit of a prefill,
which the next call naming the sequence makes) and evictions of the same blocks race with each
other. Each thread checks what only it can change (its sequences' tokens, tables and plans);
afterwards the whole manager must pass check() and account for every block. test_lifecycle.py
adds the KV contents to this picture."""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import numpy as np

from pagedkv import BlockManager, OutOfBlocks

NUM_THREADS = 4
OPS_PER_THREAD = 400
BLOCK_SIZE = 4
NUM_BLOCKS = 192  # tight enough that threads evict each other's cached blocks
SYSTEM_PROMPTS = [[p * 100 + i for i in range(24)] for p in range(3)]


def drive(
    mgr: BlockManager, worker: int, barrier: threading.Barrier
) -> tuple[dict[int, list[int]], int]:
    """Run a random mix of operations on this worker's own sequences; return what is live and
    how many copies-on-write its plans carried."""
    rng = random.Random(worker)
    live: dict[int, list[int]] = {}  # seq id -> the tokens it must hold
    copies = 0
    next_id = worker * 1_000_000
    barrier.wait()
    for _ in range(OPS_PER_THREAD):
        op = rng.choice(["allocate", "allocate", "step", "step", "step", "fork", "free"])
        try:
            if op == "allocate" or not live:
                prompt = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.7 else []
                prompt = prompt + [rng.randrange(8) for _ in range(rng.randrange(1, 30))]
                reused = mgr.allocate(next_id, prompt)
                assert reused % BLOCK_SIZE == 0 and 0 <= reused < len(prompt)
                assert mgr.num_computed(next_id) == reused
                live[next_id] = prompt
                # The prefill: the tokens the prefix cache did not hold.
                plan = mgr.plan([next_id], [len(prompt) - reused])
                assert plan.positions.tolist() == list(range(reused, len(prompt)))
                next_id += 1
            elif op == "step":
                batch = rng.sample(sorted(live), k=rng.randrange(1, len(live) + 1))
                tokens = [rng.randrange(8) for _ in batch]
                plan = mgr.step(np.array(batch, dtype=np.int64), np.array(tokens, dtype=np.int32))
                for seq_id, tok in zip(batch, tokens, strict=True):
                    live[seq_id].append(tok)
                check_plan(mgr, plan, batch, live)
                copies += len(plan.copies)
            elif op == "fork":
                parent = rng.choice(sorted(live))
                mgr.fork(parent, next_id)  # commits the parent's latest plan first
                assert mgr.num_computed(next_id) == len(live[parent])
                live[next_id] = list(live[parent])
                next_id += 1
            else:
                seq_id = rng.choice(sorted(live))
                mgr.free(seq_id)
                del live[seq_id]
        except OutOfBlocks:
            if live:  # make room, as a scheduler would by preempting
                oldest = min(live)
                mgr.free(oldest)
                del live[oldest]
        for seq_id in rng.sample(sorted(live), k=min(2, len(live))):
            assert mgr.token_ids(seq_id).tolist() == live[seq_id]
            assert len(mgr.block_table(seq_id)) == math.ceil(len(live[seq_id]) / BLOCK_SIZE)
    return live, copies


def check_plan(mgr: BlockManager, plan: Any, batch: list[int], live: dict[int, list[int]]) -> None:
    """The plan matches this worker's sequences, which no other thread can touch."""
    positions = plan.positions.tolist()
    slots = plan.slot_mapping.tolist()
    for row, seq_id in enumerate(batch):
        table = mgr.block_table(seq_id).tolist()
        pos = len(live[seq_id]) - 1
        assert positions[row] == pos
        assert slots[row] == table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def test_threads_share_one_manager() -> None:
    mgr = BlockManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0.0)
    barrier = threading.Barrier(NUM_THREADS)
    results: dict[int, tuple[dict[int, list[int]], int]] = {}
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            results[worker] = drive(mgr, worker, barrier)
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(w,)) for w in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]

    mgr.check()
    live = {seq_id: toks for worker, _ in results.values() for seq_id, toks in worker.items()}
    assert len(mgr) == len(live)
    held = set()
    for seq_id, tokens in live.items():
        assert mgr.token_ids(seq_id).tolist() == tokens
        held.update(mgr.block_table(seq_id).tolist())
    stats = mgr.stats()
    assert stats.num_free + stats.num_cached + stats.num_held == NUM_BLOCKS
    assert stats.num_held >= len(held)  # and copy sources whose step is not committed
    assert stats.evictions > 0 and stats.prefix_hit_tokens > 0  # the races were exercised
    assert sum(copies for _, copies in results.values()) > 0

    mgr.commit(sorted(live))  # the last forward pass of every sequence ran
    assert stats.num_held >= mgr.stats().num_held == len(held)
    assert mgr.stats().pending_tokens == 0
    mgr.check()

    for seq_id in live:
        mgr.free(seq_id)
    mgr.check()
    stats = mgr.stats()
    assert (stats.num_held, len(mgr)) == (0, 0)
    assert stats.num_free + stats.num_cached == NUM_BLOCKS
