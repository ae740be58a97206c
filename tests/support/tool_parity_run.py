"""marl's side of the tool-calling parity on one process or under ``torchrun``: one rollout of the scripted
policy, its shaped rewards and one update (``support.tool_agents.marl_tool_run``), each process on its share
of the prompts; ``tests/rollout/test_tool_parity.py`` compares the processes' rows with TRL's run on the
whole batch.

Usage: ``python tool_parity_run.py MODEL_DIR OUTPUT_DIR PARALLELISM SETUP TASK...`` (SETUP ``tools`` or
``environment``).
It writes ``report_<rank>.json``: this process's examples, completion ids, tool masks, rewards, advantages,
loss and tool metrics, in TRL's prompt-major order of its examples.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

# the script runs as a file under torchrun: the tests' helpers are importable from their folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.tool_agents import SETUPS, examples, marl_tool_run

REPORTED = ("examples", "completion_ids", "tool_mask", "rewards", "advantages", "loss", "sampler_calls")


def main(model_dir: str, output_dir: str, parallelism: str, setup: str, *tasks: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    run = marl_tool_run(
        Path(model_dir),
        examples(tasks),
        output_dir=Path(output_dir),
        processes=world,
        parallelism=parallelism,
        **SETUPS[setup],
    )
    report = {key: run[key] for key in REPORTED}
    report["world"] = run["trainer"].parts.parallelism.num_processes
    report["metrics"] = {name: value for name, value in run["metrics"].items() if name.startswith("tools/")}
    (Path(output_dir) / f"report_{rank}.json").write_text(json.dumps(report))
    run["trainer"].parts.parallelism.finish()


if __name__ == "__main__":
    main(*sys.argv[1:])
