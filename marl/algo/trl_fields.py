"""What :func:`marl.algo.from_trl.rloo_config_from_trl` does with every field of TRL 1.16's ``GRPOConfig`` and
``RLOOConfig``: each is ``converted`` (carried over, its unit changed where marl counts otherwise),
``refused`` when set to anything but TRL's default (the reason says why), or ``irrelevant`` (it does not
change what is trained: logging display, the hub, evaluation, placement, speed). A field of TRL's classes
that this table does not name is refused too, so that a new TRL field can never be dropped in silence
(``tests/algo/test_from_trl.py`` checks that the table covers every field).

Example:
    >>> from trl import GRPOConfig
    >>> table = field_table(GRPOConfig)
    >>> table["beta"].outcome, table["top_p"].outcome, table["hub_model_id"].outcome
    ('converted', 'refused', 'irrelevant')
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
        "read only with a refused setting (sync_ref_model, use_adaptive_entropy, tools)",
        """
        ref_model_mixup_alpha ref_model_sync_steps entropy_coef_min entropy_coef_max entropy_coef_delta
        entropy_target max_tool_calling_iterations""",
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
        loss_type scale_rewards importance_sampling_level use_bias_correction_kl
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
