"""RLOO math as pure functions on tensors.

Layout: a rollout holds ``k`` completions for each of ``P`` prompts in **k-major** order: row ``j * P + i``
is sample ``j`` of prompt ``i``, and ``tensor.view(k, P)`` puts the samples of one prompt in one column.

Names follow Ahmadian et al. (2024), "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs": the whole completion is one action, its reward is the reward-model score minus a
KL penalty against the reference policy, and the baseline of a completion is the mean reward of the other
``k - 1`` completions of the same prompt (leave-one-out).

A completion no reward source judged (NaN score) has no reward: it is left out of its group's baseline and
gets advantage 0, and so does a judged completion without a judged sibling. Normalisation statistics are
taken over the judged completions of every process (``gather`` concatenates a per-process tensor over
processes), so they do not depend on how the rollout is split over processes.

Example:
    >>> import torch
    >>> rewards = torch.tensor([1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    >>> leave_one_out_advantages(rewards, k=4)[0].item()
    -4.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# Added to standard deviations so that a batch of identical values normalises to zeros instead of NaN.
STD_EPSILON = 1e-8

# Concatenates a tensor of the same shape from every process along dim 0, in process order (accelerate's
# ``Accelerator.gather``); ``None`` stands for one process.
Gather = Callable[[torch.Tensor], torch.Tensor]


def apply_missing_eos_penalty(
    scores: torch.Tensor, contains_eos: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every completion that does not contain EOS.

    Example:
        >>> apply_missing_eos_penalty(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), 2.0)
        tensor([ 1., -1.])
    """
    return scores - penalty * (~contains_eos).to(scores.dtype)


def standardize(
    values: torch.Tensor, mask: torch.Tensor | None = None, gather: Gather | None = None
) -> torch.Tensor:
    """Z-score of the entries selected by ``mask`` (all by default), with the mean and unbiased standard
    deviation of the selected entries of every process (``gather``; ``None``: this process only). Entries
    outside ``mask`` come back unchanged; fewer than two selected entries in all map to 0.

    Example:
        >>> standardize(torch.tensor([1.0, 3.0]))
        tensor([-0.7071,  0.7071])
        >>> standardize(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([True, False, True]))
        tensor([-0.7071,     nan,  0.7071])
    """
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    pooled_values, pooled_mask = values, mask
    if gather is not None:  # one collective: values and mask side by side
        pooled = gather(torch.stack([values, mask.to(values.dtype)], dim=1))
        pooled_values, pooled_mask = pooled[:, 0], pooled[:, 1] > 0
    selected = pooled_values[pooled_mask]
    if selected.numel() < 2:
        return torch.where(mask, torch.zeros_like(values), values)
    standardized = (values - selected.mean()) / (selected.std() + STD_EPSILON)
    return torch.where(mask, standardized, values)


def normalize_and_clip_rewards(
    scores: torch.Tensor,
    clip_range: float,
    judged: torch.Tensor | None = None,
    gather: Gather | None = None,
) -> torch.Tensor:
    """Z-score the scores over the judged completions of the batch (of every process with ``gather``), then
    clip them to ``[-clip_range, clip_range]``; unjudged scores stay NaN.

    Example:
        >>> normalize_and_clip_rewards(torch.tensor([0.0, 0.0, 0.0, 100.0]), clip_range=1.0)
        tensor([-0.5000, -0.5000, -0.5000,  1.0000])
    """
    return standardize(scores, judged, gather).clamp(-clip_range, clip_range)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum over the valid positions; invalid positions contribute 0 even if they hold NaN or inf.

    Example:
        >>> masked_sum(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, False]]))
        tensor([1.])
    """
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=1)


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-completion KL estimate ``Σ_t (logp_t − ref_logp_t)`` over valid tokens, shape ``[B]``.

    Example:
        >>> mask = torch.tensor([[True, False]])
        >>> sequence_kl(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -5.0]]), mask)
        tensor([1.])
    """
    return masked_sum(logprobs - ref_logprobs, mask)


