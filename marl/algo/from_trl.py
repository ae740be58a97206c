"""A TRL 1.16 ``GRPOConfig`` or ``RLOOConfig`` as a marl :class:`~marl.config.RLOOConfig`, field by field.

Every field of TRL's classes has an outcome in :func:`field_table`: ``converted`` (carried over, its unit
changed where marl counts otherwise), ``refused`` when set to anything but TRL's default (a ConfigError names
every such field with its reason), or ``irrelevant`` (it does not change what is trained: logging display,
the hub, evaluation, placement, speed). A field the table does not know is refused too, so a converted run
never silently drops a setting and a new TRL field is never dropped in silence
(``tests/algo/test_from_trl.py`` checks that the table covers every field).
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
    >>> table = field_table(GRPOConfig)
    >>> table["beta"].outcome, table["top_p"].outcome, table["hub_model_id"].outcome
    ('converted', 'refused', 'irrelevant')
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

from marl.config.rloo_config import RLOOConfig
from marl.errors import ConfigError

CONVERTED, REFUSED, IRRELEVANT = "converted", "refused", "irrelevant"


class FieldOutcome(NamedTuple):
    """What happens to one TRL field, and why."""

    outcome: str
    reason: str


def _all(outcome: str, reason: str, names: str) -> dict[str, FieldOutcome]:
    return {name: FieldOutcome(outcome, reason) for name in names.split()}


# --- converted: see rloo_config_from_trl for each one's marl field -----------------------------------------
_CONVERTED = {
    **_all(
        CONVERTED,
        "same meaning under marl's name",
        """
        output_dir seed learning_rate lr_scheduler_type weight_decay max_grad_norm per_device_train_batch_size
        gradient_accumulation_steps bf16 fp16 activation_checkpointing report_to num_generations
        max_completion_length temperature beta epsilon epsilon_high num_iterations mask_truncated_completions
        reward_weights save_total_limit""",
    ),
    "steps_per_generation": FieldOutcome(
        CONVERTED,
        "× per_device_train_batch_size: the completions of an "
        "update; ÷ gradient_accumulation_steps: its mini-batches",
    ),
    "generation_batch_size": FieldOutcome(CONVERTED, "follows from steps_per_generation (checked equal)"),
    "max_steps": FieldOutcome(CONVERTED, "optimizer steps → total_episodes (whole generations only)"),
    "num_train_epochs": FieldOutcome(CONVERTED, "TRL's epoch is each prompt with its k completions"),
    "warmup_steps": FieldOutcome(CONVERTED, "optimizer steps → updates (a fraction < 1 → warmup_ratio)"),
    "logging_steps": FieldOutcome(CONVERTED, "optimizer steps → updates, rounded up"),
    "save_steps": FieldOutcome(CONVERTED, "optimizer steps → updates, rounded up"),
    "save_strategy": FieldOutcome(
        CONVERTED, "'steps' keeps save_steps, 'no' is save_steps=0; others refused"
    ),
    "optim": FieldOutcome(CONVERTED, "marl's optimizer is torch AdamW: adamw_torch(_fused) only"),
    "disable_dropout": FieldOutcome(
        CONVERTED,
        "marl always trains without dropout (the update must see "
        "the rollout's function); False differs only where a rate is not 0",
    ),
    "log_completions": FieldOutcome(CONVERTED, "True: marl's sample tables; False: none"),
}
# --- refused unless at TRL's default --------------------------------------------------------------------
_REFUSED = {
    **_all(
        REFUSED,
        "marl samples with the temperature alone",
        """
        top_p top_k min_p repetition_penalty generation_kwargs""",
    ),
    **_all(
        REFUSED,
        "marl's AdamW uses torch's betas and epsilon",
        "adam_beta1 adam_beta2 adam_epsilon optim_args optim_target_modules lr_scheduler_kwargs",
    ),
    **_all(
        REFUSED,
        "marl does not implement it",
        """
        delta top_entropy_quantile entropy_coef use_adaptive_entropy off_policy_mask_threshold sync_ref_model
        cast_lm_head_to_fp32 router_aux_loss_coef neftune_noise_alpha torch_compile use_liger_kernel
        liger_kernel_config auto_find_batch_size""",
    ),
    **_all(
        REFUSED,
        "marl loads and places the model itself (its own flags and accelerate launch)",
        """
        model_init_kwargs trust_remote_code deepspeed fsdp fsdp_config parallelism_config tf32""",
    ),
    **_all(
        REFUSED,
        "marl orders the prompts by --seed alone",
        "shuffle_dataset data_seed train_sampling_strategy",
    ),
    **_all(REFUSED, "marl renders conversations with the template's defaults", "chat_template_kwargs"),
    **_all(REFUSED, "marl samples with transformers, not vLLM", "use_vllm"),
    **_all(
        REFUSED, "marl writes to its output folder and pushes nothing", "push_to_hub log_completions_hub_repo"
    ),
    "reward_clip_range": FieldOutcome(REFUSED, "marl clips only normalised rewards (--reward_clip_range)"),
}
# --- irrelevant to what is trained ------------------------------------------------------------------------
_IRRELEVANT = {
    **_all(
        IRRELEVANT,
        "display and logging only",
        """
        run_name logging_strategy logging_first_step logging_nan_inf_filter log_level log_level_replica
        log_on_each_node disable_tqdm include_num_input_tokens_seen skip_memory_metrics project
        trackio_space_id trackio_bucket_id trackio_static_space_id num_completions_to_print log_unique_prompts
        log_multimodal debug""",
    ),
    **_all(
        IRRELEVANT,
        "evaluation, which marl runs as `marl evaluate`",
        """
        do_train do_eval do_predict eval_strategy eval_steps eval_delay eval_accumulation_steps eval_on_start
        eval_do_concat_batches eval_use_gather_object per_device_eval_batch_size batch_eval_metrics
        bf16_full_eval fp16_full_eval prediction_loss_only include_for_metrics label_names
        metric_for_best_model greater_is_better load_best_model_at_end num_generations_eval""",
    ),
    **_all(
        IRRELEVANT,
        "read only when pushing to the hub, which is refused",
        """
        hub_model_id hub_strategy hub_token hub_private_repo hub_always_push hub_revision""",
    ),
    **_all(
        IRRELEVANT,
        "where and how fast it runs, not what it computes",
        """
        use_cpu local_rank ddp_backend ddp_timeout ddp_find_unused_parameters ddp_bucket_cap_mb
        ddp_broadcast_buffers ddp_static_graph accelerator_config dataloader_num_workers dataloader_pin_memory
        dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context
        dataloader_drop_last dataloader_in_order use_cache torch_empty_cache_steps cache_implementation
        pad_to_multiple_of ds3_gather_for_generation use_transformers_continuous_batching
        transformers_continuous_batching_config use_transformers_paged gradient_checkpointing_kwargs
        activation_checkpointing_kwargs torch_compile_backend torch_compile_mode full_determinism
        average_tokens_across_devices""",
    ),
    **_all(
        IRRELEVANT,
        "checkpoint files and resuming: marl's own (--resume_from_checkpoint)",
        """
        save_on_each_node save_only_model resume_from_checkpoint restore_callback_states_from_checkpoint
        ignore_data_skip enable_jit_checkpoint""",
    ),
    **_all(
        IRRELEVANT,
        "not read by GRPOTrainer or RLOOTrainer",
        """
        label_smoothing_factor length_column_name remove_unused_columns""",
    ),
    **_all(
        IRRELEVANT,
        "read only with use_vllm, which is refused",
        """
        vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url
        vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization
        vllm_max_model_length vllm_tensor_parallel_size vllm_importance_sampling_cap""",
    ),
    **_all(
        IRRELEVANT,
        "read only by a loss_type marl refuses (sapo, vespo)",
        """
        sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg
        vespo_lambda_neg""",
    ),
    **_all(
        IRRELEVANT,
        "read only with a refused setting (sync_ref_model, use_adaptive_entropy)",
        """
        ref_model_mixup_alpha ref_model_sync_steps entropy_coef_min entropy_coef_max entropy_coef_delta
        entropy_target""",
    ),
    "gradient_checkpointing": FieldOutcome(
        IRRELEVANT, "transformers' older name of activation_checkpointing"
    ),
}
GRPO_ONLY = {
    **_all(
        CONVERTED,
        "same meaning under the same name",
        """
        loss_type scale_rewards importance_sampling_level use_bias_correction_kl max_tool_calling_iterations
        vllm_importance_sampling_mode vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min""",
    ),
    "vllm_importance_sampling_correction": FieldOutcome(
        CONVERTED,
        "TRL applies it only with use_vllm, which is refused: marl's stays off, as TRL's is without vLLM; "
        "pass vllm_importance_sampling_correction=True as an override to correct marl's sampler",
    ),
    "multi_objective_aggregation": FieldOutcome(
        CONVERTED, "reward_normalization: sum_then_normalize → sum, normalize_then_sum → per_reward (GDPO)"
    ),
}
RLOO_ONLY = {
    "normalize_advantages": FieldOutcome(CONVERTED, "normalize_advantage, with TRL 1.16's epsilon 1e-4"),
}
COMMON = _CONVERTED | _REFUSED | _IRRELEVANT


def field_table(config_class: Any) -> dict[str, FieldOutcome]:
    """Every classified field of TRL's ``GRPOConfig`` or ``RLOOConfig`` (by its class) with its outcome."""
    from trl import GRPOConfig

    return COMMON | (GRPO_ONLY if issubclass(config_class, GRPOConfig) else RLOO_ONLY)


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
    "max_tool_calling_iterations": "max_tool_calling_iterations",
    "normalize_advantages": "normalize_advantage",
    "vllm_importance_sampling_mode": "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min": "vllm_importance_sampling_clip_min",
}
# TRL 1.16's RLOOTrainer divides the advantages by their nan-aware std + 1e-4 (TRL v0.21: std + 1e-8).
TRL_RLOO_ADVANTAGE_EPSILON = 1e-4
ADAM_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
# GRPOConfig.multi_objective_aggregation -> marl's --reward_normalization (marl.algo.shaping).
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
