"""The records of a memory plan: where it is planned (:class:`PlanTarget`), each phase's parts
(:class:`PhasePlan`), the plan (:class:`MemoryPlan`, which reads as :func:`plan_text`), and the changes of
settings that fit (:class:`Change`, :class:`Advice`). :mod:`marl.plan.planner` makes them,
:mod:`marl.plan.advice` searches the changes, :mod:`marl.plan.report` writes the advice out.

Example:
    >>> plan = MemoryPlan("marl", "m", {}, {}, [PhasePlan("update", {"resident": 10**9})], PlanTarget())
    >>> print(plan_text(plan).splitlines()[-1])
    predicted peak: 1.00 GB (update)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from marl.model.memory import format_bytes

MiB = 2**20
# CUDA context, library handles and loaded kernels of a PyTorch process once it has trained: what a process
# held on the card outside the caching allocator at the end of a run, measured on an H100 with torch 2.11 and
# CUDA 13 (771-837 MiB, the most with 8-bit kernels: benchmarks/results/*-memory-plan-cuda.md). Other cards
# and CUDA versions were not measured.
CUDA_RUNTIME_BYTES = 800 * MiB
# CPU: what a training process holds beyond its tensors once it has run a model (library pages and buffers of
# the kernels it used, the allocator's own): the median, over the tiny-model runs of
# examples/benchmarks/plan_vs_measured.py (whose tensors are a few MB), of their peak PSS above the imports
# less the tensors planned. Larger models hold more of it (the same runs of SmolLM2-135M: 100-300 MiB more).
CPU_RUNTIME_BYTES = 112 * MiB
# The caching allocator keeps freed blocks and splits them: what a process reserves is above what its
# tensors hold at the peak. The planner's "fits" keeps this share of the card free.
ALLOCATOR_MARGIN = 0.10
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class PlanTarget:
    """Where and on what the run is planned: the device, its memory, the prompts' length, the processes."""

    device: str = "cuda"
    memory_gb: float | None = None  # the card's (or machine's) memory, decimal GB
    prompt_length: int = 512  # tokens of the longest prompt of a batch
    num_processes: int = 1
    compute_dtype: torch.dtype | None = None  # None: bfloat16 on CUDA, float32 on CPU (marl's default)

    @property
    def dtype(self) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def runtime_bytes(self) -> int:
        return CUDA_RUNTIME_BYTES if self.device == "cuda" else CPU_RUNTIME_BYTES


@dataclass(frozen=True)
class PhasePlan:
    """One phase's predicted peak, as the parts that make it up (bytes, display order)."""

    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peak of every phase of a run on one process, and what went into it."""

    system: str
    model: str
    settings: dict[str, Any]
    resident: dict[str, int]
    phases: list[PhasePlan]
    target: PlanTarget
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(phase.total for phase in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: phase.total).name

    def phase(self, name: str) -> PhasePlan:
        return next(phase for phase in self.phases if phase.name == name)

    @property
    def budget_bytes(self) -> int | None:
        """What the run may use of ``memory_gb``: the card less the allocator margin."""
        if self.target.memory_gb is None:
            return None
        return int(self.target.memory_gb * 1e9 * (1 - ALLOCATOR_MARGIN))

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.peak <= self.budget_bytes

    def __str__(self) -> str:
        return plan_text(self)


@dataclass(frozen=True)
class Change:
    """One change of settings, what it costs, and the run's plan with it."""

    flags: str
    why: str
    plan: MemoryPlan


@dataclass(frozen=True)
class Advice:
    """The changes that fit, cheapest first (the first is "no change" when the run fits as it is; empty when
    nothing tried fits) and, when no change on the run's own number of processes fits, the one of those
    (the run as given included) with the smallest predicted peak."""

    fitting: list[Change] = field(default_factory=list)
    closest: Change | None = None


def plan_text(plan: MemoryPlan) -> str:
    """The plan as lines: settings, what stays resident, each phase's parts and total, the peak."""
    target = plan.target
    lines = [
        f"memory plan ({plan.system}) for {plan.model} on {target.device}"
        + (f" with {target.memory_gb:g} GB" if target.memory_gb is not None else ""),
    ]
    if plan.settings:
        lines.append("  " + ", ".join(f"{name} {value}" for name, value in plan.settings.items()))
    resident = {name: size for name, size in plan.resident.items() if size}
    if resident:
        lines.append(
            "  resident: " + ", ".join(f"{name} {format_bytes(size)}" for name, size in resident.items())
        )
    width = max(len(phase.name) for phase in plan.phases)
    for phase in plan.phases:
        parts = " + ".join(f"{name} {format_bytes(size)}" for name, size in phase.parts.items() if size)
        lines.append(f"  {phase.name.ljust(width)}  {format_bytes(phase.total):>9}  = {parts}")
    lines += [f"  note: {note}" for note in plan.notes]
    verdict = f"predicted peak: {format_bytes(plan.peak)} ({plan.peak_phase})"
    if plan.fits is not None:
        budget = format_bytes(plan.budget_bytes)
        verdict += (
            f"; fits in {target.memory_gb:g} GB (usable {budget} after the allocator margin)"
            if plan.fits
            else f"; does NOT fit in {target.memory_gb:g} GB (usable {budget} after the allocator margin)"
        )
    lines.append(verdict)
    return "\n".join(lines)
