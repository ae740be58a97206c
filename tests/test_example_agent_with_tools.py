"""examples/agent_with_tools.py end to end in its smallest setting: the bundled model after a warm start of
three steps on two demonstrations, one update of four completions (40 tokens: the tool call fits, its result
does not), the calculator's reward beside the reward adapter's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_agent_example_calls_its_tools(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    arguments = ["--output_dir", str(output_dir), "--total_episodes", "4"]
    arguments += ["--per_device_train_batch_size", "4", "--response_length", "40"]
    arguments += ["--warm_start_steps", "3", "--warm_start_examples", "2"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_with_tools.py"), *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "update 1: tool calls per completion" in result.stdout
    (record,) = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/Calculator", "rewards/reward", "tools/failure_frequency"} <= set(record)
    assert record["tools/call_frequency"] > 0  # the warm start taught the format
    # get_reward is 1 only for a completion that made the right call: never above the calls per completion
    assert 0 <= record["rewards/Calculator"] <= record["tools/call_frequency"]
    (table,) = (output_dir / "samples").glob("*.jsonl")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    # each turn as conversation_text writes it: "assistant: [add(a=17, b=25)]"
    assert any(re.search(r"\[(add|multiply)\(a=", row["completion"]) for row in rows), rows
