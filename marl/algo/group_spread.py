"""Groups that teach nothing: prompts whose judged completions all got the same reward.

A group-relative baseline (leave-one-out, GRPO's group mean) gives every completion of such a group advantage
0, so the update learns nothing from that prompt: with most groups flat "the loss is 0 / the reward does not
move". :func:`flat_groups` counts them per update (the trainer logs ``objective/zero_spread_groups``, the
share of the groups with at least two judged completions whose judged rewards are all equal, and
``zero_spread_groups/<source>`` per reward source); :class:`ZeroSpreadWatch` warns once when the share stays
above a half.

Rows are k-major (row ``j * P + i`` is sample ``j`` of prompt ``i``).

Example:
    >>> import torch
    >>> flat_groups(torch.tensor([1.0, 0.0, 1.0, 2.0]), k=2)  # prompt 0: 1 and 1, prompt 1: 0 and 2
    (tensor([1]), tensor([2]))
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from marl.algo.advantages import unbiased_std

ZERO_SPREAD_METRIC = "objective/zero_spread_groups"
# The watch warns when more than this share of the groups is flat ...
ZERO_SPREAD_LIMIT = 0.5
# ... on this many logged updates in a row.
ZERO_SPREAD_PATIENCE = 5


def flat_groups(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of ``values`` (``[B]`` or ``[B, S]``, NaN where not judged): how many prompt groups have at
    least two judged values all equal, and how many have at least two judged values.

    Example:
        >>> nan = float("nan")
        >>> flat_groups(torch.tensor([[1.0, nan], [1.0, 3.0], [1.0, nan], [5.0, 4.0]]), k=2)
        (tensor([1, 0]), tensor([2, 1]))
    """
    columns = values.unsqueeze(1) if values.dim() == 1 else values
    grouped = columns.reshape(k, -1, columns.shape[1])
    judged = ~torch.isnan(grouped)
    counted = judged.sum(dim=0) >= 2
    highest = torch.where(judged, grouped, torch.full_like(grouped, -torch.inf)).amax(dim=0)
    lowest = torch.where(judged, grouped, torch.full_like(grouped, torch.inf)).amin(dim=0)
    flat = counted & (highest == lowest)
    return flat.sum(dim=0), counted.sum(dim=0)


def zero_std_groups(rewards: torch.Tensor, k: int) -> tuple[float, float]:
    """TRL 1.16's zero-std groups (its ``frac_reward_zero_std``): how many prompt groups of ``rewards``
    (``[B]``, NaN where not judged) have a standard deviation of their judged rewards that ``torch.isclose``
    finds 0 (TRL's ``nanstd``: a group with fewer than two judged rewards has none, and does not count), and
    how many groups there are.

    Example:
        >>> nan = float("nan")
        >>> # k-major, 3 prompts: prompt 0 got 1, 1, 1; prompt 1 0, 0, 4; prompt 2 one judged reward
        >>> zero_std_groups(torch.tensor([1.0, 0.0, nan, 1.0, 0.0, 2.0, 1.0, 4.0, nan]), k=3)
        (1.0, 3.0)
    """
    grouped = rewards.reshape(k, -1)
    std = unbiased_std(grouped, ~torch.isnan(grouped), dim=0)
    return float(torch.isclose(std, torch.zeros_like(std)).sum()), float(grouped.shape[1])


class ZeroSpreadWatch:
    """A trainer callback (``callback(state, metrics)``) that warns once, with the fix, when more than
    ``limit`` of the groups were flat (``objective/zero_spread_groups``) on ``patience`` updates in a row.

    Example:
        >>> watch = ZeroSpreadWatch(patience=2)
        >>> watch(None, {ZERO_SPREAD_METRIC: 0.9})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     watch(None, {ZERO_SPREAD_METRIC: 0.8, "zero_spread_groups/length": 1.0})
        >>> "zero_spread_groups/length" in str(caught[0].message)
        True
    """

    def __init__(self, limit: float = ZERO_SPREAD_LIMIT, patience: int = ZERO_SPREAD_PATIENCE) -> None:
        self.limit, self.patience = limit, patience
        self.streak, self.warned = 0, False

    def __call__(self, state: Any, metrics: Mapping[str, float]) -> None:
        share = metrics.get(ZERO_SPREAD_METRIC)
        if share is None or self.warned:
            return
        self.streak = self.streak + 1 if share > self.limit else 0
        if self.streak < self.patience:
            return
        self.warned = True
        sources = {
            name.removeprefix("zero_spread_groups/"): value
            for name, value in metrics.items()
            if name.startswith("zero_spread_groups/")
        }
        flattest = [f"zero_spread_groups/{name} {value:.0%}" for name, value in sources.items()]
        warnings.warn(
            f"{share:.0%} of the prompt groups got the same reward for all their completions on "
            f"{self.patience} updates in a row: they teach nothing (advantage 0). Sample more completions "
            "per prompt (--rloo_k) or at a higher --temperature, train on prompts the policy sometimes gets "
            "right and sometimes not, or use a reward with finer grades"
            + (f"; per source: {', '.join(flattest)}" if flattest else ""),
            RuntimeWarning,
            stacklevel=2,
        )
