"""The Python baseline of benches/bench_step.py makes pagedkv's decisions on a trace that
exercises prefix hits, eviction and preemption, so its speed ratio compares like with like and a
baseline that drifts from rust/core/SEMANTICS.md fails here, not only in the bench."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

from bench_step import make_trace, serve
from python_baseline import PythonBlockManager

from pagedkv import BlockManager


@pytest.mark.parametrize("seed", [0, 1])
def test_the_baseline_decides_like_pagedkv(seed: int) -> None:
    # 60 requests, at most 16 running, in a pool that holds about a dozen of them: admissions
    # wait, shared system prompts hit, cached blocks are evicted and steps preempt.
    trace = make_trace(60, seed)
    real = BlockManager(400, 16, hash_key=bytes(32))
    baseline = PythonBlockManager(400, 16, hash_key=bytes(32))
    fast, python = (serve(mgr, trace, max_running=16) for mgr in (real, baseline))
    real.check()
    baseline.check()
    assert fast.hit_tokens > 0 and fast.preemptions > 0 and fast.admission_waits > 0, fast
    assert real.stats().evictions > 0
    for field in ("query_tokens", "hit_tokens", "steps", "decode_tokens", "preemptions", "digest"):
        assert getattr(fast, field) == getattr(python, field), field


def test_a_persistent_batch_decides_like_step() -> None:
    # The same trace through step_batch (rows added and removed as requests come and go): the
    # same admissions, hits, steps and preemptions, and every step the same positions and pages.
    trace = make_trace(60, 0)
    runs = []
    for persistent in (False, True):
        mgr = BlockManager(400, 16, hash_key=bytes(32))
        runs.append(serve(mgr, trace, max_running=16, persistent=persistent))
        mgr.check()
    step, batch = runs
    assert batch.preemptions > 0 and batch.hit_tokens > 0, batch
    for field in ("query_tokens", "hit_tokens", "steps", "decode_tokens", "preemptions", "shape"):
        assert getattr(batch, field) == getattr(step, field), field
