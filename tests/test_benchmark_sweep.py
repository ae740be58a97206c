"""The sweep benchmark (examples/benchmarks/sweep.py): its comparison arithmetic, and a dry run on a tiny
model that measures a run and sweeps of 1 and 2 policies, each phase labelled, into a results file."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.benchmark_scripts import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]
_HERE = ROOT / "examples" / "benchmarks"


@pytest.fixture(scope="module")
def sweep_bench():
    with benchmark_modules("sweep") as modules:
        yield modules["sweep"]


def test_examples_of_the_comparison_run(sweep_bench):
    result = doctest.testmod(sweep_bench, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 4


def test_n_runs_one_after_another_are_n_times_one_run(sweep_bench):
    """The sequential baseline: N runs train N times the episodes at one run's rate and load the base N
    times; a sweep that trains them at the run's rate and loads once is faster only by the loads."""
    run = {"eps": {"median": 3.0}, "generation_seconds": {"median": 2.0}, "load_seconds": {"median": 6.0},
           "pss_above_baseline": {"median": 100.0}}  # fmt: skip
    sweep = {**run, "generation_seconds": {"median": 8.0}}
    rows = sweep_bench.compare({"run": run, "sweep-4": sweep}, [4], episodes=12, updates=2)
    (row,) = rows
    assert row["speed-up"] == 1.0 and row["decode speed-up"] == 1.0 and row["memory ratio"] == 1.0
    # runs: 48 episodes in 4 x 6 s of loads + 16 s; the sweep: one load, 6 + 16 s
    assert row["speed-up with loads"] == pytest.approx((48 / 22) / (48 / 40))
    assert row["runs generation s/update"] == 4 * 2.0 / 2


@pytest.mark.slow
def test_a_dry_run_measures_a_run_and_sweeps_of_one_and_two_policies(tmp_path):
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [
        sys.executable,
        str(_HERE / "sweep.py"),
        "--dry-run",
        "--quantization",
        "none",
        "--swept",
        "learning_rate",
    ]
    command += ["--work-dir", str(tmp_path / "work")]
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "work" / "report.json").read_text())
    block = report["setups"]["cpu-long4"]["blocks"]["none"]
    runs = {run["system"]: run["result"] for run in block["runs"]}
    assert list(runs) == ["run", "sweep-1", "sweep-2"] and not block["failures"]
    assert all(result["phases_labelled"] and result["eps"] > 0 for result in runs.values())
    assert [runs[name]["policies"] for name in runs] == [1, 1, 2]
    for result in runs.values():
        assert {"generation", "scoring", "update"} <= set(result["memory"]["seconds"])
    assert [row["policies"] for row in block["comparison"]] == [1, 2]
    markdown = (tmp_path / "work" / "dry-run-sweep-cpu-long4.md").read_text()
    assert "| 2 |" in markdown and "sweep-2 | generation (prefill + decode)" in markdown
