"""Tests of the `pagedkv` command line: the table, JSON, the plot, and one-line errors."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main, parse_size
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
    assert data["systems"][0]["name"] == "paged (pagedkv)"
    for s in data["systems"]:
        parts = ("token_share", "reserved_share", "internal_share", "external_share")
        assert sum(s[p] for p in parts) == pytest.approx(1.0)


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
