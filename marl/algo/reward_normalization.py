"""How several reward sources become the reward the advantage estimator sees (``--reward_normalization``).

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

Defined for the ``rloo`` and ``grpo`` estimators; refused (before any work) with ``reinforce_pp`` or an
estimator registered elsewhere, with ``--scale_rewards batch`` (the batch scale is the last step already),
``--normalize_reward`` (it z-scores the summed score, which is no longer what trains) and
``--normalize_advantage`` (the batch normalisation is part of ``per_reward``).

With ONE reward source of weight 1 and no missing-EOS penalty, ``per_reward`` gives today's ``sum`` advantages
z-scored over the batch (std + 1e-4): exactly (up to float rounding) under ``rloo`` without
``--scale_rewards`` with the KL in the reward or in the loss, and under ``grpo`` with ``--scale_rewards
group`` or ``none`` and the KL in the loss (GRPO's default). The group mean a source loses is constant within
its group, so the baseline removes it anyway; the group std of one source is the group std of the sum.
``--normalize_advantage`` does the same z-score with std + 1e-8.

Rows are k-major (row ``j * P + i`` is sample ``j`` of prompt ``i``), as everywhere in :mod:`marl.algo`.

Example:
    >>> import torch
    >>> scores = torch.tensor([[1.0, 0.0], [3.0, 10.0]])  # k=2, one prompt, two sources
    >>> group_normalized_sources(scores, k=2, scale=False)
    tensor([[-1., -5.],
            [ 1.,  5.]])
    >>> weighted_sources(group_normalized_sources(scores, k=2, scale=False), torch.tensor([1.0, 0.1]))
    tensor([-1.5000,  1.5000])
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import torch

from marl.algo.advantages import AdvantageEstimator, rloo_advantages
from marl.algo.normalized_advantages import GRPO_STD_EPSILON, grpo_advantages, unbiased_std
from marl.errors import ConfigError
from marl.registry import Registry

# GDPO's epsilon of the per-source group std and of the batch std, as TRL 1.16's "normalize_then_sum".
GDPO_STD_EPSILON = GRPO_STD_EPSILON
PER_REWARD_ESTIMATORS = ("rloo", "grpo")


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
    """``sum``: the weighted sum of the raw scores, as marl always did; defined for every estimator.

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
    "marl.algo.reward_normalization.register_reward_normalization",
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


ADVANTAGE_CENTRINGS: dict[str, AdvantageEstimator] = {
    "rloo": rloo_advantages,
    "grpo": functools.partial(grpo_advantages, scale_rewards="none"),
}


def advantage_centring(estimator_name: str) -> AdvantageEstimator | None:
    """The baseline of estimator ``estimator_name`` without its scale, for :func:`source_advantages`; ``None``
    for an estimator whose advantage does not split by source this way (``reinforce_pp``, others).

    Example:
        >>> advantage_centring("rloo") is rloo_advantages, advantage_centring("reinforce_pp")
        (True, None)
    """
    return ADVANTAGE_CENTRINGS.get(estimator_name)
