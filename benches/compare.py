"""Runs the criterion benches of this tree against another revision, interleaved, and prints
the ratio of each summary figure (medians over the rounds).

The other revision is exported with `git archive` into `compare-base-src` in this tree's target
folder (rewritten each run), this tree's bench sources (`benches/**/*.rs`, which use only the
public API) are copied over its own, and it is built there with its own target folder; then
each round runs the baseline's bench binary and this tree's, one after the other. A figure is
any summary line a bench prints as `<what>: <number> us`.

    python benches/compare.py                   # against main: the admission and manager benches
    python benches/compare.py --rev v0.1.0 --bench manager --rounds 5
    python benches/compare.py --rev v0.1.0 --in-process --rounds 40
    python benches/compare.py --rev a381765 --bench manager --own-benches \
        --filter 'decode/(step_plan|step_batch/batch256_decode)' \
        --pair 'decode step_batch=step + plan' --rounds 8

With `--own-benches` the baseline keeps its own bench sources, for a revision whose API this
tree's benches do not compile against; its figures then say what they said at that revision,
and `--pair OURS=BASE` prints the ratio of this tree's figure whose label starts with OURS to
the baseline's whose label starts with BASE (the last example: today's decode step against
the one-shot step + plan at the revision the 5 us target was set on). `--filter` passes a
criterion filter to both binaries, so that a round runs only the benches named.

With `--in-process` it runs instead the `manager` bench's decode loop (`step_batch` at batch
256, prefix caching on and off, warm and cold) on both builds in one process, alternating
every 512 steps, then the batch's first step after its prefill (which commits it), alternating
every 8 of them, each over 8 pairs of fresh managers (`benches/support/in_process.rs`, in a crate
generated in this tree's target folder that links both builds, the baseline's renamed
`pagedkv_base`): both builds then run in the same machine phase, and the median of the rounds'
ratios resolves a few percent (a build against itself: 0.97-1.00 over 96 rounds) where two
separate runs on a noisy machine do not.
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


def run(exe: Path, cwd: Path, criterion_filter: str | None) -> dict[str, float]:
    """One run of a bench binary (only the benches `criterion_filter` matches, if given): its
    summary figures, in microseconds."""
    args = [str(exe), "--bench", "--noplot"] + ([criterion_filter] if criterion_filter else [])
    out = subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True)
    figures = {}
    for line in out.stdout.splitlines():
        match = FIGURE.match(line.strip())
        if match:
            figures[match["what"]] = float(match["value"])
    return figures


def labelled(figures: dict[str, list[float]], prefix: str, side: str) -> str:
    """The one label in `figures` that starts with `prefix`."""
    found = [what for what in figures if what.startswith(prefix)]
    if len(found) != 1:
        raise SystemExit(f"--pair: {len(found)} of {side}'s figures start with {prefix!r}")
    return found[0]


def in_process(base: Path, target: Path, rounds: int) -> None:
    """Builds `benches/support/in_process.rs` with this tree's pagedkv as `ours` and `base`'s
    (renamed `pagedkv_base`) as `base`, and runs it for `rounds` rounds."""
    manifest = base / "rust/core/Cargo.toml"
    manifest.write_text(
        manifest.read_text().replace('name = "pagedkv"', 'name = "pagedkv_base"', 1)
    )
    crate = target / "compare-in-process"
    src = crate / "src"
    if src.exists():
        shutil.rmtree(src)
    for side in ("ours", "base"):
        (src / side).mkdir(parents=True)
        modules = ("decoding", "splitmix64", "tokens")
        for module in modules:
            # The support files, each a module of the crate root in the benches, become
            # modules of `side`, whose `pagedkv` is that build.
            text = (ROOT / "benches/support" / f"{module}.rs").read_text()
            text = text.replace("use crate::", "use super::").replace(
                "use pagedkv::", "use super::pagedkv::"
            )
            (src / side / f"{module}.rs").write_text(text)
        (src / side / "mod.rs").write_text(
            f"//! The benches' decode loop on the {side} build (generated by compare.py).\n"
            "#![allow(dead_code)]\n"
            f"pub use ::{side} as pagedkv;\npub use crate::BLOCK_SIZE;\n"
            + "".join(f"pub mod {module};\n" for module in modules)
        )
    shutil.copy(ROOT / "benches/support/in_process.rs", src / "main.rs")
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "compare-in-process"\nversion = "0.0.0"\nedition = "2021"\n'
        "publish = false\n\n[dependencies]\n"
        f'ours = {{ package = "pagedkv", path = "{ROOT / "rust/core"}" }}\n'
        f'base = {{ package = "pagedkv_base", path = "{base / "rust/core"}" }}\n\n'
        "[workspace]\n"
    )
    env = dict(os.environ, CARGO_TARGET_DIR=str(crate / "target"))
    print("building both builds into one binary", file=sys.stderr)
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=crate, env=env, check=True)
    exe = crate / "target/release/compare-in-process"
    subprocess.run([str(exe), str(rounds)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="main", help="the baseline revision (default: main)")
    parser.add_argument(
        "--bench", action="append", help="criterion bench to run (default: admission, manager)"
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds (default 3; 40 with --in-process)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the decode loop of both builds in one process instead of the criterion benches",
    )
    parser.add_argument(
        "--own-benches",
        action="store_true",
        help="the baseline runs its own bench sources, not this tree's",
    )
    parser.add_argument("--filter", help="criterion filter (a regex) for both bench binaries")
    parser.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="OURS=BASE",
        help="also the ratio of our figure labelled OURS... to the baseline's labelled BASE...",
    )
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
    if args.in_process and (args.own_benches or args.filter or args.pair):
        parser.error(
            "--own-benches, --filter and --pair are for the criterion benches, not --in-process"
        )
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
    if not args.own_benches:
        for source in (ROOT / "benches").rglob("*.rs"):
            shutil.copy(source, base / source.relative_to(ROOT))
    if args.in_process:
        print(f"ratio = this tree / {args.rev}")
        in_process(base, ours_target, args.rounds or 40)
        return 0
    declare_benches(base / "rust/core/Cargo.toml", benches)
    print(f"building {args.rev} in {base} and this tree", file=sys.stderr)
    exes = {"base": build(base, base_target, benches), "ours": build(ROOT, ours_target, benches)}
    figures: dict[tuple[str, str, str], list[float]] = {}
    rounds = args.rounds or 3
    for round_ in range(rounds):
        for bench in benches:
            for side, tree in (("base", base), ("ours", ROOT)):
                print(f"round {round_ + 1}/{rounds}: {bench} ({side})", file=sys.stderr)
                for what, value in run(exes[side][bench], tree, args.filter).items():
                    figures.setdefault((bench, what, side), []).append(value)
    print(f"medians over {rounds} interleaved rounds; ratio = this tree / {args.rev}")
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
        side_figures = {
            side: {w: v for (b, w, s), v in figures.items() if b == bench and s == side}
            for side in ("ours", "base")
        }
        for pair in args.pair:
            ours_prefix, _, base_prefix = pair.partition("=")
            ours_what = labelled(side_figures["ours"], ours_prefix, "this tree")
            base_what = labelled(side_figures["base"], base_prefix, args.rev)
            rounds_ours, rounds_base = (
                side_figures["ours"][ours_what],
                side_figures["base"][base_what],
            )
            ratios = [o / b for o, b in zip(rounds_ours, rounds_base, strict=True)]
            print(
                f"{bench}: {ours_what}, {statistics.median(rounds_ours):.3f} us, against "
                f"{args.rev}'s {base_what}, {statistics.median(rounds_base):.3f} us: ratios "
                f"{', '.join(f'{r:.3f}' for r in ratios)}, median {statistics.median(ratios):.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
