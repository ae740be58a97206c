"""How a memory plan reads: the phases with their parts, the peak against the card, and the changes that fit.

Example:
    >>> from marl.plan.planner import MemoryPlan, PhasePlan, PlanTarget
    >>> plan = MemoryPlan("marl", "m", {}, {}, [PhasePlan("update", {"resident": 10**9})], PlanTarget())
    >>> print(plan_text(plan).splitlines()[-1])
    predicted peak: 1.00 GB (update)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from marl.model.memory import format_bytes

if TYPE_CHECKING:
    from marl.plan.advice import Change
    from marl.plan.planner import MemoryPlan


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


def changes_text(changes: Sequence[Change]) -> str:
    """The changes, each with its flags and predicted peak, cheapest first."""
    if not changes:
        return "no single change or combination tried brings the run under the budget"
    lines = ["changes that bring it under the budget (cheapest first):"]
    for change in changes:
        lines.append(f"  {change.flags:<60} {format_bytes(change.plan.peak):>9}  {change.why}")
    return "\n".join(lines)
