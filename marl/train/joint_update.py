"""The loop of an update, for one policy or for several at once: every micro-batch step runs ONE micro-batch
PER POLICY, one after another, each a forward and a backward pass in that policy's own view.

A single run is the loop with one part (:meth:`marl.train.update.PolicyUpdate.run`); a sweep
(:class:`marl.train.sweep.SweepTrainer`) passes one part per policy. Each part keeps its own rows, its own
order of them (its own ``randperm`` draws, in the order of the parts), its own loss settings, its own
finiteness check and its own optimizer step; the epochs, mini-batches and micro-batches are the same for every
part (a sweep refuses batch settings that differ, :mod:`marl.sweep_settings`). Within a mini-batch, each
micro-batch step runs the parts' micro-batches one after another, each exactly as a single run runs its own:
its rows alone, in its policy's view (:meth:`marl.MultiAdapterModel.policy`, which switches the active
adapter and restores every parameter's ``requires_grad``, so that every policy stays trainable), its loss
divided by the accumulation steps, its backward pass accumulating into its own adapter's gradients only (the
other adapters are inactive in that view, and their gradients accumulated so far are left as they are).
Every policy's optimizer steps after the mini-batch's last micro-batch.

Why not one forward and backward pass over every policy's rows, routed per row (:mod:`marl.model.routing`,
as the decode and scoring do)? Measured once (4 policies, cpu-long4 shapes:
``benchmarks/results/2026-11-26-sweep-cpu-long4.md``), that joint micro-batch was slower than the four runs'
separate updates and held every policy's activations at once (peak memory 1.83-1.93x a run's). One
micro-batch per policy holds one run's activations and gives each policy exactly its solo loss and
gradients, bit for bit in fp32 and in bf16 (tested in ``tests/train/test_sweep.py``).

Example:
    >>> parts = [UpdatePart(trainer.policy_update, rollout, advantages) for trainer, rollout, advantages
    ...          in members]  # doctest: +SKIP
    >>> results = run_together(parts, update=3)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from marl.algo.metrics import UpdateStats
from marl.algo.passes import reuses_samples
from marl.algo.selection import loss_mask, policy_loss, truncation_warning
from marl.cpu_allocator import release_freed_memory

if TYPE_CHECKING:
    from marl.rollout.records import Rollout
    from marl.train.update import PolicyUpdate


@dataclasses.dataclass
class UpdatePart:
    """One policy's share of an update: its :class:`~marl.train.update.PolicyUpdate` (settings, optimizer,
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
        rollout skipped the policy's scoring pass (:mod:`marl.algo.passes`)."""
        config, rollout = self.step.config, self.rollout
        self.mask = loss_mask(rollout.response_mask, rollout.contains_stop, config)
        truncated = truncation_warning(rollout.contains_stop, config, update)
        if truncated is not None:
            warnings.warn(self.label + truncated, RuntimeWarning, stacklevel=4)
        self.provide = rollout.logprobs is None
        if self.provide and reuses_samples(config):
            raise ValueError("the rollout skipped the policy's scoring pass, which reusing its samples reads")
        if (
            self.provide
        ):  # filled micro-batch by micro-batch by the update's forward (each row once: one epoch)
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
        for _epoch in range(config.num_ppo_epochs):
            orders = [part.step.shuffled_rows(part.rollout) for part in parts]
            for mini_start in range(0, sizes.local_batch_size, sizes.local_mini_batch_size):
                minis = [order[mini_start : mini_start + sizes.local_mini_batch_size] for order in orders]
                finite = accumulate(parts, minis)
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
            config, new_logprobs, old, batch.ref_logprobs, part.advantages[rows], part.mask[rows], num_items
        )
        # Every process runs every backward pass (gradients are averaged inside it); the gradients of a step
        # with a non-finite loss are thrown away by the caller.
        finite = bool(torch.isfinite(loss))
        step.parallelism.backward(loss / config.gradient_accumulation_steps)
    with torch.no_grad():
        part.stats.add(policy, entropy, batch.response_mask)
    return finite
