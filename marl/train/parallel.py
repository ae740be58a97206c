"""Collectives between training processes, each on ONE flat buffer: starting every process from the main
process's policy weights, averaging policy gradients before an optimizer step, and agreeing on a flag.

One collective per step instead of one per LoRA tensor (about 450 for an all-linear LoRA on a 32-layer
model). With one process every function returns at once.
"""

from __future__ import annotations

from typing import Any

import torch


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def broadcast_from_main(parameters: list[torch.nn.Parameter], accelerator: Any) -> None:
    """Overwrite every process's ``parameters`` with the main process's (a fresh LoRA is random)."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import broadcast

    with torch.no_grad():
        _unflatten_into(broadcast(_flatten(parameters), from_process=0), parameters)


def average_gradients(parameters: list[torch.nn.Parameter], accelerator: Any) -> None:
    """Replace every parameter's gradient by its mean over processes (a missing gradient counts as zero)."""
    if accelerator.num_processes == 1:
        return
    gradients = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = accelerator.reduce(_flatten(gradients), reduction="mean")
    for parameter, gradient in zip(parameters, gradients, strict=True):
        parameter.grad = gradient
    with torch.no_grad():
        _unflatten_into(flat, gradients)


def any_process(flag: bool, accelerator: Any) -> bool:
    """Whether ``flag`` is true on at least one process."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() > 0)
