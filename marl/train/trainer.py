"""``RLOOTrainer``: the RLOO rollout-and-update loop on one base model with adapter views.

One *update* reads top to bottom in :meth:`RLOOTrainer.train`:

1. rollout (:func:`marl.rollout.collect.collect_rollout`, no grad, eval mode): this process's prompts, ``k``
sampled
   completions each under the policy, cut after the stop token, their policy and reference log-probs and
   their scores;
2. rewards and advantages (:func:`marl.algo.shaping.shape_rewards`): missing-EOS penalty, optional
normalisation, KL
   folded into the reward (or the token-level k3 variant), leave-one-out baseline, optional normalisation; a
   completion no reward source judged gets advantage 0, and normalisation statistics span all processes;
3. update: ``num_ppo_epochs`` × ``num_mini_batches`` optimizer steps, each accumulating micro-batches of
   ``per_device_train_batch_size`` completions, PPO-clip on the sequence ratio, gradient clipping, LR
   schedule, returning an :class:`~marl.algo.metrics.UpdateStats`;
4. metrics (:mod:`marl.algo.metrics`, summed over processes in one collective), sample tables, checkpoints
   (:mod:`marl.train.run_dir`, :mod:`marl.train.checkpoints`).

Leave-one-out groups never span processes: every process samples all ``k`` completions of its own prompts.
Gradients of the policy adapter are averaged over processes before each optimizer step, in one collective.

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
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from tqdm.auto import tqdm
from transformers import get_scheduler

from marl.algo.advantages import get_advantage_estimator
from marl.algo.losses import clipped_policy_loss, token_level_k3_kl
from marl.algo.metrics import RolloutStats, UpdateStats, rollout_metrics, sum_over_processes, update_metrics
from marl.algo.shaping import ShapedRewards, shape_rewards
from marl.algo.tensors import masked_sum
from marl.config import RLOOConfig
from marl.cpu_threads import apply_threads
from marl.data.prompts import prompt_text
from marl.errors import ConfigError
from marl.model.multi_adapter import MultiAdapterModel
from marl.rewards import CheckedJudge, build_rewards
from marl.rollout.collect import collect_rollout
from marl.rollout.prompts import prepare_prompts, prompts_for_update
from marl.rollout.records import Rollout
from marl.rollout.samplers import SamplerSettings, get_sampler
from marl.rollout.scoring import Scorer
from marl.train import checkpoints, run_dir
from marl.train import parallel as distributed
from marl.train.plotting import plot_training_curves

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
            adapter names, functions ``f(prompts, completions)`` returning one number (or ``None``) per
            completion, :class:`marl.rewards.RewardSource` objects. They are combined as
            ``Σ_i w_i · r_i`` with ``config.reward_weights`` (1 each by default); see
            :mod:`marl.rewards.weighted`.
        judge: optional ``judge(texts) -> scores`` (higher is better, e.g.
        :func:`marl.rewards.load_judge`)
            that no training signal sees; with ``eval_dataset``, each sample table also scores the first
            ``JUDGED_EVAL_ROWS`` held-out prompts with it and logs ``eval/judge_score`` beside ``eval/score``
            (the reward's mean on them), so that a rise of the reward without a rise of the judge shows.
        callbacks: functions called as ``callback(state, metrics)`` after every update (with the
            :class:`TrainerState` and that update's metrics). On CPU a
            :class:`marl.cpu_threads.FreeCoreThreads` is added unless ``config.threads`` fixes the count.
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
        self.judge = (
            judge if judge is None or isinstance(judge, CheckedJudge) else CheckedJudge(judge, "judge")
        )
        # On CPU torch's threads follow the free cores by default (config.threads), after every update.
        governor = apply_threads(config.threads, model.device.type)
        self.callbacks = [*callbacks, *([governor] if governor is not None else [])]
        self.dataset_source = dict(dataset_source or {})
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.policy = model.get_policy(config.policy_adapter_name).name
        self.reward = build_rewards(
            model, reward_funcs, config.reward_weights, config.local_rollout_forward_batch_size
        )

        # accelerate keeps one process-wide state whose mixed precision cannot change once set: a trainer that
        # ran before in this process (TRL's RewardTrainer in bf16, another RLOO run) would make this one fail.
        # Like transformers' own trainers, start a fresh state; the process group (PartialState) is kept.
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(
            # a model on the CPU trains on the CPU (also under torchrun, where accelerate would otherwise
            # ignore the launcher on machines without a GPU)
            cpu=model.device.type == "cpu",
            mixed_precision=config.mixed_precision,
            log_with=config.trackers or None,
            project_dir=config.output_dir,
            step_scheduler_with_optimizer=False,
        )
        self._check_devices()
        self.sampler = get_sampler(config.sampler)(
            model,
            tokenizer,
            SamplerSettings(
                temperature=config.temperature,
                response_length=config.response_length,
                stop_at_eos=config.stop_token == "eos",
                stop_token_id=config.stop_token_id,
                rows_per_pass=config.local_rollout_forward_batch_size,
                autocast=self.accelerator.autocast,
                policy=self.policy,
            ),
        )
        self.scorer = Scorer(
            model,
            tokenizer,
            temperature=config.temperature,
            rows_per_pass=config.local_rollout_forward_batch_size,
            autocast=self.accelerator.autocast,
            policy=self.policy,
            share_prompt_prefix=config.share_prompt_prefix,
        )
        # Micro-batches of whole prompt groups let the update compute each prompt once too (when packing is
        # on). The data order depends only on the batch sizes, never on whether the packing probe passed: a
        # run resumed on other hardware (another dtype) sees the same rows in the same micro-batches.
        self.grouped_micro_batches = config.per_device_train_batch_size % config.rloo_k == 0
        context = getattr(model.config, "max_position_embeddings", None)
        prompts = dict(context_length=context, response_length=config.response_length)
        self.train_prompts = prepare_prompts(train_dataset, tokenizer, "train_dataset", **prompts)
        self.eval_dataset = eval_dataset
        self.eval_prompts = (
            None
            if eval_dataset is None
            else prepare_prompts(eval_dataset, tokenizer, "eval_dataset", **prompts)
        )

        self.sizes = config.batch_sizes(self.accelerator.num_processes, len(self.train_prompts))
        self.sample_every = (
            max(1, self.sizes.num_total_batches // config.num_sample_generations)
            if config.num_sample_generations > 0
            else 0
        )
        if config.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        self.policy_parameters = model.policy_parameters(self.policy)
        distributed.broadcast_from_main(self.policy_parameters, self.accelerator)

        optimizer = torch.optim.AdamW(
            self.policy_parameters, lr=config.learning_rate, weight_decay=config.weight_decay
        )
        total_steps = self.sizes.total_optimizer_steps
        # warmup_steps counts updates, as in TRL's RLOO trainer; the schedule itself steps per optimizer step.
        warmup = config.warmup_steps * self.sizes.optimizer_steps_per_update or math.ceil(
            config.warmup_ratio * total_steps
        )
        scheduler = get_scheduler(
            config.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps
        )
        self.optimizer, self.lr_scheduler = self.accelerator.prepare(optimizer, scheduler)
        self.last_learning_rate = float(self.lr_scheduler.get_last_lr()[0])

        self.state = TrainerState()
        self.log_history: list[dict[str, float]] = []
        self.output_dir = Path(config.output_dir)

    # ------------------------------------------------------------------ derived counters

    @property
    def episode(self) -> int:
        """Completions trained on so far, over all processes."""
        return self.state.update * self.sizes.batch_size

    @property
    def global_step(self) -> int:
        """Optimizer-step slots so far (a skipped step still advances the LR schedule)."""
        return self.state.update * self.sizes.optimizer_steps_per_update

    # ------------------------------------------------------------------ setup

    def _check_devices(self) -> None:
        model_device, process_device = self.model.device, self.accelerator.device
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        if not same_device(model_device, process_device, current_cuda_index=current):
            raise ConfigError(
                f"the model is on {model_device} but this process trains on {process_device}. Load it there: "
                "MultiAdapterModel.from_pretrained(..., device_map={'': Accelerator().device}) (with "
                "accelerate "
                "launch every process needs its own copy on its own device)"
            )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.accelerator.num_processes:
            raise RuntimeError(
                f"launched as {launched} processes but accelerate runs {self.accelerator.num_processes}: an "
                "accelerate state was created earlier for another device. On CPU, launch with `torchrun "
                "--nproc_per_node N ...` and create PartialState(cpu=True) before loading the model"
            )

    # ------------------------------------------------------------------ update

    def _update(self, rollout: Rollout, advantages: torch.Tensor) -> UpdateStats:
        """PPO-clip epochs over the rollout; returns this process's sums for the policy metrics."""
        config, sizes = self.config, self.sizes
        reuse_samples = config.num_ppo_epochs > 1 or config.num_mini_batches > 1
        old_seq_logprob = masked_sum(rollout.logprobs, rollout.response_mask)
        stats = UpdateStats()
        self.model.train()
        try:
            for _epoch in range(config.num_ppo_epochs):
                order = self._shuffled_rows(rollout)
                for mini_start in range(0, sizes.local_batch_size, sizes.local_mini_batch_size):
                    mini_batch = order[mini_start : mini_start + sizes.local_mini_batch_size]
                    loss_finite = True
                    for micro_start in range(
                        0, sizes.local_mini_batch_size, config.per_device_train_batch_size
                    ):
                        rows = mini_batch[micro_start : micro_start + config.per_device_train_batch_size]
                        batch = rollout.select(rows)
                        # whole prompt groups: each prompt is computed once, its k gradients flow into it
                        packed = self.scorer.pack(batch) if self.grouped_micro_batches else None
                        with self.model.policy(self.policy), self.accelerator.autocast():
                            new_logprobs, entropy = self.scorer.completion_logprobs(
                                batch, packed, with_entropy=True
                            )
                        new_seq_logprob = masked_sum(new_logprobs, batch.response_mask)
                        # One epoch, one mini-batch: plain REINFORCE, the ratio is exactly 1 by construction.
                        old = old_seq_logprob[rows] if reuse_samples else new_seq_logprob.detach()
                        policy = clipped_policy_loss(new_seq_logprob, old, advantages[rows], config.cliprange)
                        loss = policy.loss
                        if config.token_level_kl:
                            k3 = token_level_k3_kl(new_logprobs, batch.ref_logprobs, batch.response_mask)
                            loss = loss + config.kl_coef * k3.sum(dim=1).mean()
                        if torch.isfinite(loss):
                            self.accelerator.backward(loss / config.gradient_accumulation_steps)
                        else:
                            loss_finite = False
                        with torch.no_grad():
                            stats.add(policy, entropy, batch.response_mask)
                    if self._optimizer_step(loss_finite):
                        warnings.warn(
                            f"update {self.state.update + 1}: non-finite loss or gradient; step skipped",
                            RuntimeWarning,
                            stacklevel=2,
                        )
        finally:
            self.model.eval()
        return stats

    def _shuffled_rows(self, rollout: Rollout) -> torch.Tensor:
        """A random order of the rollout's rows: whole prompt groups in a random order when micro-batches
        hold whole groups (so a prompt can be computed once for its k completions), else single rows. The
        same whether prefix sharing is on or off."""
        if not self.grouped_micro_batches:
            return torch.randperm(rollout.prompt_index.shape[0]).to(self.accelerator.device)
        groups = torch.randperm(int(rollout.prompt_index.max()) + 1).to(self.accelerator.device)
        return torch.cat([torch.nonzero(rollout.prompt_index == group).flatten() for group in groups])

    def _rollout_and_update(self) -> tuple[Rollout, ShapedRewards, UpdateStats | None]:
        """One update: the rollout, its shaped rewards, and the optimisation. Completions no reward source
        judged get advantage 0; the optimisation is skipped (and counted) only when no completion of any
        process was judged."""
        config = self.config
        self.model.eval()
        prompts = prompts_for_update(
            self.train_prompts, self.state.update, self.accelerator.process_index, self.sizes, config.seed
        )
        rollout = collect_rollout(self.sampler, self.scorer, prompts, config.rloo_k, self.reward)
        shaped = self._shaped_rewards(rollout)
        if distributed.any_process(bool(shaped.judged.any()), self.accelerator):
            return rollout, shaped, self._update(rollout, shaped.advantages)
        warnings.warn(
            f"update {self.state.update + 1}: no reward source judged any of its completions; its optimizer "
            "steps are skipped",
            RuntimeWarning,
            stacklevel=3,
        )
        self._skip_update()
        return rollout, shaped, None

    def _shaped_rewards(self, rollout: Rollout) -> ShapedRewards:
        """The rollout's rewards and advantages; normalisation statistics span every process's rollout."""
        config = self.config
        return shape_rewards(
            rollout.scores,
            rollout.logprobs,
            rollout.ref_logprobs,
            rollout.response_mask,
            rollout.contains_stop,
            k=config.rloo_k,
            kl_coef=config.kl_coef,
            missing_eos_penalty=config.missing_eos_penalty,
            normalize_reward=config.normalize_reward,
            reward_clip_range=config.reward_clip_range,
            token_level_kl=config.token_level_kl,
            normalize_advantage=config.normalize_advantage,
            gather=self.accelerator.gather,
            estimator=get_advantage_estimator(config.advantage_estimator),
        )

    def _optimizer_step(self, loss_finite: bool) -> bool:
        """Average gradients, clip, step; skip (and count) the step if anything is not finite."""
        distributed.average_gradients(self.policy_parameters, self.accelerator)
        skip = distributed.any_process(not loss_finite, self.accelerator)
        if not skip:
            max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
            grad_norm = self.accelerator.clip_grad_norm_(self.policy_parameters, max_norm)
            # With fp16 the loss scaler handles overflowing gradients itself (and lowers its scale).
            skip = self.accelerator.scaler is None and not torch.isfinite(torch.as_tensor(grad_norm)).item()
        if not skip:
            self.optimizer.step()
            # fp16: the loss scaler skips a step whose gradients overflowed.
            skip = self.optimizer.step_was_skipped
            if not skip:
                self.sampler.policy_weights_changed()
        self._advance_schedule()
        self.optimizer.zero_grad(set_to_none=True)
        if skip:
            self.state.skipped_optimizer_steps += 1
        return skip

    def _advance_schedule(self) -> None:
        # `lr` logs the rate the step just taken used, read before the schedule moves on.
        self.last_learning_rate = float(self.lr_scheduler.get_last_lr()[0])
        self.lr_scheduler.step()

    def _skip_update(self) -> None:
        """Count the steps of an update without a judged completion as skipped; the schedule moves on."""
        for _ in range(self.sizes.optimizer_steps_per_update):
            self._advance_schedule()
            self.state.skipped_optimizer_steps += 1

    # ------------------------------------------------------------------ logging

    def _metrics(self, rollout_stats: RolloutStats, update_stats: UpdateStats | None, start: tuple) -> dict:
        started_at, started_episode = start
        elapsed = max(time.perf_counter() - started_at, 1e-9)
        metrics = {"eps": (self.episode - started_episode) / elapsed}
        metrics.update(
            rollout_metrics(sum_over_processes(rollout_stats, self.accelerator), self.reward.names)
        )
        if update_stats is not None:
            metrics.update(update_metrics(sum_over_processes(update_stats, self.accelerator)))
        metrics.update(
            {
                "skipped_optimizer_steps": float(self.state.skipped_optimizer_steps),
                "lr": self.last_learning_rate,
                "episode": float(self.episode),
            }
        )
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        record = {"update": self.state.update, **metrics}
        self.log_history.append(record)
        self.accelerator.log(metrics, step=self.state.update)
        if self.accelerator.is_main_process:
            run_dir.append_metrics(self.output_dir, record)

    def _judged_prompt_text(self, index: int) -> str:
        """What `marl evaluate` gives its judge of a held-out prompt: a conversation's last message, not the
        chat template's rendering."""
        row = self.eval_dataset[index]
        return prompt_text(row["prompt"]) if "prompt" in row else self.eval_prompts[index].text

    def _sample_table(self, rollout: Rollout) -> dict[str, float]:
        """Save a table of sample completions: of held-out prompts when given (sampled without disturbing the
        training RNG), else of this rollout. Returns the held-out means to log (none without a judge)."""
        if not self.accelerator.is_main_process:
            return {}
        held_out = {}
        if self.eval_prompts is not None:
            rows = JUDGED_EVAL_ROWS if self.judge is not None else SAMPLE_TABLE_ROWS
            devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                samples = self.sampler.sample(self.sampler.batch(self.eval_prompts[:rows]), k=1)
            with torch.no_grad(), self.accelerator.autocast():
                scores = self.reward.score(self.scorer.scoring_batch(samples)).total.tolist()
            if self.judge is not None:
                texts = [
                    self._judged_prompt_text(index) + completion
                    for index, completion in enumerate(samples.completions)
                ]
                held_out = {
                    "eval/score": float(torch.tensor(scores).nanmean()),
                    "eval/judge_score": sum(self.judge(texts)) / len(texts),
                }
        else:
            samples, scores = rollout, rollout.scores.tolist()
        rows = [
            {"prompt": prompt, "completion": completion, "score": float(score)}
            for prompt, completion, score in zip(
                samples.prompt_texts, samples.completions, scores, strict=True
            )
        ][:SAMPLE_TABLE_ROWS]
        run_dir.write_sample_table(self.output_dir, self.state.update, rows)
        return held_out

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self) -> None:
        """Write ``output_dir/checkpoint-N`` atomically: a staging folder renamed once complete."""
        accelerator, update = self.accelerator, self.state.update
        staging = checkpoints.staging_folder(self.output_dir, update)
        if accelerator.is_main_process:
            checkpoints.write_checkpoint(
                staging,
                model=self.model,
                policy=self.policy,
                optimizer=self.optimizer,
                scheduler=self.lr_scheduler,
                scaler=accelerator.scaler,
                trainer_state={
                    **dataclasses.asdict(self.state),
                    "world_size": accelerator.num_processes,
                    "batch_size": self.sizes.batch_size,
                    "num_total_batches": self.sizes.num_total_batches,
                },
            )
        accelerator.wait_for_everyone()
        checkpoints.write_rng_state(staging, accelerator.process_index)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            checkpoints.publish_checkpoint(self.output_dir, update, self.config.save_total_limit)
        accelerator.wait_for_everyone()

    def _load_checkpoint(self, path: Path) -> None:
        saved = checkpoints.read_checkpoint(path, self.accelerator.process_index, self.accelerator.device)
        policy_state = get_peft_model_state_dict(self.model.peft_model, adapter_name=self.policy)
        checkpoints.check_resumable(
            saved,
            world_size=self.accelerator.num_processes,
            planned=(self.sizes.batch_size, self.sizes.num_total_batches),
            adapter_shapes={key: tuple(tensor.shape) for key, tensor in policy_state.items()},
        )
        set_peft_model_state_dict(self.model.peft_model, saved.adapter, adapter_name=self.policy)
        self.sampler.policy_weights_changed()
        self.optimizer.load_state_dict(saved.optimizer)
        self.lr_scheduler.load_state_dict(saved.scheduler)
        checkpoints.restore_loss_scaler(saved, self.accelerator.scaler)
        state = saved.trainer_state
        self.state = TrainerState(
            **{field.name: state[field.name] for field in dataclasses.fields(TrainerState)}
        )
        checkpoints.set_rng_state(saved.rng)

    def _start_writing(self, plan: run_dir.RunStart, resumed_update: int) -> None:
        """Once the first update is done, and not before: replace what the folder held, then write this run's
        settings and open the trackers. A start that fails or is killed earlier leaves the folder as it
        was."""
        if self.accelerator.is_main_process:
            self.log_history = plan.commit(resumed_update)
            run_dir.write_run_config(self.output_dir, self._run_settings())
        if self.config.trackers:
            tracker_config = {
                key: _tracker_value(value) for key, value in dataclasses.asdict(self.config).items()
            }
            self.accelerator.init_trackers(run_dir.TRACKER_DIR, config=tracker_config)

    def _run_settings(self) -> dict[str, Any]:
        """What ``rloo_config.json`` records: the config and the model that was really trained."""
        model = self.model
        return {
            **dataclasses.asdict(self.config),
            "model": {
                "name_or_path": model.name_or_path,
                "quantization": model.quantization,
                "dtype": str(model.dtype).removeprefix("torch."),
                "policy": self.policy,
                "reference": model.policies[self.policy].reference_mode,
                "gradient_checkpointing": model.gradient_checkpointing,
            },
            "world_size": self.accelerator.num_processes,
            "dataset": {
                **self.dataset_source,
                "train_prompts": len(self.train_prompts),
                "eval_prompts": None if self.eval_prompts is None else len(self.eval_prompts),
            },
        }

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
        run logs (except ``eps``, which measures time).

        Example:
            >>> history = trainer.train()  # doctest: +SKIP
            >>> history[-1]["objective/scores"]  # doctest: +SKIP
        """
        config, accelerator, sizes = self.config, self.accelerator, self.sizes
        plan = run_dir.plan_start(self.output_dir, resume_from_checkpoint, overwrite=overwrite_output_dir)
        if plan.notice and accelerator.is_main_process:
            print(plan.notice, file=sys.stderr)
        set_seed(config.seed + accelerator.process_index * PROCESS_SEED_STRIDE)
        if plan.checkpoint is not None:
            self._load_checkpoint(plan.checkpoint)
        resumed_update = self.state.update

        start = (time.perf_counter(), self.episode)
        # Closed also when an update fails, so that the error message starts on a line of its own.
        with tqdm(
            total=sizes.num_total_batches,
            initial=self.state.update,
            desc="RLOO",
            disable=not accelerator.is_local_main_process,
        ) as progress:
            while self.state.update < sizes.num_total_batches:
                rollout, shaped, update_stats = self._rollout_and_update()
                self.state.update += 1
                if self.state.update == resumed_update + 1:
                    self._start_writing(plan, resumed_update)

                metrics = self._metrics(RolloutStats.of(rollout, shaped), update_stats, start)
                sample_now = self.sample_every and (self.state.update - 1) % self.sample_every == 0
                held_out = self._sample_table(rollout) if sample_now else {}
                metrics.update(held_out)
                judged_now = sample_now and self.judge is not None  # the same on every process
                if (
                    judged_now
                    or self.state.update % config.logging_steps == 0
                    or self.state.update == sizes.num_total_batches
                ):
                    self._log(metrics)
                for callback in self.callbacks:
                    callback(self.state, metrics)
                progress.update(1)
                progress.set_postfix(
                    episode=self.episode,
                    score=f"{metrics['objective/scores']:.3f}",
                    kl=f"{metrics['objective/kl']:.3f}",
                )
                if config.save_steps and self.state.update % config.save_steps == 0:
                    self._save_checkpoint()
        if self.state.update == resumed_update:  # resumed from the last checkpoint: nothing left to train
            self._start_writing(plan, resumed_update)

        if accelerator.is_main_process:
            self.model.save_policy_adapter(self.output_dir, self.policy)
            curves = plot_training_curves(
                self.output_dir / run_dir.METRICS_FILE, self.output_dir / run_dir.CURVES_FILE
            )
            print(run_dir.finished_line(self.output_dir, self.policy, curves))
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return self.log_history


# ---------------------------------------------------------------------- helpers


def same_device(first: torch.device, second: torch.device, current_cuda_index: int) -> bool:
    """Whether two devices are the same; a CUDA device without an index is the current one (accelerate names
    the only GPU of a single process ``cuda``, a model loaded there reports ``cuda:0``).

    Example:
        >>> same_device(torch.device("cuda", 0), torch.device("cuda"), current_cuda_index=0)
        True
        >>> same_device(torch.device("cuda", 1), torch.device("cuda"), current_cuda_index=0)
        False
        >>> same_device(torch.device("cpu"), torch.device("cuda", 0), current_cuda_index=0)
        False
    """
    if first.type != second.type:
        return False
    if first.type != "cuda":
        return True
    return (first.index if first.index is not None else current_cuda_index) == (
        second.index if second.index is not None else current_cuda_index
    )


def _tracker_value(value: Any) -> Any:
    """Trackers such as tensorboard accept only scalars and strings as run configuration."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if value is not None else "none"
    return str(value)
