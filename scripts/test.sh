#!/usr/bin/env bash
# Every check of the project on a fresh machine: installs what the tests need (the `test` extra),
# then Rust (fmt, clippy, unit + doc + property + stress tests, loom model checks), Python
# (ruff, mypy --strict, stub test against the compiled module, pytest) and a benchmark smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."

# One target folder per machine, so a fresh clone reuses already compiled dependencies.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pagedkv/target}"
export CARGO_TERM_COLOR=never
# numpy's BLAS threads would only compete with the tests for the two cores.
export OPENBLAS_NUM_THREADS=1
# Loom budget: bounded preemptions keep the model checks exhaustive yet fast. The property
# test sets its own case count (50,000 in release, about half a minute); PROPTEST_CASES
# overrides it.
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"

step() { printf '\n== %s\n' "$*"; }

step "install: redis-server (the tier tests start private servers), then the test extra"
command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"

step "rust: fmt, clippy"
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

# The `ci` profile: optimized, with debug assertions and overflow checks on.
step "rust: unit, doc, property and stress tests"
cargo test -p pagedkv --profile ci

step "rust: loom model checks"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$CARGO_TARGET_DIR/loom" \
    cargo test -p pagedkv --profile ci --lib loom

step "python: ruff, mypy --strict, stubtest"
python3 -m ruff check python tests benches examples
python3 -m ruff format --check python tests benches examples
python3 -m mypy
python3 -m mypy.stubtest pagedkv._core

# The kit a lent GPU machine (no network) runs: built with cached downloads, checked against its
# 60 MiB limit, installed offline into an empty folder and imported; the FlashInfer signature
# test then reads FlashInfer from there.
step "device kit: build, size check, offline install into a clean target, import flashinfer + pagedkv"
KIT_TARGET="$(mktemp -d)"
trap 'rm -rf "$KIT_TARGET"' EXIT
python3 scripts/device_kit.py --out dist/device-kit
python3 dist/device-kit/run_device_check.py --install-only --target "$KIT_TARGET"
export PAGEDKV_FLASHINFER_SITE="$KIT_TARGET"

step "benchmark smoke run (figures only; targets are reported, not enforced)"
python3 benches/bench_step.py --quick
python3 benches/bench_events.py --quick
python3 benches/bench_tier.py --quick

step "python: pytest"
python3 -m pytest -q
