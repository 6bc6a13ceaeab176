"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs() -> None:
    text = README.read_text()
    match = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S)
    assert match, "the README has a Python quickstart"
    exec(compile(match.group(1), "README quickstart", "exec"), {})


def test_persistent_batch_example_runs() -> None:
    text = README.read_text()
    match = re.search(r"\*\*Persistent batch\.\*\*.*?```python\n(.*?)```", text, re.S)
    assert match, "the README has a persistent batch example"
    exec(compile(match.group(1), "README persistent batch", "exec"), {})


def test_speculative_decoding_example_runs() -> None:
    text = README.read_text()
    match = re.search(r"## Speculative decoding\n.*?```python\n(.*?)```", text, re.S)
    assert match, "the README has a speculative decoding example"
    exec(compile(match.group(1), "README speculative decoding", "exec"), {})


def test_for_users() -> None:
    """At most 750 lines, no revision ids, one performance table whose every row has a command."""
    text = README.read_text()
    assert len(text.splitlines()) <= 750
    revisions = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)
    assert not revisions, f"revision ids in the README: {revisions}"
    section = text.split("\n## Performance\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header, rule, *figures = rows
    assert rule.startswith("| ---")
    assert header.split("|")[1:-1] == [
        " what is measured ",
        " pagedkv ",
        " baseline, same run ",
        " ratio ",
        " command ",
    ]
    assert 0 < len(figures) <= 12
    for row in figures:
        command = row.split("|")[-2].strip()
        assert command.startswith("`") and command.endswith("`"), row
