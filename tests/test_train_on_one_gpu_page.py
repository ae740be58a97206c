"""The commands of docs/guides/train-on-one-gpu.md run, as written, on tiny models on a CPU: plan, train,
resume, evaluate. Only the paths (the base, the reward adapter) and the sizes are swapped for tiny ones, and
the CUDA graph sampler for the static one it draws the same tokens as; every other flag is the page's."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.tiny import write_jsonl

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "train-on-one-gpu.md"
BASH = re.compile(r"^```bash\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
BASE, REWARD = "~/models/Qwen2.5-1.5B-Instruct", "~/rm"
# Flag values for a run of seconds on a 2-layer model; the page's values are for a 1.5B model on a GPU.
TINY_VALUES = {
    "--rloo_k": "4",
    "--per_device_train_batch_size": "8",
    "--response_length": "8",
    "--total_episodes": "16",
    "--save_steps": "1",
    "--num_prompts": "4",
    "--sampler": "static",
}
# bf16 on a CPU: accelerate's CPU autocast is slow and not what this test checks (the flags parse and run).
DROPPED = ("--bf16",)


def page_commands() -> list[list[str]]:
    """The page's ``marl`` commands, each as its argument list (continuation lines joined)."""
    commands = []
    for block in BASH.findall(PAGE.read_text()):
        text = block.replace("\\\n", " ")
        commands += [shlex.split(line) for line in text.splitlines() if line.startswith("marl ")]
    return commands


def tiny(command: list[str], base: Path, reward: Path) -> list[str]:
    swapped, skip_value = [], False
    for index, argument in enumerate(command):
        if skip_value:
            skip_value = False
            continue
        if argument in DROPPED:
            continue
        swapped.append({BASE: str(base), REWARD: str(reward)}.get(argument, argument))
        if argument in TINY_VALUES:
            swapped.append(TINY_VALUES[argument])
            skip_value = index + 1 < len(command)
    return swapped


def test_the_page_names_each_step() -> None:
    names = [command[1] for command in page_commands()]
    assert names == ["plan", "train-rloo", "train-rloo", "evaluate"]
    assert "--resume_from_checkpoint" in page_commands()[2]


@pytest.mark.slow
def test_the_page_commands_run_on_tiny_models(
    tiny_model_factory, reward_adapter_factory, tmp_path: Path
) -> None:
    base, reward = tiny_model_factory("qwen2"), reward_adapter_factory("qwen2")
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Review number {i}: the film"} for i in range(8)])
    outputs = []
    for command in page_commands():
        argv = [sys.executable, "-m", "marl.apps.cli", *tiny(command[1:], base, reward)]
        result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{shlex.join(command)}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    assert "fits in 24 GB" in outputs[0]
    assert (tmp_path / "runs" / "grpo" / "adapter_config.json").is_file()
    assert (tmp_path / "runs" / "grpo-eval").is_dir()
