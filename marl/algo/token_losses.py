"""Token-level clipped policy losses of TRL 1.x's ``GRPOTrainer`` (``loss_type`` grpo, bnpo, dr_grpo, dapo),
with an asymmetric clip (``epsilon`` / ``epsilon_high``, DAPO's clip-higher), a token- or sequence-level
importance ratio (``importance_sampling_level``; "sequence" is GSPO's length-normalised ratio) and, with
``beta > 0``, the per-token k3 KL against the reference inside the loss.

Per token ``t`` of completion ``b`` (valid tokens only, mask ``m``):

* ratio ``ρ = exp(log π − log π_old)`` per token, or ``exp(Σ_t m·(log π − log π_old) / max(Σ_t m, 1))`` per
  sequence (GSPO), broadcast to its tokens;
* ``ℓ_bt = −w_bt·min(ρ·A_b, clip(ρ, 1 − ε, 1 + ε_high)·A_b) + β·k3_bt``, ``w`` the sampler correction's
  ratio (:mod:`marl.algo.sampler_correction`; 1 without it) with ``k3 = exp(r − n) − (r − n) − 1``
  (``r``, ``n`` the reference and policy log-probs), multiplied by ``ρ`` when ``bias_correction_kl`` (TRL's
  ``use_bias_correction_kl``: it changes the gradient even where ``ρ = 1``);
* aggregation: ``grpo`` the mean over completions of each completion's token mean; ``bnpo`` the mean over
  the micro-batch's valid tokens; ``dr_grpo`` the sum over valid tokens / (rows · ``max_completion_length``);
  ``dapo`` the sum over valid tokens / ``num_items`` (the valid tokens of the optimizer step over every
  process, divided by processes × accumulation steps: the token mean of the whole step).

The sequence-level loss of TRL v0.21's RLOO, ``loss_type="sequence"``, stays in :mod:`marl.algo.losses`.

Example:
    >>> import torch
    >>> zero, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    >>> token_policy_loss(zero, zero, torch.tensor([2.0]), mask, loss_type="bnpo", epsilon=0.2).loss.item()
    -2.0
"""

from __future__ import annotations

import torch

from marl.algo.losses import PolicyLoss, token_level_k3_kl

# "sequence" is the sequence-summed ratio of TRL v0.21's RLOO (marl.algo.losses.clipped_policy_loss).
SEQUENCE_LOSS = "sequence"
TOKEN_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LOSS_TYPES = (SEQUENCE_LOSS, *TOKEN_LOSS_TYPES)
# TRL 1.16 GRPOConfig.loss_type values marl does not implement: refused by name.
TRL_LOSS_TYPES_NOT_IMPLEMENTED = ("cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


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

    Returns a :class:`marl.algo.losses.PolicyLoss`; its per-completion fields (detached, ``[B]``) are the
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
