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
    python benches/bench_step.py --against /tmp/base/python   # this build against another one
    python benches/bench_step.py --against /tmp/base/python --in-process --rounds 20
    python benches/bench_step.py --breakdown     # ... and where step_batch's time goes

With `--against DIR` it times pagedkv alone (`step`, or `step_batch` with `--batch`), this
build and the build whose `pagedkv` package is in DIR (e.g. another revision's `python/` with
its compiled `_core`), each in a fresh interpreter, alternating for `--rounds` rounds, and
prints the medians and their ratio; with `--in-process` it records this build's `step_batch`
loop once and replays it on both builds in one process instead, alternating. With
`--breakdown` it also replays the `step_batch` loop's calls (replay.py) to split its time: the
loop's own work between steps, the steps that commit a prefill, check rows after a free or run
out of blocks, prefix caching, and the call itself.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

from python_baseline import PythonBlockManager
from replay import KINDS, Recorder, call_ns, load_core, replay

from pagedkv import Batch, BlockManager, OutOfBlocks

VOCAB = 32_000
TARGET_NS_PER_TOKEN = 30.0
TARGET_SPEEDUP = 20.0


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


def serve(
    mgr: Any,
    trace: Trace,
    max_running: int,
    persistent: bool = False,
    new_batch: Callable[[], Any] = Batch,
) -> RunResult:
    """Run the whole trace through `mgr`; seq ids are request indices.

    With `persistent`, the decode steps go through one `new_batch()` (`step_batch`): rows are
    added on admission and removed on finish or preemption, and each step's tokens are put in
    row order (outside the timed region, like computing them).
    """
    batch = new_batch() if persistent else None
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


def managers(args: argparse.Namespace, caching: bool, cls: Any = BlockManager) -> Callable[[], Any]:
    """Makes fresh managers of `cls` (this build's, or another build's) for the replays."""
    return lambda: cls(
        args.num_blocks, args.block_size, hash_key=bytes(32), enable_prefix_caching=caching
    )


