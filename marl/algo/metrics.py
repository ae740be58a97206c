"""RLOO metrics: per-process sums kept in typed records, summed over processes in one collective (by the run's
:class:`marl.train.parallel.Parallelism`), then turned into the logged means.

Sums run over valid completion tokens only (up to and including the stop token, never padding), and every
mean is taken after the sums of all processes are added, so it is the mean over the whole batch.

A completion that no reward source judged has no reward: ``objective/scores``, ``objective/rlhf_reward`` and
``objective/non_score_reward`` are means over the judged completions (so that rlhf_reward = scores +
non_score_reward holds for the logged means too; NaN when none was judged), ``rewards/<name>`` over the
completions that source judged, and ``objective/kl`` and ``objective/entropy``, which every sample has, over
all completions. ``objective/unjudged`` counts the completions no source judged, over all processes.
``objective/kl`` is left out where no reference pass ran (``kl_coef`` 0, :mod:`marl.algo.passes`).

Example:
    >>> stats = RolloutStats(kl=2.0, entropy=6.0, non_score_reward=-0.1, rlhf_reward=1.9, scores=2.0,
    ...                      num_eos=1.0, completions=2.0, kl_completions=2.0, judged=1.0,
    ...                      source_sums=torch.tensor([3.0]), source_counts=torch.tensor([2.0]))
    >>> metrics = rollout_metrics(stats, ["sentiment"])
    >>> metrics["rewards/sentiment"], metrics["objective/scores"], metrics["objective/unjudged"]
    (1.5, 2.0, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from marl.algo.losses import PolicyLoss
from marl.algo.shaping import ShapedRewards
from marl.algo.tensors import masked_sum


@dataclass
class RolloutStats:
    """Sums over one process's completions of a rollout; the reward sums over its judged completions."""

    kl: float
    entropy: float  # Σ_t −log π(y_t) of the sampled tokens
    non_score_reward: float
    rlhf_reward: float
    scores: float
    num_eos: float  # completions with an end-of-sequence id among their valid tokens
    completions: float
    kl_completions: float  # completions whose KL was computed: all, or none where no reference pass ran
    judged: float  # completions at least one reward source judged
    source_sums: torch.Tensor  # [S] each reward source's scores, over the completions it judged
    source_counts: torch.Tensor  # [S] how many completions each source judged

    @classmethod
    def of(cls, rollout: Any, shaped: ShapedRewards) -> RolloutStats:
        """From a :class:`marl.rollout.records.Rollout` (with the policy's log-probs, which the update
        provides where the rollout skipped that pass) and its shaped rewards."""
        source_judged = ~torch.isnan(rollout.source_scores)

        def judged_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.where(shaped.judged, values, torch.zeros_like(values)).sum()

        return cls(
            kl=0.0 if shaped.kl is None else shaped.kl.sum(),
            entropy=masked_sum(-rollout.logprobs, rollout.response_mask).sum(),
            non_score_reward=judged_sum(shaped.non_score_reward),
            rlhf_reward=judged_sum(shaped.rlhf_reward),
            scores=judged_sum(shaped.scores),
            num_eos=rollout.contains_eos.sum(),
            completions=float(rollout.contains_eos.numel()),
            kl_completions=0.0 if shaped.kl is None else float(shaped.kl.numel()),
            judged=shaped.judged.sum(),
            source_sums=torch.where(source_judged, rollout.source_scores, 0.0).sum(dim=0),
            source_counts=source_judged.sum(dim=0),
        )


@dataclass
class UpdateStats:
    """Sums over one process's micro-batches of an update. ``first_ratio`` sums the sequence ratios of the
    update's first micro-batch, which must be 1 when the update sees the function the rollout scored."""

    approxkl: float | torch.Tensor = 0.0
    clipped: float | torch.Tensor = 0.0
    loss: float | torch.Tensor = 0.0
    ratio: float | torch.Tensor = 0.0
    ratio_squared: float | torch.Tensor = 0.0
    completions: float | torch.Tensor = 0.0
    entropy: float = 0.0  # Σ over valid tokens of the temperature-scaled policy entropy
    tokens: float | torch.Tensor = 0.0
    first_ratio: float | torch.Tensor = 0.0
    first_completions: float | torch.Tensor = 0.0
    _first_seen: bool = field(default=False, repr=False, compare=False)

    def add(self, policy: PolicyLoss, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one micro-batch: its policy-loss output and per-token entropies with their validity mask."""
        count = policy.ratio.numel()
        self.approxkl += (0.5 * policy.log_ratio**2).sum()
        self.clipped += policy.clipped.sum()
        self.loss += policy.loss.detach() * count
        self.ratio += policy.ratio.sum()
        self.ratio_squared += (policy.ratio**2).sum()
        self.completions += count
        self.entropy += torch.where(mask, entropy, torch.zeros_like(entropy)).sum()
        self.tokens += mask.sum()
        if not self._first_seen:
            self.first_ratio += policy.ratio.sum()
            self.first_completions += count
            self._first_seen = True


def rollout_metrics(stats: RolloutStats, source_names: list[str]) -> dict[str, float]:
    """The ``objective/*`` means of a rollout and each reward source's mean ``rewards/<name>`` (over the
    completions it judged), from sums over all processes; see the module docstring for which completions each
    mean is over."""
    count, judged = stats.completions, stats.judged

    def judged_mean(total: float) -> float:
        return total / judged if judged > 0 else math.nan

    per_source = {
        f"rewards/{name}": float(total / judged) if judged > 0 else math.nan
        for name, total, judged in zip(source_names, stats.source_sums, stats.source_counts, strict=True)
    }
    kl = {"objective/kl": stats.kl / stats.kl_completions} if stats.kl_completions > 0 else {}
    return {
        **per_source,
        **kl,
        "objective/entropy": stats.entropy / count,
        "objective/non_score_reward": judged_mean(stats.non_score_reward),
        "objective/rlhf_reward": judged_mean(stats.rlhf_reward),
        "objective/scores": judged_mean(stats.scores),
        "objective/unjudged": count - judged,
        "val/num_eos_tokens": stats.num_eos,
    }


def update_metrics(stats: UpdateStats) -> dict[str, float]:
    """The ``policy/*``, ``loss/*`` and ``val/ratio*`` means of an update, from sums over all processes.

    Example:
        >>> update_metrics(UpdateStats(ratio=4.0, ratio_squared=4.0, completions=4.0, tokens=1.0,
        ...                            first_ratio=2.0, first_completions=2.0))["val/ratio_first"]
        1.0
    """
    count = stats.completions
    ratio = stats.ratio / count
    return {
        "policy/approxkl_avg": stats.approxkl / count,
        "policy/clipfrac_avg": stats.clipped / count,
        "loss/policy_avg": stats.loss / count,
        "policy/entropy_avg": stats.entropy / max(stats.tokens, 1.0),
        "val/ratio": ratio,
        "val/ratio_var": max(stats.ratio_squared / count - ratio**2, 0.0),
        "val/ratio_first": stats.first_ratio / stats.first_completions,
    }
