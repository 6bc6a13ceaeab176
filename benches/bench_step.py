"""Continuous-batching decode loop: pagedkv.BlockManager against a pure-Python block manager.

Three runs serve the same seeded, ShareGPT-like trace: pagedkv decoding through a persistent
`Batch` (`step_batch`), pagedkv's one-shot `step()` (which builds the whole attention plan),
and the pure-Python manager's `step()`. Each does admission with a prefix lookup
(can_allocate, then allocate, then the prefill's plan), one decode token per running sequence
per step, preemption by recomputation when a step runs out of blocks, and free on finish. The
timed region is the step call alone; total loop time is reported too. The semantics are
deterministic, so all runs must make identical decisions: the bench asserts equal prefix-hit
counts, step counts and plan shapes, and equal physical blocks for the two `step()` runs.

    python benches/bench_step.py                 # 1000 requests
    python benches/bench_step.py --quick         # CI smoke run
    python benches/bench_step.py --requests 4000 --seed 7 --enforce
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

from python_baseline import PythonBlockManager

from pagedkv import Batch, BlockManager, OutOfBlocks

VOCAB = 32_000
TARGET_SPEEDUP = 30.0


@dataclass
class Trace:
    """Prompts (int32 token arrays) and how many tokens each request decodes."""

    prompts: list[npt.NDArray[np.int32]]
    output_lens: npt.NDArray[np.int64]


@dataclass
class RunResult:
    """What one manager did with the trace, and how long it took."""

    step_ns: int
    total_ns: int
    decode_tokens: int
    steps: int
    query_tokens: int
    hit_tokens: int
    admission_waits: int
    preemptions: int
    digest: int
    """Of every plan's slots and sizes: equal when the same physical blocks were chosen."""
    shape: int
    """Of every plan's positions and sizes: equal for the same decisions in any row order."""


