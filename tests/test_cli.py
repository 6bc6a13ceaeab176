"""Tests of the `pagedkv` command line: the table, JSON, the plot, and one-line errors."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import TextIO

import pytest

from pagedkv.cli import main, parse_rates, parse_size
from pagedkv.simulate import progress
from pagedkv.simulate.progress import ProgressBar

SMALL = ["simulate", "--trace", "alpaca", "--num-requests", "40", "--quiet"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_shows_every_system(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *SMALL)
    assert code == 0 and err == ""
    for name in ("paged (pagedkv)", "contiguous max", "contiguous pow2", "contiguous oracle"):
        assert name in out
    assert "trace alpaca: 40 requests" in out
    assert "OPT-13B" in out and "A100-40GB" in out
    assert "tokens/held" in out and "tok/s" in out


def test_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *SMALL, "--json", "--model", "llama-3-8b", "--gpu", "h100-80gb")
    assert code == 0
    data = json.loads(out)
    assert data["config"]["model"] == "Llama-3-8B" and data["config"]["gpu"] == "H100-80GB"
    assert data["trace"]["requests"] == 40
    assert [s["name"] for s in data["systems"]] == [
        "paged (pagedkv)",
        "contiguous max",
        "contiguous pow2",
        "contiguous oracle",
    ]


def test_json_shares_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One request, prompt 5, output 4, in 32 slots of OPT-13B KV (819,200 bytes each); it
    # holds 6, 7, 8, 9 tokens after its four steps.
    trace = tmp_path / "one.jsonl"
    trace.write_text('{"prompt_len": 5, "output_len": 4}\n')
    code, out, _ = run_cli(
        capsys, "simulate", "--trace", str(trace), "--kv-memory", str(32 * 819200),
        "--block-size", "4", "--max-len", "16", "--systems", "paged,oracle",
        "--allocator", "first-fit", "--include-drain", "--quiet", "--json",
    )  # fmt: skip
    assert code == 0
    paged, oracle = json.loads(out)["systems"]
    slot_steps = 4 * 32
    # Paged, blocks of 4: 2, 2, 2, 3 blocks; the tail is reserved while tokens remain, and
    # the 3 empty slots of the last block (9 tokens in 12) are internal.
    assert paged["token_share"] == pytest.approx((6 + 7 + 8 + 9) / slot_steps)
    assert paged["reserved_share"] == pytest.approx((2 + 1 + 0 + 0) / slot_steps)
    assert paged["internal_share"] == pytest.approx((0 + 0 + 0 + 3) / slot_steps)
    assert paged["external_share"] == pytest.approx((24 + 24 + 24 + 20) / slot_steps)
    # Oracle, exact-size region of 9: what is not yet a token is reserved.
    assert oracle["token_share"] == pytest.approx((6 + 7 + 8 + 9) / slot_steps)
    assert oracle["reserved_share"] == pytest.approx((3 + 2 + 1 + 0) / slot_steps)
    assert oracle["internal_share"] == 0
    assert oracle["external_share"] == pytest.approx(4 * (32 - 9) / slot_steps)
    assert paged["steps"] == oracle["steps"] == 4


def test_float8_kv_doubles_the_batch_at_the_same_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    batch = {}
    for kv_dtype, width in (("bf16", 2), ("fp8", 1)):
        argv = [
            *SMALL,
            "--num-requests",
            "200",
            "--model",
            "deepseek-v2-lite",
            "--gpu",
            "h100-80gb",
        ]
        argv += ["--kv-memory", "100MB", "--systems", "paged", "--json", "--kv-dtype", kv_dtype]
        code, out, _ = run_cli(capsys, *argv)
        data = json.loads(out)
        assert code == 0 and data["config"]["kv_bytes_per_token"] == 27 * 576 * width
        batch[kv_dtype] = data["systems"][0]["mean_seqs"]
    assert batch["fp8"] > 1.8 * batch["bf16"]


def test_parallel_sampling_reports_sharing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *SMALL, "-n", "4", "--kv-memory", "12GB")
    assert code == 0
    assert "n=4 parallel samples" in out
    assert "sharing blocks (fork, prefix cache) saved" in out


def test_beam_search_and_subset_of_systems(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *SMALL, "--beam-width", "3", "--systems", "paged,oracle")
    assert code == 0
    assert "beam width 3" in out and "contiguous oracle" in out and "contiguous max" not in out


def test_plot_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "sim.png"
    code, out, _ = run_cli(capsys, *SMALL, "--plot", str(png))
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in out


def test_jsonl_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"prompt_len": 100 + i, "output_len": 20, "arrival": i / 10}) for i in range(30)
    ]
    trace.write_text("\n".join(lines) + "\n")
    code, out, _ = run_cli(capsys, "simulate", "--trace", str(trace), "--quiet", "--json")
    assert code == 0
    assert json.loads(out)["trace"]["requests"] == 30


def one_line_error(code: int, out: str, err: str) -> str:
    assert code != 0
    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "sharegtp"], "unknown trace 'sharegtp'"),
        (["--model", "gpt-5"], "unknown model 'gpt-5'"),
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--block-size", "-16"], "argument --block-size: expected a positive integer, got '-16'"),
        (["--num-requests", "0"], "expected a positive integer"),
        (["--kv-memory=-3GB"], "expected a size such as 12GB"),
        (["--kv-memory", "12 parsecs"], "expected a size such as 12GB"),
        (["--rate", "-1"], "expected a positive rate"),
        (["--seed", "x"], "expected a non-negative integer"),
        (["--systems", "paged,buddy"], "unknown system 'buddy'"),
        (["-n", "2", "--beam-width", "2"], "not both"),
        (["--kv-memory", "1GB"], "fewer than one max-length request"),
        (["--model", "Llama-3-70B", "--gpu", "A100-80GB"], "do not fit in 1 x A100-80GB"),
        (["--trace", "azure-code"], "cannot keep its means under max length 2048"),
        (["--plot", "out.jpg"], "give a .png file name"),
        (["--trace", "missing.jsonl"], "cannot read trace 'missing.jsonl'"),
    ],
)
def test_bad_input_is_one_line_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run_cli(capsys, "simulate", "--quiet", *argv)
    assert message in one_line_error(code, out, err)


def test_malformed_jsonl_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_len": 5, "output_len": 3}\n{"prompt_len": 5, "output_len": \n')
    code, out, err = run_cli(capsys, "simulate", "--trace", str(trace))
    assert f"{trace}:2: not valid JSON" in one_line_error(code, out, err)


def test_unwritable_plot_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *SMALL, "--plot", str(tmp_path / "no" / "such" / "x.png"))
    assert "cannot write plot" in one_line_error(code, out, err)


def test_help_names_sources_and_definitions(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "simulate", "--help")
    assert code == 0
    assert "SOSP 2023" in out and "Splitwise" in out and "facebook/opt-13b" in out
    assert "gpt-fast" in out and "Pope et al." in out  # the step-time defaults' sources
    assert "internal" in out and "reserved" in out and "external" in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys)
    assert code == 2 and "simulate" in err


def test_parse_size() -> None:
    assert parse_size("12GB") == 12 * 10**9
    assert parse_size("12 GiB") == 12 * 2**30
    assert parse_size("1.5e9") == 1_500_000_000
    assert parse_size("512mib") == 512 * 2**20
    for bad in ("", "GB", "12 XB", "0", "-1GB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_progress_bar_draws_and_erases() -> None:
    stream = io.StringIO()
    bar = ProgressBar("paged", 4, stream, enabled=True)
    bar.update(4)
    assert "paged [" in stream.getvalue() and "4/4" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r")
    silent = io.StringIO()
    quiet = ProgressBar("paged", 4, silent, enabled=False)
    quiet.update(4)
    quiet.close()
    assert silent.getvalue() == ""


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pagedkv", "simulate", *SMALL[1:], "--systems", "paged"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "paged (pagedkv)" in done.stdout


def test_plot_without_matplotlib_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    code, out, err = run_cli(capsys, *SMALL, "--plot", "x.png")
    assert "--plot needs matplotlib" in one_line_error(code, out, err)


# --- --sweep-rate ----------------------------------------------------------------------------

SWEEP = [*SMALL, "--sweep-rate", "10,30"]


def test_sweep_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *SWEEP, "--latency-bound", "0.5")
    assert code == 0 and err == ""
    assert "Poisson arrivals at 2 rates" in out
    assert "normalized latency (s per output token" in out and "mean batch" in out
    assert "sustainable rate (req/s) with latency within 0.5 s/token" in out
    assert "paged (pagedkv) / contiguous oracle: " in out
    assert "step time: decode reads at 68.5% of 1.555 TB/s" in out


def test_sweep_point_equals_a_single_rate_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *SWEEP, "--json")
    assert code == 0
    swept = json.loads(out)
    code, out, _ = run_cli(capsys, *SMALL, "--rate", "30", "--json")
    assert code == 0
    single = json.loads(out)
    assert swept["rates"] == [10.0, 30.0]
    assert swept["points"][1]["systems"] == single["systems"]
    assert swept["config"] == single["config"] and swept["trace"] == single["trace"]
    latencies = [s["mean_latency_per_token_s"] for s in single["systems"]]
    assert [s["normalized_latency_s_per_token"][1] for s in swept["systems"]] == latencies
    assert swept["latency_bound_s_per_token"] == 0.2  # the documented default
    assert [r["baseline"] for r in swept["ratios"]] == [
        "contiguous max",
        "contiguous pow2",
        "contiguous oracle",
    ]


def test_sweep_over_a_jsonl_trace_draws_arrivals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"prompt_len": {9 + i}, "output_len": 7}}\n' for i in range(20)))
    base = ["simulate", "--trace", str(trace), "--systems", "oracle", "--quiet", "--json"]
    code, out, _ = run_cli(capsys, *base, "--sweep-rate", "1:3:1")
    assert code == 0
    swept = json.loads(out)
    code, out, _ = run_cli(capsys, *base, "--rate", "2")
    assert swept["rates"] == [1.0, 2.0, 3.0]
    assert swept["points"][1]["systems"] == json.loads(out)["systems"]
    timed = tmp_path / "timed.jsonl"
    timed.write_text('{"prompt_len": 5, "output_len": 3, "arrival": 1.0}\n')
    code, out, err = run_cli(capsys, "simulate", "--trace", str(timed), "--sweep-rate", "1,2")
    assert "gives arrival times" in one_line_error(code, out, err)


def test_sweep_plot_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "sweep.png"
    code, out, _ = run_cli(capsys, *SWEEP, "--systems", "paged,max", "--plot", str(png))
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {png}" in out


def test_progress_bar_covers_the_whole_sweep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bars: list[tuple[int, list[str], list[int]]] = []

    class Recording(ProgressBar):
        def __init__(self, label: str, total: int, stream: TextIO, *, enabled: bool) -> None:
            super().__init__(label, total, stream, enabled=enabled)
            bars.append((total, [], []))

        def update(self, count: int) -> None:
            bars[-1][1].append(self.label)
            bars[-1][2].append(count)

    monkeypatch.setattr(progress, "ProgressBar", Recording)
    code, _, _ = run_cli(capsys, *SWEEP, "--systems", "paged,oracle")
    assert code == 0
    [(total, labels, counts)] = bars  # one bar for all four runs
    assert total == sum(counts) == 2 * 2 * 40  # rates x systems x requests
    assert labels[0] == "10 req/s, paged (pagedkv)"
    assert labels[-1] == "30 req/s, contiguous oracle"


def test_parse_rates() -> None:
    assert parse_rates("0.25:1:0.25") == [0.25, 0.5, 0.75, 1.0]
    assert parse_rates("0.1:0.3:0.1") == [0.1, 0.2, 0.3]  # STOP kept despite rounding
    assert parse_rates("2,1,4,2") == [1.0, 2.0, 4.0]
    for bad, message in [
        ("1:2", "START:STOP:STEP"),
        ("0:1:0.5", "positive finite rate"),
        ("2:1:0.5", "STOP is below START"),
        ("1:2:0", "positive finite rate"),
        ("1,inf", "positive finite rate"),
        ("1,x", "positive finite rate"),
        (",", "no rate"),
        ("0.001:1:0.001", "more than 200"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_rates(bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sweep-rate", "1:2"], "expected START:STOP:STEP"),
        (["--sweep-rate", "1,2", "--rate", "3"], "not allowed with argument"),
        (["--latency-bound", "0.5"], "--latency-bound goes with --sweep-rate"),
        (["--sweep-rate", "1,2", "--latency-bound", "0"], "expected a positive number"),
        (["--sweep-rate", "1", "--kv-events", "inproc://x"], "cannot go with --sweep-rate"),
        (["--decode-bandwidth-fraction", "0"], "expected a fraction in (0, 1]"),
        (["--prefill-flop-fraction", "1.5"], "expected a fraction in (0, 1]"),
    ],
)
def test_bad_sweep_input_is_one_line_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, *SMALL, *argv)
    assert message in one_line_error(code, out, err)


def test_efficiency_fractions_set_the_clock(capsys: pytest.CaptureFixture[str]) -> None:
    def throughput(*argv: str) -> float:
        code, out, _ = run_cli(capsys, *SMALL, "--systems", "oracle", "--json", *argv)
        assert code == 0
        value: float = json.loads(out)["systems"][0]["throughput_tokens_per_s"]
        return value

    ideal = throughput("--decode-bandwidth-fraction", "1")
    half = throughput("--decode-bandwidth-fraction", "0.5")
    assert half == pytest.approx(ideal / 2)
    assert throughput() == pytest.approx(ideal * 1397.31 / 2039)
