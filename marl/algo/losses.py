"""Policy-gradient losses, one micro-batch at a time: the PPO clipped surrogate on whole completions, the
token-level losses of TRL 1.x's ``GRPOTrainer`` with their aggregations, the per-token k3 KL penalty, and the
sampler correction's importance ratio; :func:`policy_loss` computes the config's loss from the numbers the
config gives it (:class:`LossSettings`), and :func:`check_algorithm` refuses the settings that would not work.

``loss_type="sequence"`` follows Ahmadian et al. (2024): the whole completion is one action, the ratio is that
of the sequence log-probabilities, and with one epoch over one mini-batch (ratio exactly 1) the loss is
REINFORCE (TRL v0.21's RLOO). The token-level losses (``loss_type`` grpo, bnpo, dr_grpo, dapo) have an
asymmetric clip (``epsilon`` / ``epsilon_high``, DAPO's clip-higher), a token- or sequence-level importance
ratio (``importance_sampling_level``; "sequence" is GSPO's length-normalised ratio) and, with ``beta > 0``,
the per-token k3 KL against the reference inside the loss. Per token ``t`` of completion ``b`` (valid tokens
only, mask ``m``):

* ratio ``ρ = exp(log π − log π_old)`` per token, or ``exp(Σ_t m·(log π − log π_old) / max(Σ_t m, 1))`` per
  sequence (GSPO), broadcast to its tokens;
* ``ℓ_bt = −w_bt·min(ρ·A_b, clip(ρ, 1 − ε, 1 + ε_high)·A_b) + β·k3_bt``, ``w`` the sampler correction's
  ratio (1 without it) with ``k3 = exp(r − n) − (r − n) − 1`` (``r``, ``n`` the reference and policy
  log-probs), multiplied by ``ρ`` when ``bias_correction_kl`` (TRL's ``use_bias_correction_kl``: it changes
  the gradient even where ``ρ = 1``);
* aggregation: ``grpo`` the mean over completions of each completion's token mean; ``bnpo`` the mean over
  the micro-batch's valid tokens; ``dr_grpo`` the sum over valid tokens / (rows · ``max_completion_length``);
  ``dapo`` the sum over valid tokens / ``num_items`` (the valid tokens of the optimizer step over every
  process, divided by processes × accumulation steps: the token mean of the whole step).

The sampler correction (TRL 1.16 ``GRPOTrainer``'s correction of vLLM samples, ``vllm_importance_sampling_*``;
settings in :mod:`marl.config.sampler_correction`): the sampler draws token ``y_t`` with log-prob ``s_t``; the
trainer computes ``o_t`` for it with the policy the update starts from (the rollout's policy pass, or the
update's own forward where that pass is skipped: the same weights). The ratio ``w = exp(o − s)`` is taken per
valid token (``token_*``) or once per completion from the sum of its tokens' log-ratios (``sequence_*``, shape
``[B, 1]``), then clamped to ``[clip_min, clip_max]`` (``*_truncate``) or set to 0 outside it (``*_mask``). A
token-level loss multiplies each token's clipped-surrogate term by ``w`` before the KL term is added (the KL
term is not weighted), as TRL does. ``w`` carries no gradient: both log-probs are the rollout's. The ratio
reads only its own row, so a micro-batch computes its rows' ratios exactly as the whole rollout would: every
epoch and mini-batch sees the same ``w``. Its metrics are in :mod:`marl.algo.metrics`.

Example:
    >>> import torch
    >>> zero = torch.tensor([0.0])
    >>> clipped_policy_loss(zero, zero, torch.tensor([-1.0]), cliprange=0.2).loss.item()
    1.0
    >>> zero, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    >>> token_policy_loss(zero, zero, torch.tensor([2.0]), mask, loss_type="bnpo", epsilon=0.2).loss.item()
    -2.0
    >>> sampled, trainer = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -2.0]])
    >>> sampler_importance_ratio(trainer, sampled, mask, "sequence_truncate", None, 1.5)
    tensor([[1.5000]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from marl.algo.advantages import check_estimator
from marl.algo.shaping import reward_normalization
from marl.algo.tensors import masked_sum
from marl.config.sampler_correction import SAMPLER_CORRECTION_MODES, SEQUENCE_MODES, TRUNCATE_MODES
from marl.errors import ConfigError

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig

# "sequence" is the sequence-summed ratio of TRL v0.21's RLOO (clipped_policy_loss).
SEQUENCE_LOSS = "sequence"


TOKEN_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


LOSS_TYPES = (SEQUENCE_LOSS, *TOKEN_LOSS_TYPES)


# TRL 1.16 GRPOConfig.loss_type values marl does not implement: refused by name.
TRL_LOSS_TYPES_NOT_IMPLEMENTED = ("cispo", "sapo", "luspo", "vespo")


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


class PolicyLoss(NamedTuple):
    """Output of :func:`clipped_policy_loss`; every field except ``loss`` is detached, shape ``[B]``, except
    ``kl``: the per-token KL term ``[B, T]`` the loss adds (before its coefficient), ``None`` without one."""

    loss: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor | None = None


def clipped_policy_loss(
    new_seq_logprob: torch.Tensor,
    old_seq_logprob: torch.Tensor,
    advantages: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate on the sequence ratio ``ρ = exp(Σ new_logp − Σ old_logp)``.

    ``loss = mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε_high)))`` with ``ε_high = cliprange_high`` (TRL 1.x's
    ``epsilon_high``; ``None``: ``cliprange``, TRL v0.21's symmetric clip). With ``ρ = 1`` (one epoch, one
    mini-batch) clipping is inactive and the gradient equals REINFORCE's ``−A · ∇ log π(completion)``.

    ``clipped[b]`` is True where the clipped branch is strictly larger (that sample gives no gradient).

    Example:
        >>> zero = torch.tensor([0.0])
        >>> out = clipped_policy_loss(zero, zero, torch.tensor([2.0]), cliprange=0.2)
        >>> out.loss.item(), out.ratio.item()
        (-2.0, 1.0)
    """
    log_ratio = new_seq_logprob - old_seq_logprob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    high = cliprange if cliprange_high is None else cliprange_high
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    loss = torch.max(unclipped_loss, clipped_loss).mean()
    return PolicyLoss(
        loss=loss,
        ratio=ratio.detach(),
        log_ratio=log_ratio.detach(),
        clipped=(clipped_loss > unclipped_loss).detach(),
    )