def lognormal_lengths(
    rng: np.random.Generator, n: int, mean: float, sigma: float, cap: int
) -> npt.NDArray[np.int64]:
    """Lengths with the given mean before capping: exp(mu + sigma^2 / 2) = mean."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)


def make_trace(num_requests: int, seed: int) -> Trace:
    """ShareGPT-like lengths; half the prompts open with one of four system prompts."""
    rng = np.random.default_rng(seed)
    system = [rng.integers(0, VOCAB, int(n), dtype=np.int32) for n in (180, 250, 320, 400)]
    prompt_lens = lognormal_lengths(rng, num_requests, mean=161, sigma=1.0, cap=1024)
    output_lens = lognormal_lengths(rng, num_requests, mean=338, sigma=0.8, cap=1024)
    prompts = []
    for length in prompt_lens:
        body = rng.integers(0, VOCAB, int(length), dtype=np.int32)
        if rng.random() < 0.5:
            body = np.concatenate([system[rng.integers(len(system))], body])
        prompts.append(body)
    return Trace(prompts, output_lens)


def decode_tokens_at(seq_ids: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]) -> Any:
    """The synthetic token each sequence decodes at a position (deterministic, so a preempted
    request's recomputed prompt is exactly what it had generated)."""
    return ((seq_ids * 7919 + positions) % VOCAB).astype(np.int32)


def serve(mgr: Any, trace: Trace, max_running: int, persistent: bool = False) -> RunResult:
    """Run the whole trace through `mgr`; seq ids are request indices.

    With `persistent`, the decode steps go through one `Batch` (`step_batch`): rows are
    added on admission and removed on finish or preemption, and each step's tokens are put in
    row order (outside the timed region, like computing them).
    """
    batch = Batch() if persistent else None
    rows: npt.NDArray[np.int64] | None = None  # where each batch row is in `ids`; None: stale
    prompts = list(trace.prompts)  # grows by the generated tokens when a request is preempted
    left_of = trace.output_lens.copy()
    waiting: deque[int] = deque(range(len(prompts)))
    ids = np.empty(0, dtype=np.int64)
    lens = np.empty(0, dtype=np.int64)
    left = np.empty(0, dtype=np.int64)
    step_ns = decode = steps = waits = preemptions = digest = shape = 0
    start = time.perf_counter_ns()
    while waiting or ids.size:
        admitted: list[int] = []
        while waiting and ids.size + len(admitted) < max_running:
            req = waiting[0]
            if not mgr.can_allocate(prompts[req]):
                waits += 1
                break
            reused = mgr.allocate(req, prompts[req])
            mgr.plan([req], [len(prompts[req]) - reused])  # the prefill (not timed)
            admitted.append(waiting.popleft())
            if batch is not None:
                batch.add(req)
        if admitted:
            new = np.array(admitted, dtype=np.int64)
            ids = np.concatenate([ids, new])
            lens = np.concatenate([lens, [len(prompts[r]) for r in admitted]])
            left = np.concatenate([left, left_of[new]])
        if not ids.size:
            raise RuntimeError(f"request {waiting[0]} does not fit in an empty pool")
        tokens = decode_tokens_at(ids, lens)
        if batch is not None:
            if rows is None or admitted:
                index_of = {seq: i for i, seq in enumerate(ids.tolist())}
                rows = np.array([index_of[seq] for seq in batch.seq_ids.tolist()], np.int64)
            tokens = tokens[rows]
        t0 = time.perf_counter_ns()
        try:
            if batch is None:
                plan: Any = mgr.step(ids, tokens)
            else:
                mgr.step_batch(batch, tokens)
                plan = batch
        except OutOfBlocks:
            step_ns += time.perf_counter_ns() - t0
            # Preempt the latest admitted sequence; it comes back with its generated tokens.
            victim, victim_len = int(ids[-1]), int(lens[-1])
            mgr.free(victim)
            if batch is not None:
                batch.remove(victim)
                rows = None
            done = np.arange(len(prompts[victim]), victim_len, dtype=np.int64)
            prompts[victim] = np.concatenate(
                [prompts[victim], decode_tokens_at(np.full_like(done, victim), done)]
            )
            left_of[victim] = left[-1]
            waiting.appendleft(victim)
            ids, lens, left = ids[:-1], lens[:-1], left[:-1]
            preemptions += 1
            continue
        step_ns += time.perf_counter_ns() - t0
        steps += 1
        decode += ids.size
        nnz = int(plan.kv_indptr[-1])
        digest = (digest * 1_000_003 + int(plan.slot_mapping.sum()) + nnz) % (1 << 61)
        shape = (shape * 1_000_003 + int(plan.positions.sum()) + nnz) % (1 << 61)
        lens += 1
        left -= 1
        finished = left == 0
        if finished.any():
            for seq_id in ids[finished].tolist():
                mgr.free(seq_id)
                if batch is not None:
                    batch.remove(seq_id)
            rows = None
            keep = ~finished
            ids, lens, left = ids[keep], lens[keep], left[keep]
    total_ns = time.perf_counter_ns() - start
    stats = mgr.stats()
    return RunResult(
        step_ns=step_ns,
        total_ns=total_ns,
        decode_tokens=decode,
        steps=steps,
        query_tokens=stats.prefix_query_tokens,
        hit_tokens=stats.prefix_hit_tokens,
        admission_waits=waits,
        preemptions=preemptions,
        digest=digest,
        shape=shape,
    )


def report(name: str, r: RunResult) -> None:
    print(
        f"{name:>10}: step {r.step_ns / r.decode_tokens:9.1f} ns/decode token | "
        f"loop {r.total_ns / 1e9:7.3f} s | {r.decode_tokens} tokens in {r.steps} steps "
        f"(mean batch {r.decode_tokens / max(r.steps, 1):.1f}) | prefix hits "
        f"{r.hit_tokens}/{r.query_tokens} = {r.hit_tokens / max(r.query_tokens, 1):.4f} | "
        f"admission waits {r.admission_waits} | preemptions {r.preemptions}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--quick", action="store_true", help="small CI smoke run (100 requests)")
    parser.add_argument("--max-running", type=int, default=256, help="batch size limit")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=7000, help="GPU blocks in the pool")
    parser.add_argument(
        "--enforce", action="store_true", help="exit 1 when a performance target is missed"
    )
    args = parser.parse_args()
    requests = 100 if args.quick else args.requests
    trace = make_trace(requests, args.seed)
    print(
        f"trace: {requests} requests, seed {args.seed}, mean prompt "
        f"{np.mean([len(p) for p in trace.prompts]):.0f}, mean output "
        f"{trace.output_lens.mean():.0f}; pool {args.num_blocks} x {args.block_size}, "
        f"max running {args.max_running}"
    )
    results = {}
    runs: tuple[tuple[str, Any, bool], ...] = (
        ("batch", BlockManager, True),
        ("step", BlockManager, False),
        ("python", PythonBlockManager, False),
    )
    for name, cls, persistent in runs:
        gc.collect()
        mgr = cls(args.num_blocks, args.block_size, hash_key=bytes(32))
        results[name] = serve(mgr, trace, args.max_running, persistent)
        mgr.check()
        report(name, results[name])
    # The batch takes blocks in row order, so only the step's physical choices match Python's.
    same = ("hit_tokens", "query_tokens", "steps", "decode_tokens", "preemptions", "shape")
    assert results["step"].digest == results["python"].digest, "step and python chose other blocks"
    for name in ("step", "python"):
        for field in same:
            ours, theirs = getattr(results["batch"], field), getattr(results[name], field)
            assert ours == theirs, f"{field} differs: batch {ours} vs {name} {theirs}"
    batch, step, ref = results["batch"], results["step"], results["python"]
    ns = batch.step_ns / batch.decode_tokens
    speedup = ref.step_ns / batch.step_ns
    print(
        f"step_batch takes {batch.step_ns / step.step_ns:.2f}x the time of step "
        f"({step.step_ns / step.decode_tokens:.1f} -> {ns:.1f} ns/decode token)"
    )
    print(
        f"step_batch {ns:.1f} ns/decode token against python's "
        f"{ref.step_ns / ref.decode_tokens:.1f}: {speedup:.1f}x faster "
        f"(target >= {TARGET_SPEEDUP:.0f}x); loop speedup {ref.total_ns / batch.total_ns:.1f}x"
    )
    met = speedup >= TARGET_SPEEDUP
    print("target met" if met else "TARGET MISSED")
    return 0 if met or not args.enforce else 1


if __name__ == "__main__":
    raise SystemExit(main())
