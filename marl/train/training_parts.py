"""What an RLOO run trains with, built once from its config, the policy update among those parts, and what
reward functions see of the run (:func:`reward_trainer_state`, :func:`reward_function_metrics`).

:func:`check_components` resolves every registry name of a config (advantage estimator, sampler, parallelism),
checks the loss and its combination with the other algorithm settings (:mod:`marl.algo.losses`), and
refuses what cannot run before any model work; the command line calls it right after parsing,
:func:`build_training_parts` calls it first. :func:`build_training_parts` then makes, in order: the reward,
the :class:`Parallelism` (which owns the ``accelerate.Accelerator``), the scorer, the tokenised prompts and
the batch arithmetic, the policy's starting weights on every process, the sampler, and the
:class:`PolicyUpdate` with its optimizer and LR schedule.

The update's loops (epochs, mini-batches, micro-batches) are the trainer's
(:func:`marl.train.trainer.update_policies`); here are what they step: :class:`PolicyUpdate` (one policy's
optimizer, schedule, row order and optimizer step) and :class:`UpdatePart` (one policy's share of an update,
whose :meth:`UpdatePart.backward` is one micro-batch: forward, clipped policy loss, backward). The
config's policy loss is :mod:`marl.algo.losses`'s (the sequence ratio of TRL v0.21's RLOO or a TRL 1.x
token-level loss, with the k3 KL when it is in the loss); gradients are averaged over processes in the
backward pass, clipped to ``max_grad_norm``, and a step whose loss or gradient is not finite on any process
is skipped on every process (the schedule still moves on). Where the rollout skipped the policy's scoring
pass (:mod:`marl.algo.scoring_passes`: one epoch, one mini-batch, no KL in the reward), each micro-batch's
forward provides those log-probs, detached, into the rollout.

A sweep updates one micro-batch PER POLICY at each micro-batch step, each in its policy's own view, not one
joint micro-batch routed per row: the joint one was slower and held every policy's activations at once
(``benchmarks/results/2026-11-26-sweep-cpu-long4.md``), while one per policy holds one run's activations and
gives each policy its solo loss and gradients bit for bit (``tests/train/test_sweep.py``).

Example:
    >>> parts = build_training_parts(config, model, tokenizer, prompts)  # doctest: +SKIP
    >>> parts.sizes.num_total_batches, parts.parallelism.num_processes  # doctest: +SKIP
    (3, 1)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import get_scheduler

from marl.algo.advantages import AdvantageEstimator, advantage_estimator
from marl.algo.group_spread import ZeroSpreadWatch
from marl.algo.losses import LossSettings, check_algorithm, loss_mask, policy_loss, truncation_warning
from marl.algo.metrics import UpdateStats
from marl.algo.scoring_passes import reuses_samples, scoring_passes
from marl.config.batch_sizes import BatchSizes
from marl.config.device import DEVICE_TYPES, Device, device_sampler, resolve_device_settings
from marl.config.rloo_config import RLOOConfig
from marl.cpu.threads import apply_threads
from marl.data.prompts import Prompt, context_length, prepare_prompts
from marl.errors import ConfigError, DataError
from marl.model.multi_adapter import MultiAdapterModel
from marl.rewards import CheckedJudge, WeightedRewards, build_rewards
from marl.rewards.trl_calls import logged_metric_means
from marl.rollout.samplers import Sampler, SamplerSettings, check_keeps_logprobs, get_sampler
from marl.rollout.scoring import Scorer
from marl.rollout.tool_calls import ToolCalling, TurnEnds
from marl.rollout.toolbox import ToolBox, check_tool_prompts, prepare_tool_template
from marl.train.parallel import Parallelism, get_parallelism

if TYPE_CHECKING:
    from marl.rollout.completions import Rollout


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
    tool_calling: ToolCalling | None = None  # with tools or environments: the turn-by-turn rollout


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
    tools: ToolBox | None = None,
) -> TrainingParts:
    """The parts of a run of ``config`` on ``model`` (arguments as :class:`marl.RLOOTrainer` takes them;
    ``tools``: its tools and environments, :mod:`marl.rollout.tool_calls`).

    Example:
        >>> parts = build_training_parts(config, model, tokenizer, prompts)  # doctest: +SKIP
        >>> parts.policy_update.optimizer  # doctest: +SKIP
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
    chat_template = None if not tools else prepare_tool_template(tokenizer)
    weights = config.reward_weights
    if tools and tools.reward_types:  # each environment owning its reward is one more source, of weight 1
        given = list(model.rewards) if reward_funcs is None else reward_funcs
        reward_funcs = [*(given if isinstance(given, list | tuple) else [given]), *tools.reward_sources()]
        weights = None if weights is None else [*weights, *[1.0] * len(tools.reward_types)]
    reward = build_rewards(model, reward_funcs, weights, rows_per_pass)
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
    if tools:  # each conversation rendered with the tools its template describes
        lengths.update(tools_of=lambda columns: tools.tools_of(tools.environment_of(columns)))
        lengths.update(chat_template=chat_template)
    train_prompts = prepare_prompts(train_dataset, tokenizer, "train_dataset", **lengths)
    eval_prompts = (
        None if eval_dataset is None else prepare_prompts(eval_dataset, tokenizer, "eval_dataset", **lengths)
    )
    if tools:
        for name, prompts in [("train_dataset", train_prompts), ("eval_dataset", eval_prompts or [])]:
            check_tool_prompts(tools, prompts, name)
    sizes = config.batch_sizes(parallelism.num_processes, len(train_prompts))
    sample_every = (
        max(1, sizes.num_total_batches // config.num_sample_generations)
        if config.num_sample_generations > 0
        else 0
    )
    if config.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    # The parallelism started every process from process 0's policy and may have replaced its tensors (FSDP2):
    # read them after it, and let a sampler keeping its own copy of the policy copy the starting weights.
    parameters = model.policy_parameters(policy)
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
    tool_calling = None
    if tools:
        tool_calling = ToolCalling(
            tools,
            tokenizer,
            chat_template,
            TurnEnds.of(tokenizer, model, config.stop_token == "eos", config.stop_token_id),
            config.response_length,
            context_length(model),
            config.max_tool_calling_iterations,
            parallelism.any_process if parallelism.shards_base else bool,
        )
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
        tool_calling=tool_calling,
    )


