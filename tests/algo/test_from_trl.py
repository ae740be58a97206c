"""``rloo_config_from_trl`` field by field: every field of TRL 1.16's ``GRPOConfig`` and ``RLOOConfig`` is in
the table of :mod:`marl.algo.from_trl` (a new TRL field fails here), each refused field is refused with its
reason when set, each irrelevant one changes nothing, each converted one lands where it should; TRL's batch
structure (generation size, optimizer steps per generation, max_steps with num_iterations) and RLOO's
normalisation epsilon are reproduced."""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch
from trl import GRPOConfig
from trl import RLOOConfig as TRLRLOOConfig

from marl.algo.from_trl import CONVERTED, IRRELEVANT, REFUSED, field_table, rloo_config_from_trl
from marl.algo.losses import LossSettings, SamplerCorrection
from marl.errors import ConfigError

BASE = dict(output_dir="out", use_cpu=True, bf16=False, report_to="none")
CLASSES = {"GRPOConfig": GRPOConfig, "RLOOConfig": TRLRLOOConfig}


def fields_with(outcome: str) -> list[tuple[str, str]]:
    return [
        (class_name, item.name)
        for class_name, config_class in CLASSES.items()
        for item in dataclasses.fields(config_class)
        if field_table(config_class).get(item.name, (REFUSED,))[0] == outcome
    ]


