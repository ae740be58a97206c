"""Policy-gradient losses: the PPO clipped surrogate on whole completions and the per-token k3 KL penalty.

Following Ahmadian et al. (2024), the whole completion is one action: the ratio is that of the sequence
log-probabilities, and with one epoch over one mini-batch (ratio exactly 1) the loss is REINFORCE.

Example:
    >>> import torch
    >>> zero = torch.tensor([0.0])
    >>> clipped_policy_loss(zero, zero, torch.tensor([-1.0]), cliprange=0.2).loss.item()
    1.0
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
