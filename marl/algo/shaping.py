"""From the reward sources' scores and the rollout's log-probs to one reward and one advantage per completion.

The order is that of Ahmadian et al. (2024) and TRL's RLOO: missing-stop-token penalty, reward normalisation
and clipping, the sequence KL against the reference folded into the reward (or, with ``token_level_kl``, left
to the loss), the advantage estimator (leave-one-out by default, see :mod:`marl.algo.advantages`), advantage
normalisation. Rows are k-major, as everywhere in :mod:`marl.algo`.

A completion no reward source judged (NaN score) has no reward and is left out of every statistic.
Normalisation statistics are taken over the completions of every process (``gather`` concatenates a
per-process tensor over processes), so they do not depend on how the rollout is split over processes.

How several reward sources become the reward the estimator sees is ``--reward_normalization``, a registry
(:func:`register_reward_normalization`):

``sum`` (the default, TRL's ``multi_objective_aggregation="sum_then_normalize"``): the weighted sum of the raw
scores, ``Σ_s w_s · r_s`` over the sources that judged a completion; the estimator then takes its baseline
(and GRPO its scale) of that sum. The source whose scores spread most within a prompt's group decides the
advantage.

``per_reward`` (GDPO, Liu et al. 2026, arXiv 2601.05242; TRL 1.16's ``"normalize_then_sum"``): each source's
scores are normalised within the prompt's group over the completions that source judged, ``n_s = (r_s − mean_g
r_s) / (std_g r_s + 1e-4)`` (the unbiased std, TRL's epsilon), the std only with ``--scale_rewards group``:
GRPO's default, and allowed with ``rloo`` under ``per_reward`` for this (``rloo`` without it, and
``--scale_rewards none``, only centre). Centring alone changes nothing a group baseline would not remove
anyway: with every completion judged, ``rloo`` without the scale gives ``sum``'s advantages z-scored over the
batch; the per-source std is what keeps one source's spread from deciding the advantage. The estimator sees
``Σ_s w_s · n_s``, over the sources that judged the completion, minus the missing-EOS penalty and, with the KL
in the reward (``--kl_placement reward``), ``kl_coef · KL``: both are added AFTER the per-source
normalisation, in its units (a ``kl_coef`` tuned under ``sum`` means something else here). The estimator takes
its baseline without a scale of its own (``rloo``: leave-one-out; ``grpo``: the group mean), and the
advantages are z-scored over the judged completions of the whole batch (every process), std + 1e-4:
GDPO's batch-wise normalisation. A source that judged fewer than two completions of a group adds 0 to them; a
judged completion without a judged sibling gets advantage 0 and counts in the batch statistics as that 0, as
TRL's ``normalize_then_sum`` keeps it; a completion no source judged stays unjudged (advantage 0, left out of
the statistics), as under ``sum``.

``per_reward`` is defined for the ``rloo`` and ``grpo`` estimators; refused (before any work) with
``reinforce_pp`` or an estimator registered elsewhere, with ``--scale_rewards batch`` (the batch scale is the
last step already), ``--normalize_reward`` (it z-scores the summed score, which is no longer what trains) and
``--normalize_advantage`` (the batch normalisation is part of ``per_reward``).

With ONE reward source of weight 1 and no missing-EOS penalty, ``per_reward`` gives the ``sum`` advantages
z-scored over the batch (std + 1e-4): exactly (up to float rounding) under ``rloo`` without
``--scale_rewards`` with the KL in the reward or in the loss, and under ``grpo`` with ``--scale_rewards
group`` or ``none`` and the KL in the loss (GRPO's default). The group mean a source loses is constant within
its group, so the baseline removes it anyway; the group std of one source is the group std of the sum.
``--normalize_advantage`` does the same z-score with std + 1e-8.

Example:
    >>> import torch
    >>> rlhf_rewards(torch.tensor([1.0]), torch.tensor([2.0]), kl_coef=0.5)[0]
    tensor([0.])
    >>> scores = torch.tensor([[1.0, 0.0], [3.0, 10.0]])  # k=2, one prompt, two sources
    >>> group_normalized_sources(scores, k=2, scale=False)
    tensor([[-1., -5.],
            [ 1.,  5.]])
    >>> weighted_sources(group_normalized_sources(scores, k=2, scale=False), torch.tensor([1.0, 0.1]))
    tensor([-1.5000,  1.5000])
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from marl.algo.advantages import (
    GRPO_STD_EPSILON,
    AdvantageEstimator,
    advantage_centring,
    grpo_advantages,
    has_judged_sibling,
    rloo_advantages,
    unbiased_std,
)
from marl.algo.tensors import STD_EPSILON, Gather, model_tokens, sequence_kl, standardize
from marl.errors import ConfigError
from marl.registry import Registry

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig
    from marl.rollout.completions import Rollout

# GDPO's epsilon of the per-source group std and of the batch std, as TRL 1.16's "normalize_then_sum".
GDPO_STD_EPSILON = GRPO_STD_EPSILON
PER_REWARD_ESTIMATORS = ("rloo", "grpo")


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


class PerRewardNormalization(NamedTuple):
    """What ``per_reward`` does for one config: whether each source's centred scores are divided by their
    group std, and the estimator that takes the baseline of the weighted sum (with no scale of its own)."""

    scale: bool
    estimator: AdvantageEstimator


class RewardNormalization(Protocol):
    """A ``--reward_normalization`` choice: called with the run's config before any work, it refuses (with a
    :class:`~marl.errors.ConfigError`) what it does not define and returns a :class:`PerRewardNormalization`,
    or ``None`` for the weighted sum of raw scores (``sum``)."""

    def __call__(self, config: Any) -> PerRewardNormalization | None: ...


def sum_normalization(config: Any) -> None:
    """``sum``: the weighted sum of the raw scores; defined for every estimator.

    Example:
        >>> sum_normalization(None) is None
        True
    """
    return None


def per_reward_normalization(config: Any) -> PerRewardNormalization:
    """``per_reward`` for ``config``, or the one-line refusal of a combination it does not define.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = dict(normalize_reward=False, normalize_advantage=False)
        >>> per_reward_normalization(SimpleNamespace(advantage_estimator="grpo", scale_rewards="group",
        ...                                          **settings)).scale
        True
        >>> per_reward_normalization(SimpleNamespace(advantage_estimator="reinforce_pp", scale_rewards=None,
        ...                                          **settings))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --reward_normalization per_reward is defined for the rloo and grpo ...
    """
    name, scale = config.advantage_estimator, config.scale_rewards
    if name not in PER_REWARD_ESTIMATORS:
        raise ConfigError(
            "--reward_normalization per_reward is defined for the rloo and grpo advantage estimators (a "
            f"baseline per prompt group), not for {name!r}. Use --advantage_estimator rloo or grpo, or "
            "--reward_normalization sum"
        )
    if scale == "batch":
        raise ConfigError(
            "--scale_rewards batch with --reward_normalization per_reward: per_reward already ends with the "
            "batch-wise normalisation. Use --scale_rewards group (each source by its group std) or none"
        )
    for flag in ("normalize_reward", "normalize_advantage"):
        if getattr(config, flag):
            raise ConfigError(
                f"--{flag} with --reward_normalization per_reward: per_reward normalises each source within "
                "its group and z-scores the advantages over the batch itself. Drop --" + flag
            )
    if name == "rloo":
        return PerRewardNormalization(scale=scale == "group", estimator=rloo_advantages)
    return PerRewardNormalization(
        scale=scale == "group", estimator=functools.partial(grpo_advantages, scale_rewards="none")
    )


REWARD_NORMALIZATIONS: Registry[RewardNormalization] = Registry(
    "reward normalisation",
    "--reward_normalization",
    "marl.algo.shaping.register_reward_normalization",
    {"sum": sum_normalization, "per_reward": per_reward_normalization},
)


def register_reward_normalization(name: str, choice: RewardNormalization) -> None:
    """Make ``choice`` the ``--reward_normalization`` named ``name``; a name is registered once.

    Example:
        >>> register_reward_normalization("sum", sum_normalization)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: reward normalisation 'sum' is already registered; pick another name, or ...
    """
    REWARD_NORMALIZATIONS.register(name, choice)


def reward_normalization(config: Any) -> PerRewardNormalization | None:
    """The config's ``--reward_normalization``, checked against its estimator and flags.

    Example:
        >>> from marl.config import RLOOConfig
        >>> reward_normalization(RLOOConfig(reward_normalization="per_reward")).estimator is rloo_advantages
        True
    """
    return REWARD_NORMALIZATIONS.lookup(config.reward_normalization)(config)


def group_normalized_sources(per_source: torch.Tensor, k: int, *, scale: bool) -> torch.Tensor:
    """Each source's scores ``[B, S]`` minus their mean over the completions of the prompt's group that
    source judged, divided by their unbiased std + 1e-4 when ``scale``. NaN where the source did not judge; 0
    where it judged fewer than two completions of the group (a mean of one says nothing).

    Example:
        >>> group_normalized_sources(torch.tensor([[1.0], [3.0], [float("nan")], [5.0]]), k=2, scale=True)
        tensor([[ 0.0000],
                [-0.7071],
                [    nan],
                [ 0.7071]])
    """
    rows, sources = per_source.shape
    if k < 2 or rows % k != 0:
        raise ValueError(f"{rows} rows cannot be split into groups of k={k} >= 2")
    grouped = per_source.view(k, -1, sources)
    judged = ~torch.isnan(grouped)
    count = judged.sum(dim=0, keepdim=True)
    total = torch.where(judged, grouped, torch.zeros_like(grouped)).sum(dim=0, keepdim=True)
    normalized = grouped - total / count.clamp(min=1)
    if scale:
        normalized = normalized / (unbiased_std(grouped, judged, dim=0) + GDPO_STD_EPSILON)
    normalized = torch.where(count >= 2, normalized, torch.zeros_like(normalized))
    return torch.where(judged, normalized, torch.full_like(normalized, float("nan"))).view(rows, sources)


def weighted_sources(per_source: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_s w_s · x_s`` per row over the sources that are not NaN there; NaN where every source is.

    Example:
        >>> nan = float("nan")
        >>> weighted_sources(torch.tensor([[1.0, nan], [nan, nan]]), torch.tensor([2.0, 1.0]))
        tensor([2., nan])
    """
    judged = ~torch.isnan(per_source)
    weights = weights.to(per_source.dtype)
    total = torch.where(judged, per_source * weights, torch.zeros_like(per_source)).sum(dim=1)
    return torch.where(judged.any(dim=1), total, torch.full_like(total, float("nan")))


