"""``RLOOTrainer``: the RLOO loop on one base model with adapter views, on parts built once from the config
(:mod:`marl.train.build`).

One *update* reads top to bottom in :meth:`RLOOTrainer.train`:

1. rollout (:func:`marl.rollout.collect.collect_rollout`, no grad, eval mode): this process's prompts, ``k``
   sampled completions each under the policy, cut after the stop token, their policy and reference log-probs
   where the algorithm reads them (:mod:`marl.algo.scoring_passes`) and their scores;
2. rewards and advantages (:func:`marl.algo.shaping.shape_rewards`): missing-EOS penalty, optional
   normalisation, KL folded into the reward (or the token-level k3 variant), leave-one-out baseline, optional
   normalisation; a completion no reward source judged gets advantage 0, and normalisation statistics span
   all processes;
3. update (:class:`marl.train.update.PolicyUpdate`): PPO-clip epochs of optimizer steps, returning an
   :class:`~marl.algo.metrics.UpdateStats`;
4. metrics (:mod:`marl.algo.metrics`, summed over processes in one collective), sample tables;
5. checkpoint, by updates or by time (:mod:`marl.train.checkpoints`, :mod:`marl.train.run_dir`).

Sampling, scoring and the update each run under :class:`marl.train.phase_guard.PhaseGuard`: measured, and
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
from marl.cpu.allocator import release_freed_memory, use_cpu_allocator
from marl.data.prompts import prompts_for_update
from marl.errors import PhaseMemoryError
from marl.model.multi_adapter import MultiAdapterModel
from marl.rollout.collect import collect_rollout, complete_for_metrics
from marl.rollout.completions import Rollout
from marl.train import checkpoints, run_dir
from marl.train.build import build_training_parts
from marl.train.curves import training_curves_note
from marl.train.phase_guard import PolicySnapshot, guard_for
from marl.train.progress import progress_description, progress_postfix
from marl.train.reward_state import reward_function_metrics, reward_trainer_state
from marl.train.sample_tables import sample_table

# Distinct sampling streams per process: the same seed everywhere would give every process the same noise.
PROCESS_SEED_STRIDE = 100_003


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

    Attributes:
        state: :class:`TrainerState`.
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
    ) -> None:
        if not isinstance(config, RLOOConfig):
            raise TypeError(f"config must be a marl.RLOOConfig, got {type(config).__name__}")
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.eval_dataset = eval_dataset
        self.dataset_source = dict(dataset_source or {})
        parts = build_training_parts(
            config, model, tokenizer, train_dataset, eval_dataset, reward_funcs, judge, callbacks
        )
        self.judge, self.callbacks = parts.judge, parts.callbacks
        self.parallelism, self.accelerator = parts.parallelism, parts.parallelism.accelerator
        self.policy, self.reward = parts.policy, parts.reward
        self.sampler, self.scorer = parts.sampler, parts.scorer
        self.train_prompts, self.eval_prompts = parts.train_prompts, parts.eval_prompts
        self.sizes, self.sample_every = parts.sizes, parts.sample_every
        self.advantage_estimator = parts.advantage_estimator
        self.policy_update = parts.policy_update
        self.policy_parameters = self.policy_update.parameters
        self.optimizer, self.lr_scheduler = self.policy_update.optimizer, self.policy_update.scheduler
        self.state = TrainerState()
        self.log_history: list[dict[str, float]] = []
        self.output_dir = Path(config.output_dir)
        self.save_schedule = checkpoints.SaveSchedule(config.save_steps, config.save_minutes)
        self.fit_record: dict[str, Any] | None = None  # what --fit auto chose (marl.plan.fit), when it ran
        self.phases = guard_for(self)  # measures each phase, and retries it smaller when memory runs out
        if self.parallelism.device.type == "cpu":
            use_cpu_allocator(config.cpu_allocator)

    # ------------------------------------------------------------------ derived counters

    @property
    def episode(self) -> int:
        """Completions trained on so far, over all processes."""
        return self.state.update * self.sizes.batch_size

    @property
    def global_step(self) -> int:
        """Optimizer-step slots so far (a skipped step still advances the LR schedule)."""
        return self.state.update * self.sizes.optimizer_steps_per_update

    # ------------------------------------------------------------------ one update

    def _rollout(self) -> Rollout:
        """This process's prompts of the next update, sampled and scored."""
        self.model.eval()
        config, process = self.config, self.parallelism.process_index
        prompts = prompts_for_update(self.train_prompts, self.state.update, process, self.sizes, config.seed)
        state = reward_trainer_state(self)  # reward functions get it as trainer_state, as under TRL
        return collect_rollout(
            self.sampler, self.scorer, prompts, config.rloo_k, self.reward, state, run_phase=self.phases.run
        )

    def _shaped_rewards(self, rollout: Rollout) -> ShapedRewards:
        """The rollout's rewards and advantages; normalisation statistics span every process's rollout."""
        gather = self.parallelism.gather
        return shape_rollout(self.config, rollout, self.reward.weights, self.advantage_estimator, gather)

    def _update(self, rollout: Rollout, advantages: torch.Tensor) -> UpdateStats:
        """The policy update on ``rollout``; returns this process's sums for the policy metrics."""
        # what the update changes is copied first, so that an update out of memory can start over smaller
        snapshot = PolicySnapshot(self.policy_update, rollout) if self.phases.retry else None
        stats, skipped = self.phases.run(
            "update",
            lambda: self.policy_update.run(rollout, advantages, update=self.state.update + 1),
            restore=None if snapshot is None else snapshot.restore,
        )
        self.state.skipped_optimizer_steps += skipped
        release_freed_memory()  # else the C heap keeps the update's CPU peak through the next rollout
        return stats

    def _update_unless_unjudged(self, rollout: Rollout, shaped: ShapedRewards) -> UpdateStats | None:
        """The update, skipped (and its steps counted) only when no completion of any process was judged;
        completions no reward source judged have advantage 0."""
        if self.parallelism.any_process(bool(shaped.judged.any())):
            return self._update(rollout, shaped.advantages)
        self.skip_unjudged_update()
        return None

    def skip_unjudged_update(self, label: str = "") -> None:
        """Warn that no reward source judged any completion of the next update (``label`` names the policy
        in a sweep) and skip its optimizer steps; the schedule moves on."""
        warnings.warn(
            f"{label}update {self.state.update + 1}: no reward source judged any of its completions; its "
            "optimizer steps are skipped",
            RuntimeWarning,
            stacklevel=4,
        )
        self.state.skipped_optimizer_steps += self.policy_update.skip()

    # ------------------------------------------------------------------ logging

    def _report(
        self, rollout: Rollout, shaped: ShapedRewards, update_stats: UpdateStats | None, start: tuple
    ) -> dict[str, float]:
        """The update's metrics over all processes, with its sample table when one is due; logged every
        ``logging_steps``, at the end and with every judged table, then given to the callbacks."""
        metrics = self._metrics(RolloutStats.of(rollout, shaped, self.config.rloo_k), update_stats, start)
        metrics.update(reward_function_metrics(rollout, metrics))  # what reward functions gave log_metric
        metrics.update(sampler_gap_metrics(rollout, self.parallelism))
        metrics.update(sampler_correction_metrics(rollout, self.policy_update.loss, self.parallelism))
        sample_now = self.sample_every and (self.state.update - 1) % self.sample_every == 0
        metrics.update(sample_table(self, rollout) if sample_now else {})
        judged_now = sample_now and self.judge is not None  # the same on every process
        if (
            judged_now
            or self.state.update % self.config.logging_steps == 0
            or self.state.update == self.sizes.num_total_batches
        ):
            self._log(metrics)
        for callback in self.callbacks:
            callback(self.state, metrics)
        return metrics

    def _metrics(self, rollout_stats: RolloutStats, update_stats: UpdateStats | None, start: tuple) -> dict:
        started_at, started_episode = start
        elapsed = max(time.perf_counter() - started_at, 1e-9)
        metrics = {"eps": (self.episode - started_episode) / elapsed}
        metrics.update(rollout_metrics(self.parallelism.sum_over_processes(rollout_stats), self.reward.names))
        if update_stats is not None:
            metrics.update(update_metrics(self.parallelism.sum_over_processes(update_stats)))
        metrics.update(
            {
                "skipped_optimizer_steps": float(self.state.skipped_optimizer_steps),
                "lr": self.policy_update.last_learning_rate,
                "episode": float(self.episode),
                **self.phases.metrics(),  # this process's measured peaks beside the plan's
            }
        )
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        record = {"update": self.state.update, **metrics}
        self.log_history.append(record)
        self.accelerator.log(metrics, step=self.state.update)
        if self.parallelism.is_main_process:
            run_dir.append_metrics(self.output_dir, record)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_due(self) -> bool:
        """Whether the update just finished ends with a checkpoint (by updates or by time, the main process's
        clock deciding for every process)."""
        parallelism = self.parallelism
        return self.save_schedule.due(
            self.state.update, lambda late: parallelism.any_process(parallelism.is_main_process and late)
        )

    def _save_checkpoint(self) -> None:
        checkpoints.save_checkpoint(
            self.output_dir,
            self.state.update,
            parallelism=self.parallelism,
            model=self.model,
            policy=self.policy,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            trainer_state={
                **dataclasses.asdict(self.state),
                "world_size": self.parallelism.num_processes,
                "batch_size": self.sizes.batch_size,
                "num_total_batches": self.sizes.num_total_batches,
            },
            save_total_limit=self.config.save_total_limit,
        )

    def _checkpoint_before_stopping(
        self, error: PhaseMemoryError, resumed_update: int, update_start: dict[str, Any]
    ) -> None:
        """Save the last completed update (the guard put back the policy's state; ``update_start``: the random
        state it ended with), unless it is saved already or none was done, and name it in ``error``."""
        folder = self.output_dir / run_dir.checkpoint_name(self.state.update)
        if self.state.update > resumed_update and not folder.exists():
            checkpoints.set_rng_state(update_start)
            self._save_checkpoint()
        error.checkpoint = str(folder) if folder.exists() else None

    def _load_checkpoint(self, path: Path) -> None:
        state = checkpoints.load_checkpoint(
            path,
            parallelism=self.parallelism,
            model=self.model,
            policy=self.policy,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            planned=(self.sizes.batch_size, self.sizes.num_total_batches),
        )
        self.sampler.policy_weights_changed()
        self.state = TrainerState(
            **{field.name: state[field.name] for field in dataclasses.fields(TrainerState)}
        )

    def _start_writing(self, plan: run_dir.RunStart, resumed_update: int) -> None:
        """Once the first update is done, and not before: replace what the folder held, then write this run's
        settings and open the trackers. A start that fails or is killed earlier leaves the folder as it
        was."""
        if self.parallelism.is_main_process:
            self.log_history = plan.commit(resumed_update)
            dataset = {
                **self.dataset_source,
                "train_prompts": len(self.train_prompts),
                "eval_prompts": None if self.eval_prompts is None else len(self.eval_prompts),
            }
            settings = run_dir.run_settings(
                self.config, self.model, self.policy, self.parallelism.num_processes, dataset
            )
            run_dir.write_run_config(
                self.output_dir,
                settings | {"rewards": run_dir.reward_record(self.reward), "fit_chosen": self.fit_record},
            )
        if self.config.trackers:
            self.accelerator.init_trackers(run_dir.TRACKER_DIR, config=run_dir.tracker_config(self.config))

    # ------------------------------------------------------------------ the loop

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
        uninterrupted
        run logs (except ``eps`` and the measured peaks: :func:`marl.train.phase_guard.is_measurement`).

        Example:
            >>> history = trainer.train()  # doctest: +SKIP
            >>> history[-1]["objective/scores"]  # doctest: +SKIP
        """
        config, parallelism, sizes = self.config, self.parallelism, self.sizes
        plan = run_dir.plan_start(self.output_dir, resume_from_checkpoint, overwrite=overwrite_output_dir)
        if plan.notice and parallelism.is_main_process:
            print(plan.notice, file=sys.stderr)
        set_seed(config.seed + parallelism.process_index * PROCESS_SEED_STRIDE)
        if plan.checkpoint is not None:
            self._load_checkpoint(plan.checkpoint)
        resumed_update = self.state.update
        self.save_schedule.start()

        start = (time.perf_counter(), self.episode)
        # Closed also when an update fails, so that the error message starts on a line of its own.
        with tqdm(
            total=sizes.num_total_batches,
            initial=self.state.update,
            desc=progress_description(config),
            disable=not parallelism.is_local_main_process,
        ) as progress:
            while self.state.update < sizes.num_total_batches:
                # a run out of memory at its smallest sizes checkpoints the update before with this state
                update_start = checkpoints.rng_state() if self.phases.retry else None
                try:
                    rollout = self._rollout()
                    shaped = self._shaped_rewards(rollout)
                    update_stats = self._update_unless_unjudged(rollout, shaped)
                except PhaseMemoryError as error:
                    self._checkpoint_before_stopping(error, resumed_update, update_start)
                    raise
                shaped = complete_for_metrics(rollout, shaped, self.scorer, config.kl_coef)
                self.state.update += 1
                if self.state.update == resumed_update + 1:
                    self._start_writing(plan, resumed_update)
                metrics = self._report(rollout, shaped, update_stats, start)
                progress.update(1)
                progress.set_postfix(progress_postfix(metrics, self.episode))
                if self.checkpoint_due():
                    self._save_checkpoint()
        if self.state.update == resumed_update:  # resumed from the last checkpoint: nothing left to train
            self._start_writing(plan, resumed_update)

        parallelism.save_policy_adapter(self.model, self.output_dir, self.policy)
        if parallelism.is_main_process:
            summary = self.phases.summary()
            if summary is not None:
                print(summary, file=sys.stderr)
            curves = training_curves_note(
                self.output_dir / run_dir.METRICS_FILE, self.output_dir / run_dir.CURVES_FILE
            )
            print(run_dir.finished_line(self.output_dir, self.policy, curves))
        parallelism.wait()
        parallelism.finish()
        return self.log_history
