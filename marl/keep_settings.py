"""The settings that keep a run from losing its work: checkpoints by updates and by time, and which batch
settings only decide memory (what an out-of-memory retry and ``--fit`` may change).

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


def save_minutes_field() -> Any:
    """The ``save_minutes`` field of :class:`marl.RLOOConfig`, with its default and help text."""
    return field(default=DEFAULT_SAVE_MINUTES, metadata={"help": SAVE_MINUTES_HELP})


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
