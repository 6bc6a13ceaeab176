"""benches/replay.py makes a recorded loop's calls again with the same outcomes, so the split of
step time that `bench_step.py --breakdown` prints is of the same steps."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

from bench_step import make_trace, serve
from replay import KINDS, Recorder, call_ns, load_core, replay

import pagedkv
from pagedkv import BlockManager


def test_a_replay_takes_the_recorded_steps() -> None:
    trace = make_trace(60, 0)

    def new_manager() -> BlockManager:
        return BlockManager(400, 16, hash_key=bytes(32))

    recorder = Recorder(new_manager())
    live = serve(recorder, trace, 16, True, recorder.new_batch)
    plain = serve(new_manager(), trace, 16, persistent=True)
    assert (live.steps, live.digest, live.preemptions) == (
        plain.steps,
        plain.digest,
        plain.preemptions,
    )
    again = replay(recorder.calls, new_manager)
    assert again.tokens == live.decode_tokens
    assert again.steps["out of blocks"] == live.preemptions > 0
    assert sum(again.steps.values()) == live.steps + live.preemptions
    assert all(again.steps[kind] > 0 for kind in KINDS)
    assert sum(again.rows.values()) - again.rows["out of blocks"] == live.decode_tokens
    assert again.ns_per_token() > 0
    assert call_ns(rounds=1, calls=10) > 0


def test_another_build_replays_in_this_process(tmp_path: Path) -> None:
    """`bench_step.py --against DIR --in-process` loads DIR's compiled module beside this one's
    (here a copy of this build's, a library of its own) and replays the same calls on it."""
    package = tmp_path / "pagedkv"
    package.mkdir()
    core = next(Path(pagedkv.__file__).parent.glob("_core*.so"))
    shutil.copy(core, package)
    other = load_core(str(tmp_path))
    assert other.BlockManager is not BlockManager
    recorder = Recorder(BlockManager(400, 16, hash_key=bytes(32)))
    live = serve(recorder, make_trace(40, 1), 16, True, recorder.new_batch)
    again = replay(recorder.calls, lambda: other.BlockManager(400, 16, hash_key=bytes(32)), other)
    assert again.tokens == live.decode_tokens
    assert again.steps["out of blocks"] == live.preemptions
