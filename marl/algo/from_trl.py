"""A TRL 1.16 ``GRPOConfig`` or ``RLOOConfig`` as a marl :class:`~marl.config.RLOOConfig`.

Each TRL field marl honours is carried over under marl's name (``num_generations`` → ``rloo_k``, ``beta`` →
``kl_coef``, ``epsilon`` → ``cliprange``, ``num_iterations`` → ``num_ppo_epochs``,
``max_completion_length`` → ``response_length``, ``max_steps`` → ``total_episodes``, ...). A field set to
anything but what TRL's class gives by default (after its own derivations)
that marl does not honour is refused with a ConfigError naming every such field, so that a converted run never
silently drops a setting. ``GRPOConfig`` becomes ``--algorithm
grpo`` (its loss, scale and clip fields override the preset), TRL's ``RLOOConfig`` ``--algorithm rloo``.

One difference of meaning is converted, not copied: an epoch of TRL is every prompt once with its
``num_generations`` completions; marl's ``num_train_epochs`` counts completions, so it is multiplied by ``k``.
``GRPOConfig.multi_objective_aggregation`` becomes ``reward_normalization``: ``"sum_then_normalize"`` →
``sum``, ``"normalize_then_sum"`` → ``per_reward`` with ``scale_rewards="group"`` (TRL's
``normalize_then_sum`` divides each reward by its group std whatever ``scale_rewards`` says).

Example:
    >>> from trl import GRPOConfig
    >>> config = rloo_config_from_trl(GRPOConfig(output_dir="out", num_generations=4, beta=0.04, use_cpu=True,
    ...                                          bf16=False, per_device_train_batch_size=8, report_to="none"))
    >>> config.algorithm, config.loss_type, config.rloo_k, config.kl_coef, config.kl_placement
    ('grpo', 'dapo', 4, 0.04, 'loss')
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marl.config import RLOOConfig
from marl.errors import ConfigError

# TRL field -> marl field, for fields of the same meaning in both.
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
    "gradient_checkpointing": "gradient_checkpointing",
    "logging_steps": "logging_steps",
    "save_steps": "save_steps",
    "save_total_limit": "save_total_limit",
    "report_to": "report_to",
    "num_generations": "rloo_k",
    "max_completion_length": "response_length",
    "temperature": "temperature",
    "beta": "kl_coef",
    "epsilon": "cliprange",
    "epsilon_high": "epsilon_high",
    "num_iterations": "num_ppo_epochs",
    "mask_truncated_completions": "mask_truncated_completions",
    "reward_weights": "reward_weights",
}
GRPO_ONLY = {
    "loss_type": "loss_type",
    "scale_rewards": "scale_rewards",
    "importance_sampling_level": "importance_sampling_level",
    "use_bias_correction_kl": "use_bias_correction_kl",
}
RLOO_ONLY = {"normalize_advantages": "normalize_advantage"}
# Converted with a change of unit (see the module docstring), or bookkeeping that follows from other fields.
CONVERTED = ("num_train_epochs", "max_steps")
DERIVED = ("steps_per_generation", "generation_batch_size", "run_name", "logging_strategy")
# Where the run executes: marl runs where accelerate puts it, whatever TRL was told.
PLACEMENT = ("use_cpu",)
# GRPOConfig.multi_objective_aggregation -> marl's --reward_normalization (marl.algo.reward_normalization).
MULTI_OBJECTIVE_AGGREGATION = {"sum_then_normalize": "sum", "normalize_then_sum": "per_reward"}


def rloo_config_from_trl(trl_config: Any, **overrides: Any) -> RLOOConfig:
    """The marl config of ``trl_config`` (a TRL 1.16 ``GRPOConfig`` or ``RLOOConfig``), with ``overrides``
    (marl field names) on top; refuses the TRL settings marl does not honour (see the module docstring).

    Example:
        >>> from trl import GRPOConfig
        >>> rloo_config_from_trl(GRPOConfig(output_dir="out", use_cpu=True, top_k=5, delta=1.5))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: TRL settings marl does not honour: delta=1.5, top_k=5. ...
    """
    from trl import GRPOConfig
    from trl import RLOOConfig as TRLRLOOConfig

    if isinstance(trl_config, GRPOConfig):
        mapping, algorithm = SAME_MEANING | GRPO_ONLY, {"algorithm": "grpo", "kl_placement": "loss"}
    elif isinstance(trl_config, TRLRLOOConfig):
        mapping, algorithm = SAME_MEANING | RLOO_ONLY, {"algorithm": "rloo", "kl_placement": "reward"}
    else:
        raise ConfigError(f"expected a TRL GRPOConfig or RLOOConfig, got {type(trl_config).__name__}")
    given = {name: getattr(trl_config, name) for name in (*mapping, *CONVERTED)}
    known = {name: value for name, value in given.items() if value is not None}
    reference = type(trl_config)(**known, use_cpu=trl_config.use_cpu)
    ignored = sorted(
        f"{item.name}={getattr(trl_config, item.name)!r}"
        for item in dataclasses.fields(trl_config)
        if item.name not in (*mapping, *CONVERTED, *DERIVED, *PLACEMENT, "multi_objective_aggregation")
        and getattr(trl_config, item.name) != getattr(reference, item.name)
    )
    if ignored:
        raise ConfigError(
            f"TRL settings marl does not honour: {', '.join(ignored)}. Set them back to TRL's defaults "
            "(or leave them out) before converting; marl's own flags are listed by `marl train-rloo --help`"
        )
    settings: dict[str, Any] = {mapping[name]: given[name] for name in mapping if given[name] is not None}
    settings["report_to"] = list(trl_config.report_to) or ["none"]
    aggregation = getattr(trl_config, "multi_objective_aggregation", "sum_then_normalize")
    if aggregation not in MULTI_OBJECTIVE_AGGREGATION:
        raise ConfigError(
            f"multi_objective_aggregation={aggregation!r} is not one of TRL 1.16's "
            f"{list(MULTI_OBJECTIVE_AGGREGATION)}; use one of them"
        )
    settings["reward_normalization"] = MULTI_OBJECTIVE_AGGREGATION[aggregation]
    if settings["reward_normalization"] == "per_reward":
        settings["scale_rewards"] = "group"  # what TRL's normalize_then_sum does whatever scale_rewards says
    if trl_config.max_steps > 0:
        batch = trl_config.per_device_train_batch_size * trl_config.gradient_accumulation_steps
        settings["total_episodes"] = trl_config.max_steps * batch * trl_config.world_size
    else:
        settings["num_train_epochs"] = trl_config.num_train_epochs * trl_config.num_generations
    return RLOOConfig(**(algorithm | settings | overrides))
