"""Where completions end: ``--stop_token`` and ``--stop_token_id`` of :class:`marl.RLOOConfig`, resolved and
checked in one place.

Unset, ``stop_token`` is ``"eos"``: a completion ends at the tokenizer's EOS and at every terminator of the
generation config, as TRL always stops. ``"none"`` asks for fixed-length completions (every one runs to
``response_length``; ``marl demo`` uses it). ``stop_token_id`` alone ends completions at that id only.

Example:
    >>> from types import SimpleNamespace
    >>> settings = SimpleNamespace(stop_token=None, stop_token_id=None, missing_eos_penalty=None)
    >>> resolve_stop_token(settings)
    >>> settings.stop_token, has_stop_token(settings)
    ('eos', True)
"""

from __future__ import annotations

from typing import Any

from marl.errors import ConfigError

# --stop_token: 'eos' ends a completion at the EOS (and the generation config's terminators); 'none' does not.
STOP_TOKEN_CHOICES = ("eos", "none")


def resolve_stop_token(settings: Any) -> None:
    """Unset ``stop_token``: ``"eos"``, or ``"none"`` when ``stop_token_id`` names the stop id instead."""
    if settings.stop_token is None:
        settings.stop_token = "eos" if settings.stop_token_id is None else "none"


def has_stop_token(settings: Any) -> bool:
    """Whether completions end at a stop token (the EOS or ``stop_token_id``), not only at the limit."""
    return settings.stop_token == "eos" or settings.stop_token_id is not None


def check_stop_settings(settings: Any) -> None:
    """Refuse stop settings that cannot work, naming the fix.

    Example:
        >>> from types import SimpleNamespace
        >>> settings = SimpleNamespace(stop_token="</s>", stop_token_id=None, missing_eos_penalty=None)
        >>> check_stop_settings(settings)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: stop_token='</s>' is not supported. Use --stop_token eos (the default), ...
    """
    if settings.stop_token not in STOP_TOKEN_CHOICES:
        raise ConfigError(
            f"stop_token={settings.stop_token!r} is not supported. Use --stop_token eos (the default), "
            "--stop_token none or --stop_token_id ID"
        )
    if settings.stop_token_id is not None and settings.stop_token_id < 0:
        raise ConfigError(
            f"stop_token_id={settings.stop_token_id} is not a token id. Pass a token id of the tokenizer"
        )
    if settings.stop_token == "eos" and settings.stop_token_id is not None:
        raise ConfigError("stop_token and stop_token_id are both set. Set only one of them")
    if settings.missing_eos_penalty is not None and not has_stop_token(settings):
        raise ConfigError(
            "missing_eos_penalty is set without a stop token: all would count as missing EOS. Add "
            "--stop_token eos (or --stop_token_id ID)"
        )
