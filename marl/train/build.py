"""The builder of an RLOO run: reads the config once and returns the ready parts the trainer's loop uses.

:func:`check_components` resolves every registry name of a config (advantage estimator, sampler, parallelism),
checks the loss and its combination with the other algorithm settings (:mod:`marl.algo.losses`), and
refuses what cannot run before any model work; the command line calls it right after parsing,
:func:`build_training_parts` calls it first. :func:`build_training_parts` then makes, in order: the reward,
the :class:`Parallelism` (which owns the ``accelerate.Accelerator``), the scorer, the tokenised prompts and
the batch arithmetic, the policy's starting weights on every process, the sampler, and the
:class:`marl.train.update.PolicyUpdate` with its optimizer and LR schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import get_scheduler

from marl.algo.advantages import AdvantageEstimator, advantage_estimator
from marl.algo.group_spread import ZeroSpreadWatch
from marl.algo.losses import LossSettings, check_algorithm
from marl.algo.scoring_passes import scoring_passes
from marl.config.batch_sizes import BatchSizes
from marl.config.device import DEVICE_TYPES, Device, device_sampler, resolve_device_settings
from marl.config.rloo_config import RLOOConfig
from marl.cpu.threads import apply_threads
from marl.data.prompts import Prompt, context_length, prepare_prompts
from marl.errors import ConfigError
from marl.model.multi_adapter import MultiAdapterModel
from marl.rewards import CheckedJudge, WeightedRewards, build_rewards
from marl.rollout.samplers import Sampler, SamplerSettings, check_keeps_logprobs, get_sampler
from marl.rollout.scoring import Scorer
from marl.train.parallel import Parallelism, get_parallelism
from marl.train.update import PolicyUpdate


@dataclass
class TrainingParts:
    """What an RLOO run trains with, built once from its config.

    ``judge``: the held-out judge, checked; ``callbacks``: the user's, then the CPU thread governor when
    ``config.threads`` asks for one, then (main process) the watch of groups that teach nothing.
    ``sample_every``: updates between sample tables (0: none). ``policy_update`` holds the optimizer, the LR
    schedule and the policy's trainable parameters.
    """

    judge: CheckedJudge | None
    callbacks: list[Callable[..., Any]]
    parallelism: Parallelism
    policy: str
    reward: WeightedRewards
    sampler: Sampler
    scorer: Scorer
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt] | None
    sizes: BatchSizes
    sample_every: int
    advantage_estimator: AdvantageEstimator
    policy_update: PolicyUpdate


def check_components(config: RLOOConfig) -> None:
    """Refuse, with a :class:`marl.errors.ConfigError` naming the flag and the known names, every registry
    name of ``config`` that names nothing registered, before any model work.

    Example:
        >>> check_components(RLOOConfig())
        >>> check_components(RLOOConfig(advantage_estimator="ppo"))
        Traceback (most recent call last):
        marl.errors.ConfigError: --advantage_estimator 'ppo' is not a registered advantage estimator; ...
    """
    check_algorithm(config)  # the estimator's name, the loss and their combinations
    # an unset sampler is the device's (marl.config.device): every one of those is checked
    unset = sorted({device_sampler(device_type) for device_type in DEVICE_TYPES})
    names = [config.sampler] if config.sampler is not None else unset
    for name in names:
        factory = get_sampler(name)
        if config.vllm_importance_sampling_correction:  # the sampler correction reads the sampler's log-probs
            check_keeps_logprobs(name, factory)
    get_parallelism(config.parallelism)


def build_training_parts(
    config: RLOOConfig,
    model: MultiAdapterModel,
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any = None,
    reward_funcs: Any = None,
    judge: Callable[[list[str]], Any] | None = None,
    callbacks: Sequence[Callable[..., Any]] = (),
) -> TrainingParts:
    """The parts of a run of ``config`` on ``model`` (arguments as :class:`marl.RLOOTrainer` takes them).

    Example:
        >>> parts = build_training_parts(config, model, tokenizer, prompts)  # doctest: +SKIP
        >>> parts.sizes.num_total_batches, parts.parallelism.num_processes  # doctest: +SKIP
        (3, 1)
    """
    check_components(config)
    if judge is not None and (eval_dataset is None or config.num_sample_generations == 0):
        raise ConfigError(
            "a judge scores the held-out samples: pass eval_dataset and set num_sample_generations > 0"
        )
    for what, function in [("judge", judge), *(("callbacks entry", c) for c in callbacks)]:
        if function is not None and not callable(function):
            raise ConfigError(
                f"{what} {function!r} is not a function: a judge is called as judge(texts) -> scores, a "
                "callback as callback(state, metrics) (not transformers.TrainerCallback objects)"
            )
    # A config built in Python arrives with its device settings unset: chosen for the model's device.
    resolve_device_settings(config, Device.named("cuda" if model.device.type == "cuda" else "cpu"))
    # On CPU torch's threads follow the free cores by default (config.threads), after every update and, at
    # the forward passes (every one runs the input embeddings), every second within it.
    governor = apply_threads(config.threads, model.device.type)
    if governor is not None:
        governor.follow(model.peft_model.get_base_model().get_input_embeddings())
    policy = model.get_policy(config.policy_adapter_name).name
    rows_per_pass = config.local_rollout_forward_batch_size
    reward = build_rewards(model, reward_funcs, config.reward_weights, rows_per_pass)
    parallelism = get_parallelism(config.parallelism)(model, config)
    scorer = Scorer(
        model,
        tokenizer,
        temperature=config.temperature,
        rows_per_pass=rows_per_pass,
        autocast=parallelism.autocast,
        policy=policy,
        share_prompt_prefix=config.share_prompt_prefix,
        passes=scoring_passes(config),  # only the log-prob passes the algorithm reads
    )
    lengths = dict(context_length=context_length(model), response_length=config.response_length)
    train_prompts = prepare_prompts(train_dataset, tokenizer, "train_dataset", **lengths)
    eval_prompts = (
        None if eval_dataset is None else prepare_prompts(eval_dataset, tokenizer, "eval_dataset", **lengths)
    )
    sizes = config.batch_sizes(parallelism.num_processes, len(train_prompts))
    sample_every = (
        max(1, sizes.num_total_batches // config.num_sample_generations)
        if config.num_sample_generations > 0
        else 0
    )
    if config.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    # The parallelism started every process from process 0's policy and may have replaced its tensors (FSDP2):
    # read them now, and let a sampler keeping its own copy of the policy copy the starting weights.
    parameters = model.policy_parameters(policy)
    # A sampler keeping its own copy of the policy copies the starting weights.
    sampler = get_sampler(config.sampler)(
        model,
        tokenizer,
        SamplerSettings(
            temperature=config.temperature,
            response_length=config.response_length,
            stop_at_eos=config.stop_token == "eos",
            stop_token_id=config.stop_token_id,
            rows_per_pass=rows_per_pass,
            autocast=parallelism.autocast,
            policy=policy,
            synced_processes=parallelism.shards_base,
            graph_capture=config.graph_capture,
        ),
    )
    if config.vllm_importance_sampling_correction:  # a sampler may fall back to generate for this model
        check_keeps_logprobs(config.sampler, sampler)
    optimizer, scheduler = parallelism.prepare(*_optimizer_and_schedule(config, sizes, parameters))
    return TrainingParts(
        judge=judge if judge is None or isinstance(judge, CheckedJudge) else CheckedJudge(judge, "judge"),
        callbacks=[
            *callbacks,
            *([governor] if governor is not None else []),
            *([ZeroSpreadWatch()] if parallelism.is_main_process else []),
        ],
        parallelism=parallelism,
        policy=policy,
        reward=reward,
        sampler=sampler,
        scorer=scorer,
        train_prompts=train_prompts,
        eval_prompts=eval_prompts,
        sizes=sizes,
        sample_every=sample_every,
        advantage_estimator=advantage_estimator(config),
        policy_update=PolicyUpdate(
            config,
            LossSettings.from_config(config),
            model,
            policy,
            sampler,
            scorer,
            parallelism,
            optimizer,
            scheduler,
            sizes,
            parameters,
        ),
    )


def _optimizer_and_schedule(
    config: RLOOConfig, sizes: BatchSizes, parameters: list[torch.nn.Parameter]
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW on the policy's parameters and its LR schedule over every optimizer step of the run."""
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
    total_steps = sizes.total_optimizer_steps
    # warmup_steps counts updates, as in TRL's RLOO trainer; the schedule itself steps per optimizer step.
    warmup = config.warmup_steps * sizes.optimizer_steps_per_update or math.ceil(
        config.warmup_ratio * total_steps
    )
    scheduler = get_scheduler(
        config.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps
    )
    return optimizer, scheduler
