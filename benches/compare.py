"""Runs the criterion benches of this tree against another revision, interleaved, and prints
the ratio of each summary figure (medians over the rounds).

The other revision is exported with `git archive` into `compare-base-src` in this tree's target
folder (rewritten each run), this tree's bench sources (`benches/**/*.rs`, which use only the
public API) are copied over its own, and it is built there with its own target folder; then
each round runs the baseline's bench binary and this tree's, one after the other. A figure is
any summary line a bench prints as `<what>: <number> us`.

    python benches/compare.py                   # against main: the admission and manager benches
    python benches/compare.py --rev v0.1.0 --bench manager --rounds 5
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"^(?P<what>[^:]+): (?P<value>[0-9.]+) us$")


def build(tree: Path, target: Path, benches: list[str]) -> dict[str, Path]:
    """Builds the bench binaries of `tree`; returns each bench's executable."""
    args = ["cargo", "bench", "-p", "pagedkv", "--no-run", "--message-format=json"]
    for bench in benches:
        args += ["--bench", bench]
    env = dict(os.environ, CARGO_TARGET_DIR=str(target))
    out = subprocess.run(args, cwd=tree, env=env, check=True, capture_output=True, text=True)
    found: dict[str, Path] = {}
    for line in out.stdout.splitlines():
        if '"executable"' not in line or '"bench"' not in line:
            continue
        name = re.search(r'"target":\{[^}]*"name":"([^"]+)"', line)
        exe = re.search(r'"executable":"([^"]+)"', line)
        if name and exe and name.group(1) in benches:
            found[name.group(1)] = Path(exe.group(1))
    missing = set(benches) - set(found)
    if missing:
        raise SystemExit(f"no executable for benches {sorted(missing)} in {tree}")
    return found


def declare_benches(manifest: Path, benches: list[str]) -> None:
    """Adds to the baseline's manifest the benches it does not declare yet."""
    text = manifest.read_text()
    for bench in benches:
        if f'name = "{bench}"' not in text:
            text += (
                f'\n[[bench]]\nname = "{bench}"\npath = "../../benches/{bench}.rs"\n'
                "harness = false\n"
            )
    manifest.write_text(text)


def run(exe: Path, cwd: Path) -> dict[str, float]:
    """One run of a bench binary: its summary figures, in microseconds."""
    out = subprocess.run(
        [str(exe), "--bench", "--noplot"], cwd=cwd, check=True, capture_output=True, text=True
    )
    figures = {}
    for line in out.stdout.splitlines():
        match = FIGURE.match(line.strip())
        if match:
            figures[match["what"]] = float(match["value"])
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="main", help="the baseline revision (default: main)")
    parser.add_argument(
        "--bench", action="append", help="criterion bench to run (default: admission, manager)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--base-dir",
        type=Path,
        help="where to export the baseline (default: compare-base-src inside this tree's target "
        "folder)",
    )
    parser.add_argument(
        "--base-target",
        type=Path,
        help="the baseline's cargo target folder (default: compare-base-target inside this tree's)",
    )
    args = parser.parse_args()
    benches = args.bench or ["admission", "manager"]
    ours_target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    # Inside our target folder, so that it is ignored like it (a sibling would be committed).
    base_target = args.base_target or ours_target / "compare-base-target"
    # One fixed place, rewritten each run: cargo judges a build fresh by the files its records
    # name, so a baseline exported somewhere new each time would be judged by the previous
    # export's files (still there, unchanged) and not rebuilt.
    base = args.base_dir or ours_target / "compare-base-src"
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", args.rev], cwd=ROOT, check=True, capture_output=True
    ).stdout
    # `-m`: the files are dated now, not at the commit, so cargo never takes them for the
    # sources of an older build in the same place.
    subprocess.run(["tar", "-x", "-m", "-C", str(base)], input=archive, check=True)
    for source in (ROOT / "benches").rglob("*.rs"):
        shutil.copy(source, base / source.relative_to(ROOT))
    declare_benches(base / "rust/core/Cargo.toml", benches)
    print(f"building {args.rev} in {base} and this tree", file=sys.stderr)
    exes = {"base": build(base, base_target, benches), "ours": build(ROOT, ours_target, benches)}
    figures: dict[tuple[str, str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for bench in benches:
            for side, tree in (("base", base), ("ours", ROOT)):
                print(f"round {round_ + 1}/{args.rounds}: {bench} ({side})", file=sys.stderr)
                for what, value in run(exes[side][bench], tree).items():
                    figures.setdefault((bench, what, side), []).append(value)
    print(f"medians over {args.rounds} interleaved rounds; ratio = this tree / {args.rev}")
    for bench in benches:
        whats = dict.fromkeys(w for (b, w, s) in figures if b == bench and s == "ours")
        for what in whats:
            ours = statistics.median(figures[(bench, what, "ours")])
            theirs = figures.get((bench, what, "base"))
            if theirs is None:
                print(f"{bench}: {what}: {ours:.3f} us (not in {args.rev})")
                continue
            before = statistics.median(theirs)
            print(
                f"{bench}: {what}: {before:.3f} -> {ours:.3f} us, ratio {ours / before:.3f} "
                f"({before / ours:.2f}x faster)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
