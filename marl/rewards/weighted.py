"""Several reward sources as one reward: ``Σ_i w_i · r_i`` over the sources that judged each row, as TRL's
``reward_funcs`` with ``reward_weights`` combine them.

A completion that no source judged has no reward: it is left out of its prompt's leave-one-out baseline and
gets advantage 0 (:func:`marl.algo.shaping.shape_rewards`); only an update in which no completion was judged
is skipped, with a warning.

Example:
    >>> length = FunctionReward(lambda completions, **kwargs: [len(c) for c in completions], "length")
    >>> batch = ScoringBatch(["Say"], [" hi!"], torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
    >>> WeightedRewards([length], [0.5]).score(batch).total
    tensor([2.])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from marl.errors import ConfigError
from marl.rewards.adapter import AdapterReward
from marl.rewards.batch import RewardScores, RewardSource, ScoringBatch
from marl.rewards.functions import FunctionReward, score_sources

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel


class WeightedRewards:
    """Several reward sources combined as ``Σ_i w_i · r_i`` over the sources that judged each row.

    Source names label the logged ``rewards/<name>`` metrics; repeated names get a ``_2``, ``_3``... suffix.

    Example:
        >>> never = FunctionReward(lambda prompts, completions: [None] * len(completions), "never")
        >>> WeightedRewards([never, never]).names
        ['never', 'never_2']
    """

    def __init__(self, sources: Sequence[RewardSource], weights: Sequence[float] | None = None) -> None:
        if not sources:
            raise ConfigError("no reward: give at least one reward adapter or reward function")
        weights = [1.0] * len(sources) if weights is None else [float(weight) for weight in weights]
        if len(weights) != len(sources):
            names = [source.name for source in sources]
            raise ConfigError(
                f"{len(weights)} reward weights for {len(sources)} reward sources {names}: give one weight "
                "per source (--reward_weights), in the order of the sources, or none for weight 1 each"
            )
        if not all(math.isfinite(weight) for weight in weights):
            raise ConfigError(f"reward weights must be finite numbers, got {weights}")
        self.sources = list(sources)
        self.weights = weights
        self.names: list[str] = []
        for source in self.sources:
            name, count = source.name, 1
            while name in self.names:
                count += 1
                name = f"{source.name}_{count}"
            self.names.append(name)

    def score(self, batch: ScoringBatch) -> RewardScores:
        per_source = torch.stack([scores.float() for scores in score_sources(self.sources, batch)], dim=1)
        return RewardScores(weighted_total(per_source, self.weights), per_source)


def weighted_total(per_source: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``Σ_i w_i · r_i`` per row of ``per_source`` ``[B, S]`` over the sources that judged the row (NaN: not
    judged); NaN where none did. A sweep weighs the same scores with each policy's own weights.

    Example:
        >>> weighted_total(torch.tensor([[1.0, 2.0], [float("nan"), 4.0], [float("nan")] * 2]), [1.0, 0.5])
        tensor([2., 2., nan])
    """
    weights = torch.tensor(list(weights), dtype=torch.float32, device=per_source.device)
    judged = ~torch.isnan(per_source)
    total = torch.where(judged, per_source * weights, torch.zeros_like(per_source)).sum(dim=1)
    return torch.where(judged.any(dim=1), total, torch.full_like(total, math.nan))


def build_rewards(
    model: MultiAdapterModel,
    reward_funcs: Any = None,
    weights: Sequence[float] | None = None,
    rows_per_pass: int = 64,
) -> WeightedRewards:
    """The reward of a run: ``reward_funcs`` is ``None`` (every reward adapter of the model), or one or a list
    of reward adapter names, reward functions (called as TRL calls them, :mod:`marl.rewards.trl_calls`) and
    :class:`RewardSource` objects (such as those :func:`marl.rewards.reward_kinds.plan_rewards` builds).

    Example:
        >>> rewards = build_rewards(model, ["sentiment", length_bonus], [1.0, 0.1])  # doctest: +SKIP
    """
    if reward_funcs is None:
        if not model.rewards:
            raise ConfigError(
                "no reward: the model has no reward adapter and no reward function was given. Load it with "
                "reward_adapter=DIR, or pass reward_funcs=callable(prompts, completions) -> list of floats"
            )
        reward_funcs = list(model.rewards)
    items = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    sources: list[RewardSource] = []
    for item in items:
        if isinstance(item, str):
            sources.append(AdapterReward(model, item, rows_per_pass))
        elif isinstance(item, RewardSource):
            sources.append(item)
        else:
            sources.append(FunctionReward(item))
    return WeightedRewards(sources, weights)
