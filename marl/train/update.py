"""The update step of RLOO: clipped policy-loss epochs over one rollout, and the optimizer steps they take,
for one policy or for several at once.

``num_ppo_epochs`` × ``num_mini_batches`` optimizer steps per rollout, each accumulating micro-batches of
``per_device_train_batch_size`` completions: the config's clipped policy loss (:mod:`marl.algo.losses`:
the sequence ratio of TRL v0.21's RLOO or a TRL 1.x token-level loss, with the k3 KL when it is in the
loss), gradients averaged over processes in the backward pass, clipped to ``max_grad_norm``, one step of
the LR schedule. A step whose loss or gradient is not finite on any process is skipped on every process;
the schedule still moves on. Where the rollout skipped the policy's scoring pass
(:mod:`marl.algo.scoring_passes`: one epoch, one mini-batch, no KL in the reward), each micro-batch's
forward provides those log-probs, detached, into the rollout (the ratio's old log-probs, and the metrics'
afterwards).

The loop (:func:`run_together`, its stages numbered) runs ONE micro-batch PER POLICY at every micro-batch
step, one after another, each a forward and a backward pass in that policy's own view. A single run is the
loop with one part (:meth:`PolicyUpdate.run`); a sweep (:class:`marl.train.sweep.SweepTrainer`) passes one
part per policy. Each part keeps its own rows, its own order of them (its own ``randperm`` draws, in the order
of the parts), its own loss settings, its own finiteness check and its own optimizer step; the epochs,
mini-batches and micro-batches are the same for every part (a sweep refuses batch settings that differ,
:mod:`marl.config.sweep`). Within a mini-batch, each micro-batch step runs the parts' micro-batches one after
another, each exactly as a single run runs its own: its rows alone, in its policy's view
(:meth:`marl.MultiAdapterModel.policy`, which switches the active adapter and restores every parameter's
``requires_grad``, so that every policy stays trainable), its loss divided by the accumulation steps, its
backward pass accumulating into its own adapter's gradients only (the other adapters are inactive in that
view, and their gradients accumulated so far are left as they are). Every policy's optimizer steps after the
mini-batch's last micro-batch.

Why not one forward and backward pass over every policy's rows, routed per row (:mod:`marl.model.rows`,
as the decode and scoring do)? Measured once (4 policies, cpu-long4 shapes:
``benchmarks/results/2026-11-26-sweep-cpu-long4.md``), that joint micro-batch was slower than the four runs'
separate updates and held every policy's activations at once (peak memory 1.83-1.93x a run's). One
micro-batch per policy holds one run's activations and gives each policy exactly its solo loss and
gradients, bit for bit in fp32 and in bf16 (tested in ``tests/train/test_sweep.py``).

Example:
    >>> step = PolicyUpdate(  # doctest: +SKIP
    ...     config, LossSettings.from_config(config), model, policy, sampler, scorer, parallelism, optimizer,
    ...     scheduler, sizes, parameters)
    >>> stats, skipped = step.run(rollout, advantages, update=1)  # doctest: +SKIP
    >>> parts = [UpdatePart(trainer.policy_update, rollout, advantages) for trainer, rollout, advantages
    ...          in members]  # doctest: +SKIP
    >>> results = run_together(parts, update=3)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.losses import LossSettings, loss_mask, policy_loss, truncation_warning
from marl.algo.metrics import UpdateStats
from marl.algo.scoring_passes import reuses_samples
from marl.cpu.allocator import release_freed_memory

if TYPE_CHECKING:
    from marl.config.batch_sizes import BatchSizes
    from marl.config.rloo_config import RLOOConfig
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rollout.completions import Rollout
    from marl.rollout.samplers import Sampler
    from marl.rollout.scoring import Scorer
    from marl.train.parallel import Parallelism


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

    def run(self, rollout: Rollout, advantages: torch.Tensor, update: int) -> tuple[UpdateStats, int]:
        """PPO-clip epochs over ``rollout`` (the ``update``-th, for warnings); returns this process's sums for
        the policy metrics and how many optimizer steps were skipped. The model is left in eval mode, also
        when a step fails. The loop is :func:`run_together`'s with this policy
        alone, the one a sweep runs with every policy."""
        return run_together([UpdatePart(self, rollout, advantages)], update)[0]

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
    """One policy's share of an update: its :class:`PolicyUpdate` (settings, optimizer,
    schedule), its rollout and advantages, and what the loop keeps for it (``label`` prefixes its warnings
    when several policies update together)."""

    step: PolicyUpdate
    rollout: Rollout
    advantages: torch.Tensor
    label: str = ""
    mask: torch.Tensor | None = None
    provide: bool = False
    stats: UpdateStats = dataclasses.field(default_factory=UpdateStats)
    skipped: int = 0

    def prepare(self, update: int) -> None:
        """The loss mask, the truncation warning, and the log-probs the update's forward provides where the
        rollout skipped the policy's scoring pass (:mod:`marl.algo.scoring_passes`)."""
        config, rollout = self.step.config, self.rollout
        self.mask = loss_mask(rollout.response_mask, rollout.contains_stop, self.step.loss)
        truncated = truncation_warning(rollout.contains_stop, self.step.loss, update)
        if truncated is not None:
            warnings.warn(self.label + truncated, RuntimeWarning, stacklevel=4)
        self.provide = rollout.logprobs is None
        if self.provide and reuses_samples(config):
            raise ValueError("the rollout skipped the policy's scoring pass, which reusing its samples reads")
        if self.provide:
            # filled micro-batch by micro-batch by the update's forward (each row once: one epoch)
            rollout.logprobs = torch.zeros(rollout.response_ids.shape, device=rollout.response_ids.device)


