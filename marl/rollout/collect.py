"""One rollout: prompts in, sampled and scored completions out, with no gradients.

1. the sampler (:mod:`marl.rollout.samplers`) draws ``k`` completions of every prompt under the policy,
   cut after their stop token (:class:`marl.rollout.records.Samples`, k-major: row ``j * P + i`` is sample
   ``j`` of prompt ``i``);
2. the scorer (:class:`marl.rollout.scoring.Scorer`) computes their policy and reference log-probs in
   float32 at the sampling temperature (the passes the algorithm reads, :mod:`marl.algo.passes`), and the
   rows the reward sources read;
3. the reward adds its scores: a :class:`marl.rollout.records.Rollout` holds everything an update needs.

Example:
    >>> rollout = collect_rollout(sampler, scorer, prompts, k=4, reward=reward)  # doctest: +SKIP
    >>> rollout.scores.shape  # doctest: +SKIP
    torch.Size([32])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.passes import POLICY_PASS
from marl.algo.shaping import ShapedRewards
from marl.algo.tensors import sequence_kl
from marl.model.memory import release_freed_memory
from marl.rollout.records import Rollout, Samples

if TYPE_CHECKING:
    from marl.rewards import WeightedRewards
    from marl.rollout.prompts import Prompt
    from marl.rollout.samplers import Sampler
    from marl.rollout.scoring import Scorer


def collect_rollout(
    sampler: Sampler,
    scorer: Scorer,
    prompts: Sequence[Prompt],
    k: int,
    reward: WeightedRewards,
    trainer_state: Any = None,
) -> Rollout:
    """Everything one update needs: k completions per prompt under the policy (``sampler``), their policy
    and reference log-probs where the algorithm reads them (``scorer.passes``), and their scores from
    ``reward``; reward functions receive ``trainer_state`` (:mod:`marl.rewards.calls`), and what they log is
    the rollout's ``reward_log``."""
    samples = sampler.sample(sampler.batch(prompts), k)
    # On CPU the C heap keeps the sampler's freed cache, fragmented, through scoring (measured on SmolLM2 in
    # 4-bit: scoring's peak 900 MiB with it, 790 without; a trim takes milliseconds).
    release_freed_memory()
    logprobs, ref_logprobs = scorer.logprobs(samples)
    with torch.no_grad(), scorer.autocast():
        batch = scorer.scoring_batch(samples, trainer_state)
        scores = reward.score(batch)
    values = {field.name: getattr(samples, field.name) for field in dataclasses.fields(Samples)}
    release_freed_memory()  # what scoring freed goes back before the update
    return Rollout(
        **values,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        scores=scores.total,
        source_scores=scores.per_source,
        reward_log=batch.reward_log,
    )


def complete_for_metrics(
    rollout: Rollout, shaped: ShapedRewards, scorer: Scorer, kl_coef: float
) -> ShapedRewards:
    """After the update, what the rollout metrics read of a rollout that skipped its policy pass: the
    policy's log-probs (``objective/entropy``), which the update's forward provided (scored here only when
    the update did not run), and, where the reference pass ran, the KL from them (``objective/kl``, the
    non-score and RLHF rewards that report it). Returns ``shaped`` with that KL."""
    if rollout.logprobs is None:  # no update forward ran (nothing was judged)
        rollout.logprobs = scorer.logprobs(rollout, POLICY_PASS)[0]
    if shaped.kl is not None or rollout.ref_logprobs is None:
        return shaped
    return shaped.with_kl(sequence_kl(rollout.logprobs, rollout.ref_logprobs, rollout.response_mask), kl_coef)
