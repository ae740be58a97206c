"""``marl plan --sweep``: the plan of the grid train-rloo --sweep would train, as the library plans it."""

from __future__ import annotations

import shutil

import pytest

from marl.apps.cli import plan_main
from marl.config import RLOOConfig
from marl.config.sweep import parse_sweep
from marl.plan import PlanTarget, load_model_config, plan_memory

FLAGS = ["--device", "cpu", "--prompt_length", "32", "--response_length", "8", "--rloo_k", "4",
         "--per_device_train_batch_size", "8", "--local_rollout_forward_batch_size", "8"]  # fmt: skip
GRID = ["--sweep", "learning_rate=1e-4,3e-4", "--sweep", "kl_coef=0.05,0.1"]


@pytest.fixture(scope="module")
def config_folder(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan-sweep-config")
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    return str(folder)


def test_a_grid_is_planned_as_its_members_trained_at_once(config_folder, capsys):
    """Two repeated --sweep flags: a grid of 4 policies (parse_sweep's product), planned with 4 policies,
    the runs one after another beside it."""
    plan = plan_main(["--model_name_or_path", config_folder, *FLAGS, *GRID])
    config = RLOOConfig(model_name_or_path=config_folder, response_length=8, rloo_k=4,
                        per_device_train_batch_size=8, local_rollout_forward_batch_size=8)  # fmt: skip
    members = parse_sweep(["learning_rate=1e-4,3e-4", "kl_coef=0.05,0.1"], config)
    target = PlanTarget(device="cpu", prompt_length=32)
    model_config = load_model_config(config_folder)
    assert plan == plan_memory(config, model_config, target, policies=len(members)) and len(members) == 4
    out = capsys.readouterr().out
    assert "policies (sweep) 4" in out
    assert "the 4 policies as runs one after another: predicted peak" in out
    alone = plan_memory(config, model_config, target)
    assert alone.peak < plan.peak
