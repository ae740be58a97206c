"""One rollout: prompts in, sampled and scored completions out, with no gradients.

1. the sampler (:mod:`marl.rollout.samplers`) draws ``k`` completions of every prompt under the policy,
   cut after their stop token (:class:`marl.rollout.completions.Samples`, k-major: row ``j * P + i`` is sample
   ``j`` of prompt ``i``);
2. the scorer (:class:`marl.rollout.scoring.Scorer`) computes their policy and reference log-probs in
   float32 at the sampling temperature (the passes the algorithm reads, :mod:`marl.algo.scoring_passes`),
   and the rows the reward sources read;
3. the reward adds its scores: a :class:`marl.rollout.completions.Rollout` holds everything an update needs.

Example:
    >>> rollout = collect_rollout(sampler, scorer, prompts, k=4, reward=reward)  # doctest: +SKIP
    >>> rollout.scores.shape  # doctest: +SKIP
    torch.Size([32])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.scoring_passes import POLICY_PASS, ScoringPasses
from marl.algo.shaping import ShapedRewards
from marl.algo.tensors import sequence_kl
from marl.cpu.allocator import release_freed_memory
from marl.rollout.completions import Rollout, Samples

if TYPE_CHECKING:
    from marl.data.prompts import Prompt
    from marl.rewards import WeightedRewards
    from marl.rollout.samplers import Sampler
    from marl.rollout.scoring import Scorer
    from marl.rollout.tool_calls import ToolCalling


def collect_rollout(
    sampler: Sampler,
    scorer: Scorer,
    prompts: Sequence[Prompt],
    k: int,
    reward: WeightedRewards,
    trainer_state: Any = None,
    policies: Sequence[str] | None = None,
    passes: ScoringPasses | None = None,
    run_phase: Callable[[str, Callable[[], Any]], Any] = lambda phase, work: work(),
    tool_calling: ToolCalling | None = None,
) -> Rollout:
    """Everything one update needs: k completions per prompt under the policy (``sampler``), their policy
    and reference log-probs where the algorithm reads them (``passes``, default ``scorer.passes``), and their
    scores from ``reward``; reward functions receive ``trainer_state`` (:mod:`marl.rewards.trl_calls`), and
    what they log is the rollout's ``reward_log``.

    ``policies`` (one per prompt): the rows of several policies, sampled in one batched decode
    (``sampler.sample_routed``) and scored in the same passes, each row under its own policy
    (:meth:`marl.rollout.scoring.Scorer.rows_view`); :func:`split_rollout` gives each policy its rows.

    ``run_phase(name, work)`` runs the ``"sampling"`` and the ``"scoring"`` work (the trainer's
    :class:`marl.train.memory_guard.PhaseGuard` measures each and retries it smaller when memory runs out).

    ``tool_calling``: the completions are conversations of turns and tool results
    (:mod:`marl.rollout.tool_calls`)."""
    if tool_calling is not None:
        samples = run_phase("sampling", lambda: tool_calling.rollout(sampler, prompts, k))
    else:
        batch = sampler.batch(prompts)
        samples = run_phase(
            "sampling",
            lambda: (
                sampler.sample(batch, k) if policies is None else sampler.sample_routed(batch, k, policies)
            ),
        )
    # On CPU the C heap keeps the sampler's freed cache, fragmented, through scoring's peak: trim it
    # (benchmarks/results/2026-11-25-memory-plan.md).
    release_freed_memory()
    passes = scorer.passes if passes is None else passes
    return run_phase("scoring", lambda: _scored(samples, scorer, reward, trainer_state, policies, passes))


def _scored(
    samples: Samples,
    scorer: Scorer,
    reward: WeightedRewards,
    trainer_state: Any,
    policies: Sequence[str] | None,
    passes: ScoringPasses,
) -> Rollout:
    """``samples`` with their log-probs and scores (see :func:`collect_rollout`)."""
    row_policies = None if policies is None else [policies[i] for i in samples.prompt_index.tolist()]
    # Where every policy drew the same prompts (a grid on one seed), the passes that are the same for every
    # policy (the reward, and the reference where it is the base) compute each prompt once for all of them.
    # (Only where the longer packed sequences are packed too: not past a sliding attention window.)
    index = None if policies is None else shared_prompt_index(samples, len(dict.fromkeys(policies)))
    shared = None if index is None else dataclasses.replace(samples, prompt_index=index)
    if shared is not None and not scorer.can_pack(shared.prompt_mask, shared.response_ids, index):
        shared = None
    if shared is not None and passes.reference and scorer.reference_is_base(row_policies):
        logprobs = scorer.logprobs(samples, dataclasses.replace(passes, reference=False), row_policies)[0]
        ref_logprobs = scorer.logprobs(shared, dataclasses.replace(passes, policy=False), row_policies)[1]
    else:
        logprobs, ref_logprobs = scorer.logprobs(samples, passes, row_policies)
    with torch.no_grad(), scorer.autocast():
        batch = scorer.scoring_batch(samples if shared is None else shared, trainer_state)
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


def shared_prompt_index(samples: Samples, members: int) -> torch.Tensor | None:
    """For rows of ``members`` policies' prompts (member after member, as :func:`collect_rollout` gets them
    with ``policies``), one prompt group per prompt for every policy's rows where every policy drew the same
    prompts in the same order (the same tokens, text and messages); else ``None``.

    Example:
        >>> from types import SimpleNamespace
        >>> rows = dict(prompt_index=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), prompt_mask=torch.ones(8, 1),
        ...     prompt_messages=[None] * 8, prompt_texts=["a", "b"] * 4)
        >>> shared_prompt_index(SimpleNamespace(prompt_ids=torch.tensor([[5], [6]] * 4), **rows), 2).tolist()
        [0, 1, 0, 1, 0, 1, 0, 1]
        >>> shared_prompt_index(SimpleNamespace(prompt_ids=torch.tensor([[5], [6], [5], [7]] * 2), **rows), 2)
    """
    if members < 2:
        return None
    index = samples.prompt_index
    groups = int(index.max()) + 1
    per_member = groups // members
    first_row = {group: row for row, group in reversed(list(enumerate(index.tolist())))}
    for group in range(per_member, groups):
        row, same_as = first_row[group], first_row[group % per_member]
        if not (
            torch.equal(samples.prompt_ids[row], samples.prompt_ids[same_as])
            and torch.equal(samples.prompt_mask[row], samples.prompt_mask[same_as])
            and samples.prompt_messages[row] == samples.prompt_messages[same_as]
            and samples.prompt_texts[row] == samples.prompt_texts[same_as]
        ):
            return None
    return index % per_member


def split_rollout(rollout: Rollout, members: int) -> list[Rollout]:
    """A rollout of ``members`` policies' prompts, member after member (as :func:`collect_rollout` got them
    with ``policies``), as one rollout per policy: its rows in their order (k-major), its prompt groups
    numbered from 0, the columns reward functions logged (``log_extra``) cut to its rows; a metric they
    logged (``log_metric``) was measured on every policy's rows at once, and each policy keeps it whole.

    Example:
        >>> from types import SimpleNamespace
        >>> rollout = SimpleNamespace(prompt_index=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]),
        ...     select=lambda rows: SimpleNamespace(prompt_index=rollout.prompt_index[rows], rows=rows))
        >>> [(part.rows.tolist(), part.prompt_index.tolist()) for part in split_rollout(rollout, 2)]
        [([0, 1, 4, 5], [0, 1, 0, 1]), ([2, 3, 6, 7], [0, 1, 0, 1])]
    """
    per_member = (int(rollout.prompt_index.max()) + 1) // members
    parts = []
    for member in range(members):
        rows = torch.nonzero(rollout.prompt_index // per_member == member).flatten()
        part = rollout.select(rows)
        part.prompt_index = part.prompt_index - member * per_member
        log = getattr(part, "reward_log", None)
        if log is not None and members > 1:
            positions = rows.tolist()
            extra = {name: [values[i] for i in positions] for name, values in log.extra.items()}
            part.reward_log = dataclasses.replace(log, rows=len(positions), extra=extra)
        parts.append(part)
    return parts


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
    return shaped.with_kl(sequence_kl(rollout.logprobs, rollout.ref_logprobs, rollout.model_mask), kl_coef)