def token_level_k3_kl(
    new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 KL estimator ``exp(ref − new) − (ref − new) − 1`` on valid tokens, else 0; ``[B, T]``.

    k3 is non-negative and unbiased for KL(π‖π_ref) under samples from π. With ``token_level_kl=True`` the
    trainer adds ``kl_coef · Σ_t k3_t`` (mean over completions) to the loss instead of folding KL into the
    reward.

    Example:
        >>> token_level_k3_kl(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([[True]]))
        tensor([[0.]])
    """
    # Masked before exp: after the stop token the log-probs are unconstrained, and exp of a large difference
    # there is inf, whose local gradient times the mask's 0 is NaN in backward. A masked log-ratio of 0 gives
    # k3 = 0 and a zero gradient.
    log_ratio_ref = torch.where(mask, ref_logprobs - new_logprobs, torch.zeros_like(new_logprobs))
    return torch.exp(log_ratio_ref) - log_ratio_ref - 1.0


def _masked_total(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ of ``values`` (``[B, T]``, or ``[B, 1]`` broadcast over tokens) over valid tokens, per row."""
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=1)


def aggregate_token_losses(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One loss from per-token losses ``[B, T]`` (or ``[B, 1]``, one per sequence, counted once per valid
    token as TRL does) by ``loss_type``'s normalisation; see the module docstring.

    Example:
        >>> per_token = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
        >>> mask = torch.tensor([[True, True], [True, False]])
        >>> [aggregate_token_losses(per_token, mask, kind, max_completion_length=4, num_items=6).item()
        ...  for kind in TOKEN_LOSS_TYPES]
        [2.0, 2.0, 0.75, 1.0]
    """
    row_totals = _masked_total(per_token.expand(mask.shape), mask)
    if loss_type == "grpo":
        return (row_totals / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return row_totals.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass it")
        return row_totals.sum() / (mask.shape[0] * max_completion_length)
    if loss_type == "dapo":
        if num_items is None:
            raise ValueError("loss_type='dapo' divides by the optimizer step's token count: pass num_items")
        return row_totals.sum() / torch.as_tensor(num_items, dtype=per_token.dtype).clamp(min=1)
    raise ValueError(f"loss_type={loss_type!r}: token-level losses are {TOKEN_LOSS_TYPES}")


def token_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
    sampler_ratio: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped token-level loss of ``loss_type`` on per-token log-probs ``[B, T]``, advantages ``[B]``
    and the valid-token mask ``[B, T]`` (see the module docstring for the definition).

    Returns a :class:`PolicyLoss`; its per-completion fields (detached, ``[B]``) are the
    sequence ratio ``exp(Σ_t log-ratio)`` and its log, as for the sequence loss, and ``clipped``, the fraction
    of the completion's valid tokens whose clipped branch is active (TRL's low and high clip); ``kl``, with
    ``beta != 0``, the per-token KL term (times the ratio with ``bias_correction_kl``) before ``beta``.
    ``sampler_ratio`` (``[B, T]`` or ``[B, 1]``, no gradient): the sampler correction's weight of each
    token's clipped term, applied before the KL term is added, as TRL 1.16 applies its vLLM correction.

    Example:
        >>> new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> advantages = torch.tensor([1.0])
        >>> out = token_policy_loss(new, new.detach(), advantages, mask, loss_type="grpo", epsilon=0.2)
        >>> out.loss.backward(); new.grad
        tensor([[-0.5000, -0.5000]])
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r}: not one of the known levels"
        )
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    # Masked before exp: log-probs past the stop token are unconstrained (see token_level_k3_kl).
    log_ratio = torch.where(mask, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    if importance_sampling_level == "sequence":
        log_weights = (log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).unsqueeze(1)
    else:
        log_weights = log_ratio
    ratio = torch.exp(log_weights)
    column = advantages.unsqueeze(1)
    unclipped = ratio * column
    clipped_branch = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * column
    per_token = -torch.min(unclipped, clipped_branch)
    if sampler_ratio is not None:
        per_token = per_token * sampler_ratio
    kl_term = None
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 puts the k3 KL in the loss: pass ref_logprobs")
        kl = token_level_k3_kl(new_logprobs, ref_logprobs, mask)
        kl_term = kl * ratio if bias_correction_kl else kl
        per_token = per_token + beta * kl_term
    loss = aggregate_token_losses(
        per_token, mask, loss_type, max_completion_length=max_completion_length, num_items=num_items
    )
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - epsilon) & (column < 0)) | ((ratio > 1.0 + epsilon_high) & (column > 0))
        clipped = _masked_total(is_clipped.expand(mask.shape).float(), mask) / mask.sum(dim=1).clamp(min=1)
        sequence_log_ratio = log_ratio.sum(dim=1)
    return PolicyLoss(
        loss=loss,
        ratio=sequence_log_ratio.exp(),
        log_ratio=sequence_log_ratio,
        clipped=clipped,
        kl=None if kl_term is None else kl_term.detach(),
    )


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


def check_algorithm(config: RLOOConfig) -> None:
    """Refuse, right after the command line is parsed (:func:`marl.train.training_parts.check_components`),
    an unknown loss, one of TRL 1.16's losses that marl does not implement, and settings that would do
    nothing with the chosen loss or estimator: a :class:`~marl.errors.ConfigError` naming the fields and the
    fix.

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
    check_estimator(config)  # --advantage_estimator and --scale_rewards
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
    ``kl_coef · Σ_t k3`` per completion, or :func:`token_policy_loss` with
    ``beta = kl_coef``. ``num_items``: the ``dapo`` normaliser. The sequence loss's record leaves its KL term
    out (the ``loss/policy_avg`` metric); a token-level loss's record holds the loss it
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
        if settings.kl_coef != 0:  # with kl_coef 0 no reference pass ran (marl.algo.scoring_passes)
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
