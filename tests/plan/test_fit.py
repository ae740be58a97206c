"""``--fit auto``: for a table of configurations and memory budgets, the settings chosen before the model
loads have a planned peak that fits, train exactly as the same settings typed by hand, and train as the typed
settings (up to float rounding) where those fit too; a budget nothing fits is refused before loading."""

from __future__ import annotations

import dataclasses
import json

import pytest
from safetensors.torch import load_file

from marl.errors import ConfigError
from marl.plan.fit import FIT_SETTINGS, fit_run, fit_target, micro_batch_sizes
from marl.plan.planner import ALLOCATOR_MARGIN, plan_memory, with_changes

from support.runs import build, prompt_dataset, tiny_config

ADAPTER = "adapter_model.safetensors"
# 3 updates; k = 2; each optimizer step's 8 rows as micro-batches of 8, 4 or 2
TYPED = {
    "micro-batches of 4": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
    "micro-batches of 2, checkpointing": dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=4, gradient_checkpointing=True
    ),
}
ROOMY = None  # 64 GB


def settings(micro: int, checkpointing: bool, rows: int = 8) -> dict:
    return {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": 8 // micro,
        "gradient_checkpointing": checkpointing,
        "local_rollout_forward_batch_size": rows,
    }


# (typed, the settings whose planned peak is the budget (None: 64 GB), the settings --fit must choose)
TABLE = [
    ("micro-batches of 4", ROOMY, settings(8, False)),  # faster: one micro-batch per step
    ("micro-batches of 4", settings(2, False), settings(2, False)),  # the typed update does not fit
    (
        "micro-batches of 4",
        settings(4, True, rows=4),
        settings(4, True, rows=4),
    ),  # smaller chunks, recomputing
    ("micro-batches of 4", settings(2, True, rows=4), settings(2, True, rows=4)),
    ("micro-batches of 2, checkpointing", ROOMY, settings(8, False)),
    ("micro-batches of 2, checkpointing", settings(2, False), settings(2, False)),  # no recomputing needed
]


def typed_config(folder, name, **overrides):
    return tiny_config(folder, local_rollout_forward_batch_size=8, **TYPED[name], **overrides)


def trained(model_dir, config):
    build(model_dir, config).train()
    return load_file(str(config.output_dir + "/" + ADAPTER))


def largest_difference(first, second) -> float:
    return max(float((first[key] - second[key]).abs().max()) for key in first)


@pytest.mark.parametrize(("typed", "budget_of", "expected"), TABLE)
def test_the_chosen_settings_fit_and_train_as_typed_by_hand(
    tiny_llama_dir, tmp_path, typed, budget_of, expected
):
    model = str(tiny_llama_dir)
    config = typed_config(tmp_path / "fit", typed, model_name_or_path=model)
    model_config, target = fit_target(config, prompt_dataset(), "cpu", memory_gb=64)
    if budget_of is not None:  # the memory at which `budget_of` just fits
        peak = plan_memory(with_changes(config, **budget_of), model_config, target).peak
        config.fit_memory_gb = (peak + 1000) / (1 - ALLOCATOR_MARGIN) / 1e9
    else:
        config.fit_memory_gb = 64
    typed_plan = plan_memory(
        config, model_config, dataclasses.replace(target, memory_gb=config.fit_memory_gb)
    )

    choice = fit_run(config, prompt_dataset(), "cpu")
    assert {name: getattr(config, name) for name in FIT_SETTINGS} == expected
    assert choice.plan.fits and choice.plan.peak <= choice.plan.budget_bytes
    assert choice.changes == {
        name: (TYPED[typed].get(name, getattr(typed_config(tmp_path, typed), name)), value)
        for name, value in expected.items()
        if getattr(typed_config(tmp_path, typed), name) != value
    }
    assert choice.changes  # every row of the table changes something
    fitted = trained(tiny_llama_dir, config)

    by_hand = tiny_config(tmp_path / "by-hand", model_name_or_path=model, fit="off", **expected)
    assert largest_difference(fitted, trained(tiny_llama_dir, by_hand)) <= 1e-6
    if typed_plan.fits:  # the run as typed fits too: the same training, up to float rounding
        as_typed = typed_config(tmp_path / "as-typed", typed, model_name_or_path=model, fit="off")
        assert largest_difference(fitted, trained(tiny_llama_dir, as_typed)) <= 1e-5


