#!/usr/bin/env python3
"""Build the device kit: everything a GPU machine without network needs to run gpu_check.

Run on a machine with the package registries (CI does, on every run):

    python3 scripts/device_kit.py            # -> dist/device-kit (at most 60 MiB)

The kit holds the pagedkv abi3 wheel (manylinux2014, so any glibc 2.17+ loads it); FlashInfer
as a .tar.xz of its unpacked files (CUDA sources of kernels other than its attention are
dropped: they are only read when those kernels are compiled); the wheels of the modules
FlashInfer imports that torch's environment may lack, for the device's Python and for this one
(so CI can install the same kit); `gpu_check.py`; and the entry script `run_device_check.py`,
which installs all that offline into a target folder and runs the check (see its docstring).
Downloads, build tools and the repacked FlashInfer are cached under `~/.cache/pagedkv/device-kit`
(keyed by version), so a rebuild costs only the pagedkv wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLASHINFER = "0.7.4"
DEVICE_PYTHON = "3.12"
LIMIT_BYTES = 60 * 1024 * 1024
# Distributions `import flashinfer` and its decode/prefill paths need beyond torch's own
# environment, pinned so the kit is reproducible. Compiled ones are fetched per Python version.
PURE = [
    "nvidia-ml-py==13.615.71",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "idna==3.20",
    "certifi==2026.10.19.post1",
    "tqdm==4.70.1",
    "packaging==26.4",
    "einops==0.8.2",
    "click==8.5.1",
    "tabulate==0.10.0",
]
COMPILED = ["apache-tvm-ffi==0.1.15.post2", "charset-normalizer==3.5.3"]
# torch does not require numpy; the device may lack it, CI has it (pagedkv requires it).
DEVICE_ONLY = ["numpy==2.3.5"]
# Builds pagedkv's wheel with an old glibc baseline (see `pagedkv_wheel`).
BUILD_TOOLS = ["maturin==1.16.0", "ziglang==0.15.2"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def run(*cmd: str, cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=cwd)


def pip_download(dest: Path, reqs: list[str], python: str | None) -> None:
    """Download wheels (no dependencies) into `dest`, for `python` on x86-64 Linux if given."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    cmd += ["--no-deps", "--only-binary=:all:", "--dest", str(dest), "--retries", "8"]
    cmd += ["--timeout", "60"]
    if python is not None:
        cmd += ["--python-version", python, "--implementation", "cp"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
    run(*cmd, *reqs)


def flashinfer_archive(cache: Path) -> Path:
    """FlashInfer's unpacked wheel minus non-attention CUDA sources, as a cached .tar.xz."""
    archive = cache / f"flashinfer-{FLASHINFER}.tar.xz"
    if archive.exists():
        return archive
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    if not list(wheel_dir.glob(f"flashinfer_python-{FLASHINFER}-*.whl")):
        pip_download(wheel_dir, [f"flashinfer-python=={FLASHINFER}"], None)
    (wheel,) = wheel_dir.glob(f"flashinfer_python-{FLASHINFER}-*.whl")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            names = [
                n
                for n in zf.namelist()
                if n.startswith(("flashinfer/", f"flashinfer_python-{FLASHINFER}.dist-info/"))
                # csrc's subfolders hold the sources of other kernel families (MoE, GEMM,
                # comm, ...); the attention JIT reads only csrc's top-level files.
                and not (n.startswith("flashinfer/data/csrc/") and n.count("/") > 3)
            ]
            zf.extractall(root, names)
        partial = archive.with_suffix(".partial")
        if shutil.which("xz"):  # multi-threaded: minutes faster than Python's lzma
            with partial.open("wb") as out:
                tar = subprocess.Popen(
                    ["tar", "-C", str(root), "-cf", "-", "."], stdout=subprocess.PIPE
                )
                subprocess.run(["xz", "-T0", "-6", "-c"], stdin=tar.stdout, stdout=out, check=True)
                if tar.wait() != 0:
                    raise RuntimeError("tar failed")
        else:
            with tarfile.open(partial, "w:xz", preset=6) as tf:
                for entry in sorted(root.iterdir()):
                    tf.add(entry, arcname=entry.name)
        partial.rename(archive)
    return archive


def dependency_wheels(cache: Path) -> list[Path]:
    """The pinned dependency wheels for the device's Python and for this one, cached."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    dest = cache / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps([PURE, COMPILED, DEVICE_ONLY, here]).encode()).hexdigest()
    stamp = dest / f"deps-{key[:16]}"
    if not stamp.exists():
        pip_download(dest, PURE, None)
        pip_download(dest, COMPILED + DEVICE_ONLY, DEVICE_PYTHON)
        if here != DEVICE_PYTHON:
            pip_download(dest, COMPILED, here)
        stamp.touch()
    names = {r.split("==")[0].replace("-", "_").lower() for r in PURE + COMPILED + DEVICE_ONLY}
    return sorted(w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() in names)


def pagedkv_wheel(dest: Path, cache: Path) -> None:
    """Build pagedkv's abi3 wheel for manylinux2014 (glibc 2.17+), linking with zig.

    A plain build links against this machine's glibc (2.34+ on current distributions), which
    the GPU machine may not have; zig links against an old glibc's symbol versions instead.
    """
    tools = cache / f"tools-{hashlib.sha256(' '.join(BUILD_TOOLS).encode()).hexdigest()[:12]}"
    if not (tools / "bin" / "maturin").exists():
        run(
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--target",
            str(tools),
            *BUILD_TOOLS,
        )
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(tools / "bin"), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tools), env.get("PYTHONPATH")]))
    cmd = [str(tools / "bin" / "maturin"), "build", "--release", "--zig"]
    cmd += ["--compatibility", "manylinux2014", "--interpreter", sys.executable, "--out", str(dest)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def build(out: Path, cache: Path) -> int:
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    pagedkv_wheel(wheels, cache)
    for w in dependency_wheels(cache):
        shutil.copy2(w, wheels / w.name)
    shutil.copy2(flashinfer_archive(cache), out / f"flashinfer-{FLASHINFER}.tar.xz")
    shutil.copy2(ROOT / "benches" / "gpu_check.py", out / "gpu_check.py")
    shutil.copy2(ROOT / "scripts" / "kit_entry.py", out / "run_device_check.py")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    manifest = {
        "flashinfer": FLASHINFER,
        "device_python": DEVICE_PYTHON,
        "files": {str(p.relative_to(out)): p.stat().st_size for p in files},
        "total_bytes": total,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"device kit: {out} holds {len(files)} files, {total / 2**20:.1f} MiB "
        f"(limit {LIMIT_BYTES / 2**20:.0f} MiB)"
    )
    if total > LIMIT_BYTES:
        print("device kit is over its size limit", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "device-kit")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/pagedkv/device-kit")
    args = parser.parse_args()
    return build(args.out.resolve(), args.cache)


if __name__ == "__main__":
    sys.exit(main())
