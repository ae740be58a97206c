"""A TRL 1.16 ``GRPOConfig`` or ``RLOOConfig`` as a marl :class:`~marl.config.RLOOConfig`, field by field.

Every field of TRL's classes has an outcome in :mod:`marl.algo.trl_fields`: converted, refused unless at
TRL's default (a ConfigError names every such field with its reason), or irrelevant to what is trained. A
field the table does not know is refused, so a converted run never silently drops a setting.
``GRPOConfig`` becomes ``--algorithm grpo`` (its loss, scale and clip fields override the preset), TRL's
``RLOOConfig`` ``--algorithm rloo`` with TRL 1.16's normalisation epsilon (nan-aware std + 1e-4).

The batch structure is TRL's: one generation of ``per_device_train_batch_size × steps_per_generation``
completions per process (``generation_batch_size`` over all) feeds ``steps_per_generation /
gradient_accumulation_steps`` optimizer steps per pass, ``num_iterations`` passes. In marl that is one update
of ``num_mini_batches = steps_per_generation / gradient_accumulation_steps`` mini-batches and
``num_ppo_epochs = num_iterations``. TRL counts ``max_steps``, ``warmup_steps``, ``logging_steps`` and
``save_steps`` in optimizer steps, marl in updates (``total_episodes`` in completions); they are converted.
An epoch of TRL is every prompt once with its ``num_generations`` completions; marl's ``num_train_epochs``
counts completions, so it is multiplied by ``k``. ``GRPOConfig.multi_objective_aggregation`` becomes
``reward_normalization``: ``"sum_then_normalize"`` → ``sum``, ``"normalize_then_sum"`` → ``per_reward`` with
``scale_rewards="group"`` (TRL's ``normalize_then_sum`` divides each reward by its group std whatever
``scale_rewards`` says). TRL's importance-sampling correction of vLLM samples keeps its names in marl (the
sampler is marl's own decode): its mode and bounds carry over; the correction itself stays off, as TRL
applies it only with ``use_vllm`` (refused); ``vllm_importance_sampling_correction=True`` as an override
turns it on for marl's sampler with TRL's mode and bounds.

Example:
    >>> from trl import GRPOConfig
    >>> trl = GRPOConfig(output_dir="out", num_generations=4, beta=0.04, use_cpu=True, bf16=False,
    ...                  per_device_train_batch_size=6, steps_per_generation=2, max_steps=4, report_to="none")
    >>> config = rloo_config_from_trl(trl)
    >>> config.algorithm, config.rloo_k, config.kl_coef, config.num_mini_batches, config.total_episodes
    ('grpo', 4, 0.04, 2, 24)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from marl.algo.trl_fields import CONVERTED, IRRELEVANT, field_table
from marl.config.rloo_config import RLOOConfig
from marl.errors import ConfigError

# TRL field -> marl field, for the converted fields of the same meaning.
SAME_MEANING = {
    "output_dir": "output_dir",
    "seed": "seed",
    "learning_rate": "learning_rate",
    "lr_scheduler_type": "lr_scheduler_type",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "per_device_train_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "bf16": "bf16",
    "fp16": "fp16",
    "activation_checkpointing": "gradient_checkpointing",
    "save_total_limit": "save_total_limit",
    "num_generations": "rloo_k",
    "max_completion_length": "response_length",
    "temperature": "temperature",
    "beta": "kl_coef",
    "epsilon": "cliprange",
    "epsilon_high": "epsilon_high",
    "num_iterations": "num_ppo_epochs",
    "mask_truncated_completions": "mask_truncated_completions",
    "reward_weights": "reward_weights",
    "loss_type": "loss_type",
    "scale_rewards": "scale_rewards",
    "importance_sampling_level": "importance_sampling_level",
    "use_bias_correction_kl": "use_bias_correction_kl",
    "normalize_advantages": "normalize_advantage",
    "vllm_importance_sampling_mode": "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
}
# TRL 1.16's RLOOTrainer divides the advantages by their nan-aware std + 1e-4 (TRL v0.21: std + 1e-8).
TRL_RLOO_ADVANTAGE_EPSILON = 1e-4
ADAM_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
# GRPOConfig.multi_objective_aggregation -> marl's --reward_normalization (marl.algo.reward_normalization).
MULTI_OBJECTIVE_AGGREGATION = {"sum_then_normalize": "sum", "normalize_then_sum": "per_reward"}


def _value(trl_config: Any, name: str) -> Any:
    value = getattr(trl_config, name)
    return getattr(value, "value", value)  # TRL's enums (save_strategy, optim, ...) as their strings


def refused_fields(trl_config: Any) -> list[str]:
    """``name=value (reason)`` for every field of ``trl_config`` that marl does not honour: a refused field
    away from TRL's default (after TRL's own derivations), or a field the table does not know."""
    table = field_table(type(trl_config))
    converted = [name for name, outcome in table.items() if outcome.outcome == CONVERTED]
    derived = ("generation_batch_size", "steps_per_generation", "gradient_checkpointing")
    given = {
        name: getattr(trl_config, name)
        for name in converted
        if hasattr(trl_config, name) and name not in derived and getattr(trl_config, name) is not None
    }
    given["steps_per_generation"] = trl_config.steps_per_generation
    with warnings.catch_warnings():  # transformers' notice about TRL's own default, not about this config
        warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
        reference = type(trl_config)(**given, use_cpu=trl_config.use_cpu)
    refused = []
    for item in dataclasses.fields(trl_config):
        outcome = table.get(item.name)
        if outcome is not None and outcome.outcome in (CONVERTED, IRRELEVANT):
            continue
        value = getattr(trl_config, item.name)
        if outcome is None:
            refused.append(f"{item.name}={value!r} (a TRL field marl does not know: check what it does)")
        elif value != getattr(reference, item.name):
            refused.append(f"{item.name}={value!r} ({outcome.reason})")
    return sorted(refused)


def _batch_structure(trl_config: Any, settings: dict[str, Any]) -> int:
    """Fill ``settings`` with TRL's generation structure; return the optimizer steps per generation."""
    per_device, accumulation = trl_config.per_device_train_batch_size, trl_config.gradient_accumulation_steps
    steps, world = trl_config.steps_per_generation, trl_config.world_size
    if steps % accumulation:
        raise ConfigError(
            f"TRL steps_per_generation={steps} is not a multiple of gradient_accumulation_steps="
            f"{accumulation}: TRL's optimizer steps would straddle two generations, marl's updates do not. "
            "Use a multiple"
        )
    if trl_config.generation_batch_size != per_device * world * steps:
        raise ConfigError(
            f"TRL generation_batch_size={trl_config.generation_batch_size} is not "
            f"per_device_train_batch_size × processes × steps_per_generation = {per_device * world * steps}. "
            "Set one of the two only"
        )
    settings["num_mini_batches"] = steps // accumulation
    return steps // accumulation * trl_config.num_iterations


