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
