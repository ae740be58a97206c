"""The wheel set a bare GPU machine is given (scripts/gpu_wheels.py): its pins meet marl's requirements, the
trimmed bitsandbytes wheel keeps a RECORD that matches its files, and the size check counts what travels."""

from __future__ import annotations

import base64
import doctest
import hashlib
import importlib.util
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
gpu_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_wheels)


def test_every_pin_meets_the_requirement_marl_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = {Requirement(line).name: Requirement(line) for line in declared}
    for name, version in gpu_wheels.WHEELS.items():
        if name in requirements:
            assert requirements[name].specifier.contains(version), (name, version)
    # what the machine lacks or has too old is pinned (its torch, accelerate, safetensors, ... are not)
    assert {"transformers", "peft", "trl", "datasets", "bitsandbytes"} <= set(gpu_wheels.WHEELS)


def test_a_trimmed_wheel_keeps_a_record_of_exactly_its_files(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.0.1-py3-none-any.whl"
    files = {
        "bitsandbytes/__init__.py": b"x = 1\n",
        "bitsandbytes/libbitsandbytes_cuda128.so": b"\0" * 5000,
        "bitsandbytes/libbitsandbytes_cuda130.so": b"\1" * 300,
        "bitsandbytes/libbitsandbytes_rocm72.so": b"\2" * 4000,
        "bitsandbytes/libbitsandbytes_cpu.so": b"\3" * 200,
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("bitsandbytes-0.0.1.dist-info/RECORD", "stale\n")
    before, after = gpu_wheels.trim_wheel(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        record = archive.read("bitsandbytes-0.0.1.dist-info/RECORD").decode().splitlines()
        kept = {name: archive.read(name) for name in names if not name.endswith("RECORD")}
    assert set(kept) == {
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes/libbitsandbytes_cpu.so",
    }
    for line in record[:-1]:
        name, digest, size = line.split(",")
        expected = base64.urlsafe_b64encode(hashlib.sha256(kept[name]).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={expected}", len(kept[name]))
    assert record[-1] == "bitsandbytes-0.0.1.dist-info/RECORD,,"
    assert len(record) == len(kept) + 1


def test_the_size_check_counts_the_checkout_and_the_carried_folder(tmp_path, monkeypatch, capsys):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".whl/\n")
    (tmp_path / "code.py").write_bytes(b"a" * 1000)
    carried = tmp_path / ".whl"
    carried.mkdir()
    (carried / "x.whl").write_bytes(b"b" * 3000)
    assert gpu_wheels.travelling_bytes(tmp_path, carried=(carried,)) == 1000 + 3000 + len(".whl/\n")
    assert gpu_wheels.travelling_bytes(tmp_path, carried=()) == 1000 + len(".whl/\n")
    monkeypatch.setattr(gpu_wheels, "WHEEL_DIR", carried)
    monkeypatch.setattr(gpu_wheels, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(gpu_wheels, "WHEELS", {"x": "1"})
    (carried / "x.whl").rename(carried / "x-1-py3-none-any.whl")
    monkeypatch.setattr(gpu_wheels, "travelling_bytes", lambda: 5000)
    assert gpu_wheels.check(limit=4999) == 1
    assert "OVER THE LIMIT" in capsys.readouterr().err
    assert gpu_wheels.check(limit=5000) == 0


def test_examples_run():
    assert doctest.testmod(gpu_wheels).failed == 0
