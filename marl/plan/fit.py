"""The planner applied to a run: what ``marl plan`` advises a run that ran out of memory.

Example:
    >>> line = out_of_memory_advice(trainer, memory_gb=24)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marl.model.memory import format_bytes
from marl.plan.advice import advise
from marl.plan.planner import plan_for_trainer


def card_memory_gb(device: Any) -> float | None:
    """The whole memory of a CUDA ``device`` in GB (``None`` on CPU, whose budget a user gives)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 1e9


def out_of_memory_advice(trainer: Any, memory_gb: float | None = None) -> str:
    """One sentence: the cheapest change ``marl plan`` finds that fits ``memory_gb`` (default: the card's
    memory; on CPU without a budget, how to ask ``marl plan``), else how far the closest setting is."""
    memory_gb = memory_gb if memory_gb is not None else card_memory_gb(trainer.parallelism.device)
    if memory_gb is None:
        return "marl plan with the same flags and --device cpu --memory_gb GB lists the settings that fit"
    plan = plan_for_trainer(trainer)
    target = dataclasses.replace(plan.target, memory_gb=memory_gb)
    advice = advise(trainer.config, trainer.model.config, target)
    same = [c for c in advice.fitting if c.plan.target.num_processes == target.num_processes]
    where = f"marl plan ({memory_gb:.1f} GB)"
    if same:
        return f"{where}: {same[0].flags} fits, {format_bytes(same[0].plan.peak)} planned"
    if advice.closest is not None:
        closest = advice.closest.plan
        over = format_bytes(closest.peak - closest.budget_bytes)
        return (
            f"{where}: nothing fits on this card; closest {advice.closest.flags} needs "
            f"{format_bytes(closest.peak)} ({closest.peak_phase}), {over} over"
        )
    return f"{where}: only on more GPUs: {advice.fitting[0].flags}"
