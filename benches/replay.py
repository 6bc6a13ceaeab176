"""Where a Python decode loop's step time goes: record every call a loop makes to a
`pagedkv.BlockManager` and its `Batch`, then make the same calls again on a fresh manager with
nothing in between, timing each `step_batch` and sorting it by what the loop did since the step
before (admitted a request, so the step commits its prefill; freed one, so the step checks the
rows of that sequence's shard in full; or neither) and whether it ran out of blocks.

Replayed, a step finds in the caches what the steps and calls before it left there, not what the
loop's own work (trace bookkeeping, numpy) did; the difference from the live loop is what that
work costs the step.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from pagedkv import Batch, BlockManager, OutOfBlocks

KINDS = ("after an admission", "after a free only", "after neither", "out of blocks")
"""What a replayed step is filed under."""


class RecordedBatch:
    """A `Batch` whose row changes are logged with the manager's calls."""

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.inner = Batch()
        self._calls = calls

    def add(self, seq_id: int) -> None:
        self._calls.append(("add", (seq_id,)))
        self.inner.add(seq_id)

    def remove(self, seq_id: int) -> None:
        self._calls.append(("remove", (seq_id,)))
        self.inner.remove(seq_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Recorder:
    """A manager whose calls are logged (arguments copied), with `new_batch` for its batch."""

    def __init__(self, mgr: BlockManager) -> None:
        self.mgr = mgr
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def new_batch(self) -> RecordedBatch:
        return RecordedBatch(self.calls)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.mgr, name)

        def call(*args: Any) -> Any:
            args = tuple(a.inner if isinstance(a, RecordedBatch) else a for a in args)
            kept = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
            self.calls.append((name, kept))
            return method(*args)

        return call


@dataclass
class Replay:
    """The replayed steps' time and decode tokens (rows of the steps that did not fail), by kind."""

    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    """Rows the steps of each kind had: their batch sizes differ, so compare them a row."""
    tokens: int = 0

    def ns_per_token(self) -> float:
        return sum(self.ns.values()) / self.tokens


def replay(
    calls: list[tuple[str, tuple[Any, ...]]],
    new_manager: Callable[[], Any],
    core: Any = None,
) -> Replay:
    """Makes `calls` again on `new_manager()` and a fresh batch, timing each `step_batch`;
    `core` is the compiled module of another build (see `load_core`) whose `Batch` and
    `OutOfBlocks` go with its manager."""
    new_batch, out_of_blocks = (
        (Batch, OutOfBlocks) if core is None else (core.Batch, core.OutOfBlocks)
    )
    mgr, batch, out = new_manager(), new_batch(), Replay()
    admitted = freed = False
    for name, args in calls:
        if name in ("add", "remove"):
            getattr(batch, name)(*args)
            continue
        if name != "step_batch":
            admitted |= name == "allocate"
            freed |= name == "free"
            getattr(mgr, name)(*args)
            continue
        tokens = args[1]
        failed = False
        start = time.perf_counter_ns()
        try:
            mgr.step_batch(batch, tokens)
        except out_of_blocks:
            failed = True
        ns = time.perf_counter_ns() - start
        if failed:
            kind = "out of blocks"
        else:
            kind = KINDS[0] if admitted else KINDS[1] if freed else KINDS[2]
            out.tokens += len(tokens)
        out.ns[kind] += ns
        out.steps[kind] += 1
        out.rows[kind] += len(tokens)
        admitted = freed = False
    return out


def load_core(directory: str) -> ModuleType:
    """The compiled module (`pagedkv._core`) of the pagedkv package in `directory`, loaded
    beside this build's under the name `_core`, so both builds run in one process."""
    path = next((Path(directory) / "pagedkv").glob("_core*.so"))
    loader = importlib.machinery.ExtensionFileLoader("_core", str(path))
    spec = importlib.util.spec_from_file_location("_core", path, loader=loader)
    assert spec is not None, f"no module in {path}"
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def call_ns(rounds: int = 5, calls: int = 20_000) -> float:
    """The least time of one `step_batch` call on an empty batch: the binding's fixed cost."""
    mgr, batch, tokens = BlockManager(16, 16), Batch(), np.empty(0, np.int32)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            mgr.step_batch(batch, tokens)
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best
