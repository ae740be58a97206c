"""``marl train-rloo --tool`` / ``--environment`` / ``--max_tool_calling_iterations``: the flags, what they
import, their refusals (one line, before any model loads, the output folder untouched), and one run end to
end with a tool, an environment that owns a reward and a reward adapter beside it."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from marl.apps.cli import main
from marl.apps.train_rloo import ScriptArguments, parse_train_rloo_args, tool_arguments
from marl.errors import ConfigError

from support.tiny import refused, save_reward_adapter, write_jsonl

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of a and b.
    """
    return a + b


class Calculator:
    """Counts the multiplications of one rollout; its reward is whether any was made."""

    def reset(self, **example):
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of a and b.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls > 0)


def bare(a, b):
    return a


class NoReset:
    def look(self) -> str:
        """Look around."""
        return "nothing"


BY_NAME = {"calculator": Calculator}
NOT_CALLABLE_ENTRY = {"calculator": Calculator, "abacus": 3}
number = 3
'''
QUESTIONS = ["What is 2 + 3?", "What is 4 times 5?", "Add 7 and 8.", "Multiply 3 by 6."]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("cli-tools")
    (root / "my_tools.py").write_text(TOOLS)
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    write_jsonl(root / "prompts.jsonl", [{"prompt": messages} for messages in conversations])
    named = [{"prompt": messages, "environment": "calculator"} for messages in conversations]
    write_jsonl(root / "named.jsonl", named)
    write_jsonl(root / "misnamed.jsonl", [{**row, "environment": "chess"} for row in named])
    write_jsonl(root / "texts.jsonl", [{"prompt": question} for question in QUESTIONS])
    return {"root": root, "tools": str(root / "my_tools.py"), "base": str(tiny_llama_dir)}


def train_words(files, output_dir, *extra, dataset="prompts"):
    return [
        "train-rloo", "--model_name_or_path", files["base"],
        "--dataset_name", f"{files['root']}/{dataset}.jsonl",
        "--output_dir", str(output_dir), "--rloo_k", "2", "--per_device_train_batch_size", "4",
        "--total_episodes", "4", "--response_length", "16", "--num_ppo_epochs", "1",
        "--num_sample_generations", "0", *extra,
    ]  # fmt: skip


def test_tool_flags_repeat_and_an_environment_may_be_the_only_reward():
    words = ["--tool", "my_tools:add", "--environment", "my_tools:Calculator", "--tool", "math:fsum"]
    script, config = parse_train_rloo_args([*words, "--max_tool_calling_iterations", "3"])
    assert script.tool == ["my_tools:add", "math:fsum"] and script.environment == "my_tools:Calculator"
    assert config.max_tool_calling_iterations == 3 and not script.reward_fn and not config.reward_adapter
    with pytest.raises(ConfigError, match=r"no reward: .*--environment with get_reward"):
        parse_train_rloo_args(["--tool", "my_tools:add"])  # a tool alone scores nothing


@pytest.mark.parametrize(
    ("trl_name", "hint"),
    [("--tools", "--tool module:function"), ("--environment_factory", "--environment module:Factory")],
)
def test_trls_keyword_names_get_marls_flag(trl_name, hint):
    with pytest.raises(ConfigError, match=rf"{trl_name} is a TRL name: marl's flag is {hint}"):
        parse_train_rloo_args(["--reward_adapter", "rm", trl_name, "m:f"])


def test_the_flags_import_what_the_trainer_takes(files):
    import datasets

    prompts = datasets.load_dataset("json", data_files=str(files["root"] / "named.jsonl"), split="train")
    script = ScriptArguments(tool=[f"{files['tools']}:add"], environment=f"{files['tools']}:BY_NAME")
    arguments = tool_arguments(script, prompts)
    (add,) = arguments["tools"]
    assert add(2, 3) == 5 and add.__doc__.startswith("Add two integers")
    assert list(arguments["environment_factory"]) == ["calculator"]
    environment = arguments["environment_factory"]["calculator"]()
    environment.reset()
    assert environment.multiply(3, 4) == 12 and environment.get_reward() == 1.0
    assert tool_arguments(ScriptArguments(), prompts) == {}  # the trainer's own defaults without the flags


# (flags, prompts file, what the one line says)
WRONG = {
    "tool-no-colon": (["--tool", "nocolon"], "prompts", r"--tool 'nocolon' must look like 'module:function'"),
    "tool-no-module": (["--tool", "not_a_module:f"], "prompts", r"--tool .*could not import 'not_a_module'"),
    "tool-absent": (["--tool", "{tools}:absent"], "prompts", r"--tool .*has no attribute 'absent'"),
    "tool-not-callable": (["--tool", "{tools}:number"], "prompts", r"--tool .*'number' is a int, not a func"),
    "env-no-colon": (["--environment", "nocolon"], "prompts", r"'nocolon' must look like 'module:Factory'"),
    "env-no-file": (["--environment", "{root}/missing.py:E"], "prompts", r"could not import .*no such file"),
    "env-absent": (["--environment", "{tools}:Absent"], "prompts", r"has no attribute 'Absent'"),
    "env-not-callable": (
        ["--environment", "{tools}:number"],
        "prompts",
        r"'number' is a int, not a callable",
    ),
    "env-entry": (
        ["--environment", "{tools}:NOT_CALLABLE_ENTRY"],
        "named",
        r"'NOT_CALLABLE_ENTRY' is a dict, not a callable",
    ),
    "env-no-column": (
        ["--environment", "{tools}:BY_NAME"],
        "prompts",
        r"environment=None is not one of environment_factory's \['calculator'\]",
    ),
    "tool-undescribed": (
        ["--tool", "{tools}:bare"],
        "prompts",
        r"--tool .*:bare: the model cannot be told how",
    ),
    "env-no-reset": (
        ["--environment", "{tools}:NoReset"],
        "prompts",
        r"made a NoReset without a reset method",
    ),
    "template": (["--tool", "{tools}:add"], "prompts", r"tools need a chat template that renders tool calls"),
    "plain-text": (["--tool", "{tools}:add"], "texts", r"row 0: tools need conversations"),
    "env-unknown-name": (
        ["--environment", "{tools}:BY_NAME"],
        "misnamed",
        r"environment='chess' is not one of",
    ),
}


@pytest.mark.parametrize(("extra", "dataset", "expected"), list(WRONG.values()), ids=list(WRONG))
def test_a_wrong_tool_or_environment_is_one_line_before_any_model_loads(
    files, tmp_path, capsys, extra, dataset, expected
):
    extra = [word.format(tools=files["tools"], root=files["root"]) for word in extra]
    output_dir = tmp_path / "run"
    reward = ["--reward_fn", "math:fsum"]  # imported, never called: the refusal comes first
    line = refused(capsys, main, train_words(files, output_dir, *reward, *extra, dataset=dataset))
    assert line.startswith("marl train-rloo: error: ")
    assert re.search(expected, line), line
    assert not output_dir.exists()


def test_a_sweep_with_tools_and_a_negative_turn_limit_are_refused(capsys):
    with pytest.raises(ConfigError, match=r"--sweep trains without tools"):
        parse_train_rloo_args(["--reward_adapter", "rm", "--sweep", "seed=1,2", "--tool", "m:f"])
    words = ["train-rloo", "--reward_adapter", "rm", "--max_tool_calling_iterations", "-1"]
    assert "max_tool_calling_iterations=-1 must be >= 0" in refused(capsys, main, words)


@pytest.mark.slow
def test_a_run_with_a_tool_an_environment_and_a_reward_adapter(files, tmp_path):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    base = tmp_path / "base"  # the tiny model with a chat template that renders tool calls (Hermes format)
    shutil.copytree(files["base"], base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(base)
    config = json.loads((base / "config.json").read_text())  # the tools' schemas make long prompts
    (base / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    reward = save_reward_adapter(base, tmp_path / "reward")
    output_dir = tmp_path / "run"
    flags = ["--tool", f"{files['tools']}:add", "--environment", f"{files['tools']}:Calculator"]
    flags += ["--reward_adapter", str(reward), "--max_tool_calling_iterations", "2"]
    words = train_words(files, output_dir, *flags)
    words[words.index("--model_name_or_path") + 1] = str(base)
    main(words)
    (record,) = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"rewards/reward", "rewards/Calculator"} <= set(record)  # the adapter and get_reward, weight 1
    assert 0 <= record["tools/failure_frequency"] <= 1
    # a completion's get_reward is 1 only where it called multiply: never more than its tool calls
    assert 0 <= record["rewards/Calculator"] <= record["tools/call_frequency"]
