"""Checks shared by every settings dataclass (``RLOOConfig`` and the arguments of the commands).

Command-line flags are converted by argparse, but values from ``--config file.yaml`` and from Python arrive as
they are: a YAML list where a number belongs, or ``.nan`` for a float, would otherwise fail much later, far
from the setting that caused it (``temperature=nan`` inside ``generate``, ``kl_coef=nan`` as every step
skipped).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Settings:
    ...     rate: float = 0.1
    >>> check_fields(Settings(rate=float("nan")))
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: --rate=nan is not a finite number. Pass a real number, e.g. --rate 0.1
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from marl.errors import ConfigError


def check_fields(settings: Any) -> None:
    """Refuse a field whose value is not of its annotated type or not one of its ``choices`` (metadata, which
    ``HfArgumentParser`` also gives argparse), and every NaN or infinite float (said as the class's
    ``NOT_FINITE`` says it for a field, when it does)."""
    hints = typing.get_type_hints(type(settings))
    for item in dataclasses.fields(settings):
        value, hint = getattr(settings, item.name), hints[item.name]
        flag = f"--{item.name}"
        if not _matches(value, hint):
            raise ConfigError(
                f"{flag}={value!r} is a {type(value).__name__}, not {_describe(hint)}. Fix the value on the "
                "command line or in the --config file"
            )
        choices = item.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{flag}={value!r} is not a choice. Use one of {tuple(choices)}")
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(_not_finite(flag, value, item, getattr(settings, "NOT_FINITE", {})))


def _not_finite(flag: str, value: Any, item: dataclasses.Field, said: dict[str, str]) -> str:
    """The refusal of a NaN or infinite value: the settings' own sentence for the field (``said``, their
    ``NOT_FINITE``: what the value should be), else an example from a numeric default, else "leave it
    unset"."""
    if item.name in said:
        return f"{flag} {value!r} {said[item.name]}"
    if item.default is None:
        return f"{flag}={value!r} is not a finite number. Pass a real number, or leave {flag} unset"
    numeric = isinstance(item.default, int | float | list) and not isinstance(item.default, bool)
    example = f", e.g. {flag} {item.default}" if numeric and item.default != [] else ""
    return f"{flag}={value!r} is not a finite number. Pass a real number{example}"


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(element, item) for element in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # YAML writes 1.0 as 1
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        type(None): "unset",
    }
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def check_seed(seed: int) -> None:
    """NumPy accepts seeds in [0, 2**32); each process adds its own offset, so keep a margin."""
    if not 0 <= seed < 2**31:
        raise ConfigError(f"--seed={seed} is out of range. Pass a seed between 0 and {2**31 - 1}")
