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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.metrics import UpdateStats
from marl.train.joint_update import UpdatePart, run_together

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
        when a step fails. The loop is :func:`marl.train.joint_update.run_together`'s with this policy
        alone, the one a sweep runs with every policy."""
        return run_together([UpdatePart(self, rollout, advantages)], update)[0]

    def tokens_per_micro_batch(self, mini_batch_mask: torch.Tensor) -> torch.Tensor | None:
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