def breakdown(args: argparse.Namespace, trace: Trace) -> None:
    """Where `step_batch`'s time goes in this loop: the loop's calls replayed with nothing
    between them (see replay.py), with prefix caching on and off, and the call's fixed cost.
    Live runs and replays alike are medians of `args.replays` runs."""
    print("where step_batch's time goes (replayed: the same calls again, nothing between them)")
    replayed = {}
    for caching in (True, False):
        new_manager = managers(args, caching)
        lives = []
        for _ in range(args.replays):
            gc.collect()
            lives.append(serve(new_manager(), trace, args.max_running, persistent=True))
        live = sorted(lives, key=lambda r: r.step_ns)[len(lives) // 2]
        if caching:
            mean_batch = live.decode_tokens / live.steps
        recorder = Recorder(new_manager())
        recorded = serve(recorder, trace, args.max_running, True, recorder.new_batch)
        assert recorded.steps == live.steps and recorded.digest == live.digest
        gc.collect()
        runs = sorted(
            (replay(recorder.calls, new_manager) for _ in range(args.replays)),
            key=lambda r: r.ns_per_token(),
        )
        run = runs[len(runs) // 2]
        assert run.tokens == live.decode_tokens
        replayed[caching] = run.ns_per_token()
        live_ns = live.step_ns / live.decode_tokens
        print(
            f"  prefix caching {'on' if caching else 'off'}: live {live_ns:.1f} ns/decode token, "
            f"replayed {replayed[caching]:.1f} (medians of {args.replays}; the loop's own work "
            f"between steps costs the step {live_ns - replayed[caching]:.1f}); "
            f"{live.preemptions} preemptions"
        )
        total = sum(run.ns.values())
        for kind in KINDS:
            if run.steps[kind]:
                print(
                    f"    {kind:>18}: {run.steps[kind]:5} steps, {run.ns[kind] / total:6.1%} of "
                    f"the time, mean batch {run.rows[kind] / run.steps[kind]:5.1f}, "
                    f"{run.ns[kind] / run.steps[kind] / 1e3:6.2f} us a step, "
                    f"{run.ns[kind] / run.rows[kind]:5.1f} ns a row"
                )
    call = call_ns()
    print(
        f"  registering, hashing and evicting blocks (replayed, on minus off; the schedules "
        f"differ a little): {replayed[True] - replayed[False]:.1f} ns/decode token"
    )
    print(
        f"  the call itself (step_batch on an empty batch): {call:.0f} ns, "
        f"{call / mean_batch:.1f} ns/decode token at the mean batch of {mean_batch:.1f}"
    )


def against(args: argparse.Namespace, argv: list[str]) -> int:
    """Times this build and the one in `args.against`, alternating, in fresh interpreters."""
    ours = str(Path(__file__).resolve().parents[1] / "python")
    skip = {"--against", "--rounds"}
    passed = [a for i, a in enumerate(argv) if a not in skip and argv[i - 1] not in skip]
    command = [sys.executable, __file__, *passed, "--pagedkv-only"]
    times: dict[str, list[float]] = {"this build": [], args.against: []}
    for round_ in range(args.rounds):
        for name, path in (("this build", ours), (args.against, args.against)):
            env = dict(os.environ, PYTHONPATH=path)
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            ns = float(out.stdout.split("ns_per_token=")[1].split()[0])
            times[name].append(ns)
            print(f"round {round_ + 1}: {name}: {ns:.1f} ns/decode token", flush=True)
    now, then = (statistics.median(times[k]) for k in ("this build", args.against))
    print(
        f"median over {args.rounds} rounds: {then:.1f} -> {now:.1f} ns/decode token, "
        f"ratio {now / then:.3f} ({then / now:.2f}x faster than {args.against})"
    )
    return 0


def against_in_process(args: argparse.Namespace) -> int:
    """Replays one recording of this build's `step_batch` loop on this build and on the build in
    `args.against`, in one process, alternating (the order too), with prefix caching on and off:
    separate interpreters put their memory elsewhere each run, which moves a step's time more
    than most changes do."""
    base = load_core(args.against)
    trace = make_trace(100 if args.quick else args.requests, args.seed)
    for caching in (True, False):
        recorder = Recorder(managers(args, caching)())
        serve(recorder, trace, args.max_running, True, recorder.new_batch)
        builds = {
            "this build": (managers(args, caching), None),
            args.against: (managers(args, caching, base.BlockManager), base),
        }
        times: dict[str, list[float]] = {name: [] for name in builds}
        for round_ in range(args.rounds):
            order = list(builds) if round_ % 2 == 0 else list(reversed(builds))
            tokens = set()
            for name in order:
                new_manager, core = builds[name]
                gc.collect()
                run = replay(recorder.calls, new_manager, core)
                tokens.add(run.tokens)
                times[name].append(run.ns_per_token())
            assert len(tokens) == 1, "the builds decided differently"
        now, then = times["this build"], times[args.against]
        ratio = statistics.median(a / b for a, b in zip(now, then, strict=True))
        print(
            f"prefix caching {'on' if caching else 'off'}: {statistics.median(then):.1f} -> "
            f"{statistics.median(now):.1f} ns/decode token replayed, ratio {ratio:.3f} (median "
            f"of {args.rounds} rounds' ratios, in one process)",
            flush=True,
        )
    return 0


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
    parser.add_argument(
        "--against", metavar="DIR", help="compare with the pagedkv package found in DIR"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --against (default 3)")
    parser.add_argument(
        "--batch", action="store_true", help="--against times step_batch instead of step"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="--against replays one recorded step_batch loop on both builds in one process",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also replay the step_batch loop's calls to show where its time goes",
    )
    parser.add_argument(
        "--replays", type=int, default=5, help="replays of each loop for --breakdown (default 5)"
    )
    parser.add_argument("--pagedkv-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against:
        return against_in_process(args) if args.in_process else against(args, sys.argv[1:])
    requests = 100 if args.quick else args.requests
    trace = make_trace(requests, args.seed)
    print(
        f"trace: {requests} requests, seed {args.seed}, mean prompt "
        f"{np.mean([len(p) for p in trace.prompts]):.0f}, mean output "
        f"{trace.output_lens.mean():.0f}; pool {args.num_blocks} x {args.block_size}, "
        f"max running {args.max_running}"
    )
    if args.pagedkv_only:
        gc.collect()
        mgr = BlockManager(args.num_blocks, args.block_size, hash_key=bytes(32))
        r = serve(mgr, trace, args.max_running, persistent=args.batch)
        report("pagedkv", r)
        print(f"ns_per_token={r.step_ns / r.decode_tokens}")
        return 0
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
        f"step speedup over python {speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x), "
        f"loop speedup {ref.total_ns / batch.total_ns:.1f}x, "
        f"step_batch {ns:.1f} ns/decode token (target <= {TARGET_NS_PER_TOKEN:.0f})"
    )
    if args.breakdown:
        breakdown(args, trace)
    met = ns <= TARGET_NS_PER_TOKEN and speedup >= TARGET_SPEEDUP
    print("targets met" if met else "TARGETS MISSED")
    return 0 if met or not args.enforce else 1


if __name__ == "__main__":
    raise SystemExit(main())
