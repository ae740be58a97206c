"""The planner applied to a run: ``--fit auto`` (the memory settings chosen before the model loads) and what
``marl plan`` advises a run that ran out of memory.

``--fit auto`` changes only settings that leave training as it is:

- the micro-batch size (``per_device_train_batch_size``), with ``gradient_accumulation_steps`` keeping their
  product (each optimizer step's rows, in the same shuffled order): every loss but ``bnpo`` averages rows (or
  divides by a count fixed for the step), so the step is the same up to float rounding; whole prompt groups
  stay whole groups (the shuffle draws groups or rows, as typed); never for ``--loss_type bnpo``;
- ``gradient_checkpointing``: the backward pass recomputes the same activations;
- ``local_rollout_forward_batch_size`` (the rollout's rows per chunk), in whole prompts and only when nothing
  else fits: scoring is per row, but the sampler draws chunk by chunk, so other chunks draw other random
  numbers (the same distribution, not the same completions as the typed run).

The fastest that fits is chosen: the rows per chunk as typed first, then no recomputation, then the largest
micro-batch (a pass over more rows at once is faster on a GPU). A setting fits when the plan's peak is under
the budget less the planner's margin (:attr:`marl.plan.planner.MemoryPlan.fits`). Every process plans the same
inputs (the budget is the least over the processes), so every process chooses the same settings.

Example:
    >>> from transformers import LlamaConfig
    >>> from marl.config import RLOOConfig
    >>> from marl.plan.planner import PlanTarget
    >>> model = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, vocab_size=256)
    >>> config = RLOOConfig(rloo_k=4, per_device_train_batch_size=4, gradient_accumulation_steps=4,
    ...     gradient_checkpointing=True, response_length=16)
    >>> choice = choose_settings(config, model, PlanTarget(device="cpu", prompt_length=32, memory_gb=64))
    >>> for line in choice.lines():  # doctest: +ELLIPSIS
    ...     print(line)
    --fit auto: --per_device_train_batch_size 4 -> 16 (planned peak ... usable)
    --fit auto: --gradient_accumulation_steps 4 -> 1 (planned peak ... usable)
    --fit auto: --gradient_checkpointing True -> False (planned peak ... usable)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from marl.config.batch_sizes import micro_batch_changes_the_loss
from marl.errors import ConfigError
from marl.model.memory import format_bytes
from marl.plan.advice import advise
from marl.plan.planner import MemoryPlan, PlanTarget, plan_for_trainer, plan_memory, with_changes
from marl.train.memory_guard import halved_chunk_rows

# The settings --fit may change, in the order its lines name them.
FIT_SETTINGS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "local_rollout_forward_batch_size",
)


@dataclass(frozen=True)
class FitChoice:
    """The settings ``--fit auto`` chose: ``changes`` maps each changed setting to (typed, chosen); ``plan``
    is the run's plan with them."""

    changes: dict[str, tuple[Any, Any]]
    plan: MemoryPlan

    def lines(self) -> list[str]:
        """One line per changed setting, as the run prints them."""
        budget = format_bytes(self.plan.budget_bytes or 0)
        return [
            f"--fit auto: --{name} {typed} -> {chosen} (planned peak {format_bytes(self.plan.peak)} of "
            f"{budget} usable)"
            for name, (typed, chosen) in self.changes.items()
        ]

    def record(self) -> dict[str, Any]:
        """What ``rloo_config.json`` records under ``"fit"``."""
        return {
            "memory_gb": self.plan.target.memory_gb,
            "planned_peak_bytes": self.plan.peak,
            "changes": {name: list(values) for name, values in self.changes.items()},
        }


