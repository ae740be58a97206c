"""How advice on a memory plan reads: the changes that fit, and how far the closest setting is when none does
(the plan itself reads as :func:`marl.plan.records.plan_text`).

Example:
    >>> from marl.plan.records import Advice
    >>> print(advice_text(Advice()))
    no single change or combination tried brings the run under the budget
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from marl.model.memory import format_bytes

if TYPE_CHECKING:
    from marl.plan.records import Advice, Change


def changes_text(changes: Sequence[Change]) -> str:
    """The changes, each with its flags and predicted peak, cheapest first."""
    if not changes:
        return "no single change or combination tried brings the run under the budget"
    lines = ["changes that bring it under the budget (cheapest first):"]
    for change in changes:
        lines.append(f"  {change.flags:<60} {format_bytes(change.plan.peak):>9}  {change.why}")
    return "\n".join(lines)


def advice_text(advice: Advice) -> str:
    """The changes that fit (:func:`changes_text`) and, when none fits on the run's own processes, how far
    the closest setting there is (:func:`closest_text`)."""
    parts = [changes_text(advice.fitting)]
    if advice.closest is not None:
        parts.append(closest_text(advice.closest))
    return "\n".join(parts)


def closest_text(change: Change) -> str:
    """How far ``change`` (the closest setting that does not fit) is over the budget, and, when its base
    weights alone take more than half the usable memory, their share.

    Example:
        >>> from marl.plan.records import Change, MemoryPlan, PhasePlan, PlanTarget
        >>> plan = MemoryPlan("marl", "m", {"quantization": "4bit"}, {"base weights": 9_200_000_000},
        ...     [PhasePlan("update", {"resident": 12 * 10**9})], PlanTarget(memory_gb=12))
        >>> change = Change("--gradient_checkpointing", "", plan)
        >>> print(closest_text(change))  # doctest: +NORMALIZE_WHITESPACE
        nothing tried on 1 GPU fits; closest: --gradient_checkpointing needs 12.00 GB (update),
        1.20 GB over the 10.80 GB usable
          the 4-bit base alone takes 9.20 GB of the 10.80 GB usable (85%)
    """
    plan, target = change.plan, change.plan.target
    budget = plan.budget_bytes
    count = target.num_processes
    where = f"{count} GPU" if target.device == "cuda" else f"{count} process"
    where += "s" if count > 1 else ""
    lines = [
        f"nothing tried on {where} fits; closest: {change.flags} needs {format_bytes(plan.peak)} "
        f"({plan.peak_phase}), {format_bytes(plan.peak - budget)} over the {format_bytes(budget)} usable"
    ]
    base = plan.resident.get("base weights", 0)
    if base > budget / 2:
        quantization = plan.settings.get("quantization", "none")
        kind = (
            plan.settings.get("dtype", "") if quantization == "none" else quantization.replace("bit", "-bit")
        )
        share = (
            f"of the {format_bytes(budget)} usable ({base / budget:.0%})"
            if base <= budget
            else f"more than the {format_bytes(budget)} usable"
        )
        base_name = f"{kind} base" if kind else "base"
        lines.append(f"  the {base_name} alone takes {format_bytes(base)} {share}")
    return "\n".join(lines)