class PolicyUpdate:
    """Trains the policy adapter on rollouts; owns the optimizer and the LR schedule between updates.

    Args:
        config: the run's settings (epochs, batch sizes).
        loss: the numbers the policy loss reads (clipping, the KL in the loss, masking).
        model: the model that holds the policy adapter.
        policy: the name of the policy adapter that trains.
        sampler: told after every optimizer step taken that the policy's weights changed.
        scorer: computes the policy's log-probs of a micro-batch (packed when whole prompt groups).
        parallelism: gradients, mixed precision and agreement over processes.
        optimizer: as prepared by ``parallelism``.
        scheduler: as prepared by ``parallelism``.
        sizes: the run's batch arithmetic.
        parameters: the policy adapter's trainable parameters.

    Attributes:
        grouped_micro_batches: micro-batches hold whole prompt groups, so the update computes each prompt
            once (when packing is on). It depends only on the batch sizes, never on whether the packing probe
            passed: a run resumed on other hardware (another dtype) sees the same rows in the same
            micro-batches.
        last_learning_rate: the rate of the latest step (the ``lr`` metric).
    """

    def __init__(
        self,
        config: RLOOConfig,
        loss: LossSettings,
        model: MultiAdapterModel,
        policy: str,
        sampler: Sampler,
        scorer: Scorer,
        parallelism: Parallelism,
        optimizer: Any,
        scheduler: Any,
        sizes: BatchSizes,
        parameters: Sequence[torch.nn.Parameter],
    ) -> None:
        self.config, self.loss, self.model, self.policy = config, loss, model, policy
        self.sampler, self.scorer = sampler, scorer
        self.parallelism, self.optimizer, self.scheduler = parallelism, optimizer, scheduler
        self.sizes, self.parameters = sizes, list(parameters)
        self.grouped_micro_batches = config.per_device_train_batch_size % config.rloo_k == 0
        self.last_learning_rate = float(scheduler.get_last_lr()[0])

    def tokens_per_micro_batch(self, mini_batch_mask: torch.Tensor) -> torch.Tensor | None:
        """The ``dapo`` normaliser: the optimizer step's loss tokens over every process, divided by
        processes × accumulation steps (the step's gradient: the token mean of the step); else None."""
        if self.loss.loss_type != "dapo":
            return None
        tokens = self.parallelism.gather(mini_batch_mask.sum().reshape(1).float()).sum()
        return tokens / (self.parallelism.num_processes * self.config.gradient_accumulation_steps)

    def skip(self) -> int:
        """Skip every optimizer step of an update (the schedule moves on); returns how many."""
        for _ in range(self.sizes.optimizer_steps_per_update):
            self._advance_schedule()
        return self.sizes.optimizer_steps_per_update

    def shuffled_rows(self, rollout: Rollout) -> torch.Tensor:
        """A random order of the rollout's rows: whole prompt groups in a random order when micro-batches
        hold whole groups (so a prompt can be computed once for its k completions), else single rows. The
        same whether prefix sharing is on or off."""
        device = self.parallelism.device
        if not self.grouped_micro_batches:
            return torch.randperm(rollout.prompt_index.shape[0]).to(device)
        groups = torch.randperm(int(rollout.prompt_index.max()) + 1).to(device)
        return torch.cat([torch.nonzero(rollout.prompt_index == group).flatten() for group in groups])

    def optimizer_step(self, loss_finite: bool) -> bool:
        """Clip the (already averaged) gradients and step; returns whether the step was skipped (anything not
        finite)."""
        skip = self.parallelism.any_process(not loss_finite)
        if not skip:
            max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
            grad_norm = self.parallelism.clip_gradients(self.parameters, max_norm)
            # With fp16 the loss scaler handles overflowing gradients itself (and lowers its scale).
            skip = (
                self.parallelism.accelerator.scaler is None
                and not torch.isfinite(torch.as_tensor(grad_norm)).item()
            )
        if not skip:
            self.optimizer.step()
            # fp16: the loss scaler skips a step whose gradients overflowed.
            skip = self.optimizer.step_was_skipped
            if not skip:
                self.sampler.policy_weights_changed()
        self._advance_schedule()
        self.optimizer.zero_grad(set_to_none=True)
        return skip

    def _advance_schedule(self) -> None:
        # `lr` logs the rate the step just taken used, read before the schedule moves on.
        self.last_learning_rate = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()