def _in_updates(name: str, steps: float, per_update: int, total_updates: int | None) -> int:
    """TRL's count of optimizer steps (a fraction < 1: of the run) as marl's updates, rounded up."""
    if 0 < steps < 1:
        if total_updates is None:
            raise ConfigError(f"TRL {name}={steps} (a fraction of the run) needs max_steps to convert")
        return max(1, math.ceil(steps * total_updates))
    return max(1, math.ceil(steps / per_update))


def rloo_config_from_trl(trl_config: Any, **overrides: Any) -> RLOOConfig:
    """The marl config of ``trl_config`` (a TRL 1.16 ``GRPOConfig`` or ``RLOOConfig``), with ``overrides``
    (marl field names) on top; refuses the TRL settings marl does not honour (see the module docstring).

    Example:
        >>> from trl import GRPOConfig
        >>> rloo_config_from_trl(GRPOConfig(output_dir="out", use_cpu=True, top_k=5, delta=1.5))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: TRL settings marl does not honour: delta=1.5 (marl does not implement ...
    """
    from trl import GRPOConfig
    from trl import RLOOConfig as TRLRLOOConfig

    if isinstance(trl_config, GRPOConfig):
        settings: dict[str, Any] = {"algorithm": "grpo", "kl_placement": "loss"}
    elif isinstance(trl_config, TRLRLOOConfig):
        settings = {"algorithm": "rloo", "kl_placement": "reward"}
        settings["advantage_epsilon"] = TRL_RLOO_ADVANTAGE_EPSILON
    else:
        raise ConfigError(f"expected a TRL GRPOConfig or RLOOConfig, got {type(trl_config).__name__}")
    refused = refused_fields(trl_config)
    optim, save_strategy = _value(trl_config, "optim"), _value(trl_config, "save_strategy")
    if optim not in ADAM_OPTIMIZERS:
        refused.append(f"optim={optim!r} (marl's optimizer is torch AdamW: {' or '.join(ADAM_OPTIMIZERS)})")
    aggregation = getattr(trl_config, "multi_objective_aggregation", "sum_then_normalize")
    if aggregation not in MULTI_OBJECTIVE_AGGREGATION:
        refused.append(
            f"multi_objective_aggregation={aggregation!r} (one of {list(MULTI_OBJECTIVE_AGGREGATION)})"
        )
    if save_strategy not in ("steps", "no"):
        refused.append(f"save_strategy={save_strategy!r} (marl saves every save_steps updates, or not: 'no')")
    if refused:
        raise ConfigError(
            f"TRL settings marl does not honour: {', '.join(refused)}. Set them back to TRL's defaults "
            "(or leave them out) before converting; marl's own flags are listed by `marl train-rloo --help`"
        )
    for name, marl_name in SAME_MEANING.items():
        if getattr(trl_config, name, None) is not None:
            settings[marl_name] = _value(trl_config, name)
    if isinstance(settings.get("scale_rewards"), bool):  # TRL's older spelling
        settings["scale_rewards"] = "group" if settings["scale_rewards"] else "none"
    settings["report_to"] = list(trl_config.report_to) or ["none"]
    settings["reward_normalization"] = MULTI_OBJECTIVE_AGGREGATION[aggregation]
    if settings["reward_normalization"] == "per_reward":
        settings["scale_rewards"] = "group"  # what TRL's normalize_then_sum does whatever scale_rewards says
    per_update = _batch_structure(trl_config, settings)
    total_updates = None
    if trl_config.max_steps > 0:
        if trl_config.max_steps % per_update:
            raise ConfigError(
                f"TRL max_steps={trl_config.max_steps} is not a whole number of generations ({per_update} "
                "optimizer steps each: steps_per_generation / gradient_accumulation_steps × num_iterations); "
                "marl updates on whole generations. Use a multiple"
            )
        total_updates = trl_config.max_steps // per_update
        per_process = trl_config.per_device_train_batch_size * trl_config.steps_per_generation
        settings["total_episodes"] = total_updates * per_process * trl_config.world_size
    else:
        settings["num_train_epochs"] = trl_config.num_train_epochs * trl_config.num_generations
    if trl_config.warmup_steps:
        if 0 < trl_config.warmup_steps < 1:
            settings["warmup_ratio"] = float(trl_config.warmup_steps)
        else:
            settings["warmup_steps"] = _in_updates("warmup_steps", trl_config.warmup_steps, per_update, None)
    settings["logging_steps"] = _in_updates(
        "logging_steps", trl_config.logging_steps, per_update, total_updates
    )
    settings["save_steps"] = (
        0
        if save_strategy == "no"
        else _in_updates("save_steps", trl_config.save_steps, per_update, total_updates)
    )
    if not trl_config.log_completions:
        settings["num_sample_generations"] = 0
    return RLOOConfig(**(settings | overrides))