def source_advantages(
    terms: torch.Tensor, judged: torch.Tensor, k: int, centring: AdvantageEstimator
) -> torch.Tensor:
    """Each source's part of the advantage ``[B, S]``: ``centring`` (the estimator's baseline without a
    scale) applied to that source's term of the estimator's reward alone (``terms[:, s]``, NaN where it did
    not judge, which counts as 0), over the completions any source judged (``judged``). The baselines are
    linear, so the parts add up to the advantage of the sources' sum (before a scale); KL and missing-EOS
    terms are not counted.

    Example:
        >>> terms = torch.tensor([[1.0, 0.0], [3.0, float("nan")]])  # k=2, one prompt
        >>> source_advantages(terms, torch.tensor([True, True]), 2, rloo_advantages)
        tensor([[-2.,  0.],
                [ 2.,  0.]])
    """
    columns = torch.nan_to_num(terms, nan=0.0).unbind(dim=1)
    return torch.stack([centring(column, judged, k, None) for column in columns], dim=1)


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
    # source_advantages); None without the sources' scores or a centring
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
    (:mod:`marl.algo.scoring_passes`): the KL is then ``None`` (see :meth:`ShapedRewards.with_kl`), which the
    advantages must not need.

    ``source_scores`` ``[B, S]`` (each source's own scores, NaN where it did not judge) with
    ``reward_weights`` ``[S]``: with ``centring`` (:func:`marl.algo.advantages.advantage_centring`)
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


def shape_rollout(
    config: RLOOConfig,
    rollout: Rollout,
    reward_weights: list[float],
    estimator: AdvantageEstimator,
    gather: Gather | None,
) -> ShapedRewards:
    """One rollout's rewards and advantages as the config asks (:func:`shape_rewards`),
    with ``--reward_normalization`` and each reward source's part of the advantage; ``estimator``: the
    config's (:func:`advantage_estimator`), ``gather``: the run's statistics over processes."""
    return shape_rewards(
        rollout.scores,
        rollout.logprobs,
        rollout.ref_logprobs,
        model_tokens(rollout),
        rollout.contains_stop,
        k=config.rloo_k,
        kl_coef=config.kl_coef,
        missing_eos_penalty=config.missing_eos_penalty,
        normalize_reward=config.normalize_reward,
        reward_clip_range=config.reward_clip_range,
        token_level_kl=config.token_level_kl,
        normalize_advantage=config.normalize_advantage,
        advantage_epsilon=config.advantage_epsilon,
        gather=gather,
        estimator=estimator,
        source_scores=rollout.source_scores,
        reward_weights=torch.tensor(reward_weights, device=rollout.scores.device),
        per_reward=reward_normalization(config),
        centring=advantage_centring(config.advantage_estimator),
    )
