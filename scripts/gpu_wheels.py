"""The wheels a bare GPU machine needs for marl's GPU sequence, downloaded here and carried with the checkout.

Such a machine (Python 3.12, a CUDA 13.0 build of torch 2.11, transformers 5.17, peft, accelerate, pyarrow,
pytest, hypothesis) reaches no package index. It lacks trl, datasets and bitsandbytes, its transformers and
peft are older than marl's requirements (pyproject.toml), and datasets needs two pure-Python packages it does
not have (dill, multiprocess). :data:`WHEELS` pins exactly those; ``download`` fetches them for CPython 3.12
on manylinux x86-64 into :data:`WHEEL_DIR` (ignored by git: wheels are never committed).

The checkout and the wheels travel together under :data:`TRAVEL_LIMIT` (64 MiB). bitsandbytes' wheel (43 MB)
holds one library per CUDA and ROCm version; the machine's torch loads the CUDA 13 one, so the wheel is
rewritten with only the libraries :data:`KEPT_LIBRARIES` names (about 3 MB; its RECORD rewritten to match,
so pip installs it as any wheel). ``check`` fails loudly when checkout + wheels exceed the limit.

On the GPU machine ``scripts/gpu-sequence.sh`` installs them offline, before anything imports them:
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site``.

    python scripts/gpu_wheels.py download   # fetch, trim, then check the size (needs the package index)
    python scripts/gpu_wheels.py check      # the size check alone

Example:
    >>> kept_in_wheel("bitsandbytes/libbitsandbytes_cuda128.so"), kept_in_wheel("bitsandbytes/nn/modules.py")
    (False, True)
    >>> [kept_in_wheel(f"bitsandbytes/libbitsandbytes_{lib}.so") for lib in ("cuda130", "cpu", "rocm72")]
    [True, True, False]
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO_ROOT / ".whl"
TRAVEL_LIMIT = 64 * 2**20  # bytes: what travels with a GPU command (the checkout, shared/, carried folders)
# name -> version: what the GPU machine lacks or has too old (pyproject.toml's lower bounds; the versions the
# CPU suite runs with), and datasets' pure-Python needs it lacks. One version of each: two stop the install.
WHEELS = {
    "transformers": "5.24.0",
    "peft": "0.21.2",
    "trl": "1.16.0",
    "datasets": "5.2.0",
    "bitsandbytes": "0.50.2",
    "dill": "0.4.1",  # datasets: dill<0.4.2
    "multiprocess": "0.70.19",  # datasets: multiprocess<0.70.20
}
# bitsandbytes' native libraries kept: the CUDA 13.x builds (the machine's torch is cu130) and the CPU one.
KEPT_LIBRARIES = ("libbitsandbytes_cuda13*", "libbitsandbytes_cpu*")
_PLATFORMS = ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014")


def kept_in_wheel(name: str) -> bool:
    """Whether a file of bitsandbytes' wheel stays: everything but the native libraries not kept."""
    base = name.rsplit("/", 1)[-1]
    if not base.startswith("libbitsandbytes_"):
        return True
    return any(fnmatch.fnmatch(base, pattern) for pattern in KEPT_LIBRARIES)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def trim_wheel(path: Path) -> tuple[int, int]:
    """``path`` rewritten without the files :func:`kept_in_wheel` drops, its RECORD listing what is left
    (path, hash, size) as the wheel format wants. Returns the sizes before and after, in bytes."""
    before = path.stat().st_size
    trimmed = path.with_suffix(".trimmed")
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as target:
        names = [info.filename for info in source.infolist() if kept_in_wheel(info.filename)]
        record = next(name for name in names if name.endswith(".dist-info/RECORD"))
        lines = []
        for name in names:
            if name == record:
                continue
            data = source.read(name)
            target.writestr(source.getinfo(name), data)
            lines.append(f"{name},{_record_hash(data)},{len(data)}")
        target.writestr(source.getinfo(record), "\n".join([*lines, f"{record},,"]) + "\n")
    trimmed.replace(path)
    return before, path.stat().st_size


def travelling_bytes(root: Path = REPO_ROOT, carried: tuple[Path, ...] = (WHEEL_DIR,)) -> int:
    """Bytes that travel with a GPU command: tracked and untracked-not-ignored files of the checkout (git's
    view), its ``shared/`` folder if it has one, and the ``carried`` folders."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    files = {root / name for name in listed.split("\0") if name}
    for folder in (root / "shared", *carried):
        if folder.is_dir():
            files.update(path for path in folder.rglob("*") if path.is_file() and not path.is_symlink())
    return sum(path.stat().st_size for path in files if path.is_file())


def _is(wheel: Path, name: str, version: str) -> bool:
    return wheel.name.startswith(f"{name}-{version}-")


def check(limit: int = TRAVEL_LIMIT) -> int:
    """Prints checkout + wheels against the limit; returns the exit status (1: over it)."""
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    missing = [name for name, version in WHEELS.items() if not any(_is(w, name, version) for w in wheels)]
    total, carried = travelling_bytes(), sum(w.stat().st_size for w in wheels)
    print(f"gpu wheels: {len(wheels)} in {WHEEL_DIR.name}/ ({carried / 2**20:.1f} MiB)")
    print(f"gpu wheels: checkout + wheels = {total / 2**20:.1f} MiB of {limit / 2**20:.0f} MiB")
    if missing:
        print(f"gpu wheels: MISSING {missing}: run `python scripts/gpu_wheels.py download`", file=sys.stderr)
        return 1
    if total > limit:
        print(
            f"gpu wheels: OVER THE LIMIT by {(total - limit) / 2**20:.1f} MiB: the command would not be "
            "sent; remove untracked files from the checkout or wheels from WHEELS",
            file=sys.stderr,
        )
        return 1
    return 0


def download() -> int:
    """Every wheel of :data:`WHEELS` for CPython 3.12 on manylinux x86-64, bitsandbytes trimmed; then
    :func:`check`."""
    WHEEL_DIR.mkdir(exist_ok=True)
    for stale in WHEEL_DIR.glob("*.whl"):  # one version of each: an older download would stop the install
        if not any(_is(stale, name, version) for name, version in WHEELS.items()):
            stale.unlink()
    platforms = [arg for tag in _PLATFORMS for arg in ("--platform", f"{tag}_x86_64")]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(WHEEL_DIR)]
    command += [f"{name}=={version}" for name, version in WHEELS.items()]
    if subprocess.run(command, check=False).returncode != 0:
        print("gpu wheels: pip download failed (it needs the package index)", file=sys.stderr)
        return 1
    for wheel in WHEEL_DIR.glob(f"bitsandbytes-{WHEELS['bitsandbytes']}-*.whl"):
        before, after = trim_wheel(wheel)
        print(f"gpu wheels: {wheel.name} trimmed to the CUDA 13 and CPU libraries, {before / 2**20:.1f} -> "
              f"{after / 2**20:.1f} MiB")  # fmt: skip
    return check()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("download", "check"))
    return download() if parser.parse_args(argv).action == "download" else check()


if __name__ == "__main__":
    sys.exit(main())
