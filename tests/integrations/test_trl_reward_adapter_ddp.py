"""marl's reward function in a TRL ``GRPOTrainer`` run on 2 CPU processes (torchrun, gloo; accelerate wraps
the PeftModel in DDP), against the same 2-process run with TRL's separately loaded reward model
(driver: tests/support/trl_reward_ddp_run.py): the same steps, logged rewards and policy adapter; DDP's
reducer and the optimizer hold the policy adapter only (the reward adapter frozen, never given a
gradient, unchanged); the reference read as TRL reads a fresh adapter's (adapters off, through DDP's
``module``) is the plain base; TRL's ``"ref"`` adapter beside the reward adapter (``beta`` > 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.processes import run_two_processes
from support.trl_reward import random_reward_adapter

DRIVER = str(Path(__file__).resolve().parents[1] / "support" / "trl_reward_ddp_run.py")
# Measured on the tiny Llama: logged rewards equal (0.0), the adapters after 2 AdamW steps within 3.7e-7
# (the scores differ by float rounding only; see test_trl_reward_adapter_runs.py for how that reaches the
# adapter). A different reward moves a tensor by up to the learning rate (5e-3) per step.
ADAPTER_TOLERANCE = 2e-4
REWARD_TOLERANCE = 1e-5


def run(model_dir: Path, adapter_dir: Path, output_dir: Path, mode: str) -> list[dict]:
    output_dir.mkdir(parents=True)
    run_two_processes(DRIVER, str(model_dir), str(adapter_dir), str(output_dir), mode)
    return [json.loads((output_dir / f"report_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_a_two_process_run_ends_as_the_run_with_the_separate_reward_model(tiny_llama_dir, tmp_path):
    adapter_dir = random_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    theirs = run(tiny_llama_dir, adapter_dir, tmp_path / "theirs", "separate")
    ours = run(tiny_llama_dir, adapter_dir, tmp_path / "ours", "marl")
    for report in ours + theirs:
        assert report["world"] == 2 and report["wrapper"] == "DistributedDataParallel"
        assert report["steps"] == 2 and len(report["rewards"]) == 2
        assert report["active_adapter"] == "default"
    # the processes scored different prompts, of different lengths
    for reports in (ours, theirs):
        first, second = (set(report["prompts_seen"]) for report in reports)
        assert first and second and not first & second
        assert {len(p.split()) for p in first} != {len(p.split()) for p in second}

    torch.testing.assert_close(
        torch.tensor(ours[0]["rewards"]), torch.tensor(theirs[0]["rewards"]), rtol=0, atol=REWARD_TOLERANCE
    )
    adapter = {name: torch.tensor(values) for name, values in ours[0]["adapter"].items()}
    assert adapter.keys() == theirs[0]["adapter"].keys() == ours[1]["adapter"].keys()
    for name, tensor in adapter.items():
        torch.testing.assert_close(
            tensor, torch.tensor(theirs[0]["adapter"][name]), rtol=0, atol=ADAPTER_TOLERANCE
        )
        torch.testing.assert_close(
            tensor, torch.tensor(ours[1]["adapter"][name]), rtol=0, atol=0
        )  # DDP: one policy

    policy = sorted(adapter)
    for report in ours:
        assert report["adapters"] == ["default", "ref", "reward"]
        # DDP's reducer, the optimizer and autograd see the policy adapter only (find_unused_parameters: TRL's
        # default for a PeftModel, which the frozen adapters do not upset)
        assert report["find_unused_parameters"] is True
        assert report["ddp_parameters"] == len(policy)
        assert report["optimized"] == policy and report["requires_grad"] == policy
        assert report["reward_moved"] == 0.0 and report["reward_grads"] == 0
        # adapters off through DDP's module: the base alone; the policy is not the base
        assert report["reference_gap"] <= 1e-6 and report["policy_gap"] > 1e-3