def other_value(value):
    """A value unlike TRL's default ``value`` (set on the instance: TRL's own checks are not the point)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, enum.Enum):
        return "other"
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return 0.123 if value in (0.0, float("inf"), float("-inf")) else value * 1.5
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list | tuple):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return {"other": 1} if value is None else "other"


@pytest.mark.parametrize("class_name", sorted(CLASSES))
def test_the_table_names_every_field_of_trls_config(class_name):
    config_class = CLASSES[class_name]
    unknown = [
        item.name for item in dataclasses.fields(config_class) if item.name not in field_table(config_class)
    ]
    assert unknown == [], f"classify these {class_name} fields in marl/algo/from_trl.py: {unknown}"


@pytest.mark.parametrize(("class_name", "name"), fields_with(REFUSED))
def test_a_refused_field_is_refused_with_its_reason(class_name, name):
    config = CLASSES[class_name](**BASE)
    setattr(config, name, other_value(getattr(config, name)))
    reason = field_table(CLASSES[class_name])[name].reason
    with pytest.raises(ConfigError, match=rf"does not honour: .*\b{name}=.*\({reason[:20]}"):
        rloo_config_from_trl(config)


@pytest.mark.parametrize(("class_name", "name"), fields_with(IRRELEVANT))
def test_an_irrelevant_field_changes_nothing(class_name, name):
    config = CLASSES[class_name](**BASE)
    expected = rloo_config_from_trl(config)
    setattr(config, name, other_value(getattr(config, name)))
    assert rloo_config_from_trl(config) == expected


# Converted fields: TRL settings (through TRL's constructor, so that its derivations run) -> marl's values.
CONVERTED_CASES = {
    "output_dir": ({"output_dir": "elsewhere"}, {"output_dir": "elsewhere"}),
    "seed": ({"seed": 7}, {"seed": 7}),
    "report_to": ({"report_to": "tensorboard"}, {"report_to": ["tensorboard"]}),
    "learning_rate": ({"learning_rate": 3e-4}, {"learning_rate": 3e-4}),
    "lr_scheduler_type": ({"lr_scheduler_type": "cosine"}, {"lr_scheduler_type": "cosine"}),
    "weight_decay": ({"weight_decay": 0.1}, {"weight_decay": 0.1}),
    "max_grad_norm": ({"max_grad_norm": 0.5}, {"max_grad_norm": 0.5}),
    "per_device_train_batch_size": ({"per_device_train_batch_size": 16}, {"per_device_train_batch_size": 16}),
    "gradient_accumulation_steps": (
        {"gradient_accumulation_steps": 2},
        {"gradient_accumulation_steps": 2, "num_mini_batches": 1},
    ),
    "bf16": ({"bf16": True}, {"bf16": True}),
    "fp16": ({"bf16": False}, {"fp16": False}),
    "activation_checkpointing": ({"activation_checkpointing": False}, {"gradient_checkpointing": False}),
    "save_total_limit": ({"save_total_limit": 2}, {"save_total_limit": 2}),
    "num_generations": ({"num_generations": 4}, {"rloo_k": 4}),
    "max_completion_length": ({"max_completion_length": 64}, {"response_length": 64}),
    "temperature": ({"temperature": 0.7}, {"temperature": 0.7}),
    "beta": ({"beta": 0.1}, {"kl_coef": 0.1}),
    "epsilon": ({"epsilon": 0.3}, {"cliprange": 0.3}),
    "epsilon_high": ({"epsilon_high": 0.4}, {"epsilon_high": 0.4}),
    "num_iterations": ({"num_iterations": 2}, {"num_ppo_epochs": 2}),
    "mask_truncated_completions": (
        {"mask_truncated_completions": True},
        {"mask_truncated_completions": True},
    ),
    "reward_weights": ({"reward_weights": [1.0, 0.5]}, {"reward_weights": [1.0, 0.5]}),
    "steps_per_generation": ({"steps_per_generation": 2}, {"num_mini_batches": 2}),
    "generation_batch_size": ({"generation_batch_size": 24}, {"num_mini_batches": 3}),
    "max_steps": ({"max_steps": 6, "num_iterations": 3}, {"total_episodes": 2 * 8, "num_ppo_epochs": 3}),
    "num_train_epochs": ({"num_train_epochs": 2.0}, {}),  # × k, checked below
    "warmup_steps": ({"warmup_steps": 2}, {"warmup_steps": 2}),
    "logging_steps": ({"logging_steps": 3}, {"logging_steps": 3}),
    "save_steps": ({"save_steps": 4}, {"save_steps": 4}),
    "save_strategy": ({"save_strategy": "no"}, {"save_steps": 0}),
    "optim": ({"optim": "adamw_torch"}, {}),
    "disable_dropout": ({"disable_dropout": True}, {}),
    "log_completions": ({"log_completions": True}, {"num_sample_generations": 10}),
    "loss_type": ({"loss_type": "grpo"}, {"loss_type": "grpo"}),
    "multi_objective_aggregation": (
        {"multi_objective_aggregation": "normalize_then_sum"},
        {"reward_normalization": "per_reward", "scale_rewards": "group"},
    ),
    "scale_rewards": ({"scale_rewards": "batch"}, {"scale_rewards": "batch"}),
    "importance_sampling_level": (
        {"importance_sampling_level": "sequence"},
        {"importance_sampling_level": "sequence"},
    ),
    "use_bias_correction_kl": ({"use_bias_correction_kl": False}, {"use_bias_correction_kl": False}),
    "max_tool_calling_iterations": (
        {"max_tool_calling_iterations": 3},
        {"max_tool_calling_iterations": 3},
    ),
    # TRL applies its correction only with use_vllm (refused): off, as TRL's is; mode and bounds carry over
    "vllm_importance_sampling_correction": (
        {"vllm_importance_sampling_correction": True},
        {"vllm_importance_sampling_correction": False},
    ),
    "vllm_importance_sampling_mode": (
        {"vllm_importance_sampling_mode": "token_truncate"},
        {"vllm_importance_sampling_mode": "token_truncate"},
    ),
    "vllm_importance_sampling_clip_max": (
        {"vllm_importance_sampling_clip_max": 2.0},
        {"vllm_importance_sampling_clip_max": 2.0},
    ),
    "vllm_importance_sampling_clip_min": (
        {"vllm_importance_sampling_clip_min": 0.5},
        {"vllm_importance_sampling_clip_min": 0.5},
    ),
    "normalize_advantages": (
        {"normalize_advantages": True},
        {"normalize_advantage": True, "advantage_epsilon": 1e-4},
    ),
}


@pytest.mark.parametrize(("class_name", "name"), fields_with(CONVERTED))
def test_a_converted_field_lands_where_it_should(class_name, name):
    settings, expected = CONVERTED_CASES[name]
    config = rloo_config_from_trl(CLASSES[class_name](**{**BASE, **settings}))
    assert {key: getattr(config, key) for key in expected} == expected
    if name == "num_train_epochs":
        assert config.num_train_epochs == 2.0 * config.rloo_k


def test_trls_correction_settings_apply_to_marls_sampler_when_turned_on():
    trl_config = CLASSES["GRPOConfig"](
        **BASE,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0,
    )
    config = rloo_config_from_trl(trl_config, vllm_importance_sampling_correction=True)
    correction = LossSettings.from_config(config).sampler_correction
    assert correction == SamplerCorrection("token_mask", 0.5, 2.0)


def test_trls_generation_structure_is_reproduced():
    """The trial's case: 6 completions per micro-batch, 2 micro-batches per generation, 1 accumulation
    step: TRL makes 12 completions per generation and 2 optimizer steps from them; so does marl's update.
    With num_iterations 3, TRL's max_steps=12 counts optimizer steps: 2 generations, not 4."""
    trl = GRPOConfig(**BASE, per_device_train_batch_size=6, steps_per_generation=2, num_generations=6,
                     num_iterations=3, max_steps=12)  # fmt: skip
    sizes = rloo_config_from_trl(trl).batch_sizes(world_size=1, dataset_length=100)
    assert sizes.local_batch_size == trl.generation_batch_size == 12
    assert sizes.optimizer_steps_per_update == 2 * 3
    assert sizes.total_optimizer_steps == trl.max_steps and sizes.num_total_batches == 2
    with pytest.raises(ConfigError, match=r"max_steps=5 is not a whole number of generations \(6 optimizer"):
        rloo_config_from_trl(GRPOConfig(**{**BASE, "max_steps": 5}, steps_per_generation=2, num_iterations=3))
    with pytest.raises(
        ConfigError, match=r"steps_per_generation=3 is not a multiple of gradient_accumulation"
    ):
        rloo_config_from_trl(GRPOConfig(**BASE, steps_per_generation=3, gradient_accumulation_steps=2))


