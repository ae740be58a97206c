"""A base sharded over two CPU processes (``--parallelism fsdp2``, gloo) with completions that end at EOS
after a different number of steps on each process: every forward pass is a collective, so a process whose rows
have all stopped must keep running forward passes until the other's have too. The rollout and the held-out
sample table (which both processes sample) finish under both samplers, and draw and train exactly what a
replicated run on the same rows does (driver: tests/support/stop_token_run.py; before the fix the processes
fell out of step and the run failed in its first rollout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marl.train.run_dir import sample_table_file

from support.processes import run_processes
from support.stop_token_run import RESPONSE_LENGTH, save_model_that_stops

DRIVER = str(Path(__file__).resolve().parents[1] / "support" / "stop_token_run.py")
# The parallel equality test's: the adapter after AdamW steps on gradients reduced in another order.
ADAPTER_TOLERANCE = 1e-5
SCORE_TOLERANCE = 1e-5


def run(model_dir: Path, reward_dir: Path, output_dir: Path, parallelism: str, sampler: str) -> list[dict]:
    output_dir.mkdir(parents=True)
    run_processes(DRIVER, str(model_dir), str(reward_dir), str(output_dir), parallelism, sampler)
    return [json.loads((output_dir / f"report_{rank}.json").read_text()) for rank in (0, 1)]


def sample_table(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in sample_table_file(output_dir, 1).read_text().splitlines()]


@pytest.fixture(scope="module")
def model_that_stops(tiny_llama_dir, tmp_path_factory) -> Path:
    return save_model_that_stops(str(tiny_llama_dir), tmp_path_factory.mktemp("stops") / "model")


@pytest.fixture(scope="module")
def replicated(model_that_stops, tiny_reward_adapter, tmp_path_factory) -> tuple[Path, list[dict]]:
    output = tmp_path_factory.mktemp("replicated") / "run"
    return output, run(model_that_stops, tiny_reward_adapter, output, "replicated", "static")


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["static", "transformers"])
def test_sharded_run_with_a_stop_token_finishes_and_equals_the_replicated_run(
    sampler, replicated, model_that_stops, tiny_reward_adapter, tmp_path
):
    output = tmp_path / "run"
    reports = run(model_that_stops, tiny_reward_adapter, output, "fsdp2", sampler)
    expected_output, expected = replicated
    assert [report["world"] for report in reports + expected] == [2, 2, 2, 2]
    # both processes sampled the rollout, then the sample table (a replicated run's table: process 0 alone)
    assert [len(report["lengths"]) for report in reports] == [2, 2]
    assert [len(report["lengths"]) for report in expected] == [2, 1]
    lengths = [report["lengths"] for report in reports]
    for call in (0, 1):
        rows = lengths[0][call] + lengths[1][call]
        assert min(rows) < RESPONSE_LENGTH  # rows ended at EOS...
        assert max(lengths[0][call]) != max(lengths[1][call])  # ...and one process ended before the other
    # the same rows as the replicated run, and the same training on them
    assert lengths[0] == expected[0]["lengths"] and lengths[1][0] == expected[1]["lengths"][0]
    for report in reports:
        difference = torch.tensor(report["adapter"]) - torch.tensor(expected[0]["adapter"])
        assert difference.abs().max() <= ADAPTER_TOLERANCE
    table, expected_table = sample_table(output), sample_table(expected_output)
    assert [row["completion"] for row in table] == [row["completion"] for row in expected_table]
    scores = torch.tensor(
        [[row["score"], other["score"]] for row, other in zip(table, expected_table, strict=True)]
    )
    assert (scores[:, 0] - scores[:, 1]).abs().max() <= SCORE_TOLERANCE
