"""From a config's algorithm settings to the estimator and the loss, and the combinations that are refused.

:func:`check_algorithm` runs in :func:`marl.train.training_parts.check_components`, right after the command
line is parsed: an unknown loss, one of TRL 1.16's losses that marl does not implement, or settings that would
do nothing with the chosen loss or estimator are a :class:`~marl.errors.ConfigError` naming the fields and the
fix. :func:`policy_loss` computes one micro-batch's loss from the numbers the config gives it
(:class:`LossSettings`, taken from the config once when the run's parts are built).

Example:
    >>> from marl.config import RLOOConfig
    >>> check_algorithm(RLOOConfig(algorithm="grpo", loss_type="cispo"))
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --loss_type 'cispo' is one of TRL 1.16's losses marl does not implement ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.advantages import (
    AdvantageEstimator,
    configured_estimator,
    get_advantage_estimator,
    takes_scale_rewards,
)
from marl.algo.losses import PolicyLoss, clipped_policy_loss, token_level_k3_kl
from marl.algo.normalized_advantages import SCALE_REWARDS
from marl.algo.reward_normalization import advantage_centring, reward_normalization
from marl.algo.sampler_correction import RatioStats, SamplerCorrection, counted_ratios, ratio_metrics
from marl.algo.shaping import ShapedRewards, shape_rewards
from marl.algo.tensors import Gather, masked_sum
from marl.algo.token_losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    SEQUENCE_LOSS,
    TRL_LOSS_TYPES_NOT_IMPLEMENTED,
    token_policy_loss,
)
from marl.errors import ConfigError

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig
    from marl.rollout.records import Rollout


def check_algorithm(config: RLOOConfig) -> None:
    """Refuse an unknown or unimplemented loss and the invalid combinations (see the module docstring).

    Example:
        >>> from marl.config import RLOOConfig
        >>> check_algorithm(RLOOConfig(algorithm="gspo"))
        >>> check_algorithm(RLOOConfig(importance_sampling_level="sequence"))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: importance_sampling_level='sequence' applies to token-level losses, ...
    """
    loss_type = config.loss_type
    if loss_type in TRL_LOSS_TYPES_NOT_IMPLEMENTED:
        raise ConfigError(
            f"--loss_type {loss_type!r} is one of TRL 1.16's losses marl does not implement "
            f"({', '.join(TRL_LOSS_TYPES_NOT_IMPLEMENTED)}). Use one of {list(LOSS_TYPES)}"
        )
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"--loss_type {loss_type!r} is not a policy loss. Use one of {list(LOSS_TYPES)}")
    estimator = get_advantage_estimator(config.advantage_estimator)
    if config.scale_rewards is not None:
        # per_reward scales each source by its group std under rloo too (marl.algo.reward_normalization)
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
    if loss_type == SEQUENCE_LOSS:
        for name in ("importance_sampling_level", "use_bias_correction_kl"):
            if getattr(config, name) is not None:
                raise ConfigError(
                    f"{name}={getattr(config, name)!r} applies to token-level losses, but "
                    "loss_type='sequence' takes the ratio of the summed log-probs. Drop "
                    f"--{name}, or pick a token-level --loss_type (grpo, bnpo, dr_grpo, dapo)"
                )
    elif config.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ConfigError(
            f"--importance_sampling_level {config.importance_sampling_level!r} is not one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}. Use token, or sequence (GSPO)"
        )
    reward_normalization(config)  # --reward_normalization: a registered name, defined for this estimator
    if config.mask_truncated_completions and not config.has_stop_token:
        raise ConfigError(
            "mask_truncated_completions=true without a stop token (--stop_token none): every completion "
            "counts as truncated and none would train. Drop --stop_token none (the EOS ends completions), "
            "pass --stop_token_id ID, or --mask_truncated_completions false"
        )


def advantage_estimator(config: RLOOConfig) -> AdvantageEstimator:
    """The config's estimator, with ``--scale_rewards`` bound when it takes it.

    Example:
        >>> from marl.config import RLOOConfig
        >>> advantage_estimator(RLOOConfig(algorithm="dr_grpo")).keywords
        {'scale_rewards': 'none'}
    """
    return configured_estimator(config.advantage_estimator, config.scale_rewards)


def shape_rollout(
    config: RLOOConfig,
    rollout: Rollout,
    reward_weights: list[float],
    estimator: AdvantageEstimator,
    gather: Gather | None,
) -> ShapedRewards:
    """One rollout's rewards and advantages as the config asks (:func:`marl.algo.shaping.shape_rewards`),
    with ``--reward_normalization`` and each reward source's part of the advantage; ``estimator``: the
    config's (:func:`advantage_estimator`), ``gather``: the run's statistics over processes."""
    return shape_rewards(
        rollout.scores,
        rollout.logprobs,
        rollout.ref_logprobs,
        rollout.response_mask,
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


@dataclass(frozen=True)
class LossSettings:
    """What the policy loss reads of a run's settings: its numbers, not the whole config (as torchtune's
    ``PPOLoss(epsilon, ...)``), built once (:meth:`from_config`) when the run's parts are built.

    Attributes:
        kl_coef: the KL term's weight in the loss; 0 unless the run puts its KL in the loss
            (``kl_placement='loss'``: in the reward it is part of the advantages instead).
        response_length: the longest completion (``dr_grpo``'s normaliser, and the truncation warning).
        sampler_correction: the importance-sampling correction of the sampler's log-probs (``None``: off).

    Example:
        >>> from marl.config import RLOOConfig
        >>> LossSettings.from_config(RLOOConfig(algorithm="grpo", kl_coef=0.1)).kl_coef
        0.1
        >>> LossSettings.from_config(RLOOConfig(kl_coef=0.1)).kl_coef  # RLOO: the KL is in the reward
        0.0
    """

    loss_type: str
    cliprange: float
    epsilon_high: float | None
    kl_coef: float
    importance_sampling_level: str
    bias_correction_kl: bool
    response_length: int
    mask_truncated_completions: bool
    sampler_correction: SamplerCorrection | None = None

    @classmethod
    def from_config(cls, config: RLOOConfig) -> LossSettings:
        return cls(
            loss_type=config.loss_type,
            cliprange=config.cliprange,
            epsilon_high=config.epsilon_high,
            kl_coef=config.kl_coef if config.kl_placement == "loss" else 0.0,
            importance_sampling_level=config.importance_sampling_level,
            bias_correction_kl=bool(config.use_bias_correction_kl),
            response_length=config.response_length,
            mask_truncated_completions=config.mask_truncated_completions,
            sampler_correction=SamplerCorrection.from_config(config),
        )


def loss_mask(
    response_mask: torch.Tensor, contains_stop: torch.Tensor, settings: LossSettings
) -> torch.Tensor:
    """The tokens the loss sees: the valid tokens, without the truncated completions' when
    ``mask_truncated_completions``.

    Example:
        >>> from marl.config import RLOOConfig
        >>> settings = LossSettings.from_config(RLOOConfig(mask_truncated_completions=True))
        >>> loss_mask(torch.ones(2, 1, dtype=torch.bool), torch.tensor([True, False]), settings).flatten()
        tensor([ True, False])
    """
    if not settings.mask_truncated_completions:
        return response_mask
    return response_mask & contains_stop.unsqueeze(1)


def sampler_correction_metrics(
    rollout: Rollout, settings: LossSettings, parallelism: Any
) -> dict[str, float]:
    """TRL's ``sampling/importance_sampling_ratio/*`` of an updated ``rollout`` (its ``logprobs`` are the
    trainer's: scored, or provided by the update) over its loss tokens on every process (``parallelism``'s
    ``sum_over_processes``); empty where the correction is off."""
    correction = settings.sampler_correction
    if correction is None or rollout.sampled_logprobs is None or rollout.logprobs is None:
        return {}
    mask = loss_mask(rollout.response_mask, rollout.contains_stop, settings)
    ratios = counted_ratios(correction.ratio(rollout.logprobs, rollout.sampled_logprobs, mask), mask)
    return ratio_metrics(parallelism.sum_over_processes(RatioStats.of(ratios)))


def truncation_warning(contains_stop: torch.Tensor, settings: LossSettings, update: int) -> str | None:
    """What to warn when ``mask_truncated_completions`` leaves most of an update's completions (those without
    a stop token: they reached ``response_length``) out of the loss, else ``None``.

    Example:
        >>> from marl.config import RLOOConfig
        >>> settings = LossSettings.from_config(RLOOConfig(algorithm="dapo"))
        >>> truncation_warning(torch.tensor([True, False, False]), settings, 3)
        'update 3: 2 of 3 completions reached --response_length=512 without a stop token and ...'
        >>> truncation_warning(torch.tensor([True, True, False]), settings, 3) is None
        True
    """
    truncated, total = int((~contains_stop).sum()), contains_stop.numel()
    if not settings.mask_truncated_completions or 2 * truncated <= total:
        return None
    masked = "the loss masks them (mask_truncated_completions)"
    if truncated == total:
        masked = "the loss masks them all (mask_truncated_completions): this update trains on nothing"
    return (
        f"update {update}: {truncated} of {total} completions reached --response_length="
        f"{settings.response_length} without a stop token and {masked}. Raise --response_length, or pass "
        "--mask_truncated_completions false to train on them"
    )


def policy_loss(
    settings: LossSettings,
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_items: torch.Tensor | float | None = None,
    sampled_logprobs: torch.Tensor | None = None,
) -> tuple[PolicyLoss, torch.Tensor]:
    """One micro-batch's policy loss and the loss to back-propagate (before the division by the accumulation
    steps), KL term included when ``kl_placement='loss'``: the sequence loss of TRL v0.21's RLOO with its
    ``kl_coef · Σ_t k3`` per completion, or :func:`marl.algo.token_losses.token_policy_loss` with
    ``beta = kl_coef``. ``num_items``: the ``dapo`` normaliser. The sequence loss's record leaves its KL term
    out (as the ``loss/policy_avg`` metric always did); a token-level loss's record holds the loss it
    back-propagates. With the sampler correction on, each token's term is weighted by its ratio of
    ``old_logprobs`` (the trainer's, at sampling time) to ``sampled_logprobs`` (the sampler's).

    Example:
        >>> from marl.config import RLOOConfig
        >>> zero, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
        >>> settings = LossSettings.from_config(RLOOConfig())
        >>> policy_loss(settings, zero, zero, zero, torch.tensor([-1.0]), mask)[1].item()
        1.0
    """
    if settings.loss_type == SEQUENCE_LOSS:
        new_seq, old_seq = masked_sum(new_logprobs, mask), masked_sum(old_logprobs, mask)
        out = clipped_policy_loss(new_seq, old_seq, advantages, settings.cliprange, settings.epsilon_high)
        loss = out.loss
        if settings.kl_coef != 0:  # with kl_coef 0 no reference pass ran (marl.algo.passes)
            k3 = token_level_k3_kl(new_logprobs, ref_logprobs, mask)
            loss = loss + settings.kl_coef * k3.sum(dim=1).mean()
            out = out._replace(kl=k3.detach())
        return out, loss
    correction = settings.sampler_correction
    sampler_ratio = None
    if correction is not None:
        if sampled_logprobs is None:
            raise ValueError("the sampler correction is on: pass the sampler's log-probs")
        sampler_ratio = correction.ratio(old_logprobs, sampled_logprobs, mask)
    out = token_policy_loss(
        new_logprobs,
        old_logprobs,
        advantages,
        mask,
        loss_type=settings.loss_type,
        epsilon=settings.cliprange,
        epsilon_high=settings.epsilon_high,
        importance_sampling_level=settings.importance_sampling_level,
        ref_logprobs=ref_logprobs,
        beta=settings.kl_coef,
        bias_correction_kl=settings.bias_correction_kl,
        max_completion_length=settings.response_length,
        num_items=num_items,
        sampler_ratio=sampler_ratio,
    )
    return out, out.loss