def micro_batch_sizes(config: Any) -> list[int]:
    """The micro-batch sizes that keep each optimizer step's rows (``per_device_train_batch_size`` ×
    ``gradient_accumulation_steps``) and whether micro-batches hold whole prompt groups, largest first; only
    the typed one for ``--loss_type bnpo``.

    Example:
        >>> from types import SimpleNamespace
        >>> micro_batch_sizes(SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2,
        ...     rloo_k=2, loss_type="grpo"))
        [8, 4, 2]
    """
    typed, k = config.per_device_train_batch_size, config.rloo_k
    if micro_batch_changes_the_loss(config.loss_type):
        return [typed]
    step_rows = typed * config.gradient_accumulation_steps
    grouped = typed % k == 0
    return [m for m in range(step_rows, 0, -1) if step_rows % m == 0 and (m % k == 0) == grouped]


def _chunk_rows(config: Any) -> Iterator[int]:
    """The rollout's rows per chunk: as typed, then halved in whole prompts down to one prompt's rows."""
    rows: int | None = config.local_rollout_forward_batch_size
    while rows is not None:
        yield rows
        rows = halved_chunk_rows(rows, config.rloo_k)


def choose_settings(
    config: Any,
    model_config: Any,
    target: PlanTarget,
    policies: int = 1,
    progress: Callable[[str], None] | None = None,
) -> FitChoice:
    """The fastest settings among those ``--fit auto`` may change (module docstring) whose plan fits
    ``target.memory_gb``; a :class:`marl.errors.ConfigError` naming the closest and its excess when none
    does. ``policies``: a sweep's (every policy gets the same settings)."""
    tried: list[tuple[dict[str, Any], MemoryPlan]] = []

    def plan(changes: dict[str, Any]) -> MemoryPlan:
        if progress is not None:
            progress(f"--fit auto: planning {changes}")
        planned = plan_memory(with_changes(config, **changes), model_config, target, policies=policies)
        tried.append((changes, planned))
        return planned

    step_rows = config.per_device_train_batch_size * config.gradient_accumulation_steps
    for rows in _chunk_rows(config):
        for checkpointing in (False, True):
            sizes = micro_batch_sizes(config)

            def settings(micro: int, rows: int = rows, checkpointing: bool = checkpointing) -> dict[str, Any]:
                return {
                    "per_device_train_batch_size": micro,
                    "gradient_accumulation_steps": step_rows // micro,
                    "gradient_checkpointing": checkpointing,
                    "local_rollout_forward_batch_size": rows,
                }

            smallest = plan(settings(sizes[-1]))
            if not smallest.fits:  # none of the larger micro-batches fits either
                continue
            for micro in sizes:
                changes = settings(micro)
                chosen = smallest if micro == sizes[-1] else plan(changes)
                if chosen.fits:
                    typed = {name: getattr(config, name) for name in FIT_SETTINGS}
                    return FitChoice(
                        {
                            name: (typed[name], changes[name])
                            for name in FIT_SETTINGS
                            if typed[name] != changes[name]
                        },
                        chosen,
                    )
    changes, closest = min(tried, key=lambda entry: entry[1].peak)
    flags = " ".join(f"--{name} {value}" for name, value in changes.items())
    budget = closest.budget_bytes or 0
    over = format_bytes(closest.peak - budget)
    raise ConfigError(
        f"--fit auto: nothing fits the {format_bytes(budget)} usable of {target.memory_gb:g} GB; closest: "
        f"{flags} needs {format_bytes(closest.peak)} ({closest.peak_phase}), {over} over. "
        "Pass a smaller model, --quantization 4bit or more GPUs (marl plan --memory_gb lists what fits), or "
        "--fit off to run the settings as typed"
    )


def apply_choice(configs: list[Any], choice: FitChoice) -> None:
    """Give every config (a run's, or a sweep's base and members) the chosen settings."""
    for config in configs:
        for name, (_, chosen) in choice.changes.items():
            setattr(config, name, chosen)


