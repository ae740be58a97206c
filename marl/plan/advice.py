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
model.

Example:
    >>> from transformers import LlamaConfig
    >>> from marl.config import RLOOConfig
    >>> from marl.plan.records import PlanTarget
    >>> model = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, vocab_size=256)
    >>> config = RLOOConfig(rloo_k=4, per_device_train_batch_size=8, response_length=16)
    >>> changes = changes_that_fit(config, model, PlanTarget(device="cpu", prompt_length=32, memory_gb=64))
    >>> changes[0].flags
    '(none: it fits as it is)'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from marl.plan.planner import plan_memory, with_changes
from marl.plan.records import Advice, Change, MemoryPlan, PlanTarget

GPU_COUNTS = (2, 4, 8)
FITS_AS_IT_IS = "(none: it fits as it is)"
AS_GIVEN = "(the run as given)"


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
