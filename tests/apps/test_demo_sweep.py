"""``marl demo --sweep`` on the bundled model in 4-bit: a sweep of one policy is the demo's own run (the same
adapter, metrics and held-out completions), and a grid writes every member's run, the sweep's table and the
ranking of its policies on the held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from marl.apps.cli import demo_main
from marl.train.memory_guard import is_measurement

ADAPTER = "adapter_model.safetensors"
# Two updates of 8 completions (2 prompts × k=4) of 8 tokens, 3 held-out prompts: the demo's path, short.
SHORT = [
    "--total_episodes", "16", "--rloo_k", "4", "--per_device_train_batch_size", "8",
    "--num_mini_batches", "1", "--response_length", "8", "--num_eval_prompts", "3", "--threads", "2",
]  # fmt: skip


def metrics(folder: Path) -> list[dict]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if not is_measurement(key)} for record in records]


def completions(folder: Path, model: str) -> list[str]:
    rows = [json.loads(line) for line in (folder / "eval_completions.jsonl").read_text().splitlines()]
    return [row[model]["completion"] for row in rows]


@pytest.mark.slow  # three short demos on the bundled 135M model in 4-bit, about a minute each
def test_a_demo_sweep_of_one_is_the_demo_and_a_grid_is_ranked(tmp_path):
    alone = demo_main([*SHORT, "--output_dir", str(tmp_path / "alone")])
    one = demo_main([*SHORT, "--sweep", "seed=0", "--output_dir", str(tmp_path / "one")])
    run, member = tmp_path / "alone" / "policy", tmp_path / "one" / "seed=0"
    assert alone["reward_weights"]["weights"] == one["reward_weights"]["weights"]  # measured alike
    solo, swept = load_file(run / ADAPTER), load_file(member / ADAPTER)
    assert solo.keys() == swept.keys()
    assert all(torch.equal(solo[key], swept[key]) for key in solo)
    assert metrics(run) == metrics(member)
    assert completions(run, "policy") == completions(tmp_path / "one", "seed=0")
    assert completions(run, "base") == completions(tmp_path / "one", "base")

    # one update, the on-topic weight given: the grid's measurement would repeat the one compared above
    grid_words = [*SHORT, "--total_episodes", "8", "--topic_weight", "0.4"]
    grid_words += ["--sweep", "learning_rate=3e-3,1e-3"]
    grid = demo_main([*grid_words, "--output_dir", str(tmp_path / "grid")])
    names = ["learning_rate=3e-3", "learning_rate=1e-3"]
    for name, rate in zip(names, (3e-3, 1e-3), strict=True):
        folder = tmp_path / "grid" / name
        assert json.loads((folder / "rloo_config.json").read_text())["learning_rate"] == rate
        assert (folder / ADAPTER).is_file() and len(metrics(folder)) == 1
    first, second = (load_file(tmp_path / "grid" / name / ADAPTER) for name in names)
    assert any(not torch.equal(first[key], second[key]) for key in first)  # each learned at its own rate
    table = (tmp_path / "grid" / "sweep_summary.md").read_text()
    assert all(name in table for name in names)
    assert sorted(policy["name"] for policy in grid["ranking"]) == sorted(names)
    assert set(grid["topicality"]) == {"base", *names}
    saved = json.loads((tmp_path / "grid" / "demo_summary.json").read_text())
    assert saved["ranking"] == json.loads(json.dumps(grid["ranking"]))  # its intervals' tuples as lists
    assert saved["settings"]["sweep"] == ["learning_rate=3e-3,1e-3"]