def card_memory_gb(device: Any) -> float | None:
    """The whole memory of a CUDA ``device`` in GB (``None`` on CPU, whose budget a user gives)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 1e9


def out_of_memory_advice(trainer: Any, memory_gb: float | None = None) -> str:
    """One sentence: the cheapest change ``marl plan`` finds that fits ``memory_gb`` (default: the card's
    memory; on CPU without a budget, how to ask ``marl plan``), else how far the closest setting is."""
    memory_gb = memory_gb if memory_gb is not None else card_memory_gb(trainer.parts.parallelism.device)
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


def least_free_memory_gb(device: Any) -> float:
    """The free memory of the CUDA ``device`` in GB, the least over the run's processes (so that every
    process plans the same budget and chooses the same settings). Under a cap on this process's allocator
    (``torch.cuda.set_per_process_memory_fraction``), what the cap leaves, if less."""
    import torch
    import torch.distributed as distributed

    # torch's per-process memory functions want the card's index: "cuda" alone (accelerate's device on one
    # GPU) is the current card
    device = torch.device(device)
    device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    capped = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    free = torch.tensor([float(min(torch.cuda.mem_get_info(device)[0], capped))], device=device)
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        distributed.all_reduce(free, op=distributed.ReduceOp.MIN)
    return float(free.item()) / 1e9


def fit_target(
    config: Any,
    train_dataset: Any,
    device: Any,
    memory_gb: float,
    num_processes: int = 1,
    tools: Any = None,
) -> tuple[Any, PlanTarget]:
    """The model's config and the :class:`PlanTarget` ``--fit auto`` plans for: ``device``, ``memory_gb``,
    the longest training prompt in tokens, the processes and the compute dtype the model will load in.
    ``tools`` (a :class:`marl.rollout.tool_calls.ToolBox`): the prompts as rendered with them, and the
    later turns of the longest conversation the limits allow."""
    import torch

    from marl.data.assets import resolve_model_path
    from marl.data.prompts import prepare_prompts
    from marl.model.loading import load_tokenizer
    from marl.model.quantization import default_compute_dtype
    from marl.plan.planner import load_model_config

    model_config = load_model_config(config.model_name_or_path)
    tokenizer = load_tokenizer(resolve_model_path(config.model_name_or_path))
    rendering = {}
    if tools:
        from marl.rollout.toolbox import prepare_tool_template

        rendering = dict(
            tools_of=lambda columns: tools.tools_of(tools.environment_of(columns)),
            chat_template=prepare_tool_template(tokenizer),
        )
    prompts = prepare_prompts(
        train_dataset,
        tokenizer,
        "train_dataset",
        context_length=getattr(model_config.get_text_config(), "max_position_embeddings", None),
        response_length=config.response_length,
        **rendering,
    )
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.mixed_precision)
    target = PlanTarget(
        device="cuda" if torch.device(device).type == "cuda" else "cpu",
        memory_gb=memory_gb,
        prompt_length=max(len(prompt.ids) for prompt in prompts),
        num_processes=num_processes,
        compute_dtype=mixed or default_compute_dtype(),
        tool_turns=bool(tools),
    )
    return model_config, target


def fit_run(
    config: Any,
    train_dataset: Any,
    device: Any,
    num_processes: int = 1,
    member_configs: list[Any] | None = None,
    tools: Any = None,
) -> FitChoice | None:
    """``--fit auto`` before the model loads: the settings chosen for ``config`` (and a sweep's
    ``member_configs``, planned as one sweep) on ``device`` with the run's longest prompt (and with
    ``tools``, :func:`fit_target`), applied to them;
    ``None`` when ``--fit off``, or on CPU without ``--fit_memory_gb``. Raises the one-line
    :class:`marl.errors.ConfigError` of :func:`choose_settings` when nothing fits.

    Example:
        >>> choice = fit_run(config, prompts, "cuda")  # doctest: +SKIP
        >>> model = MultiAdapterModel.from_config(config)  # with the chosen settings  # doctest: +SKIP
    """
    import torch

    if config.fit == "off":
        return None
    memory_gb = config.fit_memory_gb
    if memory_gb is None and torch.device(device).type == "cuda":
        memory_gb = least_free_memory_gb(device)
    if memory_gb is None:
        return None
    model_config, target = fit_target(config, train_dataset, device, memory_gb, num_processes, tools)
    members = member_configs or []
    choice = choose_settings(config, model_config, target, policies=max(1, len(members)))
    apply_choice([config, *members], choice)
    return choice