@dataclasses.dataclass
class UpdatePart:
    """One policy's share of an update: its :class:`PolicyUpdate` (settings, optimizer, schedule), its rollout
    and advantages, and what the loop keeps for it (``label`` prefixes its warnings when several policies
    update together).

    Example:
        >>> part = UpdatePart(trainer.parts.policy_update, rollout, advantages)  # doctest: +SKIP
        >>> stats, skipped = update_policies([part], trainer.phases, update=1)[0]  # doctest: +SKIP
    """

    step: PolicyUpdate
    rollout: Rollout
    advantages: torch.Tensor
    label: str = ""
    mask: torch.Tensor | None = None
    provide: bool = False
    stats: UpdateStats = dataclasses.field(default_factory=UpdateStats)
    skipped: int = 0

    def prepare(self, update: int) -> None:
        """Start an attempt of the ``update``-th update: no sums yet (a failed attempt's are dropped), the
        loss mask, the truncation warning, and the log-probs the update's forward provides where the rollout
        skipped the policy's scoring pass (:mod:`marl.algo.scoring_passes`)."""
        config, rollout = self.step.config, self.rollout
        self.stats, self.skipped = UpdateStats(), 0
        self.mask = loss_mask(rollout.model_mask, rollout.contains_stop, self.step.loss)
        truncated = truncation_warning(rollout.contains_stop, self.step.loss, update)
        if truncated is not None:
            warnings.warn(self.label + truncated, RuntimeWarning, stacklevel=4)
        self.provide = rollout.logprobs is None
        if self.provide and reuses_samples(config):
            raise ValueError("the rollout skipped the policy's scoring pass, which reusing its samples reads")
        if self.provide:
            # filled micro-batch by micro-batch by the update's forward (each row once: one epoch)
            rollout.logprobs = torch.zeros(rollout.response_ids.shape, device=rollout.response_ids.device)

    def backward(self, rows: torch.Tensor, num_items: torch.Tensor | None) -> bool:
        """One micro-batch (``rows``) of this part, in its policy's view: one forward, its loss (its metrics
        added to its stats; where it provides them, its detached log-probs written into its rollout), one
        backward pass; returns whether the loss was finite.

        Its own method so that the micro-batch's autograd graph dies when it returns, before the next
        micro-batch's forward (the next policy's, in a sweep): a custom autograd function may keep its inputs
        as attributes of its context (bitsandbytes' int8 matmul on CPU keeps each layer's input), which a
        backward pass does not free.
        """
        step, config = self.step, self.step.config
        batch = self.rollout.select(rows)
        # whole prompt groups: each prompt is computed once, its k gradients flow into it
        packed = step.scorer.pack(batch) if step.grouped_micro_batches else None
        # The backward pass runs in the view too: under gradient checkpointing it computes each layer's
        # forward again, which must see the same adapter.
        with step.model.policy(step.policy):
            with step.parallelism.autocast():
                new_logprobs, entropy = step.scorer.completion_logprobs(batch, packed, with_entropy=True)
            # One epoch, one mini-batch: plain REINFORCE, the ratio is exactly 1 by construction (TRL 1.16:
            # old_per_token_logps = per_token_logps.detach()), whether or not the rollout scored the policy.
            old = batch.logprobs if reuses_samples(config) else new_logprobs.detach()
            if self.provide:
                self.rollout.logprobs[rows] = old.float()
            policy, loss = policy_loss(
                step.loss,
                new_logprobs,
                old,
                batch.ref_logprobs,
                self.advantages[rows],
                self.mask[rows],
                num_items,
                batch.sampled_logprobs,
            )
            # Every process runs every backward pass (gradients are averaged inside it); the gradients of a
            # step with a non-finite loss are thrown away by the caller.
            finite = bool(torch.isfinite(loss))
            step.parallelism.backward(loss / config.gradient_accumulation_steps)
        with torch.no_grad():
            self.stats.add(policy, entropy, batch.model_mask, self.mask[rows])
        return finite


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


