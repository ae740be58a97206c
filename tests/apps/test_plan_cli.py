"""``marl plan`` as a user runs it: the plan from a model folder's config.json, the verdict against
``--memory_gb``, the changes that fit, and the other systems with ``--compare``."""

from __future__ import annotations

import re
import shutil

import pytest

from marl.apps.cli import main


@pytest.fixture(scope="module")
def config_folder(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan-config")
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    return str(folder)


FLAGS = ["--device", "cpu", "--prompt_length", "32", "--response_length", "8", "--rloo_k", "4",
         "--per_device_train_batch_size", "16", "--local_rollout_forward_batch_size", "16"]  # fmt: skip


def _peak_gb(text: str) -> float:
    value, unit = re.search(r"predicted peak: ([\d.]+) (GB|MB|kB)", text).groups()
    return float(value) * {"GB": 1.0, "MB": 1e-3, "kB": 1e-6}[unit]


def test_plan_prints_every_phase_and_the_peak(config_folder, capsys):
    main(["plan", "--model_name_or_path", config_folder, *FLAGS])
    out = capsys.readouterr().out
    for phase in ("load", "sampling", "scoring", "update"):
        assert re.search(rf"^  {phase} +[\d.]+ (GB|MB)", out, re.MULTILINE), out
    assert "predicted peak:" in out and "fits" not in out


def test_a_run_that_does_not_fit_gets_the_changes_that_do(config_folder, capsys):
    main(["plan", "--model_name_or_path", config_folder, *FLAGS])
    peak = _peak_gb(capsys.readouterr().out)
    budget = (peak - 0.02) / 0.9  # just too small for the run as it is
    main(["plan", "--model_name_or_path", config_folder, *FLAGS, "--memory_gb", f"{budget:.4f}"])
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    assert "changes that bring it under the budget" in out or "no single change" in out


def test_compare_plans_trl_and_ppo_as_the_planner_models_them(config_folder, capsys):
    main(["plan", "--model_name_or_path", config_folder, *FLAGS, "--compare"])
    out = capsys.readouterr().out
    blocks = out.split("memory plan (")[1:]
    assert [block.split(")")[0] for block in blocks] == [
        "marl",
        "TRL RLOOTrainer + peft_config (planner's model",
        "PPO, four copies (planner's model",
    ]
    peaks = [_peak_gb(block) for block in blocks]
    assert peaks[0] < peaks[1] < peaks[2]