def test_refusals_name_every_field_at_once_and_unknown_optimizers():
    with pytest.raises(
        ConfigError, match=r"delta=1.5 \(marl does not implement it\), top_k=5 \(marl samples"
    ):
        rloo_config_from_trl(GRPOConfig(**BASE, top_k=5, delta=1.5))
    with pytest.raises(ConfigError, match=r"optim='sgd' \(marl's optimizer is torch AdamW"):
        rloo_config_from_trl(GRPOConfig(**BASE, optim="sgd"))
    with pytest.raises(ConfigError, match=r"save_strategy='epoch'"):
        rloo_config_from_trl(GRPOConfig(**BASE, save_strategy="epoch"))


def test_rloo_advantages_are_normalised_as_trl_1_16_does():
    """TRL 1.16's RLOOTrainer: (A − nanmean A) / (nanstd A + 1e-4), with TRL's own nanstd; marl under the
    converted config gives the same, not std + 1e-8 (TRL v0.21's)."""
    from trl.trainer.utils import nanstd

    from marl.algo.shaping import shape_rewards

    config = rloo_config_from_trl(
        TRLRLOOConfig(**BASE, normalize_advantages=True, num_generations=2, beta=0.0)
    )
    scores = torch.tensor([1.0, 1.00002, 1.00001, 1.00004])  # a small spread: the epsilon shows
    zero = torch.zeros(4, 1)
    shaped = shape_rewards(
        scores, zero, zero, zero.bool(), torch.ones(4, dtype=torch.bool), k=2, kl_coef=0.0,
        normalize_advantage=config.normalize_advantage, advantage_epsilon=config.advantage_epsilon,
    )  # fmt: skip
    raw = shape_rewards(scores, zero, zero, zero.bool(), torch.ones(4, dtype=torch.bool), k=2, kl_coef=0.0)
    trl = (raw.advantages - torch.nanmean(raw.advantages)) / (nanstd(raw.advantages) + 1e-4)
    torch.testing.assert_close(shaped.advantages, trl)
    old = (raw.advantages - raw.advantages.mean()) / (raw.advantages.std() + 1e-8)
    assert not torch.allclose(shaped.advantages, old, rtol=1e-3)