def rlhf_rewards(
    scores: torch.Tensor, seq_kl: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the sequence-level KL penalty into the reward.

    Returns:
        ``(rlhf_reward, non_score_reward)`` with ``non_score_reward = −kl_coef · seq_kl`` and
        ``rlhf_reward = scores + non_score_reward``.

    Example:
        >>> rlhf_rewards(torch.tensor([1.0]), torch.tensor([2.0]), kl_coef=0.1)
        (tensor([0.8000]), tensor([-0.2000]))
    """
    non_score_reward = -kl_coef * seq_kl
    return scores + non_score_reward, non_score_reward


def _check_groups(count: int, k: int) -> None:
    if k < 2:
        raise ValueError(f"leave-one-out needs k >= 2 samples per prompt, got k={k}")
    if count % k != 0:
        raise ValueError(f"{count} rewards cannot be split into groups of k={k}")


def leave_one_out_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """RLOO advantage: a completion's reward minus the mean of the other ``k − 1`` samples of its prompt.

    ``rewards`` is k-major, length ``k · P``.

    Example:
        >>> leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0]), k=2)
        tensor([-2., -3.,  2.,  3.])
    """
    _check_groups(rewards.numel(), k)
    per_prompt = rewards.view(k, -1)
    baseline = (per_prompt.sum(dim=0, keepdim=True) - per_prompt) / (k - 1)
    return (per_prompt - baseline).flatten()


def judged_leave_one_out_advantages(
    rewards: torch.Tensor, judged: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out advantages where only ``judged`` completions have a reward: the baseline of a completion
    is the mean reward of the JUDGED other samples of its prompt. An unjudged completion, and a judged one
    without a judged sibling, get advantage 0. With every completion judged this equals
    :func:`leave_one_out_advantages` bit for bit.

    Returns:
        ``(advantages, has_advantage)``; ``has_advantage[b]``: row ``b`` is judged with a judged sibling.

    Example:
        >>> rewards = torch.tensor([1.0, 2.0, 3.0, float("nan")])  # k=2: prompt 1 has one judged sample
        >>> judged_leave_one_out_advantages(rewards, ~rewards.isnan(), k=2)
        (tensor([-2.,  0.,  2.,  0.]), tensor([ True, False,  True, False]))
    """
    _check_groups(rewards.numel(), k)
    per_prompt, judged_per_prompt = rewards.view(k, -1), judged.view(k, -1)
    judged_rewards = torch.where(judged_per_prompt, per_prompt, torch.zeros_like(per_prompt))
    judged_count = judged_per_prompt.sum(dim=0, keepdim=True)
    baseline = (judged_rewards.sum(dim=0, keepdim=True) - judged_rewards) / (judged_count - 1)
    has_advantage = judged_per_prompt & (judged_count >= 2)
    advantages = torch.where(has_advantage, per_prompt - baseline, torch.zeros_like(per_prompt))
    return advantages.flatten(), has_advantage.flatten()


class PolicyLoss(NamedTuple):
    """Output of :func:`clipped_policy_loss`; every field except ``loss`` is detached, shape ``[B]``."""

    loss: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    clipped: torch.Tensor


def clipped_policy_loss(
    new_seq_logprob: torch.Tensor,
    old_seq_logprob: torch.Tensor,
    advantages: torch.Tensor,
    cliprange: float,
) -> PolicyLoss:
    """PPO clipped surrogate on the sequence ratio ``ρ = exp(Σ new_logp − Σ old_logp)``.

    ``loss = mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)))``. With ``ρ = 1`` (one epoch, one mini-batch) clipping
    is inactive and the gradient equals REINFORCE's ``−A · ∇ log π(completion)``.

    ``clipped[b]`` is True where the clipped branch is strictly larger (that sample gives no gradient).

    Example:
        >>> zero = torch.tensor([0.0])
        >>> out = clipped_policy_loss(zero, zero, torch.tensor([2.0]), cliprange=0.2)
        >>> out.loss.item(), out.ratio.item()
        (-2.0, 1.0)
    """
    log_ratio = new_seq_logprob - old_seq_logprob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = torch.max(unclipped_loss, clipped_loss).mean()
    return PolicyLoss(
        loss=loss,
        ratio=ratio.detach(),
        log_ratio=log_ratio.detach(),
        clipped=(clipped_loss > unclipped_loss).detach(),
    )


