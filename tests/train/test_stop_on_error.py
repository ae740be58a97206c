"""An error that stops a run after updates completed since its last checkpoint (a reward function that
raises, an error inside the update) first saves the last completed update, with the state it ended with, and
says so in the error's one line; resuming from it ends byte for byte as the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from marl.errors import DataError

from support.kill_resume import metrics_without_eps
from support.runs import build, count_e, tiny_config

ADAPTER = "adapter_model.safetensors"
# 4 updates of 16 completions, 4 optimizer steps each; no checkpoint is due before the end
SETTINGS = dict(total_episodes=64, save_steps=100, save_minutes=0)
STEPS_PER_UPDATE = 4


def raising_in_update(update: int):
    def reward(prompts, completions, **columns):
        if columns["trainer_state"].global_step >= (update - 1) * STEPS_PER_UPDATE:
            raise RuntimeError("the scoring service is down")
        return count_e(prompts, completions)

    reward.__name__ = reward.__qualname__ = "count_e"  # the metrics name it as the fixed function
    return reward


def checkpoints(run):
    return sorted(path.name for path in run.glob("checkpoint-*"))


def assert_ends_as(run, reference):
    assert metrics_without_eps(run) == metrics_without_eps(reference)
    assert (run / ADAPTER).read_bytes() == (reference / ADAPTER).read_bytes()


@pytest.fixture
def reference(tiny_llama_dir, tmp_path):
    build(tiny_llama_dir, tiny_config(tmp_path / "reference", **SETTINGS)).train()
    return tmp_path / "reference"


def test_a_reward_function_raising_in_update_3_leaves_checkpoint_2_and_resuming_ends_as_the_full_run(
    tiny_llama_dir, tmp_path, reference
):
    run = tmp_path / "run"
    with pytest.raises(DataError, match="Fix that function") as raised:
        build(tiny_llama_dir, tiny_config(run, **SETTINGS), reward_fn=raising_in_update(3)).train()
    assert raised.value.__notes__ == [
        f"Update 2 is saved in {run / 'checkpoint-2'}: --resume_from_checkpoint latest resumes from it."
    ]
    assert checkpoints(run) == ["checkpoint-2"]
    build(tiny_llama_dir, tiny_config(run, **SETTINGS)).train(resume_from_checkpoint=True)
    assert_ends_as(run, reference)


class FailingForward:
    """Raises at the ``at``-th forward pass of the policy update (train mode) counted over the run: an error
    in the middle of an update, after optimizer steps of it were taken."""

    def __init__(self, trainer, at: int) -> None:
        self.count, self.at = 0, at
        embeddings = trainer.model.peft_model.get_base_model().get_input_embeddings()
        embeddings.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if module.training:
            self.count += 1
            if self.count == self.at:
                raise RuntimeError("a custom part failed")


# micro-batches of 4, 2 accumulated, 2 mini-batches, 2 epochs: 8 update forward passes per update; the 19th
# is update 3's second mini-batch's first, after one optimizer step of update 3
IN_UPDATE_3_AFTER_A_STEP = 19


def test_an_error_after_an_optimizer_step_puts_the_policy_back_before_saving(
    tiny_llama_dir, tmp_path, reference
):
    run = tmp_path / "run"
    trainer = build(tiny_llama_dir, tiny_config(run, **SETTINGS))
    FailingForward(trainer, IN_UPDATE_3_AFTER_A_STEP)
    with pytest.raises(RuntimeError, match="a custom part failed") as raised:
        trainer.train()
    assert "resumes from it" in raised.value.__notes__[0]
    assert checkpoints(run) == ["checkpoint-2"]
    build(tiny_llama_dir, tiny_config(run, **SETTINGS)).train(resume_from_checkpoint=True)
    assert_ends_as(run, reference)


def test_without_a_copy_of_the_policy_an_error_after_a_step_saves_nothing_and_says_so(
    tiny_llama_dir, tmp_path
):
    run = tmp_path / "run"
    trainer = build(tiny_llama_dir, tiny_config(run, **SETTINGS))
    trainer.phases.retry = False  # as under several processes: the update keeps no copy of the policy
    FailingForward(trainer, IN_UPDATE_3_AFTER_A_STEP)
    with pytest.raises(RuntimeError) as raised:
        trainer.train()
    assert raised.value.__notes__ == [
        "Update 3 was stopped after it had changed the policy, so update 2 could not be saved; resume from "
        "the last checkpoint."
    ]
    assert checkpoints(run) == []


def test_an_error_before_any_update_saves_nothing(tiny_llama_dir, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(DataError) as raised:
        build(tiny_llama_dir, tiny_config(run, **SETTINGS), reward_fn=raising_in_update(1)).train()
    assert raised.value.__notes__ == ["No update was completed, so nothing was saved."]
    assert not run.exists() or checkpoints(run) == []


def test_a_sweep_saves_every_member_at_the_same_update(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from marl.config.sweep import parse_sweep
    from marl.train.sweep_trainer import SweepTrainer, build_sweep_model

    from support.runs import prompt_dataset

    def sweep(folder, reward):
        config = tiny_config(folder, model_name_or_path=str(tiny_llama_dir), **SETTINGS)
        members = parse_sweep(["learning_rate=1e-2,2e-2"], config)
        torch.manual_seed(0)
        model = build_sweep_model([member.config for member in members])
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        return SweepTrainer(members, model, tokenizer, prompt_dataset(), reward_funcs=reward)

    sweep(tmp_path / "reference", count_e).train()
    with pytest.raises(DataError, match="Fix that function"):
        sweep(tmp_path / "run", raising_in_update(3)).train()
    members = ("learning_rate=1e-2", "learning_rate=2e-2")
    assert [checkpoints(tmp_path / "run" / member) for member in members] == [["checkpoint-2"]] * 2
    sweep(tmp_path / "run", count_e).train(resume_from_checkpoint=True)
    for member in members:
        assert_ends_as(tmp_path / "run" / member, tmp_path / "reference" / member)


def raising_reward_file(path, body: str):
    """A reward function file whose count_e runs ``body`` from update 3 on (of the command's updates)."""
    from support.kill_resume import UPDATES

    path.write_text(
        "import os, signal\n"
        "def count_e(prompts, completions, trainer_state, **columns):\n"
        f"    if trainer_state.global_step >= 2 * trainer_state.max_steps // {UPDATES}:\n"
        f"        {body}\n"
        "    return [c.count('e') for c in completions]\n"
    )
    return f"{path}:count_e"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "code", "ending"),
    [
        (
            "raise RuntimeError('the scoring service is down')",
            2,
            "Fix that function (--debug shows the traceback) Update 2 is saved in {checkpoint}: "
            "--resume_from_checkpoint latest resumes from it.",
        ),
        # Ctrl-C as it comes while update 3 scores its completions
        (
            "os.kill(os.getpid(), signal.SIGINT)",
            130,
            "interrupted: after 2 of 6 updates; last checkpoint {checkpoint}. Resume with: ",
        ),
    ],
)
def test_the_command_ends_in_one_line_naming_the_resume_flag_and_resuming_ends_as_the_full_run(
    tmp_path, body, code, ending
):
    from support.kill_resume import command, make_world, run_cli

    world = make_world(tmp_path / "world")
    assert run_cli(world, command(world, tmp_path / "reference")).returncode == 0
    run = tmp_path / "run"
    words = [*command(world, run), "--save_steps", "0", "--save_minutes", "0"]
    fixed, raising = f"{world['reward']}:count_e", raising_reward_file(tmp_path / "raising.py", body)
    failed = run_cli(world, [raising if word == fixed else word for word in words])
    assert failed.returncode == code and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    [line] = [line for line in failed.stderr.splitlines() if line.startswith("marl train-rloo: ")]
    expected = ending.format(checkpoint=run / "checkpoint-2")
    assert expected in line and "--resume_from_checkpoint latest" in line, line
    assert sorted(path.name for path in run.glob("checkpoint-*")) == ["checkpoint-2"]
    resumed = run_cli(world, [*words, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_ends_as(run, tmp_path / "reference")
