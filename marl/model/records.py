"""What a loaded model is made of, and how its adapters are named: the records that
:mod:`marl.model.build` returns and :class:`~marl.model.multi_adapter.MultiAdapterModel` keeps.

Adapter names: policies and reward adapters share one namespace on the base. ``reference`` names the view of
a policy's reference, and the frozen copy of policy ``P``'s starting weights (when it is its reference) is the
adapter ``P-reference``; neither can be used as a name. Unnamed reward adapters are named by
:func:`marl.config.model.name_reward_adapters`.

Example:
    >>> check_adapter_name("policy-reference", [], "policy")
    Traceback (most recent call last):
    ...
    marl.errors.ConfigError: policy name 'policy-reference' is reserved: ...
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from marl.config.model import DEFAULT_POLICY, name_reward_adapters
from marl.errors import ConfigError
from marl.model import adapters

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from marl.model.families import LogitHead

__all__ = [
    "BASE_VIEW",
    "DEFAULT_POLICY",
    "REFERENCE_SUFFIX",
    "REFERENCE_VIEW",
    "LoadedModel",
    "PolicyAdapter",
    "RewardAdapter",
    "check_adapter_name",
    "named_reward_adapters",
    "reference_adapter_name",
]

REFERENCE_VIEW = "reference"
# The base with adapters disabled, whatever a policy's reference is; PEFT's own name for "no adapter", which
# no adapter may take (check_adapter_name).
BASE_VIEW = "__base__"
REFERENCE_SUFFIX = "-reference"
# PEFT stores adapters in module dictionaries (no dots) and uses "__base__" for "no adapter".
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


def reference_adapter_name(policy: str) -> str:
    """The adapter that holds policy ``policy``'s starting weights when they are its reference.

    Example:
        >>> reference_adapter_name("policy")
        'policy-reference'
    """
    return f"{policy}{REFERENCE_SUFFIX}"


@dataclass
class PolicyAdapter:
    """A trainable policy on the base: its LoRA tensors and how its reference is built (``"base"``: adapters
    disabled; ``"initial-policy"``: the frozen copy of its starting weights)."""

    name: str
    parameters: list[nn.Parameter]
    reference_mode: str

    @property
    def reference_adapter(self) -> str | None:
        return reference_adapter_name(self.name) if self.reference_mode == "initial-policy" else None


@dataclass
class RewardAdapter:
    """A frozen reward on the base: its LoRA (the adapter ``name``), its float32 score head, what was read
    from the head, and the padding id that decides where its score is read."""

    name: str
    head: nn.Linear
    info: adapters.RewardHead
    pad_token_id: int


@dataclass
class LoadedModel:
    """What :func:`marl.model.build.load` returns: the PEFT model with every adapter attached and settled,
    and the records the model keeps (policies first-added first: the first is the default)."""

    peft_model: PeftModel
    name_or_path: str
    quantization: str | None
    dtype: torch.dtype
    logit_head: LogitHead
    policies: dict[str, PolicyAdapter]
    rewards: dict[str, RewardAdapter]


def check_adapter_name(name: str, taken: list[str], role: str) -> None:
    """Refuse a name that is not a plain identifier, is reserved, or is already used on this base."""
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name) or name == BASE_VIEW:
        raise ConfigError(
            f"{role} name {name!r} is not usable: use letters, digits, '_' and '-' (no dots or spaces)"
        )
    if name == REFERENCE_VIEW or name.endswith(REFERENCE_SUFFIX):
        raise ConfigError(
            f"{role} name {name!r} is reserved: 'reference' names a policy's reference view and '<policy>"
            f"{REFERENCE_SUFFIX}' its frozen starting copy. Choose another name"
        )
    if name in taken:
        raise ConfigError(
            f"{role} name {name!r} is already used on this base (adapters: {taken}); choose another"
        )


def named_reward_adapters(
    reward_adapter: str | os.PathLike | None, reward_adapters: Mapping[str, str | os.PathLike] | None
) -> dict[str, str | os.PathLike]:
    """``reward_adapter=DIR`` is one unnamed reward adapter (named by
    :func:`marl.config.model.name_reward_adapters`); giving both is an error."""
    if reward_adapter is not None and reward_adapters:
        raise ConfigError("pass either reward_adapter=DIR or reward_adapters={name: DIR, ...}, not both")
    if reward_adapter is not None:
        return name_reward_adapters([(None, reward_adapter)])
    return dict(reward_adapters or {})