def test_a_budget_nothing_fits_is_refused_with_the_closest_setting(tiny_llama_dir, tmp_path):
    config = typed_config(tmp_path / "run", "micro-batches of 4", model_name_or_path=str(tiny_llama_dir))
    config.fit_memory_gb = 0.1  # the runtime alone is more
    with pytest.raises(ConfigError) as raised:
        fit_run(config, prompt_dataset(), "cpu")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("--fit auto: nothing fits the 90.0 MB usable of 0.1 GB; closest: ")
    assert (
        "--per_device_train_batch_size 2 --gradient_accumulation_steps 4 --gradient_checkpointing True"
        in message
    )
    assert "over. " in message and "--fit off" in message
    assert config.per_device_train_batch_size == 4  # nothing applied


def test_fit_off_and_cpu_without_a_budget_change_nothing(tiny_llama_dir, tmp_path):
    config = typed_config(tmp_path / "run", "micro-batches of 4", model_name_or_path=str(tiny_llama_dir))
    assert fit_run(config, prompt_dataset(), "cpu") is None  # CPU: no budget known
    config.fit, config.fit_memory_gb = "off", 64
    assert fit_run(config, prompt_dataset(), "cpu") is None
    assert config.per_device_train_batch_size == 4


def test_bnpo_keeps_its_micro_batch():
    config = tiny_config("unused", loss_type="bnpo", algorithm="grpo", per_device_train_batch_size=4)
    assert micro_batch_sizes(config) == [4]


@pytest.mark.parametrize("sweep", [[], ["--sweep", "learning_rate=1e-3,2e-3"]], ids=["run", "sweep"])
def test_the_command_prints_each_change_and_records_it(tiny_llama_dir, tmp_path, capsys, sweep):
    from marl.apps.cli import train_rloo_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ["a b", "c d", "e f", "g h"]))
    reward = tmp_path / "reward.py"
    reward.write_text("def count_e(prompts, completions):\n    return [c.count('e') for c in completions]\n")
    words = [
        "--model_name_or_path", str(tiny_llama_dir), "--dataset_name", str(prompts),
        "--reward_fn", f"{reward}:count_e", "--output_dir", str(tmp_path / "run"), "--rloo_k", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--total_episodes", "8",
        "--response_length", "4", "--num_sample_generations", "0", "--fit_memory_gb", "64",
    ]  # fmt: skip
    train_rloo_main([*words, *sweep])
    err = capsys.readouterr().err
    assert err.count("marl: --fit auto: --per_device_train_batch_size 2 -> 4 (planned peak ") == 1
    assert err.count("marl: --fit auto: --gradient_accumulation_steps 2 -> 1 (planned peak ") == 1
    folders = (
        [tmp_path / "run" / name for name in ("learning_rate=1e-3", "learning_rate=2e-3")] if sweep else []
    )
    for folder in folders or [tmp_path / "run"]:  # every policy of a sweep gets the same settings
        recorded = json.loads((folder / "rloo_config.json").read_text())
        assert recorded["per_device_train_batch_size"] == 4 and recorded["gradient_accumulation_steps"] == 1
        assert recorded["fit_chosen"]["memory_gb"] == 64
        assert recorded["fit_chosen"]["changes"] == {
            "per_device_train_batch_size": [2, 4],
            "gradient_accumulation_steps": [2, 1],
        }


def test_fit_with_tools_counts_their_descriptions_in_the_prompts_and_the_later_turns(tmp_path):
    """``--fit auto`` with tools plans the prompts as the chat template renders them with the tools'
    descriptions, and the later turns' decode (:class:`marl.plan.PlanTarget` ``tool_turns``)."""
    from datasets import Dataset

    from marl.rollout.toolbox import ToolBox

    from support.tool_agents import add, save_tool_model

    model_dir = save_tool_model("qwen2", tmp_path / "qwen2")
    config = tiny_config(tmp_path / "run", model_name_or_path=str(model_dir))
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 2 + 3?"}]]})
    _, plain = fit_target(config, prompts, "cpu", memory_gb=8)
    _, with_tools = fit_target(config, prompts, "cpu", memory_gb=8, tools=ToolBox([add]))
    assert not plain.tool_turns and with_tools.tool_turns
    assert with_tools.prompt_length > plain.prompt_length  # the tools' descriptions are in the prompt
