"""SIGKILL ``marl train-rloo`` (the real command, in its own process) and resume it with the documented
command: the result equals an uninterrupted run's. Ctrl-C (SIGINT) ends each command with one line that says
what was kept and the command to go on with. Two trials here (three kills); ``python
tests/support/kill_resume.py --trials N`` runs many more by hand."""

from __future__ import annotations

import random
import shlex
import shutil
import signal

import pytest

from support.kill_resume import (
    FIRST_CHECKPOINT_EVENTS,
    Kill,
    command,
    make_world,
    metrics_without_eps,
    run_cli,
    trial,
)
from support.tiny import write_jsonl

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


# ---------------------------------------------------------------------- Ctrl-C


def interrupted_line(result, prog: str) -> str:
    """The one line a Ctrl-C leaves: exit code 130, no traceback."""
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: interrupted: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_finishes_the_run(world, tmp_path):
    output_dir = tmp_path / "run"
    words = command(world, output_dir)
    # Ctrl-C once 3 of the 6 updates are done, as the third checkpoint starts to be written
    result = run_cli(world, words, Kill(needle=".checkpoint-3.tmp", signal=signal.SIGINT))
    line = interrupted_line(result, "marl train-rloo")
    resume = f"marl train-rloo {shlex.join(words[1:])} --resume_from_checkpoint latest"
    assert line == (
        f"marl train-rloo: interrupted: after 3 of 6 updates; last checkpoint {output_dir / 'checkpoint-2'}. "
        f"Resume with: {resume}"
    )
    resumed = run_cli(world, shlex.split(resume)[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = world["reference"]
    adapter = "adapter_model.safetensors"
    assert (output_dir / adapter).read_bytes() == (reference / adapter).read_bytes()
    assert metrics_without_eps(output_dir) == metrics_without_eps(reference)


def test_ctrl_c_before_the_first_checkpoint_says_resuming_starts_over(world, tmp_path):
    words = command(world, tmp_path / "run")
    result = run_cli(world, words, Kill(needle=".checkpoint-1.tmp", signal=signal.SIGINT))
    line = interrupted_line(result, "marl train-rloo")
    assert "after 1 of 6 updates; no checkpoint saved yet (one every 1 updates)" in line
    # an --overwrite_output_dir run stopped while loading keeps the earlier run: the same command starts it
    previous = shutil.copytree(world["reference"], tmp_path / "previous")
    words = [*command(world, previous), "--overwrite_output_dir"]
    result = run_cli(world, words, Kill(needle="config.json", signal=signal.SIGINT))
    line = interrupted_line(result, "marl train-rloo")
    assert line.endswith(
        "before the first update; the output folder is as it was. Run the same command again to start: "
        f"marl train-rloo {shlex.join(words[1:])}"
    )


def test_ctrl_c_in_evaluate_and_train_reward_is_one_line(world, tmp_path):
    evaluate = [
        "evaluate", "--model_name_or_path", str(world["base"]), "--dataset_name", str(world["prompts"]),
        "--prompt_column", "text", "--num_prompts", "2", "--output_dir", str(tmp_path / "evaluation"),
    ]  # fmt: skip
    line = interrupted_line(
        run_cli(world, evaluate, Kill(needle="config.json", signal=signal.SIGINT)), "marl evaluate"
    )
    assert line == (
        "marl evaluate: interrupted: before the results were written. Run the same command again: "
        f"marl {shlex.join(evaluate)}"
    )
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(8)]
    )
    reward = [
        "train-reward", "--model_name_or_path", str(world["base"]), "--dataset", str(pairs),
        "--output_dir", str(tmp_path / "rm"), "--quantization", "none",
    ]  # fmt: skip
    result = run_cli(world, reward, Kill(needle="config.json", signal=signal.SIGINT))
    line = interrupted_line(result, "marl train-reward")
    assert line.startswith("marl train-reward: interrupted: before the adapter was saved")


def test_killed_while_writing_a_time_checkpoint_resumes_from_the_one_before(world, tmp_path):
    """No checkpoints by update count, one by time after every update (a minute is a few microseconds here):
    SIGKILL while checkpoint-4 is written leaves checkpoint-3, a time checkpoint, and the resumed run ends as
    the uninterrupted run ends."""
    output_dir = tmp_path / "run"
    words = [*command(world, output_dir), "--save_steps", "0", "--save_minutes", "1e-7"]
    killed = run_cli(world, words, Kill(needle=".checkpoint-4.tmp"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (output_dir / "checkpoint-3").is_dir()
    resumed = run_cli(world, [*words, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    adapter = "adapter_model.safetensors"
    assert (output_dir / adapter).read_bytes() == (world["reference"] / adapter).read_bytes()
    assert metrics_without_eps(output_dir) == metrics_without_eps(world["reference"])
