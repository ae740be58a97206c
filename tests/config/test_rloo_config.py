"""RLOOConfig: defaults, CLI parsing, validation messages and batch arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import HfArgumentParser

from marl.config import RLOOConfig


def test_defaults_follow_the_reference_trainer():
    config = RLOOConfig()
    assert config.rloo_k == 2
    assert config.num_ppo_epochs == 4
    assert config.num_mini_batches == 1
    assert config.kl_coef == 0.05
    assert config.cliprange == 0.2
    assert config.temperature == 0.7
    assert config.reward_clip_range == 10.0
    assert config.local_rollout_forward_batch_size == 64
    assert config.num_sample_generations == 10
    assert config.stop_token == "eos" and config.missing_eos_penalty is None  # stops at EOS, as TRL
    assert not config.token_level_kl and not config.normalize_reward and not config.normalize_advantage
    assert config.model_name_or_path == "smollm2-135m-instruct"
    assert config.trackers == []
    assert config.mixed_precision == "no"


def test_no_flag_that_would_do_nothing():
    names = {f.name for f in dataclasses.fields(RLOOConfig)}
    assert "whiten_rewards" not in names
    assert "lora_dropout" not in names  # dropout is off for RL (the rollout and the update see one function)


def test_parses_from_the_command_line():
    parser = HfArgumentParser(RLOOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        [
            "--rloo_k",
            "4",
            "--quantization",
            "4bit",
            "--report_to",
            "tensorboard",
            "wandb",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--token_level_kl",
            "--stop_token",
            "eos",
            "--missing_eos_penalty",
            "1.0",
            # unset by default (chosen for the device), as TRL's own bf16: HfArgumentParser wants a value
            # (marl's commands take the switch alone too: tests/config/test_device.py)
            "--bf16",
            "true",
        ]
    )
    assert config.rloo_k == 4
    assert config.quantization == "4bit"
    assert config.trackers == ["tensorboard", "wandb"]
    assert config.policy_lora_config().target_modules == {"q_proj", "v_proj"}
    assert config.token_level_kl
    assert config.missing_eos_penalty == 1.0
    assert config.mixed_precision == "bf16"


def test_single_strings_are_accepted_from_python():
    config = RLOOConfig(report_to="tensorboard", lora_target_modules="all-linear", quantization="none")
    assert config.trackers == ["tensorboard"]
    assert config.policy_lora_config().target_modules == "all-linear"
    assert config.quantization is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rloo_k": 1}, "rloo_k=1.*--rloo_k 2"),
        ({"rloo_k": 3, "per_device_train_batch_size": 4}, "not a multiple of rloo_k=3"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0"),
        ({"report_to": ["tensorbord"]}, "unknown report_to"),
        ({"report_to": ["none", "wandb"]}, "mixes 'none'"),
        ({"quantization": "3bit"}, "quantization='3bit'.*4bit, 8bit"),
        ({"reference": "sft"}, "reference='sft'"),
        ({"reference": "initial-policy"}, "--policy_adapter"),
        ({"stop_token": "eos", "stop_token_id": 3}, "both set"),
        ({"stop_token": "</s>"}, "--stop_token eos"),
        ({"missing_eos_penalty": 1.0, "stop_token": "none"}, "Add --stop_token eos"),
        ({"bf16": True, "fp16": True}, "bf16 and fp16"),
        ({"temperature": 0.0}, "temperature"),
        ({"lr_scheduler_type": "linearr"}, "lr_scheduler_type"),
        ({"total_episodes": 0}, "total_episodes"),
        ({"save_total_limit": 0}, "save_total_limit"),
        ({"max_tool_calling_iterations": -1}, r"max_tool_calling_iterations=-1 must be >= 0.*unset"),
        ({"graph_capture": "cudagraphs"}, r"graph_capture='cudagraphs' is not a choice.*'cuda_graphs'"),
        ({"graph_capture": "cuda_graphs", "sampler": "static"}, "--sampler graph only.*Add --sampler graph"),
    ],
)
def test_invalid_settings_fail_early_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        RLOOConfig(**overrides)


def test_batch_arithmetic():
    config = RLOOConfig(
        rloo_k=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=3,
    )
    sizes = config.batch_sizes(world_size=2, dataset_length=50)
    assert sizes.local_batch_size == 16
    assert sizes.batch_size == 32
    assert sizes.prompts_per_process == 4
    assert sizes.prompts_per_update == 8
    assert sizes.local_mini_batch_size == 8
    assert sizes.mini_batch_size == 16
    assert sizes.total_episodes == 150  # num_train_epochs (3) × 50 prompts
    assert sizes.num_total_batches == 5  # ceil(150 / 32)
    assert sizes.optimizer_steps_per_update == 6
    assert sizes.total_optimizer_steps == 30


def test_total_episodes_overrides_epochs_and_empty_dataset_is_rejected():
    config = RLOOConfig(total_episodes=17, per_device_train_batch_size=4)
    assert config.batch_sizes(world_size=1, dataset_length=1000).num_total_batches == 5
    with pytest.raises(ValueError, match="empty"):
        config.batch_sizes(world_size=1, dataset_length=0)
