"""``RLOOTrainer``: the RLOO rollout-and-update loop on one base model with adapter views.

One *update* reads top to bottom in :meth:`RLOOTrainer.train`:

1. rollout (no grad, eval mode): take this process's prompts, sample ``k`` completions each under the policy,
   cut them after the stop token, and compute by forward passes the policy and reference log-probs and the
   scores (reward adapter, or ``reward_fn``);
2. rewards and advantages (``marl.rloo``): missing-EOS penalty, optional normalisation, KL folded into the
   reward (or the token-level k3 variant), leave-one-out baseline, optional advantage normalisation;
3. update: ``num_ppo_epochs`` × ``num_mini_batches`` optimizer steps, each accumulating micro-batches of
   ``per_device_train_batch_size`` completions, PPO-clip on the sequence ratio, gradient clipping, LR
   schedule;
4. metrics (gathered over processes), sample tables, checkpoints.

Leave-one-out groups never span processes: every process samples all ``k`` completions of its own prompts.
Gradients of the policy adapter are averaged over processes explicitly before each optimizer step.

Example:
    >>> from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
    >>> config = RLOOConfig(output_dir="runs/rloo", reward_adapter="adapters/my-reward")
    >>> model = config.load_model()  # doctest: +SKIP
    >>> tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)  # doctest: +SKIP
    >>> trainer = RLOOTrainer(config, model, tokenizer, train_dataset=prompts)  # doctest: +SKIP
    >>> history = trainer.train()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast, set_seed
from peft.utils import set_peft_model_state_dict
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import get_scheduler

from marl import rloo
from marl.adapters import SAFETENSORS_WEIGHTS_NAME
from marl.config import RLOOConfig
from marl.data import left_pad, tokenize_prompt
from marl.model import MultiAdapterModel, position_ids_from_mask
from marl.sampling import SamplingSettings, eos_token_ids, pad_token_id, prompt_cache_can_be_shared

RewardFn = Callable[[list[str], list[str]], Sequence[float]]

METRICS_FILE = "metrics.jsonl"
SAMPLES_DIR = "samples"
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
# Distinct sampling streams per process: the same seed everywhere would give every process the same noise.
PROCESS_SEED_STRIDE = 100_003
SAMPLE_TABLE_ROWS = 8


@dataclass
class TrainerState:
    """Counters of a run; saved in every checkpoint.

    ``update`` counts finished updates, ``episode`` the completions trained on (all processes),
    ``global_step`` optimizer-step slots (a skipped step still advances the LR schedule), and
    ``skipped_optimizer_steps`` the steps skipped because a reward or the loss was not finite.
    """

    update: int = 0
    episode: int = 0
    global_step: int = 0
    skipped_optimizer_steps: int = 0


@dataclass
class Rollout:
    """One process's rollout, k-major (row ``j * P + i`` is sample ``j`` of prompt ``i``)."""

    prompt_texts: list[str]
    query_responses: torch.Tensor  # [B, prompt_length + response_length]
    attention_mask: torch.Tensor  # [B, prompt_length + response_length]; 0 on padding and after the stop
    prompt_length: int
    response_mask: torch.Tensor  # [B, response_length] bool, valid completion tokens
    contains_stop: torch.Tensor  # [B] bool, the stop token ends the completion
    contains_eos: torch.Tensor  # [B] bool, an EOS token among the valid tokens (for val/num_eos_tokens)
    completions: list[str]
    logprobs: torch.Tensor  # [B, response_length] float32, policy at rollout time
    ref_logprobs: torch.Tensor  # [B, response_length] float32
    raw_scores: torch.Tensor  # [B] float32, before EOS penalty and normalisation


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
        reward_fn: ``None`` to score with the model's reward adapter, or ``reward_fn(prompts, completions)``
            returning one number per completion.

    Attributes:
        state: :class:`TrainerState` (``update``, ``episode``, ``global_step``, ``skipped_optimizer_steps``).
        log_history: the logged metric dicts, also appended to ``output_dir/metrics.jsonl``.
        first_microbatch_ratios: mean sequence ratio of the first micro-batch of every update; 1 up to
            numerical noise when the rollout and the update see the same model (no dropout, float32).

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
        reward_fn: RewardFn | None = None,
    ) -> None:
        if not isinstance(config, RLOOConfig):
            raise TypeError(f"config must be a marl.RLOOConfig, got {type(config).__name__}")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        if reward_fn is None and not model.has_reward_adapter:
            raise ValueError(
                "no reward: the model has no reward adapter and no reward_fn was given. Load the model with "
                "reward_adapter=DIR, or pass reward_fn=callable(prompts, completions) -> list of floats"
            )
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(
                f"reward_fn must be callable(prompts, completions), got {type(reward_fn).__name__}"
            )

        self.accelerator = Accelerator(
            # a model on the CPU trains on the CPU (also under torchrun, where accelerate would otherwise
            # ignore the launcher on machines without a GPU)
            cpu=model.device.type == "cpu",
            mixed_precision=config.mixed_precision,
            log_with=config.trackers or None,
            project_dir=config.output_dir,
            step_scheduler_with_optimizer=False,
        )
        self._check_device()
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.accelerator.num_processes:
            raise RuntimeError(
                f"launched as {launched} processes but accelerate runs {self.accelerator.num_processes}: an "
                "accelerate state was created earlier for another device. On CPU, launch with "
                "`torchrun --nproc_per_node N ...` and create PartialState(cpu=True) before loading the model"
            )

        self.pad_token_id = pad_token_id(tokenizer)
        # Every end-of-sequence id of the model: a list in generation_config.eos_token_id (Llama-3.x-Instruct
        # has three) all end a completion when stop_token='eos', and all count in val/num_eos_tokens.
        self.eos_token_ids = eos_token_ids(tokenizer, model.peft_model.get_base_model().generation_config)
        if config.stop_token == "eos":
            if not self.eos_token_ids:
                raise ValueError(
                    "stop_token='eos' but the tokenizer has no EOS token; pass --stop_token_id ID"
                )
            self.stop_token_ids = self.eos_token_ids
        else:
            self.stop_token_ids = () if config.stop_token_id is None else (config.stop_token_id,)
        self.share_prompt_cache = prompt_cache_can_be_shared(model.peft_model.get_base_model())
        self.sampling = SamplingSettings(
            temperature=config.temperature,
            max_new_tokens=config.response_length,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
        )

        self.train_prompts = self._prepare_prompts(train_dataset, "train_dataset")
        self.eval_prompts = (
            None if eval_dataset is None else self._prepare_prompts(eval_dataset, "eval_dataset")
        )

        self.sizes = config.batch_sizes(self.accelerator.num_processes, len(self.train_prompts))
        if config.num_sample_generations > 0:
            self.sample_every = max(1, self.sizes.num_total_batches // config.num_sample_generations)
        else:
            self.sample_every = 0

        if config.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        self._synchronise_policy_weights()

        self.policy_parameters = model.policy_parameters()
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

        self.state = TrainerState()
        self.last_learning_rate = float(self.lr_scheduler.get_last_lr()[0])
        self.log_history: list[dict[str, float]] = []
        self.first_microbatch_ratios: list[float] = []
        self.output_dir = Path(config.output_dir)

    # ------------------------------------------------------------------ validation and data

    def _check_device(self) -> None:
        model_device, process_device = self.model.device, self.accelerator.device
        same_type = model_device.type == process_device.type
        same_index = model_device.type != "cuda" or model_device.index == process_device.index
        if not (same_type and same_index):
            raise ValueError(
                f"the model is on {model_device} but this process trains on {process_device}. Load it there: "
                "MultiAdapterModel.from_pretrained(..., device_map={'': Accelerator().device}) "
                "(with accelerate launch every process needs its own copy on its own device)"
            )

    def _prepare_prompts(self, dataset: Any, name: str) -> list[tuple[list[int], str]]:
        """Tokenise every prompt once: ``(token ids, prompt text shown to reward_fn and in samples)``."""
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"{name} is empty; pass a dataset with at least one prompt")
        columns = list(dataset.column_names) if hasattr(dataset, "column_names") else list(dataset[0].keys())
        if "prompt" not in columns and "input_ids" not in columns:
            raise ValueError(
                f"{name} has no 'prompt' or 'input_ids' column (columns: {columns}). Rename the prompt "
                "column, e.g. dataset.rename_column('text', 'prompt')"
            )
        use_ids = "prompt" not in columns
        prepared = []
        for index in range(len(dataset)):
            row = dataset[index]
            if use_ids:
                ids = [int(token) for token in row["input_ids"]]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            else:
                ids, text = tokenize_prompt(self.tokenizer, row["prompt"], f"{name} row {index}")
            if not ids:
                raise ValueError(f"{name} row {index} has an empty prompt; remove it or give it text")
            prepared.append((ids, text))
        longest = max(len(ids) for ids, _ in prepared)
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and longest + self.config.response_length > context:
            too_long = sum(len(ids) + self.config.response_length > context for ids, _ in prepared)
            raise ValueError(
                f"{too_long} prompt(s) of {name} (longest {longest} tokens) plus response_length="
                f"{self.config.response_length} exceed the model's context of {context} tokens. Filter or "
                "shorten those prompts, or lower --response_length"
            )
        return prepared

    def _prompt_indices(self, update: int) -> list[int]:
        """Dataset rows of this process for ``update`` (0-based).

        The prompt order is an endless concatenation of seeded permutations of the dataset, so the data
        position is a function of the update number alone and a resumed run sees the same prompts.
        """
        per_update, per_process = self.sizes.prompts_per_update, self.sizes.prompts_per_process
        start = update * per_update + self.accelerator.process_index * per_process
        size = len(self.train_prompts)
        indices = []
        for position in range(start, start + per_process):
            epoch, offset = divmod(position, size)
            indices.append(int(self._permutation(epoch)[offset]))
        return indices

    def _permutation(self, epoch: int) -> torch.Tensor:
        cached = getattr(self, "_cached_permutation", None)
        if cached is None or cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.config.seed + epoch)
            cached = (epoch, torch.randperm(len(self.train_prompts), generator=generator))
            self._cached_permutation = cached
        return cached[1]

    def _synchronise_policy_weights(self) -> None:
        """Start every process from process 0's policy adapter (a fresh LoRA is initialised randomly)."""
        if self.accelerator.num_processes == 1:
            return
        with torch.no_grad():
            for parameter in self.model.policy_parameters():
                parameter.copy_(broadcast(parameter.detach().clone(), from_process=0))

    # ------------------------------------------------------------------ rollout

    def _left_pad(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = left_pad(sequences, self.pad_token_id)
        device = self.accelerator.device
        return input_ids.to(device), attention_mask.to(device)

    def _sample_completions(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, samples_per_prompt: int
    ) -> torch.Tensor:
        """``samples_per_prompt`` sampled completions of every prompt, k-major, ``[k * P, response_length]``.

        Each prompt is prefilled ONCE: its KV cache is copied to its k samples, instead of running the prompt
        through the model k times. Prompts go in chunks of ``local_rollout_forward_batch_size`` sampled rows.
        Sampling draws from exactly ``softmax(logits / temperature)`` (see :mod:`marl.sampling`).
        """
        config, k = self.config, samples_per_prompt
        prompts_per_chunk = max(1, config.local_rollout_forward_batch_size // k)
        pieces = []
        for start in range(0, prompt_ids.shape[0], prompts_per_chunk):
            ids = prompt_ids[start : start + prompts_per_chunk]
            mask = prompt_mask[start : start + prompts_per_chunk]
            with self.model.policy(), self.accelerator.autocast():
                responses = self.model.sample(
                    ids.repeat_interleave(k, dim=0),
                    mask.repeat_interleave(k, dim=0),
                    self.sampling,
                    past_key_values=self._shared_prompt_cache(ids, mask, k),
                )
            # generate ran prompt-major (row i * k + j); the rollout layout is k-major (row j * P + i)
            pieces.append(responses.view(ids.shape[0], k, -1).transpose(0, 1))
        return torch.cat(pieces, dim=1).reshape(k * prompt_ids.shape[0], -1)

    def _shared_prompt_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, copies: int):
        """KV cache of all prompt tokens but the last (generate feeds that one), repeated ``copies`` times.

        ``None`` (generate prefills by itself) when there is nothing to share: one copy or one-token prompts.
        """
        if copies == 1 or prompt_ids.shape[1] < 2 or not self.share_prompt_cache:
            return None
        with self.model.policy(), torch.no_grad(), self.accelerator.autocast():
            prefill = self.model.peft_model(
                input_ids=prompt_ids[:, :-1],
                attention_mask=prompt_mask[:, :-1],
                position_ids=position_ids_from_mask(prompt_mask[:, :-1]),
                use_cache=True,
                logits_to_keep=1,
            )
        cache = prefill.past_key_values
        cache.batch_repeat_interleave(copies)
        return cache

    def _forward_logprobs(
        self, query_responses: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
    ):
        """No-grad policy and reference log-probs of the completions, chunked."""
        chunk = self.config.local_rollout_forward_batch_size
        logprobs, ref_logprobs = [], []
        with torch.no_grad(), self.accelerator.autocast():
            for start in range(0, query_responses.shape[0], chunk):
                rows = slice(start, start + chunk)
                arguments = dict(response_start=prompt_length, temperature=self.config.temperature)
                with self.model.policy():
                    logprobs.append(
                        self.model.token_logprobs(query_responses[rows], attention_mask[rows], **arguments)
                    )
                with self.model.reference():
                    ref_logprobs.append(
                        self.model.token_logprobs(query_responses[rows], attention_mask[rows], **arguments)
                    )
        return torch.cat(logprobs).float(), torch.cat(ref_logprobs).float()

    def _score(
        self, prompt_texts: list[str], completions: list[str], query_responses: torch.Tensor, attention_mask
    ) -> torch.Tensor:
        if self.reward_fn is None:
            chunk = self.config.local_rollout_forward_batch_size
            with self.accelerator.autocast():
                scores = [
                    self.model.compute_reward_score(
                        query_responses[start : start + chunk], attention_mask[start : start + chunk]
                    )
                    for start in range(0, query_responses.shape[0], chunk)
                ]
            return torch.cat(scores).float()
        return self._call_reward_fn(prompt_texts, completions).to(self.accelerator.device)

    def _call_reward_fn(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        name = getattr(self.reward_fn, "__name__", type(self.reward_fn).__name__)
        values = self.reward_fn(prompts, completions)
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().reshape(-1).tolist()
        try:
            values = list(values)
        except TypeError:
            raise TypeError(
                f"reward_fn {name} returned {type(values).__name__}; it must return one number per completion"
            ) from None
        if len(values) != len(completions):
            raise ValueError(
                f"reward_fn {name} returned {len(values)} scores for {len(completions)} completions; "
                "return exactly one number per completion, in order"
            )
        for position, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"reward_fn {name} returned {value!r} ({type(value).__name__}) at position {position}; "
                    "scores must be real numbers"
                )
        return torch.tensor([float(value) for value in values], dtype=torch.float32)

    def _rollout(self, prompt_rows: list[tuple[list[int], str]]) -> Rollout:
        """Sample k completions per prompt and compute everything the update needs, without gradients."""
        config = self.config
        k = config.rloo_k
        prompt_ids, prompt_mask = self._left_pad([ids for ids, _ in prompt_rows])
        self.model.eval()
        responses = self._sample_completions(prompt_ids, prompt_mask, k)
        # k-major: the prompt block is repeated k times, so row j * P + i is sample j of prompt i.
        prompt_ids, prompt_mask = prompt_ids.repeat(k, 1), prompt_mask.repeat(k, 1)
        prompt_texts = [text for _, text in prompt_rows] * k
        responses, contains_stop = rloo.truncate_after_stop_token(
            responses, self.stop_token_ids, self.pad_token_id
        )
        lengths = rloo.response_lengths(responses, self.stop_token_ids)
        response_mask = rloo.response_mask(lengths, responses.shape[1])
        query_responses = torch.cat([prompt_ids, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        contains_eos = (rloo.is_stop_token(responses, self.eos_token_ids) & response_mask).any(dim=1)
        completions = self.tokenizer.batch_decode(
            [row[:length].tolist() for row, length in zip(responses, lengths.tolist(), strict=True)],
            skip_special_tokens=True,
        )
        logprobs, ref_logprobs = self._forward_logprobs(query_responses, attention_mask, prompt_ids.shape[1])
        raw_scores = self._score(prompt_texts, completions, query_responses, attention_mask)
        return Rollout(
            prompt_texts=prompt_texts,
            query_responses=query_responses,
            attention_mask=attention_mask,
            prompt_length=prompt_ids.shape[1],
            response_mask=response_mask,
            contains_stop=contains_stop,
            contains_eos=contains_eos,
            completions=completions,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            raw_scores=raw_scores,
        )

    # ------------------------------------------------------------------ rewards and advantages

    def _rewards_and_advantages(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        config = self.config
        scores = rollout.raw_scores
        if config.missing_eos_penalty is not None:
            scores = rloo.apply_missing_eos_penalty(scores, rollout.contains_stop, config.missing_eos_penalty)
        if config.normalize_reward:
            scores = rloo.normalize_and_clip_rewards(scores, config.reward_clip_range)
        seq_kl = rloo.sequence_kl(rollout.logprobs, rollout.ref_logprobs, rollout.response_mask)
        rlhf_reward, non_score_reward = rloo.rlhf_rewards(scores, seq_kl, config.kl_coef)
        # token_level_kl moves the KL penalty from the reward into the loss (per token, k3 estimator).
        reward_for_advantage = scores if config.token_level_kl else rlhf_reward
        advantages = rloo.leave_one_out_advantages(reward_for_advantage, config.rloo_k)
        if config.normalize_advantage:
            advantages = rloo.normalize_advantages(advantages)
        return {
            "scores": scores,
            "seq_kl": seq_kl,
            "non_score_reward": non_score_reward,
            "rlhf_reward": rlhf_reward,
            "advantages": advantages,
        }

    # ------------------------------------------------------------------ update

    def _any_process(self, flag: bool) -> bool:
        value = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(value, reduction="sum").item() > 0)

    def _average_gradients(self) -> None:
        if self.accelerator.num_processes == 1:
            return
        for parameter in self.policy_parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            parameter.grad.copy_(self.accelerator.reduce(parameter.grad, reduction="mean"))

    def _optimizer_step(self, loss_finite: bool) -> bool:
        """Average gradients, clip, step; skip (and count) the step if anything is not finite."""
        self._average_gradients()
        skip = self._any_process(not loss_finite)
        if not skip:
            max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
            grad_norm = self.accelerator.clip_grad_norm_(self.policy_parameters, max_norm)
            # With fp16 the loss scaler handles overflowing gradients itself (and lowers its scale).
            skip = self.accelerator.scaler is None and not torch.isfinite(torch.as_tensor(grad_norm)).item()
        if not skip:
            self.optimizer.step()
            # fp16: the loss scaler skips a step whose gradients overflowed (and lowers its scale).
            skip = self.optimizer.step_was_skipped
        # The learning rate this step used, logged as `lr` (read before the schedule moves on).
        self.last_learning_rate = float(self.lr_scheduler.get_last_lr()[0])
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        if skip:
            self.state.skipped_optimizer_steps += 1
        return skip

    def _update(self, rollout: Rollout, advantages: torch.Tensor) -> torch.Tensor:
        """PPO-clip epochs over the rollout. Returns per-process sums for the policy metrics."""
        config = self.config
        sizes = self.sizes
        reuse_samples = config.num_ppo_epochs > 1 or config.num_mini_batches > 1
        old_seq_logprob = rloo.masked_sum(rollout.logprobs, rollout.response_mask)
        # sums over completions: approxkl, clipped, loss, ratio, ratio², count; over tokens: entropy, count
        totals = torch.zeros(8, dtype=torch.float64, device=self.accelerator.device)
        first_microbatch = True
        self.model.train()
        try:
            for _epoch in range(config.num_ppo_epochs):
                order = torch.randperm(sizes.local_batch_size).to(self.accelerator.device)
                for mini_start in range(0, sizes.local_batch_size, sizes.local_mini_batch_size):
                    mini_batch = order[mini_start : mini_start + sizes.local_mini_batch_size]
                    loss_finite = True
                    for micro_start in range(
                        0, sizes.local_mini_batch_size, config.per_device_train_batch_size
                    ):
                        rows = mini_batch[micro_start : micro_start + config.per_device_train_batch_size]
                        mask = rollout.response_mask[rows]
                        with self.model.policy(), self.accelerator.autocast():
                            new_logprobs, entropy = self.model.token_logprobs(
                                rollout.query_responses[rows],
                                rollout.attention_mask[rows],
                                response_start=rollout.prompt_length,
                                temperature=config.temperature,
                                with_entropy=True,
                            )
                        new_seq_logprob = rloo.masked_sum(new_logprobs, mask)
                        # One epoch, one mini-batch: plain REINFORCE, the ratio is exactly 1 by construction.
                        old = old_seq_logprob[rows] if reuse_samples else new_seq_logprob.detach()
                        policy = rloo.clipped_policy_loss(
                            new_seq_logprob, old, advantages[rows], config.cliprange
                        )
                        loss = policy.loss
                        if config.token_level_kl:
                            k3 = rloo.token_level_k3_kl(new_logprobs, rollout.ref_logprobs[rows], mask)
                            loss = loss + config.kl_coef * k3.sum(dim=1).mean()
                        if torch.isfinite(loss):
                            self.accelerator.backward(loss / config.gradient_accumulation_steps)
                        else:
                            loss_finite = False
                        if first_microbatch:
                            self.first_microbatch_ratios.append(policy.ratio.mean().item())
                            first_microbatch = False
                        with torch.no_grad():
                            totals += torch.stack(
                                [
                                    (0.5 * policy.log_ratio**2).sum(),
                                    policy.clipped.sum(),
                                    policy.loss.detach() * rows.numel(),
                                    policy.ratio.sum(),
                                    (policy.ratio**2).sum(),
                                    torch.tensor(rows.numel(), device=totals.device),
                                    torch.where(mask, entropy, torch.zeros_like(entropy)).sum(),
                                    mask.sum(),
                                ]
                            ).to(totals)
                    if self._optimizer_step(loss_finite):
                        warnings.warn(
                            f"update {self.state.update + 1}: non-finite loss or gradient; step skipped",
                            RuntimeWarning,
                            stacklevel=2,
                        )
        finally:
            self.model.eval()
        return totals

    def _skip_update(self) -> None:
        """Count the optimizer steps of an update with non-finite rewards as skipped; the schedule moves."""
        for _ in range(self.sizes.optimizer_steps_per_update):
            self.last_learning_rate = float(self.lr_scheduler.get_last_lr()[0])
            self.lr_scheduler.step()
            self.state.global_step += 1
            self.state.skipped_optimizer_steps += 1

    # ------------------------------------------------------------------ metrics

    def _metrics(
        self, rollout: Rollout, shaped: dict[str, torch.Tensor], update_totals, start
    ) -> dict[str, float]:
        entropy_seq = rloo.masked_sum(-rollout.logprobs, rollout.response_mask)
        rollout_sums = torch.stack(
            [
                shaped["seq_kl"].sum(),
                entropy_seq.sum(),
                shaped["non_score_reward"].sum(),
                shaped["rlhf_reward"].sum(),
                shaped["scores"].sum(),
                rollout.contains_eos.sum(),
                torch.tensor(rollout.contains_eos.numel(), device=rollout.contains_eos.device),
            ]
        ).to(torch.float64)
        rollout_sums = self.accelerator.reduce(rollout_sums, reduction="sum")
        kl, entropy, non_score, rlhf, scores, num_eos, count = rollout_sums.tolist()
        elapsed = max(time.perf_counter() - start[0], 1e-9)
        metrics = {
            "eps": (self.state.episode - start[1]) / elapsed,
            "objective/kl": kl / count,
            "objective/entropy": entropy / count,
            "objective/non_score_reward": non_score / count,
            "objective/rlhf_reward": rlhf / count,
            "objective/scores": scores / count,
        }
        if update_totals is not None:
            totals = self.accelerator.reduce(update_totals, reduction="sum").tolist()
            approxkl, clipped, loss, ratio, ratio_sq, samples, entropy_tokens, tokens = totals
            ratio_mean = ratio / samples
            metrics.update(
                {
                    "policy/approxkl_avg": approxkl / samples,
                    "policy/clipfrac_avg": clipped / samples,
                    "loss/policy_avg": loss / samples,
                    "policy/entropy_avg": entropy_tokens / max(tokens, 1.0),
                    "val/ratio": ratio_mean,
                    "val/ratio_var": max(ratio_sq / samples - ratio_mean**2, 0.0),
                }
            )
        metrics.update(
            {
                "val/num_eos_tokens": num_eos,
                "skipped_optimizer_steps": float(self.state.skipped_optimizer_steps),
                "lr": self.last_learning_rate,
                "episode": float(self.state.episode),
            }
        )
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        record = {"update": self.state.update, **metrics}
        self.log_history.append(record)
        self.accelerator.log(metrics, step=self.state.update)
        if self.accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with (self.output_dir / METRICS_FILE).open("a") as handle:
                handle.write(json.dumps(_json_safe(record)) + "\n")

    def _sample_table(self, rollout: Rollout, scores: torch.Tensor) -> None:
        """Print and save a table of sample completions (eval prompts when given, else this rollout)."""
        if not self.accelerator.is_main_process:
            return
        if self.eval_prompts is not None:
            rows = self._eval_samples()
        else:
            rows = [
                (prompt, completion, float(score))
                for prompt, completion, score in zip(
                    rollout.prompt_texts, rollout.completions, scores.tolist(), strict=True
                )
            ][:SAMPLE_TABLE_ROWS]
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"samples at update {self.state.update}", show_lines=True)
        for column in ("prompt", "completion", "score"):
            table.add_column(column)
        for prompt, completion, score in rows:
            table.add_row(prompt, completion, f"{score:.4f}")
        Console().print(table)
        directory = self.output_dir / SAMPLES_DIR
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / f"update_{self.state.update:06d}.jsonl").open("w") as handle:
            for prompt, completion, score in rows:
                handle.write(json.dumps({"prompt": prompt, "completion": completion, "score": score}) + "\n")

    def _eval_samples(self) -> list[tuple[str, str, float]]:
        """One scored completion for each of the first eval prompts, without disturbing the training RNG."""
        prompt_rows = self.eval_prompts[:SAMPLE_TABLE_ROWS]
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            prompt_ids, prompt_mask = self._left_pad([ids for ids, _ in prompt_rows])
            responses = self._sample_completions(prompt_ids, prompt_mask, samples_per_prompt=1)
        responses, _ = rloo.truncate_after_stop_token(responses, self.stop_token_ids, self.pad_token_id)
        lengths = rloo.response_lengths(responses, self.stop_token_ids)
        mask = rloo.response_mask(lengths, responses.shape[1])
        texts = [text for _, text in prompt_rows]
        completions = self.tokenizer.batch_decode(
            [row[:length].tolist() for row, length in zip(responses, lengths.tolist(), strict=True)],
            skip_special_tokens=True,
        )
        query_responses = torch.cat([prompt_ids, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, mask.long()], dim=1)
        scores = self._score(texts, completions, query_responses, attention_mask)
        return list(zip(texts, completions, scores.tolist(), strict=True))

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self) -> None:
        """Write ``output_dir/checkpoint-N`` atomically: a temporary folder renamed once complete."""
        accelerator = self.accelerator
        final = self.output_dir / f"{CHECKPOINT_PREFIX}{self.state.update}"
        staging = self.output_dir / f".{CHECKPOINT_PREFIX}{self.state.update}.tmp"
        if accelerator.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
            self.model.save_policy_adapter(staging)
            torch.save(self.optimizer.state_dict(), staging / OPTIMIZER_FILE)
            torch.save(self.lr_scheduler.state_dict(), staging / SCHEDULER_FILE)
            state = {
                **dataclasses.asdict(self.state),
                "prompts_consumed": self.state.update * self.sizes.prompts_per_update,
                "world_size": accelerator.num_processes,
                "batch_size": self.sizes.batch_size,
                "num_total_batches": self.sizes.num_total_batches,
                "first_microbatch_ratios": self.first_microbatch_ratios,
            }
            (staging / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2))
        accelerator.wait_for_everyone()
        torch.save(_rng_state(), staging / f"rng_state_{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            self._prune_checkpoints()
        accelerator.wait_for_everyone()

    def _prune_checkpoints(self) -> None:
        limit = self.config.save_total_limit
        if limit is None:
            return
        for old in _list_checkpoints(self.output_dir)[:-limit]:
            shutil.rmtree(old)

    def _load_checkpoint(self, checkpoint: str | os.PathLike | bool) -> None:
        if checkpoint is True:
            found = _list_checkpoints(self.output_dir)
            if not found:
                raise FileNotFoundError(
                    f"resume_from_checkpoint=True but {self.output_dir} has no {CHECKPOINT_PREFIX}N folder; "
                    "pass a checkpoint path, or start without resume_from_checkpoint"
                )
            checkpoint = found[-1]
        path = Path(checkpoint)
        state_file = path / TRAINER_STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint of this trainer (no {TRAINER_STATE_FILE})")
        saved = json.loads(state_file.read_text())
        if saved["world_size"] != self.accelerator.num_processes:
            raise ValueError(
                f"{path} was written by {saved['world_size']} processes but this run has "
                f"{self.accelerator.num_processes}; resume with the same number of processes"
            )
        planned = (self.sizes.batch_size, self.sizes.num_total_batches)
        if (saved["batch_size"], saved["num_total_batches"]) != planned:
            raise ValueError(
                f"{path} belongs to a run of {saved['num_total_batches']} updates of {saved['batch_size']} "
                f"completions, this config plans {planned[1]} updates of {planned[0]}; resume with the batch "
                "settings, total_episodes and dataset of the original run"
            )
        weights = load_file(str(path / SAFETENSORS_WEIGHTS_NAME), device=str(self.accelerator.device))
        result = set_peft_model_state_dict(
            self.model.peft_model, weights, adapter_name=MultiAdapterModel.POLICY_ADAPTER
        )
        if result.unexpected_keys:
            raise ValueError(
                f"{path}: adapter weights that match no policy parameter: {result.unexpected_keys[:5]}"
            )
        self.optimizer.load_state_dict(
            torch.load(path / OPTIMIZER_FILE, map_location=self.accelerator.device)
        )
        self.lr_scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, weights_only=False))
        self.state = TrainerState(
            **{field.name: saved[field.name] for field in dataclasses.fields(TrainerState)}
        )
        self.first_microbatch_ratios = list(saved["first_microbatch_ratios"])
        _set_rng_state(
            torch.load(path / f"rng_state_{self.accelerator.process_index}.pt", weights_only=False)
        )
        if self.accelerator.is_main_process:
            self._truncate_metrics_file()

    def _refuse_to_mix_runs(self) -> None:
        """A fresh run never appends to, or prunes, the metrics and checkpoints of an earlier run."""
        earlier = _list_checkpoints(self.output_dir) + [
            path for path in (self.output_dir / METRICS_FILE,) if path.exists()
        ]
        if earlier:
            raise FileExistsError(
                f"{self.output_dir} already holds a run ({', '.join(path.name for path in earlier[:3])}). "
                "Continue it with train(resume_from_checkpoint=True), or choose another output_dir"
            )

    def _truncate_metrics_file(self) -> None:
        """Drop records written after the checkpoint: the resumed run writes those updates again."""
        metrics_file = self.output_dir / METRICS_FILE
        if not metrics_file.exists():
            return
        kept = [
            line
            for line in metrics_file.read_text().splitlines()
            if json.loads(line)["update"] <= self.state.update
        ]
        metrics_file.write_text("".join(line + "\n" for line in kept))
        self.log_history = [json.loads(line) for line in kept]

    # ------------------------------------------------------------------ the loop

    def train(self, resume_from_checkpoint: str | os.PathLike | bool | None = None) -> list[dict[str, float]]:
        """Run RLOO until ``num_total_batches`` updates are done; returns the logged metric dicts.

        ``resume_from_checkpoint``: a ``checkpoint-N`` folder, or ``True`` for the latest in ``output_dir``.
        On CPU with a fixed seed a resumed run logs exactly the metrics an uninterrupted run logs (except
        ``eps``, which measures time).

        Example:
            >>> history = trainer.train()  # doctest: +SKIP
            >>> history[-1]["objective/scores"]  # doctest: +SKIP
        """
        config, accelerator, sizes = self.config, self.accelerator, self.sizes
        set_seed(config.seed + accelerator.process_index * PROCESS_SEED_STRIDE)
        if resume_from_checkpoint:
            self._load_checkpoint(resume_from_checkpoint)
        else:
            self._refuse_to_mix_runs()
        if accelerator.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "rloo_config.json").write_text(
                json.dumps(dataclasses.asdict(config), indent=2)
            )
        if config.trackers:
            tracker_config = {key: _tracker_value(value) for key, value in dataclasses.asdict(config).items()}
            accelerator.init_trackers("marl-rloo", config=tracker_config)

        progress = tqdm(
            total=sizes.num_total_batches,
            initial=self.state.update,
            desc="RLOO",
            disable=not accelerator.is_local_main_process,
        )
        start = (time.perf_counter(), self.state.episode)
        while self.state.update < sizes.num_total_batches:
            prompt_rows = [self.train_prompts[index] for index in self._prompt_indices(self.state.update)]
            rollout = self._rollout(prompt_rows)
            shaped = self._rewards_and_advantages(rollout)
            rewards_finite = bool(
                torch.isfinite(shaped["rlhf_reward"]).all() and torch.isfinite(shaped["scores"]).all()
            )
            update_totals = None
            if self._any_process(not rewards_finite):
                warnings.warn(
                    f"update {self.state.update + 1}: non-finite reward; its optimizer steps are skipped",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._skip_update()
            else:
                update_totals = self._update(rollout, shaped["advantages"])
            self.state.update += 1
            self.state.episode += sizes.batch_size

            metrics = self._metrics(rollout, shaped, update_totals, start)
            if self.state.update % config.logging_steps == 0 or self.state.update == sizes.num_total_batches:
                self._log(metrics)
            progress.update(1)
            progress.set_postfix(
                episode=self.state.episode,
                score=f"{metrics['objective/scores']:.3f}",
                kl=f"{metrics['objective/kl']:.3f}",
            )
            if self.sample_every and (self.state.update - 1) % self.sample_every == 0:
                self._sample_table(rollout, shaped["scores"])
            if config.save_steps and self.state.update % config.save_steps == 0:
                self._save_checkpoint()
        progress.close()

        if accelerator.is_main_process:
            self.model.save_policy_adapter(self.output_dir)
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return self.log_history


# ---------------------------------------------------------------------- helpers


def _list_checkpoints(output_dir: Path) -> list[Path]:
    pattern = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
    found = [
        (int(match.group(1)), path)
        for path in output_dir.glob(f"{CHECKPOINT_PREFIX}*")
        if path.is_dir() and (match := pattern.match(path.name))
    ]
    return [path for _, path in sorted(found)]


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats become null: JSON has no NaN."""
    return {
        key: (value if not isinstance(value, float) or math.isfinite(value) else None)
        for key, value in record.items()
    }


def _tracker_value(value: Any) -> Any:
    """Trackers such as tensorboard accept only scalars and strings as run configuration."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if value is not None else "none"
    return str(value)
