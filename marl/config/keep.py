"""The settings that keep a run from losing its work: checkpoints by updates and by time, ``--fit`` (settings
chosen from the memory plan before the model loads), and which batch settings only decide memory (what an
out-of-memory retry and ``--fit`` may change).

Settings layer (beside :mod:`marl.config`): the fields' defaults and help, and their checks, in one place.
A checkpoint is written every ``save_steps`` updates and, besides, at the end of the first update that ends
``save_minutes`` or more after the last checkpoint (or the start): by default a crash loses at most about 10
minutes and one update.

Example:
    >>> check_save_settings(save_steps=500, save_minutes=-1.0, save_total_limit=None)
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --save_minutes=-1.0 must be >= 0 (0 turns checkpoints by time off). Set ...
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from marl.errors import ConfigError

DEFAULT_SAVE_MINUTES = 10.0
SAVE_MINUTES_HELP = (
    "Also checkpoint after the first update that ends this many minutes after the last checkpoint (or the "
    "start); 0 turns checkpoints by time off. With the default a crash loses at most about 10 minutes and "
    "one update. Pruned with the others (--save_total_limit)."
)
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


def save_minutes_field() -> Any:
    """The ``save_minutes`` field of :class:`marl.RLOOConfig`, with its default and help text."""
    return field(default=DEFAULT_SAVE_MINUTES, metadata={"help": SAVE_MINUTES_HELP})


def fit_field() -> Any:
    """The ``fit`` field of :class:`marl.RLOOConfig`."""
    return field(default="auto", metadata={"help": FIT_HELP})


def fit_memory_field() -> Any:
    """The ``fit_memory_gb`` field of :class:`marl.RLOOConfig`."""
    return field(default=None, metadata={"help": FIT_MEMORY_HELP})


def check_keep_settings(config: Any) -> None:
    """Refuse checkpoint and ``--fit`` settings that cannot work, one line each, before anything loads.

    Example:
        >>> from types import SimpleNamespace
        >>> check_keep_settings(SimpleNamespace(save_steps=0, save_minutes=0, save_total_limit=None,
        ...     fit="always", fit_memory_gb=None))
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --fit 'always' is not one of ('auto', 'off'): pass --fit auto ...
    """
    check_save_settings(config.save_steps, config.save_minutes, config.save_total_limit)
    if config.fit not in FIT_CHOICES:
        raise ConfigError(
            f"--fit {config.fit!r} is not one of {FIT_CHOICES}: pass --fit auto (choose the memory settings "
            "from the plan) or --fit off (run them as typed)"
        )
    if config.fit_memory_gb is not None and not config.fit_memory_gb > 0:
        raise ConfigError(
            f"--fit_memory_gb {config.fit_memory_gb} must be a positive number of GB, e.g. --fit_memory_gb 24"
        )


def check_save_settings(save_steps: int, save_minutes: float, save_total_limit: int | None) -> None:
    """Refuse checkpoint settings that cannot work, one line each, before anything loads.

    Example:
        >>> check_save_settings(save_steps=-2, save_minutes=10, save_total_limit=None)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --save_steps=-2 must be >= 0 (0 turns checkpoints by updates off). Set ...
    """
    if save_steps < 0:
        raise ConfigError(
            f"--save_steps={save_steps} must be >= 0 (0 turns checkpoints by updates off). "
            "Set it to 0 or more"
        )
    if not save_minutes >= 0:  # NaN too
        raise ConfigError(
            f"--save_minutes={save_minutes} must be >= 0 (0 turns checkpoints by time off). "
            f"Set it to 0 or more, e.g. --save_minutes {DEFAULT_SAVE_MINUTES:g}"
        )
    if save_total_limit is not None and save_total_limit < 1:
        raise ConfigError(
            f"--save_total_limit={save_total_limit} must be >= 1. Leave it unset to keep all checkpoints"
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
