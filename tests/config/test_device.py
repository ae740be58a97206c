"""The settings chosen for the device (:mod:`marl.config.device`): bf16 (fp16 on a card without bfloat16)
and gradient checkpointing on a CUDA device as TRL's configs default them, nothing on a CPU; the ``graph``
sampler on a CUDA device, ``static`` on a CPU; a given value always wins; train-rloo and marl plan choose by
the same rule. The device is an input: these run on a CPU."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil

import pytest
from trl import GRPOConfig

from marl.apps.flags import parse_flags
from marl.apps.train_rloo import parse_train_rloo_args
from marl.config import RLOOConfig
from marl.config.algorithms import GRPO_RESPONSE_LENGTH, PRESETS
from marl.config.device import (
    DEVICE_FIELDS,
    Device,
    choose_device_settings,
    describe_choices,
    resolve_device_settings,
)

DEVICES = [Device("cuda"), Device("cuda", supports_bf16=False), Device("cpu", supports_bf16=False)]
# The newcomer's command of docs/guides/coming-from-trl.md.
GRPO_4BIT = ["--algorithm", "grpo", "--quantization", "4bit", "--reward_adapter", "rm"]


@pytest.mark.parametrize("device", DEVICES, ids=["cuda-bf16", "cuda-fp16", "cpu"])
def test_nothing_given_chooses_the_devices_defaults(device):
    chosen = choose_device_settings(dict.fromkeys(DEVICE_FIELDS), device)
    values = {name: value for name, (value, _reason) in chosen.items()}
    cuda = device.type == "cuda"
    assert values == {
        "bf16": cuda and device.supports_bf16,
        "fp16": cuda and not device.supports_bf16,
        "gradient_checkpointing": cuda,
        "sampler": "graph" if cuda else "static",
    }
    switches = {name: reason for name, (_, reason) in chosen.items() if name != "sampler"}
    assert all(reason.startswith("on" if values[name] else "off") for name, reason in switches.items())
    assert chosen["sampler"][1].startswith(values["sampler"] + ": ")


@pytest.mark.parametrize("device", DEVICES, ids=["cuda-bf16", "cuda-fp16", "cpu"])
@pytest.mark.parametrize(
    "given",
    list(itertools.product([None, True, False], [None, True, False], [None, True, False], [None, "static"])),
)
def test_a_given_value_always_wins_and_one_precision_at_most(device, given):
    if given[0] and given[1]:
        return  # bf16 and fp16 both given: RLOOConfig refuses that
    given_fields = dict(zip(DEVICE_FIELDS, given, strict=True))
    chosen = choose_device_settings(given_fields, device)
    assert set(chosen) == {name for name, value in given_fields.items() if value is None}
    final = given_fields | {name: value for name, (value, _) in chosen.items()}
    assert not (final["bf16"] and final["fp16"])
    if given_fields["bf16"] is not None or given_fields["fp16"] is not None:  # a precision was asked for
        assert not any(chosen[name][0] for name in ("bf16", "fp16") if name in chosen)


def test_the_grpo_family_samples_trls_completion_length_unless_given():
    trl_defaults = {item.name: item.default for item in dataclasses.fields(GRPOConfig)}
    assert trl_defaults["max_completion_length"] == GRPO_RESPONSE_LENGTH
    for algorithm, preset in PRESETS.items():
        expected = GRPO_RESPONSE_LENGTH if preset["advantage_estimator"] == "grpo" else 53
        assert RLOOConfig(algorithm=algorithm).response_length == expected, algorithm
        assert RLOOConfig(algorithm=algorithm, response_length=20).response_length == 20


def test_train_rloo_on_a_cuda_device_chooses_bf16_and_checkpointing_and_says_so():
    _, config = parse_train_rloo_args(GRPO_4BIT, device="cuda")
    assert (config.bf16, config.fp16, config.gradient_checkpointing) == (True, False, True)
    assert config.response_length == GRPO_RESPONSE_LENGTH
    line = describe_choices(config.chosen_for_device, "cuda")
    assert line.startswith("chosen for the cuda device: bf16 on: the CUDA device computes in bfloat16")
    assert "gradient_checkpointing on: a CUDA device (TRL's default" in line
    # a card without bfloat16 gets fp16; a CPU today's defaults
    config = RLOOConfig()
    resolve_device_settings(config, Device("cuda", supports_bf16=False))
    assert (config.bf16, config.fp16, config.gradient_checkpointing) == (False, True, True)
    _, on_cpu = parse_train_rloo_args(GRPO_4BIT, device="cpu")
    assert (on_cpu.bf16, on_cpu.fp16, on_cpu.gradient_checkpointing) == (False, False, False)
    assert (config.sampler, on_cpu.sampler) == ("graph", "static")
    _, given = parse_train_rloo_args([*GRPO_4BIT, "--sampler", "static"], device="cuda")
    assert given.sampler == "static" and "sampler" not in given.chosen_for_device
    # --graph_capture without --sampler: the device's sampler, graph on a CUDA device, captures
    _, captured = parse_train_rloo_args([*GRPO_4BIT, "--graph_capture", "cuda_graphs"], device="cuda")
    assert (captured.sampler, captured.graph_capture) == ("graph", "cuda_graphs")


def test_flags_given_win_over_the_devices_choice():
    _, config = parse_train_rloo_args(
        [*GRPO_4BIT, "--bf16", "false", "--gradient_checkpointing", "false", "--response_length", "64"],
        device="cuda",
    )
    assert (config.bf16, config.fp16, config.gradient_checkpointing) == (False, False, False)
    assert config.response_length == 64 and set(config.chosen_for_device) == {"fp16", "sampler"}
    _, config = parse_train_rloo_args([*GRPO_4BIT, "--fp16"], device="cuda")  # a switch stands alone
    assert (config.bf16, config.fp16) == (False, True)
    assert config.chosen_for_device["bf16"] == "off: --fp16 is given"
    _, config = parse_train_rloo_args([*GRPO_4BIT, "--gradient_checkpointing"], device="cpu")
    assert config.gradient_checkpointing is True and "gradient_checkpointing" not in config.chosen_for_device


def test_a_sweeps_members_keep_the_record_of_the_choice():
    from marl.apps.train_rloo import sweep_members

    script, config = parse_train_rloo_args([*GRPO_4BIT, "--sweep", "seed=1,2"], device="cuda")
    for member in sweep_members(script, config):
        assert member.config.bf16 and member.config.gradient_checkpointing
        assert member.config.chosen_for_device == config.chosen_for_device


def test_marl_plan_chooses_as_train_rloo_does(tiny_llama_dir, tmp_path, capsys):
    from marl.apps.plan import PlanArguments, run_plan

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    flags = ["--model_name_or_path", str(tmp_path), "--response_length", "4"]
    for device in ("cuda", "cpu"):
        words = [*flags, "--prompt_length", "8", "--device", device]
        arguments, planned = parse_flags([PlanArguments, RLOOConfig], "marl plan", words)
        plan = run_plan(arguments, planned)
        _, trained = parse_train_rloo_args([*flags, "--reward_adapter", "rm"], device=device)
        assert [getattr(planned, name) for name in DEVICE_FIELDS] == [
            getattr(trained, name) for name in DEVICE_FIELDS
        ]
        assert plan.settings["gradient_checkpointing"] == (device == "cuda")
        assert f"chosen for the {device} device" in capsys.readouterr().err  # stdout holds the plan alone
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
