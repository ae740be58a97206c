"""The loop of an update, for one policy or for several at once: every micro-batch is ONE forward and ONE
backward pass over the rows of every policy, each row routed through its own policy's adapter.

A single run is the loop with one part (:meth:`marl.train.update.PolicyUpdate.run`); a sweep
(:class:`marl.train.sweep.SweepTrainer`) passes one part per policy. Each part keeps its own rows, its own
order of them (its own ``randperm`` draws, in the order of the parts), its own loss settings, its own
finiteness check and its own optimizer step; the epochs, mini-batches and micro-batches are the same for every
part (a sweep refuses batch settings that differ, :mod:`marl.sweep_settings`). The micro-batch's rows are the
parts' micro-batches one after another (:func:`marl.rollout.records.concat_samples`), run in
:meth:`marl.rollout.scoring.Scorer.rows_view`: one part runs in its policy's own view, exactly as a single
run always has; several are routed per row (:mod:`marl.model.routing`). The loss is the sum of the parts'
losses: a policy's adapter sees only its own rows, so its gradient is that of its own loss alone (and a part
whose loss is not finite spoils no other part's gradient: rows never mix in the base's layers).

Example:
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

from marl.algo.metrics import UpdateStats
from marl.algo.passes import reuses_samples
from marl.algo.selection import loss_mask, policy_loss, truncation_warning
from marl.rollout.records import concat_samples

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
                num_items = [
                    part.step.tokens_per_micro_batch(part.mask[mini])
                    for part, mini in zip(parts, minis, strict=True)
                ]
                finite = [True] * len(parts)
                for micro_start in range(0, sizes.local_mini_batch_size, config.per_device_train_batch_size):
                    end = micro_start + config.per_device_train_batch_size
                    done = _backward(parts, [mini[micro_start:end] for mini in minis], num_items)
                    finite = [before and now for before, now in zip(finite, done, strict=True)]
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


def _backward(
    parts: Sequence[UpdatePart], rows: list[torch.Tensor], num_items: list[torch.Tensor | None]
) -> list[bool]:
    """One micro-batch of every part: one forward, each part's loss (its metrics added to its stats; where it
    provides them, its detached log-probs written into its rollout), one backward pass of their sum; returns
    whether each part's loss was finite.

    Its own function so that the micro-batch's autograd graph dies when it returns, before the next
    micro-batch's forward: a custom autograd function may keep its inputs as attributes of its context
    (bitsandbytes' int8 matmul on CPU keeps each layer's input), which a backward pass does not free.
    """
    first = parts[0].step
    batches = [part.rollout.select(part_rows) for part, part_rows in zip(parts, rows, strict=True)]
    batch = batches[0] if len(parts) == 1 else concat_samples(batches, first.scorer.pad_token_id)
    # whole prompt groups: each prompt is computed once, its k gradients flow into it
    packed = first.scorer.pack(batch) if first.grouped_micro_batches else None
    names = [
        part.step.policy
        for part, own in zip(parts, batches, strict=True)
        for _ in range(own.response_ids.shape[0])
    ]
    # The backward pass runs in the view too: under gradient checkpointing it computes each layer's forward
    # again, which must see the same adapters (and, for several policies, the same routes).
    with first.scorer.rows_view(names, batch.prompt_index, packed):
        with first.parallelism.autocast():
            new_logprobs, entropy = first.scorer.completion_logprobs(batch, packed, with_entropy=True)
        losses, finite, terms = _losses(parts, batches, rows, num_items, new_logprobs, entropy)
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        first.parallelism.backward(total)
    with torch.no_grad():
        for part, (policy, own_entropy, response_mask) in zip(parts, terms, strict=True):
            part.stats.add(policy, own_entropy, response_mask)
    return finite


def _losses(
    parts: Sequence[UpdatePart],
    batches: list[Any],
    rows: list[torch.Tensor],
    num_items: list[torch.Tensor | None],
    new_logprobs: torch.Tensor,
    entropy: torch.Tensor,
) -> tuple[list[torch.Tensor], list[bool], list[tuple[Any, torch.Tensor, torch.Tensor]]]:
    """Each part's loss (divided by its accumulation steps) on its own rows of the micro-batch's log-probs,
    whether it is finite, and what its metrics read."""
    losses, finite, terms, start = [], [], [], 0
    for part, own, part_rows, items in zip(parts, batches, rows, num_items, strict=True):
        config, count = part.step.config, own.response_ids.shape[0]
        new, own_entropy = new_logprobs, entropy
        if len(parts) > 1:
            new, own_entropy = new_logprobs[start : start + count], entropy[start : start + count]
        start += count
        # One epoch, one mini-batch: plain REINFORCE, the ratio is exactly 1 by construction (TRL 1.16:
        # old_per_token_logps = per_token_logps.detach()), whether or not the rollout scored the policy.
        old = own.logprobs if reuses_samples(config) else new.detach()
        if part.provide:
            part.rollout.logprobs[part_rows] = old.float()
        policy, loss = policy_loss(
            config, new, old, own.ref_logprobs, part.advantages[part_rows], part.mask[part_rows], items
        )
        # Every process runs every backward pass (gradients are averaged inside it); the gradients of a step
        # with a non-finite loss are thrown away by the caller.
        finite.append(bool(torch.isfinite(loss)))
        losses.append(loss / config.gradient_accumulation_steps)
        terms.append((policy, own_entropy, own.response_mask))
    return losses, finite, terms
