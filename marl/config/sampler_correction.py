"""The importance-sampling correction of the sampler/trainer log-prob mismatch: ``RLOOConfig``'s four
``vllm_importance_sampling_*`` fields (TRL 1.16 ``GRPOConfig``'s names, so a TRL config maps onto them one to
one) and their checks, in one place.

TRL samples with vLLM, whose kernels and precision differ from the trainer's, and multiplies each token's
loss by ``π_trainer / π_sampler`` (truncated or masked, per token or per sequence) to undo the mismatch; it
turns the correction on by default because vLLM's mismatch is large. In marl the sampler is marl's own
decode on the same weights, the same adapter and the same dtype as the trainer
(``sampling/sampling_logp_difference`` measures what is left: rounding of another kernel), so the
correction is off by default and offered where that gap is material (bf16 on a GPU:
``benchmarks/results/2026-11-27-gpu-sequence.md``). The ``vllm_`` prefix stays for a TRL user's
sake: in marl it names the sampler, whichever it is. The math is :mod:`marl.algo.losses`.

Example:
    >>> from types import SimpleNamespace
    >>> settings = SimpleNamespace(vllm_importance_sampling_correction=True, loss_type="grpo",
    ...     vllm_importance_sampling_mode="token_clip", vllm_importance_sampling_clip_min=None,
    ...     vllm_importance_sampling_clip_max=3.0)
    >>> check_sampler_correction(settings)
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --vllm_importance_sampling_mode 'token_clip' is not one of ('token_truncate', ...
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from marl.errors import ConfigError

# TRL 1.16's modes: the granularity (one ratio per token, or one per sequence for all its tokens) and what
# happens outside [clip_min, clip_max] (truncate: clamped to the bounds; mask: set to 0).
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SEQUENCE_MODES = ("sequence_truncate", "sequence_mask")
TRUNCATE_MODES = ("token_truncate", "sequence_truncate")


def correction_field() -> Any:
    return field(
        default=False,
        metadata={
            "help": "Multiply each token's loss by the importance ratio π_trainer / π_sampler of its token "
            "(TRL's correction of vLLM samples; here the sampler is marl's --sampler, which must keep its "
            "log-probs: static or graph). Off by default, unlike TRL, which turns it on for vLLM only: marl "
            "samples with the trainer's own weights, adapter and dtype, so the ratio is 1 up to rounding. "
            "Turn it on where sampling/sampling_logp_difference/mean is material (above about 1e-2). "
            "Token-level losses only."
        },
    )


def mode_field() -> Any:
    return field(
        default="sequence_mask",
        metadata={
            "help": "How the correction's ratio is taken and bounded: token_truncate, token_mask, "
            "sequence_truncate or sequence_mask (TRL's default): per token or one per completion (the sum "
            "of its tokens' log-ratios), clamped to [clip_min, clip_max] (truncate) or set to 0 outside it "
            "(mask)."
        },
        # no "choices": check_sampler_correction names the modes in a one-line error
    )


def clip_max_field() -> Any:
    return field(
        default=3.0,
        metadata={"help": "Upper bound of the correction's ratio (TRL's C_max); unset: none."},
    )


def clip_min_field() -> Any:
    return field(
        default=None,
        metadata={"help": "Lower bound of the correction's ratio (TRL's C_min); unset: none."},
    )


def check_sampler_correction(settings: Any) -> None:
    """Refuse a correction setting that cannot work (TRL 1.16 ``GRPOConfig``'s own checks, and marl's sequence
    loss, whose ratio is one per completion, not per token), naming the fix.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(vllm_importance_sampling_correction=False, loss_type="grpo",
        ...     vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=2.0,
        ...     vllm_importance_sampling_clip_max=2.0)
        >>> check_sampler_correction(settings)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: vllm_importance_sampling_clip_min=2.0 is not below ...
    """
    mode = settings.vllm_importance_sampling_mode
    low, high = settings.vllm_importance_sampling_clip_min, settings.vllm_importance_sampling_clip_max
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ConfigError(
            f"--vllm_importance_sampling_mode {mode!r} is not one of {SAMPLER_CORRECTION_MODES}. Use one of "
            "them (TRL's default: sequence_mask)"
        )
    if low is not None and high is not None and low >= high:
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={low} is not below vllm_importance_sampling_clip_max={high}. "
            "Lower --vllm_importance_sampling_clip_min or raise --vllm_importance_sampling_clip_max"
        )
    if not settings.vllm_importance_sampling_correction:
        return
    if mode in TRUNCATE_MODES and low is None and high is None:
        raise ConfigError(
            f"--vllm_importance_sampling_mode {mode} clamps the ratio, but neither bound is set. Set "
            "--vllm_importance_sampling_clip_max (TRL's default 3.0) or --vllm_importance_sampling_clip_min"
        )
    if settings.loss_type == "sequence":
        raise ConfigError(
            "vllm_importance_sampling_correction=true weights each token's loss, but loss_type='sequence' "
            "takes one ratio per completion. Pick a token-level --loss_type (grpo, bnpo, dr_grpo, dapo), or "
            "drop --vllm_importance_sampling_correction"
        )
