"""From the reward sources' scores and the rollout's log-probs to one reward and one advantage per completion.

The order is that of Ahmadian et al. (2024) and TRL's RLOO: missing-stop-token penalty, reward normalisation
and clipping, the sequence KL against the reference folded into the reward (or, with ``token_level_kl``, left
to the loss), the advantage estimator (leave-one-out by default, see :mod:`marl.algo.advantages`), advantage
normalisation. With ``per_reward`` (:mod:`marl.algo.reward_normalization`) each source is normalised within
its group first and the penalty and KL are added to the weighted sum of those. Rows are k-major, as
everywhere in :mod:`marl.algo`.

A completion no reward source judged (NaN score) has no reward and is left out of every statistic.
Normalisation statistics are taken over the completions of every process (``gather`` concatenates a
per-process tensor over processes), so they do not depend on how the rollout is split over processes.

Example:
    >>> import torch
    >>> rlhf_rewards(torch.tensor([1.0]), torch.tensor([2.0]), kl_coef=0.5)[0]
    tensor([0.])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from marl.algo.advantages import AdvantageEstimator, has_judged_sibling, rloo_advantages
from marl.algo.reward_normalization import (
    GDPO_STD_EPSILON,
    PerRewardNormalization,
    group_normalized_sources,
    source_advantages,
    weighted_sources,
)
from marl.algo.tensors import STD_EPSILON, Gather, sequence_kl, standardize


def apply_missing_eos_penalty(
    scores: torch.Tensor, contains_eos: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every completion that does not contain EOS.

    Example:
        >>> apply_missing_eos_penalty(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), 2.0)
        tensor([ 1., -1.])
    """
    return scores - penalty * (~contains_eos).to(scores.dtype)


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


class ShapedRewards(NamedTuple):
    """Rewards and advantages of one rollout, one value per completion (k-major). ``scores`` and
    ``rlhf_reward`` are NaN where no source judged the completion; its advantage is 0."""

    scores: torch.Tensor  # after the missing-EOS penalty and normalisation
    kl: torch.Tensor | None  # Σ_t (logp_t − ref_logp_t) over valid tokens; None: not (yet) computed
    non_score_reward: torch.Tensor  # −kl_coef · kl (0 without a KL)
    rlhf_reward: torch.Tensor  # scores + non_score_reward
    advantages: torch.Tensor
    judged: torch.Tensor  # bool: at least one reward source judged the completion
    # [B, S] each reward source's part of the advantage before any scale (see
    # marl.algo.reward_normalization.source_advantages); None without the sources' scores or a centring
    source_advantages: torch.Tensor | None = None

    def with_kl(self, kl: torch.Tensor, kl_coef: float) -> ShapedRewards:
        """These rewards reporting the sequence KL ``kl``, computed after the advantages (which it did not
        enter: the KL is in the loss, or its coefficient is 0).

        Example:
            >>> one = torch.ones(1)
            >>> ShapedRewards(one, None, 0 * one, one, one, one.bool()).with_kl(2 * one, 0.5).rlhf_reward
            tensor([0.])
        """
        rlhf_reward, non_score_reward = rlhf_rewards(self.scores, kl, kl_coef)
        return self._replace(kl=kl, non_score_reward=non_score_reward, rlhf_reward=rlhf_reward)


