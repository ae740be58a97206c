"""SIGKILL ``marl train-rloo`` (the real command, in its own process) and resume it with the documented
command: the result equals an uninterrupted run's. Two trials here (three kills); ``python
tests/kill_resume.py --trials N`` runs many more by hand."""

from __future__ import annotations

import random

import pytest
from kill_resume import FIRST_CHECKPOINT_EVENTS, Kill, command, make_world, run_cli, trial

pytestmark = pytest.mark.slow  # each trial runs the command in new processes


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = make_world(tmp_path_factory.mktemp("kill"))
    reference = world["base"].parent / "reference"
    result = run_cli(world, command(world, reference))
    assert result.returncode == 0, result.stderr
    world["reference"] = reference
    return world


def test_killed_during_start_up_the_resumed_run_starts_over_and_repeats_the_run_exactly(world, tmp_path):
    """Killed while the base model loads, before anything is written: `--resume_from_checkpoint latest` finds
    no checkpoint and runs from the beginning, in a new process. That it matches the reference run bit for bit
    also shows that the seed is set before the policy LoRA is built."""
    outcome = trial(world, world["reference"], tmp_path / "run", [Kill(needle="config.json", count=1)])
    assert outcome.killed == 1, outcome
    assert outcome.identical, outcome.problem
    assert not (tmp_path / "run" / ".deleting-replaced-run").exists()


def test_killed_while_writing_the_first_checkpoint_then_at_a_random_moment(world, tmp_path):
    rng = random.Random(0)
    kills = [
        # at one of the file operations of the first checkpoint (a seeded choice): no checkpoint-1 yet, or a
        # complete one
        Kill(needle=".checkpoint-1.tmp", count=rng.randint(1, FIRST_CHECKPOINT_EVENTS)),
        # the resumed run, at a random moment of its start-up or its updates
        Kill(delay=rng.uniform(1.0, 8.0)),
    ]
    outcome = trial(world, world["reference"], tmp_path / "run", kills)
    assert outcome.killed >= 1, outcome
    assert outcome.identical, outcome.problem
