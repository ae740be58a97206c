"""The measured peak of each phase, logged beside the memory plan's: ``memory/<phase>_peak_mb`` and
``memory/<phase>_plan_mb`` in the metrics, and one line at the end of the run."""

from __future__ import annotations

import json

import pytest
import torch

from marl.model.process_memory import IMPORTS_RSS_BYTES
from marl.train.memory_guard import MB, PhaseGuard, Resizable

from support.runs import build, tiny_config

pytestmark = pytest.mark.skipif(IMPORTS_RSS_BYTES is None, reason="no /proc/self/status")


def test_each_phase_measures_its_own_peak():
    guard = PhaseGuard(
        torch.device("cpu"),
        {phase: Resizable(lambda: "", lambda: False) for phase in ("sampling", "scoring")},
        torch.nn.Embedding(2, 2),
    )

    def hold(megabytes: int) -> None:
        block = torch.ones(megabytes * 250_000)  # float32: written, so resident
        del block

    guard.run("sampling", lambda: hold(400))
    guard.run("scoring", lambda: hold(1))
    assert guard.peaks["sampling"] >= 400 * MB
    assert guard.peaks["scoring"] < guard.peaks["sampling"] - 300 * MB  # the peak was reset between them


@pytest.mark.parametrize("allocator", ["maps", "heap"])
def test_a_run_logs_each_phase_peak_beside_the_plan(tiny_llama_dir, tmp_path, capsys, allocator):
    """The end's line compares the peaks with the plan only where the plan models the run's allocator
    (``maps``); with ``heap`` it says why it does not."""
    from marl.apps.train_rloo import memory_card_with_plan

    trainer = build(tiny_llama_dir, tiny_config(tmp_path / "run", cpu_allocator=allocator))
    memory_card_with_plan(trainer)  # as train-rloo prints it: the plan's peaks go to the run
    trainer.train()
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    for phase in ("sampling", "scoring", "update"):
        assert last[f"memory/{phase}_peak_mb"] > 0
        assert last[f"memory/{phase}_plan_mb"] == trainer.phases.planned[phase] / MB > 0
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("peak memory"))
    assert line.startswith("peak memory per phase (resident above the imports): sampling ")
    if allocator == "maps":
        assert "(plan " in line and line.count("%") == 3
    else:
        assert "(plan " not in line and "%" not in line
        assert line.endswith(
            "; not compared with the plan, which models --cpu_allocator maps: this run used --cpu_allocator "
            "heap, whose C heap also keeps the blocks freed within a phase"
        )