def run_together(parts: Sequence[UpdatePart], update: int) -> list[tuple[UpdateStats, int]]:
    """PPO-clip epochs over every part's rollout (the ``update``-th, for warnings); returns each part's sums
    for the policy metrics and how many of its optimizer steps were skipped. The model is left in eval mode,
    also when a step fails."""
    first = parts[0].step
    config, sizes = first.config, first.sizes
    for part in parts:
        part.prepare(update)
    first.model.train()
    try:
        # step 1. epochs: each a new random order of every part's rows
        for _epoch in range(config.num_ppo_epochs):
            orders = [part.step.shuffled_rows(part.rollout) for part in parts]
            # step 2. mini-batches: one optimizer step each
            for mini_start in range(0, sizes.local_batch_size, sizes.local_mini_batch_size):
                minis = [order[mini_start : mini_start + sizes.local_mini_batch_size] for order in orders]
                # step 3. micro-batches: gradients accumulated, one forward and backward pass per part each
                finite = accumulate(parts, minis)
                # step 4. the optimizer step of every part (skipped where a loss or gradient is not finite)
                for part, loss_finite in zip(parts, finite, strict=True):
                    if part.step.optimizer_step(loss_finite):
                        part.skipped += 1
                        warnings.warn(
                            f"{part.label}update {update}: non-finite loss or gradient; step skipped",
                            RuntimeWarning,
                            stacklevel=3,
                        )
    finally:
        first.model.eval()
    return [(part.stats, part.skipped) for part in parts]


def accumulate(parts: Sequence[UpdatePart], minis: Sequence[torch.Tensor]) -> list[bool]:
    """The gradients of one mini-batch of every part (``minis``: each part's rows of it), accumulated into
    each part's adapter: micro-batch step after micro-batch step, the parts' micro-batches one after another;
    returns whether each part's losses were all finite. The model must be in train mode; the optimizers do not
    step here."""
    micro_rows = parts[0].step.config.per_device_train_batch_size
    num_items = [
        part.step.tokens_per_micro_batch(part.mask[mini]) for part, mini in zip(parts, minis, strict=True)
    ]
    finite = [True] * len(parts)
    # With several policies the C heap kept the blocks each policy's micro-batch freed, beside the live
    # tensors, and grew with the policies (4 policies, cpu-long4 in 4-bit: the update's peak PSS 4456 MiB,
    # 2.2x a run's, while the tensors in use peaked at 1.25x a run's); given back after each policy's
    # micro-batch: 2675 MiB, 1.3x, and no slower. A single run keeps its heap for reuse.
    release_between_parts = len(parts) > 1 and parts[0].rollout.response_ids.device.type == "cpu"
    for micro_start in range(0, len(minis[0]), micro_rows):
        for index, (part, mini, items) in enumerate(zip(parts, minis, num_items, strict=True)):
            done = _backward(part, mini[micro_start : micro_start + micro_rows], items)
            finite[index] = finite[index] and done
            if release_between_parts:
                release_freed_memory()
    return finite


def _backward(part: UpdatePart, rows: torch.Tensor, num_items: torch.Tensor | None) -> bool:
    """One micro-batch of one part, in its policy's view: one forward, its loss (its metrics added to its
    stats; where it provides them, its detached log-probs written into its rollout), one backward pass;
    returns whether the loss was finite.

    Its own function so that the micro-batch's autograd graph dies when it returns, before the next
    micro-batch's forward (the next policy's, in a sweep): a custom autograd function may keep its inputs as
    attributes of its context (bitsandbytes' int8 matmul on CPU keeps each layer's input), which a backward
    pass does not free.
    """
    step, config = part.step, part.step.config
    batch = part.rollout.select(rows)
    # whole prompt groups: each prompt is computed once, its k gradients flow into it
    packed = step.scorer.pack(batch) if step.grouped_micro_batches else None
    # The backward pass runs in the view too: under gradient checkpointing it computes each layer's forward
    # again, which must see the same adapter.
    with step.model.policy(step.policy):
        with step.parallelism.autocast():
            new_logprobs, entropy = step.scorer.completion_logprobs(batch, packed, with_entropy=True)
        # One epoch, one mini-batch: plain REINFORCE, the ratio is exactly 1 by construction (TRL 1.16:
        # old_per_token_logps = per_token_logps.detach()), whether or not the rollout scored the policy.
        old = batch.logprobs if reuses_samples(config) else new_logprobs.detach()
        if part.provide:
            part.rollout.logprobs[rows] = old.float()
        policy, loss = policy_loss(
            step.loss,
            new_logprobs,
            old,
            batch.ref_logprobs,
            part.advantages[rows],
            part.mask[rows],
            num_items,
            batch.sampled_logprobs,
        )
        # Every process runs every backward pass (gradients are averaged inside it); the gradients of a step
        # with a non-finite loss are thrown away by the caller.
        finite = bool(torch.isfinite(loss))
        step.parallelism.backward(loss / config.gradient_accumulation_steps)
    with torch.no_grad():
        part.stats.add(policy, entropy, batch.response_mask, part.mask[rows])
    return finite
