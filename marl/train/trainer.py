"""``RLOOTrainer``: the RLOO loop on one base model with adapter views, on parts built once from the config
(:mod:`marl.train.training_parts`), and its reports (metrics, progress bar, sample tables).

The loop, :func:`train_policies`, reads top to bottom; a run is it with one trainer, a sweep
(:class:`marl.train.sweep_trainer.SweepTrainer`) with one per policy. Each update:

1. rollout (:func:`marl.rollout.collect.collect_rollout`, no grad, eval mode): this process's prompts, ``k``
   completions each, cut after the stop token, their log-probs where the algorithm reads them
   (:mod:`marl.algo.scoring_passes`) and their scores;
2. rewards and advantages (:func:`marl.algo.shaping.shape_rewards`; statistics span all processes; a
   completion no reward source judged gets advantage 0);
3. the policy update (:func:`update_policies`): epochs, mini-batches (one optimizer step each), micro-batches
   (one forward and backward per policy each: :meth:`marl.train.training_parts.UpdatePart.backward`);
4. metrics (:mod:`marl.algo.metrics`, summed over processes in one collective), sample tables;
5. checkpoint, by updates or by time (:mod:`marl.train.checkpoints`, :mod:`marl.train.run_dir`).

Sampling, scoring and the update each run under :class:`marl.train.memory_guard.PhaseGuard`: measured, and
retried at half their size when memory runs out.

Leave-one-out groups never span processes: every process samples all ``k`` completions of its own prompts.
Every collective goes through the run's :class:`marl.train.parallel.Parallelism` (``--parallelism``).

Example:
    >>> from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
    >>> config = RLOOConfig(output_dir="runs/rloo", reward_adapter="adapters/my-reward")
    >>> model = MultiAdapterModel.from_config(config)  # doctest: +SKIP
    >>> tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)  # doctest: +SKIP
    >>> trainer = RLOOTrainer(config, model, tokenizer, train_dataset=prompts)  # doctest: +SKIP
    >>> history = trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from marl.algo.metrics import (
    RolloutStats,
    UpdateStats,
    rollout_metrics,
    sampler_correction_metrics,
    sampler_gap_metrics,
    update_metrics,
)
from marl.algo.shaping import ShapedRewards, shape_rollout
from marl.config.rloo_config import RLOOConfig
from marl.cpu.allocator import release_freed_memory, unplanned_allocator, use_cpu_allocator
from marl.data.prompts import prompt_text, prompts_for_update
from marl.model.multi_adapter import MultiAdapterModel
from marl.rollout.collect import collect_rollout, complete_for_metrics
from marl.rollout.completions import Rollout
from marl.rollout.tool_calls import conversation_text
from marl.rollout.toolbox import ToolBox
from marl.train import checkpoints, run_dir
from marl.train.curves import progress_description, progress_postfix, training_curves_note
from marl.train.memory_guard import PhaseGuard, PolicySnapshot, guard_for, restore_all
from marl.train.training_parts import (
    UpdatePart,
    build_training_parts,
    reward_function_metrics,
    reward_trainer_state,
)

# Distinct sampling streams per process: the same seed everywhere would give every process the same noise.
PROCESS_SEED_STRIDE = 100_003
SAMPLE_TABLE_ROWS = 8
# Held-out prompts a judge scores at each sample table: enough for a readable curve, cheap next to an update.
JUDGED_EVAL_ROWS = 32


@dataclass
class TrainerState:
    """What a run has done; saved in every checkpoint. ``update`` counts finished updates, and
    ``skipped_optimizer_steps`` the steps skipped because no reward source judged any completion of the update
    or a loss or gradient was not finite. Episodes and optimizer steps follow from ``update`` (see
    :attr:`RLOOTrainer.episode`)."""

    update: int = 0
    skipped_optimizer_steps: int = 0


class RLOOTrainer:
    """RLOO on a :class:`marl.MultiAdapterModel`: only the policy adapter trains.

    Args:
        config: the run's :class:`marl.RLOOConfig`.
        model: the shared base with its policy (trainable), reference and (optional) reward views.
        tokenizer: the base model's tokenizer.
        train_dataset: prompts, a ``datasets.Dataset`` (or list of dicts) with a ``prompt`` column (text, or a
            conversation as a list of ``{"role", "content"}`` rendered with the chat template) or an
            ``input_ids`` column.
        eval_dataset: optional prompts in the same format; the periodic sample tables use them when given.
        reward_funcs: ``None`` to score with every reward adapter of the model, or one or a list of: reward
            adapter names, reward functions called as TRL calls them (:mod:`marl.rewards.trl_calls`: dataset
            columns among the keywords), :class:`marl.rewards.RewardSource` objects, combined as ``Σ_i w_i ·
            r_i`` with ``config.reward_weights`` (1 each by default); see :mod:`marl.rewards.weighted`.
        judge: optional ``judge(texts) -> scores`` (higher is better, e.g. :func:`marl.rewards.load_judge`)
            that no training signal sees; with ``eval_dataset``, each sample table also scores the first
            ``JUDGED_EVAL_ROWS`` held-out prompts with it and logs ``eval/judge_score`` beside ``eval/score``
            (the reward's mean on them), so that a rise of the reward without a rise of the judge shows.
        callbacks: functions called as ``callback(state, metrics)`` after every update (with the
            :class:`TrainerState` and that update's metrics). On CPU a
            :class:`marl.cpu.threads.FreeCoreThreads` is added unless ``config.threads`` fixes the count.
        dataset_source: where the prompts came from (e.g. ``dataset_name``, ``dataset_train_split``,
            ``prompt_column``), recorded in ``rloo_config.json`` under ``"dataset"`` with the prompt counts;
            ``marl evaluate`` reads it to tell held-out prompts from training prompts.
        tools: functions the policy may call, as TRL's ``GRPOTrainer`` takes them
            (:mod:`marl.rollout.tool_calls`): each completion is decoded turn by turn, the tools' results
            between its turns masked out of the loss and the KL.
        environment_factory: makes one environment per completion (or a dict of factories chosen by the
            ``environment`` column), whose methods are its tools (:mod:`marl.rollout.toolbox`).

    Attributes:
        parts: the :class:`marl.train.training_parts.TrainingParts` the run trains with (the parallelism,
            sampler, scorer, reward, prompts, sizes, and the policy update with its optimizer and schedule).
        state: :class:`TrainerState`.
        phases: the :class:`marl.train.memory_guard.PhaseGuard` each phase runs under.
        log_history: the logged metric dicts, also appended to ``output_dir/metrics.jsonl``.

    Example:
        >>> trainer = RLOOTrainer(RLOOConfig(output_dir="runs/x"), model, tok, prompts)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> trainer.train(resume_from_checkpoint=True)  # from the latest checkpoint  # doctest: +SKIP
    """

    def __init__(
        self,
        config: RLOOConfig,
        model: MultiAdapterModel,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        reward_funcs: Any = None,
        judge: Callable[[list[str]], Any] | None = None,
        callbacks: Sequence[Callable[[TrainerState, dict[str, float]], Any]] = (),
        dataset_source: Mapping[str, Any] | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
    ) -> None:
        if not isinstance(config, RLOOConfig):
            raise TypeError(f"config must be a marl.RLOOConfig, got {type(config).__name__}")
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.eval_dataset = eval_dataset
        self.dataset_source = dict(dataset_source or {})
        box = ToolBox(tools or (), environment_factory) if tools or environment_factory else None
        self.parts = build_training_parts(
            config, model, tokenizer, train_dataset, eval_dataset, reward_funcs, judge, callbacks, box
        )
        self.state = TrainerState()
        self.log_history: list[dict[str, float]] = []
        self.output_dir = Path(config.output_dir)
        self.save_schedule = checkpoints.SaveSchedule(config.save_steps, config.save_minutes)
        self.fit_record: dict[str, Any] | None = None  # what --fit auto chose (marl.plan.fit), when it ran
        self.phases = guard_for(self.parts, model, [config])  # measured; retried smaller when out of memory
        if self.parts.parallelism.device.type == "cpu":
            use_cpu_allocator(config.cpu_allocator)

    @property
    def episode(self) -> int:
        """Completions trained on so far, over all processes."""
        return self.state.update * self.parts.sizes.batch_size

    @property
    def global_step(self) -> int:
        """Optimizer-step slots so far (a skipped step still advances the LR schedule)."""
        return self.state.update * self.parts.sizes.optimizer_steps_per_update

    def train(
        self,
        resume_from_checkpoint: str | os.PathLike | bool | None = None,
        overwrite_output_dir: bool = False,
    ) -> list[dict[str, float]]:
        """Run RLOO until ``num_total_batches`` updates are done; returns the logged metric dicts.

        ``resume_from_checkpoint``: a ``checkpoint-N`` folder, or ``True`` for the latest in ``output_dir``
        (with none yet, the run starts from the beginning). ``overwrite_output_dir``: replace the run in
        ``output_dir``. Nothing in ``output_dir`` changes before the first update is done (see
        :mod:`marl.train.run_dir`). On CPU with a fixed seed a resumed run logs exactly the metrics an
        uninterrupted run logs (except ``eps`` and the measured peaks:
        :func:`marl.train.memory_guard.is_measurement`).

        Example:
            >>> history = trainer.train()  # doctest: +SKIP
            >>> history[-1]["objective/scores"]  # doctest: +SKIP
        """
        parallelism = self.parts.parallelism
        plan = run_dir.plan_start(self.output_dir, resume_from_checkpoint, overwrite=overwrite_output_dir)
        if plan.notice and parallelism.is_main_process:
            print(plan.notice, file=sys.stderr)
        train_policies([self], [plan], lambda: [self.rollout()])
        if parallelism.is_main_process:
            cpu = parallelism.device.type == "cpu"
            summary = self.phases.summary(unplanned_allocator(self.config.cpu_allocator) if cpu else None)
            if summary is not None:
                print(summary, file=sys.stderr)
            curves = training_curves_note(
                self.output_dir / run_dir.METRICS_FILE, self.output_dir / run_dir.CURVES_FILE
            )
            print(run_dir.finished_line(self.output_dir, self.parts.policy, curves))
        parallelism.wait()
        parallelism.finish()
        return self.log_history

    # ------------------------------------------------------------------ the steps of an update

    def rollout(self) -> Rollout:
        """This process's prompts of the next update, sampled and scored."""
        parts, process = self.parts, self.parts.parallelism.process_index
        self.model.eval()
        prompts = prompts_for_update(
            parts.train_prompts, self.state.update, process, parts.sizes, self.config.seed
        )
        return collect_rollout(
            parts.sampler,
            parts.scorer,
            prompts,
            self.config.rloo_k,
            parts.reward,
            reward_trainer_state(self),  # reward functions get it as trainer_state, as under TRL
            run_phase=self.phases.run,
            tool_calling=parts.tool_calling,
        )

    def shaped_rewards(self, rollout: Rollout) -> ShapedRewards:
        """The rollout's rewards and advantages; normalisation statistics span every process's rollout."""
        parts = self.parts
        return shape_rollout(
            self.config, rollout, parts.reward.weights, parts.advantage_estimator, parts.parallelism.gather
        )

    def update_part(self, rollout: Rollout, shaped: ShapedRewards, label: str = "") -> UpdatePart | None:
        """This policy's share of the update, or ``None`` (its steps skipped, with a warning; the schedule
        moves on) when no completion of any process was judged: those have advantage 0."""
        if self.parts.parallelism.any_process(bool(shaped.judged.any())):
            return UpdatePart(self.parts.policy_update, rollout, shaped.advantages, label)
        warnings.warn(
            f"{label}update {self.state.update + 1}: no reward source judged any of its completions; its "
            "optimizer steps are skipped",
            RuntimeWarning,
            stacklevel=3,
        )
        self.state.skipped_optimizer_steps += self.parts.policy_update.skip()
        return None

    def report(
        self, rollout: Rollout, shaped: ShapedRewards, stats: UpdateStats | None, start: tuple
    ) -> dict:
        """The update's metrics over all processes, with its sample table when one is due; logged every
        ``logging_steps``, at the end and with every judged table, then given to the callbacks."""
        parts, config, update = self.parts, self.config, self.state.update
        started_at, started_episode = start
        metrics = {"eps": (self.episode - started_episode) / max(time.perf_counter() - started_at, 1e-9)}
        rollout_stats = RolloutStats.of(rollout, shaped, config.rloo_k)
        metrics.update(
            rollout_metrics(parts.parallelism.sum_over_processes(rollout_stats), parts.reward.names)
        )
        if stats is not None:
            metrics.update(update_metrics(parts.parallelism.sum_over_processes(stats)))
        metrics.update(
            {
                "skipped_optimizer_steps": float(self.state.skipped_optimizer_steps),
                "lr": parts.policy_update.last_learning_rate,
                "episode": float(self.episode),
                **self.phases.metrics(),  # this process's measured peaks beside the plan's
            }
        )
        metrics.update(reward_function_metrics(rollout, metrics))  # what reward functions gave log_metric
        metrics.update(sampler_gap_metrics(rollout, parts.parallelism))
        metrics.update(sampler_correction_metrics(rollout, parts.policy_update.loss, parts.parallelism))
        sample_now = parts.sample_every and (update - 1) % parts.sample_every == 0
        metrics.update(sample_table(self, rollout) if sample_now else {})
        judged_now = sample_now and parts.judge is not None  # the same on every process
        if judged_now or update % config.logging_steps == 0 or update == parts.sizes.num_total_batches:
            record = {"update": update, **metrics}
            self.log_history.append(record)
            parts.parallelism.accelerator.log(metrics, step=update)
            if parts.parallelism.is_main_process:
                run_dir.append_metrics(self.output_dir, record)
        for callback in parts.callbacks:
            callback(self.state, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_due(self) -> bool:
        """Whether the update just finished ends with a checkpoint (by updates or by time, the main process's
        clock deciding for every process)."""
        parallelism = self.parts.parallelism
        return self.save_schedule.due(
            self.state.update, lambda late: parallelism.any_process(parallelism.is_main_process and late)
        )

    def save_checkpoint(self) -> None:
        """Save the run after its latest update into ``output_dir/checkpoint-N``."""
        parts = self.parts
        checkpoints.save_checkpoint(
            self.output_dir,
            self.state.update,
            parallelism=parts.parallelism,
            model=self.model,
            policy=parts.policy,
            optimizer=parts.policy_update.optimizer,
            scheduler=parts.policy_update.scheduler,
            trainer_state={
                **dataclasses.asdict(self.state),
                "world_size": parts.parallelism.num_processes,
                "batch_size": parts.sizes.batch_size,
                "num_total_batches": parts.sizes.num_total_batches,
            },
            save_total_limit=self.config.save_total_limit,
        )

    def checkpoint_before_stopping(self, resumed: int) -> str:
        """After an error stopped the update in progress, with the state put back as it was at its start:
        save the last completed update unless it is saved already or none was done; returns a sentence
        saying where it is."""
        done, folder = self.state.update, self.output_dir / run_dir.checkpoint_name(self.state.update)
        if done > resumed and not folder.exists():
            self.save_checkpoint()
        if folder.exists():
            return f"Update {done} is saved in {folder}: --resume_from_checkpoint latest resumes from it."
        return "No update was completed, so nothing was saved."

    def load_checkpoint(self, path: Path) -> None:
        """Continue from the ``checkpoint-N`` folder ``path``: the policy, optimizer, schedule and state."""
        parts = self.parts
        state = checkpoints.load_checkpoint(
            path,
            parallelism=parts.parallelism,
            model=self.model,
            policy=parts.policy,
            optimizer=parts.policy_update.optimizer,
            scheduler=parts.policy_update.scheduler,
            planned=(parts.sizes.batch_size, parts.sizes.num_total_batches),
        )
        parts.sampler.policy_weights_changed()
        self.state = TrainerState(
            **{field.name: state[field.name] for field in dataclasses.fields(TrainerState)}
        )

    def write_settings(self, changes: Sequence[str]) -> None:
        """Write ``rloo_config.json``: the settings in force, and the sizes the guard halved (``changes``)."""
        parts = self.parts
        dataset = {
            **self.dataset_source,
            "train_prompts": len(parts.train_prompts),
            "eval_prompts": None if parts.eval_prompts is None else len(parts.eval_prompts),
        }
        settings = run_dir.run_settings(
            self.config, self.model, parts.policy, parts.parallelism.num_processes, dataset
        )
        record = {"rewards": run_dir.reward_record(parts.reward), "fit_chosen": self.fit_record}
        run_dir.write_run_config(self.output_dir, settings | record | {run_dir.RETRIED_KEY: list(changes)})

    def start_writing(self, plan: run_dir.RunStart, resumed: int, changes: Sequence[str] = ()) -> None:
        """Once the first update is done, and not before: replace what the folder held, then write this run's
        settings and open the trackers. A start that fails or is killed earlier leaves the folder as it
        was."""
        parts = self.parts
        if parts.parallelism.is_main_process:
            self.log_history = plan.commit(resumed)
            self.write_settings(changes)
        if self.config.trackers:
            parts.parallelism.accelerator.init_trackers(
                run_dir.TRACKER_DIR, config=run_dir.tracker_config(self.config)
            )


# ---------------------------------------------------------------------- the loop


def train_policies(
    trainers: Sequence[RLOOTrainer],
    plans: Sequence[run_dir.RunStart],
    rollouts: Callable[[], list[Rollout]],
    labels: Sequence[str] | None = None,
) -> None:
    """The RLOO loop: train every one of ``trainers`` (one run, or a sweep's policies on one base) from its
    ``plans`` start until ``num_total_batches`` updates are done, then save each policy adapter.

    ``rollouts()`` samples and scores the next update's rollout of every trainer (a run's
    :meth:`RLOOTrainer.rollout`, a sweep's joint one); ``labels`` prefix each policy's warnings. The first
    trainer's seed seeds the process and its guard runs every phase; each trainer keeps its own advantages,
    optimizer, metrics and checkpoints, saved together after the same update."""
    first, labels = trainers[0], labels or [""] * len(trainers)
    parallelism, sizes, guard = first.parts.parallelism, first.parts.sizes, first.phases
    set_seed(first.config.seed + parallelism.process_index * PROCESS_SEED_STRIDE)
    for trainer, plan in zip(trainers, plans, strict=True):
        if plan.checkpoint is not None:
            trainer.load_checkpoint(plan.checkpoint)
    resumed = first.state.update
    retried = resumed and run_dir.resume_retried_micro_batch(first.output_dir, [t.config for t in trainers])
    if retried:  # resumed at the micro-batch the run it resumes went on at
        guard.changes.append(f"out of memory in update: {retried[0]} -> {retried[1]}, kept for the rest")
        guard.planned = guard.replan() if guard.replan is not None else guard.planned
        if parallelism.is_main_process:
            print(
                f"marl: resuming with {retried[1]}, as the run went on after running out of memory",
                file=sys.stderr,
            )
    recorded = len(guard.changes)
    first.save_schedule.start()
    start = (time.perf_counter(), first.episode)
    title = progress_description(first.config)
    # Closed also when an update fails, so that the error message starts on a line of its own.
    with tqdm(
        total=sizes.num_total_batches,
        initial=resumed,
        desc=title if len(trainers) == 1 else f"{len(trainers)} policies: {title}",
        disable=not parallelism.is_local_main_process,
    ) as progress:
        while first.state.update < sizes.num_total_batches:
            start_of_update = checkpoints.UpdateStart.of(trainers)  # the update before is saved from it
            try:
                # 1. rollout: every policy's prompts, sampled and scored
                rolled = rollouts()
                # 2. rewards and advantages, each policy with its own settings
                shaped = [
                    trainer.shaped_rewards(rollout) for trainer, rollout in zip(trainers, rolled, strict=True)
                ]
                # 3. the policy update of every policy some reward source judged
                parts = [
                    trainer.update_part(rollout, own, label)
                    for trainer, rollout, own, label in zip(trainers, rolled, shaped, labels, strict=True)
                ]
                judged = [part for part in parts if part is not None]
                update = first.state.update + 1
                done = iter(update_policies(judged, guard, update, start_of_update) if judged else [])
                release_freed_memory()  # else the C heap keeps the update's CPU peak through the next rollout
            except BaseException as error:  # Ctrl-C too: every policy's last completed update is saved first
                checkpoints.stop_with_checkpoints(trainers, start_of_update, resumed, error)
                raise
            # 4. metrics, sample tables, callbacks: each policy's own
            metrics = []
            for trainer, plan, rollout, own, part in zip(trainers, plans, rolled, shaped, parts, strict=True):
                stats, skipped = next(done) if part is not None else (None, 0)
                trainer.state.skipped_optimizer_steps += skipped
                own = complete_for_metrics(rollout, own, trainer.parts.scorer, trainer.config.kl_coef)
                trainer.state.update += 1
                if trainer.state.update == resumed + 1:
                    trainer.start_writing(plan, resumed, guard.changes)
                elif len(guard.changes) > recorded and parallelism.is_main_process:  # retried smaller
                    trainer.write_settings(guard.changes)
                metrics.append(trainer.report(rollout, own, stats, start))
            recorded = len(guard.changes)
            progress.update(1)
            progress.set_postfix(progress_postfix(metrics, first.episode))
            # 5. checkpoint: every policy at the same update
            if first.checkpoint_due():
                for trainer in trainers:
                    trainer.save_checkpoint()
    if first.state.update == resumed:  # resumed from the last checkpoint: nothing left to train
        for trainer, plan in zip(trainers, plans, strict=True):
            trainer.start_writing(plan, resumed, guard.changes)
    for trainer in trainers:
        trainer.parts.parallelism.save_policy_adapter(trainer.model, trainer.output_dir, trainer.parts.policy)


def update_policies(
    parts: Sequence[UpdatePart],
    guard: PhaseGuard,
    update: int,
    update_start: checkpoints.UpdateStart | None = None,
) -> list[tuple[UpdateStats, int]]:
    """PPO-clip epochs over every part's rollout (the ``update``-th, for warnings), under ``guard``'s
    ``"update"`` phase; returns each part's sums for the policy metrics and how many of its optimizer steps
    were skipped. Each part keeps its own rows, row order (its own ``randperm`` draws, in the order of the
    parts), loss settings, finiteness check and optimizer step; the epochs, mini-batches and micro-batches are
    the same for every part (a sweep refuses batch settings that differ, :mod:`marl.config.sweep`). The model
    is left in eval mode, also when a step fails. ``update_start`` learns whether a step began and gets the
    copies that can undo it."""
    first = parts[0].step
    config, sizes = first.config, first.sizes
    # what the update changes is copied first, so that an update out of memory can start over smaller
    snapshots = [PolicySnapshot(part.step, part.rollout) for part in parts] if guard.retry else []
    if update_start is not None:
        update_start.snapshots = snapshots
    # With several policies on CPU the C heap is trimmed after each policy's micro-batch, else it keeps every
    # policy's freed blocks (benchmarks/results/2026-11-26-sweep-cpu-long4-shared.md); a run reuses its heap.
    release_between_parts = len(parts) > 1 and parts[0].rollout.response_ids.device.type == "cpu"
    first.model.train()
    try:
        for attempt in guard.attempts("update", restore=lambda: restore_all(snapshots)):
            with attempt:
                micro_rows = config.per_device_train_batch_size  # the guard halves it after out of memory
                for part in parts:
                    part.prepare(update)
                # 3a. epochs: each a new random order of every part's rows
                for _epoch in range(config.num_ppo_epochs):
                    orders = [part.step.shuffled_rows(part.rollout) for part in parts]
                    # 3b. mini-batches: one optimizer step each
                    for start in range(0, sizes.local_batch_size, sizes.local_mini_batch_size):
                        minis = [order[start : start + sizes.local_mini_batch_size] for order in orders]
                        tokens = [
                            part.step.tokens_per_micro_batch(part.mask[rows])
                            for part, rows in zip(parts, minis, strict=True)
                        ]
                        finite = [True] * len(parts)
                        # 3c. micro-batches: gradients accumulated, one forward and backward per part each
                        for micro in range(0, len(minis[0]), micro_rows):
                            for index, part in enumerate(parts):
                                rows = minis[index][micro : micro + micro_rows]
                                finite[index] = part.backward(rows, tokens[index]) and finite[index]
                                if release_between_parts:
                                    release_freed_memory()
                        # 3d. every part's optimizer step (skipped where a loss or gradient is not finite)
                        if update_start is not None:
                            update_start.stepped = True
                        for part, loss_finite in zip(parts, finite, strict=True):
                            if part.step.optimizer_step(loss_finite):
                                part.skipped += 1
                                warnings.warn(
                                    f"{part.label}update {update}: non-finite loss or gradient; step skipped",
                                    RuntimeWarning,
                                    stacklevel=2,
                                )
    finally:
        first.model.eval()
    return [(part.stats, part.skipped) for part in parts]


# ---------------------------------------------------------------------- reports


def sample_table(trainer: RLOOTrainer, rollout: Rollout) -> dict[str, float]:
    """Save a table of sample completions, every ``num_sample_generations``-th of the run: of held-out prompts
    when given (sampled without disturbing the training RNG), scored by the reward and, with a judge, by the
    judge; else of this rollout. Returns the held-out means to log (``eval/score``, ``eval/judge_score``; none
    without a judge). With a sharded base every process samples with the main one (each forward pass gathers
    the layers)."""
    parts = trainer.parts
    parallelism, eval_prompts = parts.parallelism, parts.eval_prompts
    if not parallelism.is_main_process and not (parallelism.shards_base and eval_prompts is not None):
        return {}
    held_out = {}
    if eval_prompts is not None:
        rows = JUDGED_EVAL_ROWS if parts.judge is not None else SAMPLE_TABLE_ROWS
        devices = [parallelism.device] if parallelism.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if parts.tool_calling is not None:
                samples = parts.tool_calling.rollout(parts.sampler, eval_prompts[:rows], 1)
            else:
                samples = parts.sampler.sample(parts.sampler.batch(eval_prompts[:rows]), k=1)
        with torch.no_grad(), parallelism.autocast():
            batch = parts.scorer.scoring_batch(samples, reward_trainer_state(trainer))
            scores, extra = parts.reward.score(batch).total.tolist(), batch.reward_log.extra
        if not parallelism.is_main_process:
            return {}
        if parts.judge is not None:
            # as `marl evaluate` judges: a conversation's last message, not the chat template's text
            texts = [
                (
                    prompt_text(row["prompt"])
                    if "prompt" in (row := trainer.eval_dataset[index])
                    else eval_prompts[index].text
                )
                + completion
                for index, completion in enumerate(samples.completions)
            ]
            held_out = {
                "eval/score": float(torch.tensor(scores).nanmean()),
                "eval/judge_score": sum(parts.judge(texts)) / len(texts),
            }
    else:
        samples, scores = rollout, rollout.scores.tolist()
        extra = rollout.reward_log.extra if rollout.reward_log is not None else {}
    # with tools, each completion's turns and tool results after its question (not the tools' descriptions)
    completions = [conversation_text(turns) for turns in samples.turns] or samples.completions
    prompts = [prompt_text(m) for m in samples.prompt_messages] if samples.turns else samples.prompt_texts
    rows = run_dir.sample_rows(prompts, completions, scores, extra)[:SAMPLE_TABLE_ROWS]
    run_dir.write_sample_table(trainer.output_dir, trainer.state.update, rows)
    return held_out
