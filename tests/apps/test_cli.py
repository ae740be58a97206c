"""``marl`` argument parsing, YAML configs and the output-folder guard (no model needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from marl.apps.cli import main, parse_train_rloo_args, train_rloo_main
from marl.errors import ConfigError, MissingPathError, RunFolderError
from marl.train.run_dir import DELETING_DIR, plan_start

from support.tiny import refused


@pytest.mark.parametrize("flag", ["--reward-adapter", "--reward_adapter"])
def test_reward_adapter_flag_with_dashes_or_underscores(flag):
    script, config = parse_train_rloo_args(
        [flag, "rm-dir", "--rloo-k", "4", "--per_device_train_batch_size", "8"]
    )
    assert config.reward_adapter == ["rm-dir"] and config.reward_adapter_folders() == {"reward": "rm-dir"}
    assert config.rloo_k == 4 and config.per_device_train_batch_size == 8
    assert script.dataset_name == "rotten-tomatoes" and script.reward_fn is None


def test_every_rloo_config_field_is_a_flag():
    from dataclasses import fields

    from marl.config import RLOOConfig

    script, config = parse_train_rloo_args(
        [
            "--reward_fn",
            "rewards:score",
            "--quantization",
            "4bit",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--kl_coef",
            "0.1",
            "--normalize_advantage",
            "--stop_token",
            "eos",
            "--total_episodes",
            "64",
        ]
    )
    assert script.reward_fn == ["rewards:score"]
    assert config.quantization == "4bit" and config.lora_target_modules == ["q_proj", "v_proj"]
    assert config.kl_coef == 0.1 and config.normalize_advantage is True
    assert config.stop_token == "eos" and config.total_episodes == 64
    help_text = subprocess.run(
        [sys.executable, "-m", "marl.apps.cli", "train-rloo", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for config_field in fields(RLOOConfig):
        assert f"--{config_field.name}" in help_text


def test_yaml_config_sets_defaults_that_flags_override(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        "reward_adapter: adapters/rm\nrloo_k: 4\nlearning_rate: 1.0e-4\ndataset_name: prompts.jsonl\n"
        "prompt_column: question\nlora_target_modules: [q_proj, k_proj]\n"
    )
    script, config = parse_train_rloo_args(["--config", str(config_file), "--rloo_k", "2"])
    assert config.reward_adapter == ["adapters/rm"] and config.learning_rate == 1e-4
    assert config.rloo_k == 2  # the flag wins over the file
    assert config.lora_target_modules == ["q_proj", "k_proj"]
    assert (script.dataset_name, script.prompt_column) == ("prompts.jsonl", "question")


def test_yaml_config_with_an_unknown_key_fails(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("reward_adapter: rm\nnot_a_setting: 3\n")
    with pytest.raises(ValueError, match="not_a_setting"):
        parse_train_rloo_args(["--config", str(config_file)])


def test_a_reward_is_required_and_only_one(capsys):
    with pytest.raises(ConfigError, match=r"--reward_adapter DIR.*--reward_fn"):
        parse_train_rloo_args([])
    # several reward sources combine: adapters and functions, each flag repeatable
    script, config = parse_train_rloo_args(
        [
            "--reward_adapter",
            "rm",
            "--reward_fn",
            "m:f",
            "--reward-adapter",
            "fluency=fl",
            "--reward_fn",
            "m:g",
        ]
    )
    assert config.reward_adapter_folders() == {"reward": "rm", "fluency": "fl"}
    assert script.reward_fn == ["m:f", "m:g"]
    assert refused(capsys, train_rloo_main, []).startswith("marl train-rloo: error: no reward")


def test_invalid_config_values_fail_with_a_one_line_error(capsys):
    line = refused(capsys, train_rloo_main, ["--reward_adapter", "rm", "--rloo_k", "1"])
    assert "rloo_k=1" in line and "--rloo_k 2" in line


def test_output_dir_with_a_previous_run_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"update": 2}\n')
    (run / "notes.txt").write_text("mine")
    with pytest.raises(
        RunFolderError, match=r"already holds a run.*--overwrite_output_dir.*--resume_from_checkpoint"
    ):
        plan_start(run)
    assert plan_start(run, True).checkpoint == run / "checkpoint-2"
    assert plan_start(run, overwrite=True).replace
    plan = plan_start(run, overwrite=True)
    plan.commit(resumed_update=0)  # what the run does once its first update is done
    assert sorted(path.name for path in run.iterdir()) == ["notes.txt"]  # the user's own files stay


def test_a_deletion_cut_short_by_a_kill_is_never_taken_for_a_run_to_resume(tmp_path):
    """A kill while an overwritten run was being deleted leaves some of its files and the marker folder: the
    resumed command starts from the beginning (not from the old run's checkpoint) and ends the deletion."""
    run = tmp_path / "run"
    (run / DELETING_DIR / "trash").mkdir(parents=True)
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (run / "adapter_model.safetensors").write_text("old")
    (run / ".metrics.jsonl.tmp").write_text("cut off")
    plan = plan_start(run, True)
    assert plan.checkpoint is None and plan.replace and "starts from the beginning" in plan.notice
    plan.commit(resumed_update=0)
    assert list(run.iterdir()) == []


def test_output_dir_guard_through_the_command(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text("{}")
    line = refused(capsys, train_rloo_main, ["--reward_adapter", "rm", "--output_dir", str(tmp_path)])
    assert "already holds a run" in line
    flags = ["--reward_adapter", "rm", "--overwrite_output_dir", "--resume_from_checkpoint", "latest"]
    assert "pass only one" in refused(capsys, train_rloo_main, flags)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not plan_start(empty).replace
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(RunFolderError, match="is a file"):
        plan_start(a_file)
    with pytest.raises(RunFolderError, match="cannot be created"):
        plan_start(a_file / "run")
    with pytest.raises(MissingPathError, match="not a checkpoint"):
        plan_start(empty, tmp_path / "checkpoint-9")


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("train-rloo", "train-reward", "evaluate", "demo"):
        assert command in out
    with pytest.raises(SystemExit) as exit_info:
        main(["train-ppo"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
