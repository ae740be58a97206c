"""The GPU check of ``--fit auto`` and the out-of-memory retry (``examples/benchmarks/fit_check.py``, run
by ``scripts/gpu-check.sh``) cannot fail on a GPU machine for a reason a CPU would have caught: ``--dry-run``
runs its whole flow on a tiny model, with ``--fit_memory_gb`` in place of the allocator's cap and the test
hook's error in place of a real one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # builds a tokenizer and trains twice in a new process


def test_the_dry_run_fits_under_the_budget_and_survives_the_error(tmp_path):
    output = tmp_path / "fit.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "benchmarks" / "fit_check.py"), "--dry-run",
         "--work", str(tmp_path / "work"), "--output", str(output)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    blocks = [json.loads(block) for block in re.findall(r"```json\n(.*?)\n```", output.read_text(), re.S)]
    capped, lowered = blocks
    assert capped["finished"] and capped["fit"]["changes"]  # the typed settings did not fit the budget
    assert capped["fit"]["planned_peak_bytes"] / 1e6 <= capped["cap_mb"] < capped["typed_plan_mb"]
    assert lowered["finished"] and lowered["retried"]
    assert lowered["changes"][0].startswith("out of memory in update: --per_device_train_batch_size 8")
    assert all(phase["measured_mb"] > 0 and phase["plan_mb"] > 0 for phase in lowered["peaks"].values())
