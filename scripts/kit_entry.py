#!/usr/bin/env python3
"""Device kit entry point: install the kit offline into a folder, then run the GPU check.

    python3 run_device_check.py                  # install into /tmp/pagedkv-kit, gpu_check --quick
    python3 run_device_check.py --install-only   # install and `import flashinfer, pagedkv` only
    python3 run_device_check.py -- --backends triton   # arguments after -- go to gpu_check

Needs nothing from the network: FlashInfer is unpacked from the kit's .tar.xz, and of the
dependency wheels only those whose module this Python cannot import already are installed (with
pip, `--no-index --no-deps`, or unzipped where pip is missing), so torch's own environment is
used as it is. The target folder is put first on PYTHONPATH for the check. FlashInfer compiles
its kernels on first use (nvcc, ninja); gpu_check prints that compile time on its own line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

KIT = Path(__file__).resolve().parent
# distribution name (as in the wheel file name) -> module whose presence means it is installed
MODULES = {
    "pagedkv": None,  # always installed from the kit
    "apache_tvm_ffi": "tvm_ffi",
    "nvidia_ml_py": "pynvml",
    "requests": "requests",
    "urllib3": "urllib3",
    "idna": "idna",
    "certifi": "certifi",
    "charset_normalizer": "charset_normalizer",
    "tqdm": "tqdm",
    "packaging": "packaging",
    "einops": "einops",
    "click": "click",
    "tabulate": "tabulate",
    "numpy": "numpy",
}


def install(target: Path) -> None:
    manifest = (KIT / "manifest.json").read_text()
    stamp = target / ".pagedkv-kit"
    if stamp.exists() and stamp.read_text() == manifest:
        print(f"kit already installed in {target}")
        return
    target.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    (archive,) = KIT.glob("flashinfer-*.tar.xz")
    # The "data" filter (Python 3.12, and 3.11.4+) refuses links and paths leaving the target.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(archive) as tar:
        tar.extractall(target, **safe)  # type: ignore[arg-type]
    wanted = sorted(
        {
            w.name.split("-")[0]
            for w in (KIT / "wheels").glob("*.whl")
            if MODULES.get(w.name.split("-")[0]) is None
            or importlib.util.find_spec(MODULES[w.name.split("-")[0]] or "") is None
        }
    )
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        unzip_wheels(wanted, target)
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        cmd += ["--no-index", "--no-deps", "--find-links", str(KIT / "wheels")]
        subprocess.run([*cmd, "--target", str(target), *wanted], check=True)
    stamp.write_text(manifest)
    print(
        f"installed FlashInfer and {', '.join(wanted)} into {target} "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )


def unzip_wheels(names: list[str], target: Path) -> None:
    """Install wheels without pip: unzip each (none of the kit's has a .data folder)."""
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for name in names:
        fits = [
            w
            for w in (KIT / "wheels").glob(f"{name}-*.whl")
            if w.name.split("-")[-3] in (py, "py3", "py2.py3") or w.name.split("-")[-2] == "abi3"
        ]
        if not fits:
            raise SystemExit(f"the kit has no wheel of {name} for {py}")
        with zipfile.ZipFile(fits[0]) as zf:
            zf.extractall(target)


def environment(target: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))  # FlashInfer's JIT: parallel ninja
    return env


def import_check(target: Path) -> None:
    code = (
        "import json, flashinfer, pagedkv; "
        "print(json.dumps({'flashinfer': flashinfer.__version__, 'flashinfer_from': "
        "flashinfer.__file__, 'pagedkv_from': pagedkv.__file__}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=environment(target),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    info = json.loads(out.strip().splitlines()[-1])
    for key in ("flashinfer_from", "pagedkv_from"):
        if not info[key].startswith(str(target)):
            raise SystemExit(f"{key} = {info[key]}: not the kit's copy in {target}")
    print(f"import flashinfer, pagedkv: ok (flashinfer {info['flashinfer']}, both from {target})")


def main() -> int:
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        rest = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description="install the pagedkv device kit, run gpu_check")
    parser.add_argument("--target", type=Path, default=Path("/tmp/pagedkv-kit"))
    parser.add_argument("--install-only", action="store_true")
    args = parser.parse_args(argv)
    target = args.target.resolve()
    install(target)
    import_check(target)
    if args.install_only:
        return 0
    t0 = time.perf_counter()
    cmd = [sys.executable, str(KIT / "gpu_check.py"), *(rest or ["--quick"])]
    code = subprocess.run(cmd, env=environment(target)).returncode
    print(f"gpu_check exited {code} after {time.perf_counter() - t0:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
