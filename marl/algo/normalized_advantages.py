"""Advantage estimators with a mean baseline and a standard-deviation scale: GRPO's group baseline (Shao et
al., 2024, as TRL 1.x's ``GRPOTrainer`` computes it, with its ``scale_rewards``) and REINFORCE++'s batch
baseline (Hu, 2025). :mod:`marl.algo.advantages` registers them as ``"grpo"`` and ``"reinforce_pp"``.

Rows are k-major (row ``j * P + i`` is sample ``j`` of prompt ``i``). A completion no reward source judged
(``judged`` False, reward NaN) is left out of every mean and standard deviation and gets advantage 0.

Example:
    >>> import torch
    >>> rewards = torch.tensor([1.0, 0.0, 3.0, 0.0])  # k=2, P=2: prompt 0 has 1 and 3, prompt 1 has 0 and 0
    >>> grpo_advantages(rewards, torch.ones(4, dtype=torch.bool), 2, scale_rewards="none")
    tensor([-1.,  0.,  1.,  0.])
"""

from __future__ import annotations

import torch

from marl.algo.tensors import Gather, standardize

# TRL 1.x's GRPOTrainer divides by (std + 1e-4), not by the 1e-8 of marl's other z-scores.
GRPO_STD_EPSILON = 1e-4
SCALE_REWARDS = ("group", "batch", "none")


def unbiased_std(values: torch.Tensor, selected: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Standard deviation with Bessel's correction over the ``selected`` entries (along ``dim``, kept as a
    dimension of size 1, or of all): TRL's own ``nanstd`` (its GRPO and RLOO trainers' group std) over the
    values with the others as NaN; NaN where fewer than two entries are selected.

    Example:
        >>> values = torch.tensor([[1.0, 5.0], [3.0, 7.0], [9.0, 0.0]])
        >>> selected = torch.tensor([[True, True], [True, True], [False, True]])
        >>> unbiased_std(values, selected, dim=0)
        tensor([[1.4142, 3.6056]])
    """
    # Imported here: trl's utilities pull in most of transformers, which the pure math does not need.
    from trl.trainer.utils import nanstd

    return nanstd(torch.where(selected, values, float("nan")), dim=dim, keepdim=dim is not None)


def grpo_advantages(
    rewards: torch.Tensor,
    judged: torch.Tensor,
    k: int,
    gather: Gather | None = None,
    *,
    scale_rewards: str = "group",
) -> torch.Tensor:
    """GRPO: a completion's reward minus the mean reward of its prompt's judged completions, divided by
    ``std + 1e-4`` where ``std`` is the unbiased standard deviation of the judged rewards of its prompt
    (``scale_rewards="group"``) or of the whole batch over every process (``"batch"``), or not divided
    (``"none"``). TRL 1.16's ``GRPOConfig.scale_rewards`` with the same names.

    A judged completion without a judged sibling gets 0 (its reward is its group's mean), as does every
    unjudged completion.

    Example:
        >>> rewards = torch.tensor([1.0, 2.0, 3.0, float("nan")])
        >>> grpo_advantages(rewards, ~rewards.isnan(), 2)
        tensor([-0.7071,  0.0000,  0.7071,  0.0000])
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: use one of {SCALE_REWARDS}")
    if k < 2 or rewards.numel() % k != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of k={k} >= 2")
    per_prompt, judged_per_prompt = rewards.view(k, -1), judged.view(k, -1)
    count = judged_per_prompt.sum(dim=0, keepdim=True)
    judged_rewards = torch.where(judged_per_prompt, per_prompt, torch.zeros_like(per_prompt))
    advantages = per_prompt - judged_rewards.sum(dim=0, keepdim=True) / count
    if scale_rewards == "group":
        advantages = advantages / (unbiased_std(per_prompt, judged_per_prompt, dim=0) + GRPO_STD_EPSILON)
    elif scale_rewards == "batch":
        pooled_rewards, pooled_judged = rewards, judged
        if gather is not None:  # one collective: rewards and judged side by side
            pooled = gather(torch.stack([rewards, judged.to(rewards.dtype)], dim=1))
            pooled_rewards, pooled_judged = pooled[:, 0], pooled[:, 1] > 0
        advantages = advantages / (unbiased_std(pooled_rewards, pooled_judged, dim=None) + GRPO_STD_EPSILON)
    has_advantage = judged_per_prompt & (count >= 2)
    advantages = torch.where(has_advantage, advantages, torch.zeros_like(advantages))
    return advantages.flatten()


def reinforce_pp_advantages(
    rewards: torch.Tensor, judged: torch.Tensor, k: int, gather: Gather | None = None
) -> torch.Tensor:
    """REINFORCE++: a completion's reward minus the mean reward of the batch, divided by the batch's unbiased
    standard deviation (+ 1e-8); statistics over the judged completions of every process (``gather``), so the
    result does not depend on how the batch is split. Every judged completion gets an advantage (the
    baseline is not its group's), unjudged ones 0; fewer than two judged completions in all give 0.

    Example:
        >>> reinforce_pp_advantages(torch.tensor([1.0, 3.0, float("nan"), 2.0]),
        ...                         torch.tensor([True, True, False, True]), 2)
        tensor([-1.,  1.,  0.,  0.])
    """
    if k < 1 or rewards.numel() % k != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of k={k}")
    advantages = standardize(rewards, judged, gather)
    return torch.where(judged, advantages, torch.zeros_like(advantages))
