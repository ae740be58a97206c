"""The batch arithmetic of an RLOO run (how many completions, prompts and optimizer steps one update holds)
and ``--fit`` (the batch settings that only decide memory, chosen from the plan before the model loads).

Part of the settings (:mod:`marl.config`, which re-exports :class:`BatchSizes`): pure integer arithmetic
on the batch fields of a config, written once for the checks made when the config is built and for the sizes
the trainer derives for a number of processes and a dataset; the ``fit`` fields and their checks (the choice
is :mod:`marl.plan.fit`'s), and which batch settings only decide memory (what an out-of-memory retry and
``--fit`` may change).

Example:
    >>> from types import SimpleNamespace
    >>> settings = SimpleNamespace(rloo_k=4, per_device_train_batch_size=8, gradient_accumulation_steps=1,
    ...     num_mini_batches=1, num_ppo_epochs=4, total_episodes=64, num_train_epochs=3.0)
    >>> sizes = batch_sizes(settings, world_size=1, dataset_length=100)
    >>> sizes.local_batch_size, sizes.prompts_per_process, sizes.num_total_batches
    (8, 2, 8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from marl.errors import ConfigError

# --fit: 'auto' chooses the memory settings from the plan, 'off' runs them as typed.
FIT_CHOICES = ("auto", "off")
FIT_HELP = (
    "'auto': before the model loads, choose among the settings that only decide memory (the micro-batch "
    "size with gradient accumulation keeping the effective batch, gradient checkpointing and, when "
    "nothing else fits, the rollout's rows per chunk) the fastest whose planned peak fits the GPU's free "
    "memory (or --fit_memory_gb) with the planner's margin; each change is printed and recorded in "
    "rloo_config.json, and a run that fits in no way is refused before loading. On CPU it does nothing "
    "unless --fit_memory_gb is given. 'off': the settings as typed."
)
FIT_MEMORY_HELP = (
    "The memory --fit auto plans for, in GB (decimal): default the GPU's free memory when the run starts "
    "(the least over its processes); on CPU --fit auto needs it."
)

# What --fit_memory_gb nan or inf is told (after "--fit_memory_gb nan").
FIT_MEMORY_NOT_FINITE = (
    "is not a memory size: pass a number of GB, e.g. --fit_memory_gb 12, or leave it unset to plan for the "
    "GPU's free memory"
)


class BatchSettings(Protocol):
    """The fields of a config that decide its batch arithmetic (``RLOOConfig`` has them all)."""

    rloo_k: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_mini_batches: int
    num_ppo_epochs: int
    total_episodes: int | None
    num_train_epochs: float


@dataclass(frozen=True)
class BatchSizes:
    """Batch arithmetic of a run; one *update* is one rollout plus its optimisation.

    ``local_batch_size`` counts completions per process per update; ``batch_size`` counts them over all
    processes.
    """

    local_batch_size: int
    batch_size: int
    prompts_per_process: int
    prompts_per_update: int
    local_mini_batch_size: int
    mini_batch_size: int
    total_episodes: int
    num_total_batches: int
    optimizer_steps_per_update: int
    total_optimizer_steps: int


def local_batch_size(settings: BatchSettings) -> int:
    """Completions per process per update: micro-batch × accumulation × mini-batches.

    Example:
        >>> from types import SimpleNamespace
        >>> local_batch_size(SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2,
        ...     num_mini_batches=3))
        24
    """
    return (
        settings.per_device_train_batch_size
        * settings.gradient_accumulation_steps
        * settings.num_mini_batches
    )


def check_batch_settings(settings: BatchSettings) -> None:
    """Refuse batch fields that cannot work: fewer than 2 completions per prompt, a size below 1, an update
    that does not hold whole prompt groups, no episodes to train on.

    Example:
        >>> from types import SimpleNamespace
        >>> check_batch_settings(SimpleNamespace(rloo_k=1))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: rloo_k=1: leave-one-out needs at least 2 completions per prompt. ...
    """
    if settings.rloo_k < 2:
        raise ConfigError(
            f"rloo_k={settings.rloo_k}: leave-one-out needs at least 2 completions per prompt. "
            "Set --rloo_k 2 or more"
        )
    for name in (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_mini_batches",
        "num_ppo_epochs",
    ):
        if getattr(settings, name) < 1:
            raise ConfigError(
                f"{name}={getattr(settings, name)} must be a positive integer. Set --{name} to 1 or more"
            )
    completions = local_batch_size(settings)
    if completions % settings.rloo_k != 0:
        example = settings.rloo_k * max(1, settings.per_device_train_batch_size // settings.rloo_k)
        raise ConfigError(
            "per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches = "
            f"{completions} completions per update is not a multiple of rloo_k={settings.rloo_k}, so "
            f"completions cannot be grouped by prompt. Make {completions} a multiple of {settings.rloo_k} "
            f"(e.g. --per_device_train_batch_size {example})"
        )
    if settings.total_episodes is not None and settings.total_episodes < 1:
        raise ConfigError(
            f"total_episodes={settings.total_episodes} must be positive. "
            "Set it to 1 or more, or leave it unset"
        )
    if settings.total_episodes is None and settings.num_train_epochs <= 0:
        raise ConfigError(
            f"num_train_epochs={settings.num_train_epochs} must be positive. Set --num_train_epochs above 0"
        )


def batch_sizes(settings: BatchSettings, world_size: int, dataset_length: int) -> BatchSizes:
    """The batch arithmetic of ``settings`` for ``world_size`` processes and ``dataset_length`` prompts."""
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    if dataset_length < 1:
        raise ConfigError("the training dataset is empty. Pass a dataset with at least one prompt")
    local = local_batch_size(settings)
    batch_size = local * world_size
    total_episodes = (
        settings.total_episodes
        if settings.total_episodes is not None
        else max(1, int(settings.num_train_epochs * dataset_length))
    )
    num_total_batches = math.ceil(total_episodes / batch_size)
    optimizer_steps_per_update = settings.num_ppo_epochs * settings.num_mini_batches
    return BatchSizes(
        local_batch_size=local,
        batch_size=batch_size,
        prompts_per_process=local // settings.rloo_k,
        prompts_per_update=batch_size // settings.rloo_k,
        local_mini_batch_size=local // settings.num_mini_batches,
        mini_batch_size=batch_size // settings.num_mini_batches,
        total_episodes=total_episodes,
        num_total_batches=num_total_batches,
        optimizer_steps_per_update=optimizer_steps_per_update,
        total_optimizer_steps=num_total_batches * optimizer_steps_per_update,
    )


def fit_field() -> Any:
    """The ``fit`` field of :class:`marl.RLOOConfig`."""
    return field(default="auto", metadata={"help": FIT_HELP})


def fit_memory_field() -> Any:
    """The ``fit_memory_gb`` field of :class:`marl.RLOOConfig`."""
    return field(default=None, metadata={"help": FIT_MEMORY_HELP})


def check_fit_settings(config: Any) -> None:
    """Refuse ``--fit`` settings that cannot work, one line each, before anything loads.

    Example:
        >>> from types import SimpleNamespace
        >>> check_fit_settings(SimpleNamespace(fit="always", fit_memory_gb=None))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --fit 'always' is not one of ('auto', 'off'): pass --fit auto ...
    """
    if config.fit not in FIT_CHOICES:
        raise ConfigError(
            f"--fit {config.fit!r} is not one of {FIT_CHOICES}: pass --fit auto (choose the memory settings "
            "from the plan) or --fit off (run them as typed)"
        )
    if config.fit_memory_gb is not None and not config.fit_memory_gb > 0:
        raise ConfigError(
            f"--fit_memory_gb {config.fit_memory_gb} must be a positive number of GB, e.g. --fit_memory_gb 24"
        )


def micro_batch_changes_the_loss(loss_type: str | None) -> bool:
    """Whether the update's result depends on the micro-batch size at a fixed effective batch: only for
    ``bnpo``, whose loss is the mean over each micro-batch's tokens. Every other loss averages rows (or
    divides by a count fixed for the optimizer step), so a smaller micro-batch with proportionally more
    accumulation steps gives the same step up to floating-point rounding.

    Example:
        >>> micro_batch_changes_the_loss("bnpo"), micro_batch_changes_the_loss("grpo")
        (True, False)
    """
    return loss_type == "bnpo"
