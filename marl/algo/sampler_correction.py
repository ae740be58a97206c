"""The importance-sampling correction of the sampler/trainer mismatch (TRL 1.16 ``GRPOTrainer``'s correction
of vLLM samples, ``vllm_importance_sampling_*``; settings in :mod:`marl.config.sampler_correction`).

The sampler draws token ``y_t`` with log-prob ``s_t``; the trainer computes ``o_t`` for it with the policy the
update starts from (the rollout's policy pass, or the update's own forward where that pass is skipped: the
same weights). The ratio ``w = exp(o − s)`` is taken per valid token (``token_*``) or once per completion
from the sum of its tokens' log-ratios (``sequence_*``, shape ``[B, 1]``), then clamped to ``[clip_min,
clip_max]`` (``*_truncate``) or set to 0 outside it (``*_mask``). A token-level loss multiplies each token's
clipped-surrogate term by ``w`` before the KL term is added (the KL term is not weighted), as TRL does.
``w`` carries no gradient: both log-probs are the rollout's.

The ratio reads only its own row, so a micro-batch computes its rows' ratios exactly as the whole rollout
would: every epoch and mini-batch sees the same ``w``.

Metrics, TRL's names: ``sampling/importance_sampling_ratio/min``, ``/mean`` and ``/max`` over the valid
tokens (``token_*``) or over the completions (``sequence_*``) of every process. TRL takes the mean of each
process's mean; marl the mean over all of them (the same on one process).

Example:
    >>> import torch
    >>> sampled = torch.tensor([[-1.0, -2.0]])
    >>> trainer = torch.tensor([[-0.5, -2.0]])
    >>> mask = torch.tensor([[True, True]])
    >>> sampler_importance_ratio(trainer, sampled, mask, "sequence_truncate", None, 1.5)
    tensor([[1.5000]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from marl.algo.metrics import highest, lowest
from marl.config.sampler_correction import SAMPLER_CORRECTION_MODES, SEQUENCE_MODES, TRUNCATE_MODES

RATIO_MIN = "sampling/importance_sampling_ratio/min"
RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
RATIO_MAX = "sampling/importance_sampling_ratio/max"


@dataclass(frozen=True)
class SamplerCorrection:
    """The correction's settings: the mode and the ratio's bounds (``None``: unbounded on that side).

    Example:
        >>> from marl.config import RLOOConfig
        >>> SamplerCorrection.from_config(RLOOConfig(algorithm="grpo")) is None
        True
    """

    mode: str
    clip_min: float | None
    clip_max: float | None

    @classmethod
    def from_config(cls, config: Any) -> SamplerCorrection | None:
        """The config's correction, ``None`` where it is off."""
        if not config.vllm_importance_sampling_correction:
            return None
        return cls(
            config.vllm_importance_sampling_mode,
            config.vllm_importance_sampling_clip_min,
            config.vllm_importance_sampling_clip_max,
        )

    def ratio(
        self, trainer_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """:func:`sampler_importance_ratio` with these settings."""
        return sampler_importance_ratio(
            trainer_logprobs, sampled_logprobs, mask, self.mode, self.clip_min, self.clip_max
        )


def sampler_importance_ratio(
    trainer_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """The correction's ratio ``π_trainer / π_sampler`` (see the module docstring): ``[B, T]`` for the
    ``token_*`` modes (1 on invalid tokens before bounding), ``[B, 1]`` for the ``sequence_*`` modes. A
    sampled log-prob that is NaN counts as agreeing (log-ratio 0), as TRL counts a token vLLM could not score.

    Example:
        >>> trainer = torch.tensor([[0.0, 0.0, 0.0]])
        >>> sampled = torch.tensor([[-2.0, 0.0, 2.0]])
        >>> mask = torch.ones(1, 3, dtype=torch.bool)
        >>> sampler_importance_ratio(trainer, sampled, mask, "token_truncate", 0.5, 3.0)
        tensor([[3.0000, 1.0000, 0.5000]])
        >>> sampler_importance_ratio(trainer, sampled, mask, "token_mask", 0.5, 3.0)
        tensor([[0., 1., 0.]])
        >>> sampler_importance_ratio(trainer, sampled, mask, "sequence_mask", None, 3.0)
        tensor([[1.]])
    """
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(f"mode={mode!r}: not one of {SAMPLER_CORRECTION_MODES}")
    log_ratio = torch.where(mask.bool(), trainer_logprobs.float() - sampled_logprobs.float(), 0.0)
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0)
    if mode in SEQUENCE_MODES:
        log_ratio = log_ratio.sum(dim=1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode in TRUNCATE_MODES:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def counted_ratios(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ratios the metrics count, 1-D: every completion's (``[B, 1]``), else the valid tokens'.

    Example:
        >>> counted_ratios(torch.tensor([[2.0, 5.0]]), torch.tensor([[True, False]])).tolist()
        [2.0]
    """
    return ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]


@dataclass
class RatioStats:
    """One process's sum, count, minimum and maximum of the counted ratios (combined over processes by
    :func:`marl.train.parallel.sum_over_processes`: sums added, the minimum and maximum of them all)."""

    total: float | torch.Tensor = 0.0
    count: float | torch.Tensor = 0.0
    smallest: float = lowest()
    largest: float = highest()

    @classmethod
    def of(cls, ratios: torch.Tensor) -> RatioStats:
        if ratios.numel() == 0:
            return cls()
        return cls(ratios.sum(), float(ratios.numel()), float(ratios.min()), float(ratios.max()))


def ratio_metrics(stats: RatioStats) -> dict[str, float]:
    """TRL's three metrics from the stats of every process (empty where no ratio was counted).

    Example:
        >>> ratio_metrics(RatioStats.of(torch.tensor([0.5, 1.5])))
        {'sampling/importance_sampling_ratio/min': 0.5, 'sampling/importance_sampling_ratio/mean': 1.0, \
'sampling/importance_sampling_ratio/max': 1.5}
    """
    if stats.count == 0:
        return {}
    return {
        RATIO_MIN: float(stats.smallest),
        RATIO_MEAN: float(stats.total / stats.count),
        RATIO_MAX: float(stats.largest),
    }
