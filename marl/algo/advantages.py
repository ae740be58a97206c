"""Advantage estimators by name: the leave-one-out baseline of RLOO, and the registry that lets a new
estimator plug in with one registration and one flag value (``--advantage_estimator NAME``). ``"grpo"`` and
``"reinforce_pp"`` live in :mod:`marl.algo.normalized_advantages`; an estimator with a keyword-only
``scale_rewards`` parameter receives ``--scale_rewards`` (see :func:`configured_estimator`).

Layout: a rollout holds ``k`` completions for each of ``P`` prompts in **k-major** order: row ``j * P + i``
is sample ``j`` of prompt ``i``, and ``tensor.view(k, P)`` puts the samples of one prompt in one column.

Names follow Ahmadian et al. (2024), "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
from Human Feedback in LLMs": the whole completion is one action, its reward is the reward-model score minus a
KL penalty against the reference policy (:mod:`marl.algo.shaping`), and the baseline of a completion is the
mean reward of the other ``k - 1`` completions of the same prompt (leave-one-out, registered as ``"rloo"``).

A completion no reward source judged (NaN reward) has no reward: it is left out of its group's baseline and
gets advantage 0, and so does a judged completion without a judged sibling.

Example:
    >>> import torch
    >>> rewards = torch.tensor([1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    >>> leave_one_out_advantages(rewards, k=4)[0].item()
    -4.0
    >>> get_advantage_estimator("rloo")(rewards, ~rewards.isnan(), 4, None)[0].item()
    -4.0
"""

from __future__ import annotations

import functools
import inspect
from typing import Protocol

import torch

from marl.algo.normalized_advantages import grpo_advantages, reinforce_pp_advantages
from marl.algo.tensors import Gather
from marl.registry import Registry


class AdvantageEstimator(Protocol):
    """Turns one rollout's rewards into one advantage per completion.

    Called as ``estimator(rewards, judged, k, gather)``: ``rewards`` float ``[B]`` in k-major order (NaN where
    no source judged the completion), ``judged`` bool ``[B]``, ``k`` completions per prompt, ``gather`` None
    (one process) or an accelerate-style gather for statistics over every process's rollout (every process
    then calls the estimator, as with any collective). Returns finite advantages ``[B]``, 0 for unjudged rows.
    """

    def __call__(
        self, rewards: torch.Tensor, judged: torch.Tensor, k: int, gather: Gather | None, /
    ) -> torch.Tensor: ...


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


def has_judged_sibling(judged: torch.Tensor, k: int) -> torch.Tensor:
    """Rows that are judged and share their prompt with another judged row: the rows a baseline built from
    the other samples of a prompt can give an advantage (and the rows advantage normalisation pools).

    Example:
        >>> has_judged_sibling(torch.tensor([True, True, True, False]), k=2)  # prompt 1: one judged sample
        tensor([ True, False,  True, False])
    """
    judged_per_prompt = judged.view(k, -1)
    return (judged_per_prompt & (judged_per_prompt.sum(dim=0, keepdim=True) >= 2)).flatten()


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
    has_advantage = has_judged_sibling(judged, k)
    advantages = torch.where(has_advantage.view(k, -1), per_prompt - baseline, torch.zeros_like(per_prompt))
    return advantages.flatten(), has_advantage


def rloo_advantages(
    rewards: torch.Tensor, judged: torch.Tensor, k: int, gather: Gather | None = None
) -> torch.Tensor:
    """The ``"rloo"`` estimator: :func:`judged_leave_one_out_advantages`. Each prompt's group lies on one
    process, so ``gather`` is not needed.

    Example:
        >>> rloo_advantages(torch.tensor([1.0, 2.0, 3.0, float("nan")]), torch.tensor([1, 1, 1, 0]).bool(), 2)
        tensor([-2.,  0.,  2.,  0.])
    """
    return judged_leave_one_out_advantages(rewards, judged, k)[0]


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    "--advantage_estimator",
    "marl.algo.advantages.register_advantage_estimator",
    {"rloo": rloo_advantages, "grpo": grpo_advantages, "reinforce_pp": reinforce_pp_advantages},
)


def register_advantage_estimator(name: str, estimator: AdvantageEstimator) -> None:
    """Make ``estimator`` the advantage estimator named ``name`` (``--advantage_estimator name``); a name is
    registered once.

    Example:
        >>> register_advantage_estimator("rloo", rloo_advantages)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: advantage estimator 'rloo' is already registered; pick another name, or ...
    """
    ADVANTAGE_ESTIMATORS.register(name, estimator)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Example:
        >>> get_advantage_estimator("rloo") is rloo_advantages
        True
    """
    return ADVANTAGE_ESTIMATORS.lookup(name)


def configured_estimator(name: str, scale_rewards: str | None) -> AdvantageEstimator:
    """The estimator registered as ``name``, with ``scale_rewards`` bound when it takes that keyword (GRPO).

    Example:
        >>> rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
        >>> configured_estimator("grpo", "none")(rewards, ~rewards.isnan(), 2, None)
        tensor([-1., -2.,  1.,  2.])
    """
    estimator = get_advantage_estimator(name)
    if scale_rewards is not None and takes_scale_rewards(estimator):
        return functools.partial(estimator, scale_rewards=scale_rewards)
    return estimator


def takes_scale_rewards(estimator: AdvantageEstimator) -> bool:
    """Whether ``estimator`` takes the keyword ``scale_rewards``.

    Example:
        >>> takes_scale_rewards(rloo_advantages), takes_scale_rewards(get_advantage_estimator("grpo"))
        (False, True)
    """
    try:
        return "scale_rewards" in inspect.signature(estimator).parameters
    except (TypeError, ValueError):
        return False
