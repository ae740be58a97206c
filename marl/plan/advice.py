"""Which setting to change when a run does not fit: each change planned, those that fit listed cheapest first.

The changes are tried in the order of what they cost the run, least first:

1. ``--share_prompt_prefix`` back on (each prompt computed once: faster, not slower);
2. a smaller ``--local_rollout_forward_batch_size`` (sampling and scoring in more, smaller chunks);
3. ``--gradient_checkpointing`` (the update recomputes activations: about a third more update compute);
4. a smaller ``--per_device_train_batch_size`` with a larger ``--gradient_accumulation_steps`` (the same
   optimizer step in more passes);
5. ``--quantization 4bit`` (another base: its numbers change);
6. ``--parallelism fsdp2`` over 2, 4 or 8 GPUs (the base sharded; unquantized and 4-bit bases).

Each is planned alone; when none fits alone, they are combined in that order until the run fits. When only
changes that add GPUs fit, those on the run's own GPUs are also combined (listed first when that fits). When
nothing on the run's own GPUs fits, the one that came closest is kept (:class:`Advice`): how far over the
budget it is, and how much of the budget the base alone takes, are what a user needs to choose a card or a
model. :func:`advice_text` writes the advice out (the plan itself reads as
:func:`marl.plan.planner.plan_text`).

Example:
    >>> from transformers import LlamaConfig
    >>> from marl.config import RLOOConfig
    >>> from marl.plan.planner import PlanTarget
    >>> model = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, vocab_size=256)
    >>> config = RLOOConfig(rloo_k=4, per_device_train_batch_size=8, response_length=16)
    >>> changes = changes_that_fit(config, model, PlanTarget(device="cpu", prompt_length=32, memory_gb=64))
    >>> changes[0].flags
    '(none: it fits as it is)'
    >>> print(advice_text(Advice()))
    no single change or combination tried brings the run under the budget
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from marl.model.memory import format_bytes
from marl.plan.planner import MemoryPlan, PlanTarget, plan_memory, with_changes

GPU_COUNTS = (2, 4, 8)
FITS_AS_IT_IS = "(none: it fits as it is)"
AS_GIVEN = "(the run as given)"


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


def _candidates(config: Any, target: PlanTarget) -> Iterator[tuple[str, str, dict, PlanTarget]]:
    """(flags, what it costs, config changes, target) of each change that applies to ``config``."""
    if not config.share_prompt_prefix:
        yield "--share_prompt_prefix", "faster too", {"share_prompt_prefix": True}, target
    rows = config.local_rollout_forward_batch_size
    smaller_rows = max(config.rloo_k, rows // 4)
    if smaller_rows < rows:
        yield (
            f"--local_rollout_forward_batch_size {smaller_rows}",
            "sampling and scoring in smaller chunks",
            {"local_rollout_forward_batch_size": smaller_rows},
            target,
        )
    if not config.gradient_checkpointing:
        yield (
            "--gradient_checkpointing",
            "about 1/3 more update compute",
            {"gradient_checkpointing": True},
            target,
        )
    micro = config.per_device_train_batch_size
    smaller_micro = max(config.rloo_k if micro % config.rloo_k == 0 else 1, micro // 4)
    if smaller_micro < micro and micro % smaller_micro == 0:
        accumulation = config.gradient_accumulation_steps * micro // smaller_micro
        yield (
            f"--per_device_train_batch_size {smaller_micro} --gradient_accumulation_steps {accumulation}",
            "the same step in more passes",
            {"per_device_train_batch_size": smaller_micro, "gradient_accumulation_steps": accumulation},
            target,
        )
    if config.quantization != "4bit":
        yield "--quantization 4bit", "a 4-bit base (other numbers)", {"quantization": "4bit"}, target
    if config.quantization != "8bit" and target.num_processes == 1:
        for gpus in GPU_COUNTS:
            yield (
                f"--parallelism fsdp2 on {gpus} GPUs",
                f"{gpus} GPUs, the base sharded",
                {"parallelism": "fsdp2"},
                dataclasses.replace(target, num_processes=gpus),
            )


def advise(
    config: Any,
    model_config: Any,
    target: PlanTarget,
    plan: MemoryPlan | None = None,
    progress: Callable[[str], None] | None = None,
    policies: int = 1,
) -> Advice:
    """The :class:`Advice` for ``config`` on ``target`` (``plan``: the run's plan, when already made);
    ``progress`` gets one line before each plan it makes (``[n/N] planning with FLAGS``). ``policies``: of a
    sweep, each change applied to every policy (:func:`marl.plan.planner.plan_memory`)."""
    say = progress or _quiet
    if plan is None:
        plan = plan_memory(config, model_config, target, policies=policies)
    if plan.fits is None or plan.fits:
        return Advice([Change(FITS_AS_IT_IS, "", plan)])
    candidates = list(_candidates(config, target))
    tried = [Change(AS_GIVEN, "", plan)]
    for number, (words, why, changes, changed_target) in enumerate(candidates, start=1):
        say(f"[{number}/{len(candidates)}] planning with {words}")
        planned = plan_memory(
            with_changes(config, **changes), model_config, changed_target, policies=policies
        )
        tried.append(Change(words, why, planned))
    fitting = [change for change in tried[1:] if change.plan.fits]
    local = [candidate for candidate in candidates if candidate[3].num_processes == target.num_processes]
    if not fitting:
        together = _together(config, model_config, candidates, tried, say, policies)
        fitting = [together] if together is not None else []
    elif not any(_same_processes(change, target) for change in fitting) and len(local) > 1:
        together = _together(config, model_config, local, tried, say, policies)
        fitting = [together, *fitting] if together is not None else fitting
    same = [change for change in tried if _same_processes(change, target)]
    if any(change.plan.fits for change in same):
        return Advice(fitting)
    return Advice(fitting, min(same, key=lambda change: change.plan.peak))


def _same_processes(change: Change, target: PlanTarget) -> bool:
    return change.plan.target.num_processes == target.num_processes


def _quiet(line: str) -> None:
    """No progress lines."""


def _together(
    config: Any,
    model_config: Any,
    candidates: list[tuple[str, str, dict, PlanTarget]],
    tried: list[Change],
    say: Callable[[str], None],
    policies: int = 1,
) -> Change | None:
    """``candidates`` combined in order (a larger GPU count replaces a smaller one) until the run fits: the
    first combination that fits, else ``None``; each combination planned is added to ``tried``."""
    combined: dict[str, Any] = {}
    flags: dict[str, str] = {}  # by flag
    for number, (words, _, changes, changed_target) in enumerate(candidates, start=1):
        combined.update(changes)
        flags[words.split()[0]] = words
        if number == 1:
            continue  # the first alone is planned already
        together = " ".join(flags.values())
        say(f"[{number}/{len(candidates)}] planning together: {together}")
        planned = plan_memory(
            with_changes(config, **combined), model_config, changed_target, policies=policies
        )
        tried.append(Change(together, "these together", planned))
        if planned.fits:
            return tried[-1]
    return None


def changes_that_fit(config: Any, model_config: Any, target: PlanTarget, policies: int = 1) -> list[Change]:
    """The changes (alone, else combined in order) whose plan fits ``target.memory_gb``; the first is "no
    change" when the run fits as it is. Empty when nothing tried fits (see :func:`advise`; ``policies``: of a
    sweep)."""
    return advise(config, model_config, target, policies=policies).fitting


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
        >>> from marl.plan.planner import MemoryPlan, PhasePlan, PlanTarget
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
