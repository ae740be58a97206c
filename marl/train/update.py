"""The update step of RLOO: clipped policy-loss epochs over one rollout, and the optimizer steps they take.

``num_ppo_epochs`` × ``num_mini_batches`` optimizer steps per rollout, each accumulating micro-batches of
``per_device_train_batch_size`` completions: the config's clipped policy loss (:mod:`marl.algo.selection`:
the sequence ratio of TRL v0.21's RLOO or a TRL 1.x token-level loss, with the k3 KL when it is in the
loss), gradients averaged over processes in the backward pass, clipped to ``max_grad_norm``, one step of
the LR schedule. A step whose loss or gradient is not finite on any process is skipped on every process;
the schedule still moves on. Where the rollout skipped the policy's scoring pass (:mod:`marl.algo.passes`:
one epoch, one mini-batch, no KL in the reward), each micro-batch's forward provides those log-probs,
detached, into the rollout (the ratio's old log-probs, and the metrics' afterwards).

Example:
    >>> step = PolicyUpdate(  # doctest: +SKIP
    ...     config, model, policy, sampler, scorer, parallelism, optimizer, scheduler, sizes, parameters)
    >>> stats, skipped = step.run(rollout, advantages, update=1)  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.metrics import UpdateStats
from marl.algo.passes import reuses_samples
from marl.algo.selection import loss_mask, policy_loss, truncation_warning

if TYPE_CHECKING:
    from marl.batch_sizes import BatchSizes
    from marl.config import RLOOConfig
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rollout.records import Rollout
    from marl.rollout.samplers import Sampler
    from marl.rollout.scoring import Scorer
    from marl.train.parallel import Parallelism


class PolicyUpdate:
    """Trains the policy adapter on rollouts; owns the optimizer and the LR schedule between updates.

    Args:
        config: the run's settings (epochs, batch sizes, clipping, KL).
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
        self.config, self.model, self.policy = config, model, policy
        self.sampler, self.scorer = sampler, scorer
        self.parallelism, self.optimizer, self.scheduler = parallelism, optimizer, scheduler
        self.sizes, self.parameters = sizes, list(parameters)
        self.grouped_micro_batches = config.per_device_train_batch_size % config.rloo_k == 0
        self.last_learning_rate = float(scheduler.get_last_lr()[0])

    def run(self, rollout: Rollout, advantages: torch.Tensor, update: int) -> tuple[UpdateStats, int]:
        """PPO-clip epochs over ``rollout`` (the ``update``-th, for warnings); returns this process's sums for
        the policy metrics and how many optimizer steps were skipped. The model is left in eval mode, also
        when a step fails."""
        config, sizes = self.config, self.sizes
        mask = loss_mask(rollout.response_mask, rollout.contains_stop, config)
        truncated = truncation_warning(rollout.contains_stop, config, update)
        if truncated is not None:
            warnings.warn(truncated, RuntimeWarning, stacklevel=2)
        stats, skipped = UpdateStats(), 0
        provide = rollout.logprobs is None
        if provide and reuses_samples(config):
            raise ValueError("the rollout skipped the policy's scoring pass, which reusing its samples reads")
        if provide:  # filled micro-batch by micro-batch by the update's forward (each row once: one epoch)
            rollout.logprobs = torch.zeros(rollout.response_ids.shape, device=rollout.response_ids.device)
        self.model.train()
        try:
            for _epoch in range(config.num_ppo_epochs):
                order = self.shuffled_rows(rollout)
                for mini_start in range(0, sizes.local_batch_size, sizes.local_mini_batch_size):
                    mini_batch = order[mini_start : mini_start + sizes.local_mini_batch_size]
                    num_items = self._tokens_per_micro_batch(mask[mini_batch])
                    loss_finite = True
                    for micro_start in range(
                        0, sizes.local_mini_batch_size, config.per_device_train_batch_size
                    ):
                        rows = mini_batch[micro_start : micro_start + config.per_device_train_batch_size]
                        finite = self._backward(rollout, rows, advantages, mask, num_items, stats, provide)
                        loss_finite = loss_finite and finite
                    if self._optimizer_step(loss_finite):
                        skipped += 1
                        warnings.warn(
                            f"update {update}: non-finite loss or gradient; step skipped",
                            RuntimeWarning,
                            stacklevel=2,
                        )
        finally:
            self.model.eval()
        return stats, skipped

    def _backward(
        self,
        rollout: Rollout,
        rows: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_items: torch.Tensor | None,
        stats: UpdateStats,
        provide: bool = False,
    ) -> bool:
        """One micro-batch's forward, loss and backward pass (its metrics added to ``stats``; with
        ``provide``, its detached log-probs written into ``rollout.logprobs``); returns whether its loss was
        finite.

        Its own method so that the micro-batch's autograd graph dies when it returns, before the next
        micro-batch's forward: a custom autograd function may keep its inputs as attributes of its context
        (bitsandbytes' int8 matmul on CPU keeps each layer's input), which a backward pass does not free.
        """
        config = self.config
        batch = rollout.select(rows)
        # whole prompt groups: each prompt is computed once, its k gradients flow into it
        packed = self.scorer.pack(batch) if self.grouped_micro_batches else None
        with self.model.policy(self.policy), self.parallelism.autocast():
            new_logprobs, entropy = self.scorer.completion_logprobs(batch, packed, with_entropy=True)
        # One epoch, one mini-batch: plain REINFORCE, the ratio is exactly 1 by construction (TRL 1.16:
        # old_per_token_logps = per_token_logps.detach()), whether or not the rollout scored the policy.
        old = batch.logprobs if reuses_samples(config) else new_logprobs.detach()
        if provide:
            rollout.logprobs[rows] = old.float()
        policy, loss = policy_loss(
            config, new_logprobs, old, batch.ref_logprobs, advantages[rows], mask[rows], num_items
        )
        # Every process runs every backward pass (gradients are averaged inside it); the gradients of a step
        # with a non-finite loss are thrown away by the caller.
        finite = bool(torch.isfinite(loss))
        self.parallelism.backward(loss / config.gradient_accumulation_steps)
        with torch.no_grad():
            stats.add(policy, entropy, batch.response_mask)
        return finite

    def _tokens_per_micro_batch(self, mini_batch_mask: torch.Tensor) -> torch.Tensor | None:
        """The ``dapo`` normaliser: the optimizer step's loss tokens over every process, divided by
        processes × accumulation steps (the step's gradient: the token mean of the step); else None."""
        if self.config.loss_type != "dapo":
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

    def _optimizer_step(self, loss_finite: bool) -> bool:
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
