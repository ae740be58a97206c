"""Small tensor helpers shared by the RL math: masked sums over valid tokens, the sequence KL, and z-scores
whose statistics span every process.

A ``Gather`` concatenates a per-process tensor over processes (accelerate's ``Accelerator.gather``);
statistics taken after it do not depend on how a batch is split over processes. ``None`` stands for one
process.

Example:
    >>> import torch
    >>> masked_sum(torch.tensor([[1.0, 2.0]]), torch.tensor([[True, True]]))
    tensor([3.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Added to standard deviations so that a batch of identical values normalises to zeros instead of NaN.
STD_EPSILON = 1e-8

# Concatenates a tensor of the same shape from every process along dim 0, in process order (accelerate's
# ``Accelerator.gather``); ``None`` stands for one process.
Gather = Callable[[torch.Tensor], torch.Tensor]


def standardize(
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    gather: Gather | None = None,
    epsilon: float = STD_EPSILON,
) -> torch.Tensor:
    """Z-score of the entries selected by ``mask`` (all by default), with the mean and unbiased standard
    deviation (+ ``epsilon``) of the selected entries of every process (``gather``; ``None``: this process
    only). Entries outside ``mask`` come back unchanged; fewer than two selected entries in all map to 0.

    Example:
        >>> standardize(torch.tensor([1.0, 3.0]))
        tensor([-0.7071,  0.7071])
        >>> standardize(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([True, False, True]))
        tensor([-0.7071,     nan,  0.7071])
    """
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    pooled_values, pooled_mask = values, mask
    if gather is not None:  # one collective: values and mask side by side
        pooled = gather(torch.stack([values, mask.to(values.dtype)], dim=1))
        pooled_values, pooled_mask = pooled[:, 0], pooled[:, 1] > 0
    selected = pooled_values[pooled_mask]
    if selected.numel() < 2:
        return torch.where(mask, torch.zeros_like(values), values)
    standardized = (values - selected.mean()) / (selected.std() + epsilon)
    return torch.where(mask, standardized, values)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum over the valid positions; invalid positions contribute 0 even if they hold NaN or inf.

    Example:
        >>> masked_sum(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, False]]))
        tensor([1.])
    """
    return torch.where(mask, values, torch.zeros_like(values)).sum(dim=1)


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-completion KL estimate ``Σ_t (logp_t − ref_logp_t)`` over valid tokens, shape ``[B]``.

    Example:
        >>> mask = torch.tensor([[True, False]])
        >>> sequence_kl(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -5.0]]), mask)
        tensor([1.])
    """
    return masked_sum(logprobs - ref_logprobs, mask)


def model_tokens(rows: Any) -> torch.Tensor:
    """The valid tokens the model sampled of ``rows`` (samples, or any record with a ``response_mask``): all
    of them but, with tools, the tools' results between its turns (TRL's ``tool_mask``).

    Example:
        >>> from types import SimpleNamespace
        >>> valid = torch.tensor([[True, True, True]])
        >>> model_tokens(SimpleNamespace(response_mask=valid, tool_mask=torch.tensor([[True, False, True]])))
        tensor([[ True, False,  True]])
    """
    tool_mask = getattr(rows, "tool_mask", None)
    return rows.response_mask if tool_mask is None else rows.response_mask & tool_mask