def shape_rewards(
    raw_scores: torch.Tensor,
    logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
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
    advantage_epsilon: float = STD_EPSILON,
    gather: Gather | None = None,
    estimator: AdvantageEstimator = rloo_advantages,
    source_scores: torch.Tensor | None = None,
    reward_weights: torch.Tensor | None = None,
    per_reward: PerRewardNormalization | None = None,
    centring: AdvantageEstimator | None = None,
) -> ShapedRewards:
    """From the reward source's scores and the rollout's log-probs to advantages, in this order:
    missing-stop-token penalty, reward normalisation and clipping, the sequence KL folded into the reward,
    ``estimator`` (the judged leave-one-out of RLOO by default), advantage normalisation (by the std plus
    ``advantage_epsilon``).

    ``raw_scores`` is NaN where no source judged a completion: such a completion has no reward, is left out of
    its group's baseline and of the normalisation statistics, and gets advantage 0 (as does a judged one with
    no judged sibling). Reward normalisation uses the judged completions, advantage normalisation the judged
    completions with a judged sibling (the others keep the estimator's advantage, 0 for RLOO); with ``gather``
    (e.g. ``accelerator.gather``) those of every process, so that the result does not depend on the number of
    processes. ``gather=None`` is one process; every process must then call this function, as with any
    collective. ``gather`` is also handed to the estimator.

    With ``token_level_kl`` the advantages come from the scores alone: the KL then enters the loss per token
    (:func:`marl.algo.losses.token_level_k3_kl`), and ``rlhf_reward`` only reports the sequence-level view.
    ``logprobs`` or ``ref_logprobs`` is ``None`` where the rollout skipped that pass
    (:mod:`marl.algo.passes`): the KL is then ``None`` (see :meth:`ShapedRewards.with_kl`), which the
    advantages must not need.

    ``source_scores`` ``[B, S]`` (each source's own scores, NaN where it did not judge) with
    ``reward_weights`` ``[S]``: with ``centring`` (:func:`marl.algo.reward_normalization.advantage_centring`)
    each source's part of the advantage is returned; with ``per_reward`` the estimator sees the weighted sum
    of the sources' group normalised scores (minus the missing-EOS penalty and, in the reward,
    ``kl_coef · KL``) instead of ``raw_scores``, takes ``per_reward.estimator``'s baseline, and the
    advantages are z-scored over the judged completions of the batch (std + 1e-4; one without a judged sibling
    counts as its advantage 0, as in TRL's ``normalize_then_sum``). ``scores`` and ``rlhf_reward`` still
    report the raw weighted sum.

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
    if logprobs is not None and ref_logprobs is not None:
        kl = sequence_kl(logprobs, ref_logprobs, response_mask)
        rlhf_reward, non_score_reward = rlhf_rewards(scores, kl, kl_coef)
    elif kl_coef != 0 and not token_level_kl:
        raise ValueError("a KL folded into the reward needs the policy's and the reference's log-probs")
    else:
        kl, rlhf_reward, non_score_reward = None, scores, torch.zeros_like(scores)
    terms = None if source_scores is None else source_scores * reward_weights.to(source_scores.dtype)
    if per_reward is None:
        advantages = estimator(scores if token_level_kl else rlhf_reward, judged, k, gather)
        if normalize_advantage:
            advantages = standardize(advantages, has_judged_sibling(judged, k), gather, advantage_epsilon)
    else:
        if source_scores is None or normalize_reward or normalize_advantage:
            raise ValueError(
                "per_reward needs source_scores and excludes normalize_reward/normalize_advantage"
            )
        terms = group_normalized_sources(source_scores, k, scale=per_reward.scale)
        terms = terms * reward_weights.to(terms.dtype)
        reward = weighted_sources(terms, torch.ones(terms.shape[1]))
        if missing_eos_penalty is not None:
            reward = apply_missing_eos_penalty(reward, contains_stop, missing_eos_penalty)
        if not token_level_kl:
            reward = reward + non_score_reward
        advantages = per_reward.estimator(reward, judged, k, gather)
        # Every judged completion counts in the batch statistics, one without a judged sibling as its 0: TRL's
        # normalize_then_sum keeps it so (leaving it out scaled every other advantage by sqrt((n-1)/n)).
        advantages = standardize(advantages, judged, gather, GDPO_STD_EPSILON)
    parts = None if terms is None or centring is None else source_advantages(terms, judged, k, centring)
    return ShapedRewards(scores, kl, non_score_reward, rlhf_reward, advantages, judged, parts)
