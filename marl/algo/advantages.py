"""Advantage estimators side by side, by name: RLOO's leave-one-out baseline (``"rloo"``), GRPO's group mean
and std (``"grpo"``), REINFORCE++'s batch mean and std (``"reinforce_pp"``), and the registry that lets a new
estimator plug in with one registration and one flag value (``--advantage_estimator NAME``). An estimator with
a keyword-only ``scale_rewards`` parameter receives ``--scale_rewards`` (see :func:`configured_estimator`).

Layout: a rollout holds ``k`` completions for each of ``P`` prompts in **k-major** order: row ``j * P + i``
is sample ``j`` of prompt ``i``, and ``tensor.view(k, P)`` puts the samples of one prompt in one column.

Names follow the papers: Ahmadian et al. (2024), "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs" (RLOO: the whole completion is one action, its reward is the
reward-model score minus a KL penalty against the reference policy, :mod:`marl.algo.shaping`, and its baseline
is the mean reward of the other ``k - 1`` completions of the same prompt); Shao et al. (2024) for GRPO, as TRL
1.x's ``GRPOTrainer`` computes it; Hu (2025) for REINFORCE++.

A completion no reward source judged (NaN reward, ``judged`` False) has no reward: it is left out of every
baseline, mean and standard deviation and gets advantage 0, and so does a judged completion without a judged
sibling under a group baseline.

Example:
    >>> import torch
    >>> rewards = torch.tensor([1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    >>> leave_one_out_advantages(rewards, k=4)[0].item()
    -4.0
    >>> get_advantage_estimator("rloo")(rewards, ~rewards.isnan(), 4, None)[0].item()
    -4.0
    >>> rewards = torch.tensor([1.0, 0.0, 3.0, 0.0])  # k=2, P=2: prompt 0 has 1 and 3, prompt 1 has 0 and 0
    >>> grpo_advantages(rewards, torch.ones(4, dtype=torch.bool), 2, scale_rewards="none")
    tensor([-1.,  0.,  1.,  0.])
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Protocol

import torch

from marl.algo.tensors import Gather, standardize
from marl.errors import ConfigError
from marl.registry import Registry

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig

# TRL 1.x's GRPOTrainer divides by (std + 1e-4), not by the 1e-8 of marl's other z-scores.
GRPO_STD_EPSILON = 1e-4
SCALE_REWARDS = ("group", "batch", "none")


class AdvantageEstimator(Protocol):
    """Turns one rollout's rewards into one advantage per completion.

    Called as ``estimator(rewards, judged, k, gather)``: ``rewards`` float ``[B]`` in k-major order (NaN where
    no source judged the completion), ``judged`` bool ``[B]``, ``k`` completions per prompt, ``gather`` None
    (one process) or an accelerate-style gather for statistics over every process's rollout (every process
    then calls the estimator, as with any collective). Returns finite advantages ``[B]``, 0 for unjudged rows.
    Optional: a keyword-only ``scale_rewards`` parameter, which then receives ``--scale_rewards``.
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


def advantage_estimator(config: RLOOConfig) -> AdvantageEstimator:
    """The config's estimator, with ``--scale_rewards`` bound when it takes it.

    Example:
        >>> from marl.config import RLOOConfig
        >>> advantage_estimator(RLOOConfig(algorithm="dr_grpo")).keywords
        {'scale_rewards': 'none'}
    """
    return configured_estimator(config.advantage_estimator, config.scale_rewards)


def check_estimator(config: RLOOConfig) -> None:
    """Refuse an unregistered ``--advantage_estimator``, and a ``--scale_rewards`` that the estimator would
    ignore or does not know, naming the fix.

    Example:
        >>> from marl.config import RLOOConfig
        >>> check_estimator(RLOOConfig(scale_rewards="group"))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: scale_rewards='group' is set but the advantage estimator 'rloo' does not ...
    """
    estimator = get_advantage_estimator(config.advantage_estimator)
    if config.scale_rewards is None:
        return
    # per_reward scales each source by its group std under rloo too (marl.algo.shaping)
    per_source = config.reward_normalization == "per_reward" and config.advantage_estimator == "rloo"
    if not takes_scale_rewards(estimator) and not per_source:
        also = " or --reward_normalization per_reward (each source by its group std)"
        raise ConfigError(
            f"scale_rewards={config.scale_rewards!r} is set but the advantage estimator "
            f"{config.advantage_estimator!r} does not scale rewards. Drop --scale_rewards, or use "
            f"--advantage_estimator grpo{also if config.advantage_estimator == 'rloo' else ''}"
        )
    if config.scale_rewards not in SCALE_REWARDS:
        raise ConfigError(
            f"--scale_rewards {config.scale_rewards!r} is not one of {SCALE_REWARDS}. Use one of them"
        )


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
