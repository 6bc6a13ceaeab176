"""The continuous-batching scheduler that drives every system through the same trace.

Policy, identical for every system: at each step, requests that have arrived wait in FCFS
order; the head is admitted while its memory can be had (no request overtakes the head);
then every running sequence stores one more token; a request whose last output token is
stored is freed at the end of the step. A request of prompt P and output O therefore holds
P + k tokens after its k-th step and P + O at its last. A system that cannot store a step's
tokens (only the paged one, which does not reserve ahead) preempts the most recently admitted
request: its KV is dropped and it returns to the head of the queue, to be recomputed from its
prompt and the tokens it already generated when memory allows (vLLM's recompute policy).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pagedkv.simulate.errors import SimulationError
from pagedkv.simulate.metrics import Composition, StepLog, SystemMetrics, summarize
from pagedkv.simulate.timing import StepTimeModel
from pagedkv.simulate.trace import Request, next_turns


@dataclass(eq=False)  # identity: the scheduler removes exactly this request from its lists
class Active:
    """A request inside the scheduler: its trace entry and how far it has got."""

    index: int
    request: Request
    width: int  # sequences it runs: parallel samples or beams
    generated: int = 0  # tokens stored per sequence beyond the prompt
    arrived: float | None = None  # when it arrived, if not at the request's own arrival

    @property
    def started(self) -> float:
        """When it arrived."""
        return self.request.arrival if self.arrived is None else self.arrived

    @property
    def length(self) -> int:
        """Tokens each of its sequences holds now."""
        return self.request.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        """Tokens each of its sequences will still store."""
        return self.request.output_len - self.generated


class KVSystem(Protocol):
    """A KV memory manager under test, as the scheduler drives it."""

    name: str
    capacity: int  # token slots

    def admit(self, active: Active) -> int | None:
        """Take memory for a waiting request; prompt tokens computed, or None if it must wait."""
        ...

    def decode(self, running: Sequence[Active]) -> list[Active]:
        """Store one more token in every sequence; return the requests preempted to do so."""
        ...

    def release(self, active: Active) -> None:
        """Free a finished request's memory."""
        ...

    def composition(self, running: Sequence[Active]) -> Composition:
        """Where the memory is now (after the step's tokens are stored)."""
        ...


def run(
    system: KVSystem,
    trace: Sequence[Request],
    *,
    width: int,
    timing: StepTimeModel,
    include_drain: bool,
    on_finish: Callable[[int], None] | None = None,
    need: Callable[[npt.NDArray[np.int64]], float] | None = None,
) -> SystemMetrics:
    """Drive `system` through `trace` (sorted by arrival) and summarize its memory use.

    A request with a `think` time arrives that long after the previous turn of its
    conversation finishes.

    `need(lengths)`: the slots sequences of these lengths need at least (default: one per
    token): the KV a decode step reads, and `SystemMetrics.bound_seqs`.
    """
    log = StepLog()
    waiting: deque[Active] = deque()
    running: list[Active] = []
    latencies: list[float] = []
    preemptions = 0
    clock = 0.0
    follows = next_turns(trace)
    # (arrival, index): the trace's own arrivals, then each next turn as its previous finishes.
    arrivals = [(r.arrival, i) for i, r in enumerate(trace) if r.think is None]
    heapq.heapify(arrivals)
    while arrivals or waiting or running:
        while arrivals and arrivals[0][0] <= clock:
            at, index = heapq.heappop(arrivals)
            waiting.append(Active(index, trace[index], width, arrived=at))
        if not waiting and not running:
            clock = arrivals[0][0]  # idle until the next arrival
            continue
        loaded = bool(waiting)
        prefill = 0
        while waiting:
            computed = system.admit(waiting[0])
            if computed is None:
                break
            running.append(waiting.popleft())
            prefill += computed
        if not running:
            head = waiting[0]
            raise SimulationError(
                f"{system.name}: request {head.index} (prompt {head.request.prompt_len}, "
                f"output {head.request.output_len}, {width} sequence(s)) does not fit in an "
                f"empty KV memory of {system.capacity} token slots"
            )
        for victim in system.decode(running):
            running.remove(victim)
            waiting.appendleft(victim)  # victims come latest first: the earliest ends in front
            preemptions += 1
        for active in running:
            active.generated += 1
        comp = system.composition(running)
        seqs = width * len(running)
        lengths = np.fromiter((a.length for a in running), dtype=np.int64, count=len(running))
        needed = width * (need(lengths) if need is not None else float(lengths.sum()))
        decode = timing.decode_seconds(needed)
        clock += decode + timing.prefill_seconds(prefill)
        log.record(
            comp,
            time=clock,
            decode_seconds=decode,
            needed=needed,
            seqs=seqs,
            requests=len(running),
            generated=seqs,
            loaded=loaded,
        )
        finished = [a for a in running if a.remaining == 0]
        for active in finished:
            system.release(active)
            running.remove(active)
            latencies.append((clock - active.started) / active.request.output_len)
            if active.index in follows:
                after = follows[active.index]
                heapq.heappush(arrivals, (clock + (trace[after].think or 0.0), after))
        if finished and on_finish is not None:
            on_finish(len(finished))
    return summarize(
        system.name,
        system.capacity,
        log,
        include_drain=include_drain,
        preemptions=preemptions,
        latencies=latencies,
    )