def token_level_k3_kl(
    new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 KL estimator ``exp(ref − new) − (ref − new) − 1`` on valid tokens, else 0; ``[B, T]``.

    k3 is non-negative and unbiased for KL(π‖π_ref) under samples from π. With ``token_level_kl=True`` the
    trainer adds ``kl_coef · Σ_t k3_t`` (mean over completions) to the loss instead of folding KL into the
    reward.

    Example:
        >>> token_level_k3_kl(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([[True]]))
        tensor([[0.]])
    """
    # Masked before exp: after the stop token the log-probs are unconstrained, and exp of a large difference
    # there is inf, whose local gradient times the mask's 0 is NaN in backward. A masked log-ratio of 0 gives
    # k3 = 0 and a zero gradient.
    log_ratio_ref = torch.where(mask, ref_logprobs - new_logprobs, torch.zeros_like(new_logprobs))
    return torch.exp(log_ratio_ref) - log_ratio_ref - 1.0


class ShapedRewards(NamedTuple):
    """Rewards and advantages of one rollout, one value per completion (k-major). ``scores`` and
    ``rlhf_reward`` are NaN where no source judged the completion; its advantage is 0."""

    scores: torch.Tensor  # after the missing-EOS penalty and normalisation
    kl: torch.Tensor  # Σ_t (logp_t − ref_logp_t) over valid tokens
    non_score_reward: torch.Tensor  # −kl_coef · kl
    rlhf_reward: torch.Tensor  # scores + non_score_reward
    advantages: torch.Tensor
    judged: torch.Tensor  # bool: at least one reward source judged the completion


def shape_rewards(
    raw_scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    contains_stop: torch.Tensor,
    *,
    k: int,
    kl_coef: float,
    missing_eos_penalty: float | None = None,
    normalize_reward: bool = False,
    reward_clip_range: float = 10.0,
    token_level_kl: bool = False,
    normalize_advantage: bool = False,
    gather: Gather | None = None,
) -> ShapedRewards:
    """From the reward source's scores and the rollout's log-probs to RLOO advantages, in this order:
    missing-stop-token penalty, reward normalisation and clipping, the sequence KL folded into the reward,
    leave-one-out advantages, advantage normalisation.

    ``raw_scores`` is NaN where no source judged a completion: such a completion has no reward, is left out of
    its group's baseline and of the normalisation statistics, and gets advantage 0 (as does a judged one with
    no judged sibling). Reward normalisation uses the judged completions, advantage normalisation the
    completions that have an advantage; with ``gather`` (e.g. ``accelerator.gather``) those of every process,
    so that the result does not depend on the number of processes. ``gather=None`` is one process; every
    process must then call this function, as with any collective.

    With ``token_level_kl`` the advantages come from the scores alone: the KL then enters the loss per token
    (:func:`token_level_k3_kl`), and ``rlhf_reward`` only reports the sequence-level view.

    Example:
        >>> zero = torch.zeros(4, 1)
        >>> shaped = shape_rewards(torch.tensor([1.0, 2.0, 3.0, 5.0]), zero, zero, zero.bool(),
        ...                        torch.ones(4, dtype=torch.bool), k=2, kl_coef=0.1)
        >>> shaped.advantages
        tensor([-2., -3.,  2.,  3.])
    """
    judged = ~torch.isnan(raw_scores)
    scores = raw_scores
    if missing_eos_penalty is not None:
        scores = apply_missing_eos_penalty(scores, contains_stop, missing_eos_penalty)
    if normalize_reward:
        scores = normalize_and_clip_rewards(scores, reward_clip_range, judged, gather)
    kl = sequence_kl(logprobs, ref_logprobs, response_mask)
    rlhf_reward, non_score_reward = rlhf_rewards(scores, kl, kl_coef)
    advantages, has_advantage = judged_leave_one_out_advantages(
        scores if token_level_kl else rlhf_reward, judged, k
    )
    if normalize_advantage:
        advantages = standardize(advantages, has_advantage, gather)
    return ShapedRewards(scores, kl, non_score_reward, rlhf_reward, advantages, judged)
