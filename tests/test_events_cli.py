"""`pagedkv simulate --kv-events` as a subprocess, read live by the independent subscriber.

The simulation is deterministic: the same run in process, with an event sink that records the
manager's registered hashes after every step that has events, is the truth each received
batch must bring the subscriber's index to.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from kv_events_decoder import Subscriber

from pagedkv import BlockManager
from pagedkv.cli import main
from pagedkv.simulate import GPUS, MODELS, SimulationConfig, load_jsonl, simulate

MASK = 2**64 - 1
ARGS = ["--model", "OPT-13B", "--kv-memory", "1GB", "--systems", "paged", "--quiet"]


def write_trace(path: Path) -> Path:
    lines = [
        {
            "prompt_len": 40 + (7 * i) % 60,
            "output_len": 5 + (11 * i) % 25,
            "prefix_id": f"p{i % 3}",
            "prefix_len": 32,
        }
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def expected_indexes(trace_path: Path) -> list[set[int]]:
    model = MODELS["OPT-13B"]
    config = SimulationConfig(model, GPUS["A100-40GB"], kv_memory=10**9, systems=("paged",))
    trace = load_jsonl(trace_path, max_len=model.max_len, rate=math.inf, seed=0)
    after_steps: list[set[int]] = []

    def record(mgr: BlockManager) -> None:
        if mgr.take_events():
            after_steps.append({h & MASK for h in mgr.stored_hashes("GPU")})

    simulate(trace, config, event_sink=record)
    return after_steps


def test_simulate_publishes_the_paged_engines_events_live(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl")
    expected = expected_indexes(trace)
    assert len(expected) > 20
    sub = Subscriber("tcp://127.0.0.1:*", bind=True, topic=b"kv@pod-a@opt")
    try:
        live = ["--kv-events", sub.endpoint, "--kv-events-topic", "kv@pod-a@opt"]
        command = [sys.executable, "-m", "pagedkv", "simulate", "--trace", str(trace), *ARGS]
        proc = subprocess.Popen(
            [*command, *live, "--kv-events-wait", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for want in expected:
            sub.follow(timeout_ms=20_000)
            assert sub.index.tier("GPU") == want
            assert sub.index.tier("CPU") == set()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"kv events: {len(expected)} batches sent" in err and "0 dropped" in err
        assert "paged (pagedkv)" in out
        assert not sub.sub.poll(200)  # nothing more than the in-process run produced
    finally:
        sub.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-events-topic", "t"], "need --kv-events"),
        (["--kv-events", "tcp://*:5557", "--systems", "max"], "include it in --systems"),
        (["--kv-events", "tcp://127.0.0.1:bad"], "cannot connect"),
        (["--kv-events", "tcp://*:5557", "--kv-events-wait", "-1"], "must not be negative"),
    ],
)
def test_kv_events_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = main(["simulate", "--trace", "alpaca", "--num-requests", "5", "--quiet", *argv])
    assert code == 1
    assert message in capsys.readouterr().err