# ---------------------------------------------------------------------- what reward functions see of the run


def reward_trainer_state(trainer: Any) -> Any:
    """The ``trainer_state`` reward functions receive (:mod:`marl.rewards.trl_calls`) before the next update
    of ``trainer`` (a :class:`marl.RLOOTrainer`; typed ``Any``: the trainer imports this module).
    A ``transformers.TrainerState``, the class TRL passes, filled with the run's progress so that a reward
    shaped by it reads the same numbers as under TRL: ``global_step`` (optimizer steps before this update's
    rollout), ``max_steps`` (all of the run), ``epoch`` (prompts drawn before this update over the dataset's
    size, fractional as TRL's), ``num_train_epochs`` (the run's prompts over the dataset's size, rounded up),
    ``train_batch_size`` (``per_device_train_batch_size``), ``logging_steps``, ``save_steps``,
    ``is_world_process_zero`` and ``is_local_process_zero``. The rest keep ``TrainerState``'s defaults
    (``log_history`` is empty: marl's metrics are in ``metrics.jsonl``).

    Example:
        >>> state = reward_trainer_state(trainer)  # doctest: +SKIP
        >>> state.global_step, state.max_steps  # doctest: +SKIP
        (12, 48)
    """
    from transformers import TrainerState

    sizes, config, parallelism = trainer.parts.sizes, trainer.config, trainer.parts.parallelism
    dataset = max(len(trainer.parts.train_prompts), 1)
    return TrainerState(
        epoch=trainer.state.update * sizes.prompts_per_update / dataset,
        global_step=trainer.global_step,
        max_steps=sizes.total_optimizer_steps,
        logging_steps=config.logging_steps,
        save_steps=config.save_steps,
        train_batch_size=config.per_device_train_batch_size,
        num_train_epochs=math.ceil(sizes.num_total_batches * sizes.prompts_per_update / dataset),
        is_local_process_zero=parallelism.is_local_main_process,
        is_world_process_zero=parallelism.is_main_process,
    )


def reward_function_metrics(rollout: Any, metrics: Mapping[str, float]) -> dict[str, float]:
    """What the run's reward functions logged with ``log_metric`` while scoring ``rollout`` (this process's
    :class:`marl.rollout.completions.Rollout`), to log with the update's ``metrics`` under the names given:
    each the mean of every value any process logged during the update's rollout, as TRL averages them. Every
    process calls it (it gathers the names and sums). A name that is one of marl's own metrics is an error
    naming it.

    Example:
        >>> metrics = reward_function_metrics(rollout, {"objective/kl": 0.1})  # doctest: +SKIP
    """
    from accelerate.utils import gather_object

    sums = rollout.reward_log.metric_sums() if rollout.reward_log is not None else {}
    logged = logged_metric_means(gather_object([sums]))
    taken = sorted(set(logged) & set(metrics))
    if taken:
        raise DataError(
            f"a reward function logged {taken[0]!r} with log_metric, which is one of marl's own metrics: "
            "give it another name"
        )
    return logged
