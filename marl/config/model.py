"""Settings of the shared base and its adapters that both the config and the model layer read: the
quantization choices, the reference modes, the default policy LoRA and how reward adapters are named.

They live with the settings (:mod:`marl.config`, which imports no model code), so that each rule has one
owner: ``RLOOConfig`` checks a setting with the same function that :mod:`marl.model.loading` uses when the
model is built from Python.

Example:
    >>> parse_quantization("none") is None, parse_quantization("4bit")
    (True, '4bit')
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from marl.errors import ConfigError

if TYPE_CHECKING:
    from peft import LoraConfig

QUANTIZATION_CHOICES = ("4bit", "8bit")
# Spellings of "no quantization" accepted from command lines and YAML files.
_NO_QUANTIZATION = (None, "", "none", "None", "null", "no")
# How a policy's reference is built: the base with adapters disabled, a frozen copy of the policy's starting
# weights, or "auto" (the base for a fresh LoRA, the starting copy for a loaded adapter).
REFERENCE_MODES = ("auto", "base", "initial-policy")
# The name of a model's first policy adapter unless one is given.
DEFAULT_POLICY = "policy"


def parse_quantization(value: str | None) -> str | None:
    """``"4bit"``, ``"8bit"`` or ``None``; raise with the accepted spellings otherwise.

    Example:
        >>> parse_quantization("8bit")
        '8bit'
    """
    if value in _NO_QUANTIZATION:
        return None
    if value not in QUANTIZATION_CHOICES:
        raise ConfigError(
            f"quantization={value!r} is unknown: quantization must be one of 4bit, 8bit or none"
        )
    return value


def check_reference_mode(reference: str) -> None:
    """Refuse a reference mode that is not one of :data:`REFERENCE_MODES`.

    Example:
        >>> check_reference_mode("frozen")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: reference='frozen' is unknown: reference must be one of auto, base, ...
    """
    if reference not in REFERENCE_MODES:
        raise ConfigError(
            f"reference={reference!r} is unknown: reference must be one of {', '.join(REFERENCE_MODES)}. "
            "Use one of them, e.g. --reference auto"
        )


# Default policy LoRA. r=16 with alpha=32 (scale 2) on every linear layer of the blocks: RL fine-tuning
# moves far fewer bits than SFT (one scalar reward per completion), and low ranks are known to match full
# fine-tuning for policy-gradient RL, so r=16 leaves ample headroom while keeping the trainable state at
# ~0.5 % of a 7B model. alpha = 2r is the common QLoRA setting and keeps the learning rate transferable
# when r changes by small factors. No dropout: RL training switches every dropout off anyway (the rollout
# and the update must compute the same function).
DEFAULT_LORA_R = 16
DEFAULT_LORA_ALPHA = 32
DEFAULT_TARGET_MODULES = "all-linear"


def policy_lora_config(
    r: int = DEFAULT_LORA_R,
    alpha: int = DEFAULT_LORA_ALPHA,
    target_modules: str | list[str] = DEFAULT_TARGET_MODULES,
) -> LoraConfig:
    """The ``peft.LoraConfig`` of a new policy adapter; with no arguments, the default policy LoRA (r=16,
    alpha=32, no dropout, all linear layers of the blocks).

    Example:
        >>> policy_lora_config().r, policy_lora_config(r=8, target_modules=["q_proj"]).target_modules
        (16, {'q_proj'})
    """
    from peft import LoraConfig

    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def name_reward_adapters(entries: Iterable[tuple[str | None, str | os.PathLike]]) -> dict[str, Any]:
    """The one naming rule of reward adapters, for ``(name or None, folder)`` entries: a named entry keeps its
    name; unnamed ones are ``reward``, ``reward_2``, ... in order; a name given twice is refused.

    Example:
        >>> name_reward_adapters([(None, "rm"), ("fluency", "adapters/fluency"), (None, "rm2")])
        {'reward': 'rm', 'fluency': 'adapters/fluency', 'reward_2': 'rm2'}
    """
    folders: dict[str, Any] = {}
    unnamed = 0
    for name, folder in entries:
        if name is None:
            unnamed += 1
            name = "reward" if unnamed == 1 else f"reward_{unnamed}"
        if name in folders:
            raise ConfigError(
                f"two reward adapters are named {name!r}; give each one a distinct name with "
                "--reward_adapter NAME=DIR"
            )
        folders[name] = folder
    return folders


def reward_adapter_folders(entries: list[str]) -> dict[str, str]:
    """The reward adapters of ``--reward_adapter`` entries by name: ``NAME=DIR`` entries keep their name; bare
    folders are named by :func:`name_reward_adapters`.

    Example:
        >>> reward_adapter_folders(["rm", "fluency=adapters/fluency"])
        {'reward': 'rm', 'fluency': 'adapters/fluency'}
    """
    split = (entry.partition("=") for entry in entries)
    return name_reward_adapters(
        (name, folder) if separator else (None, name) for name, separator, folder in split
    )
