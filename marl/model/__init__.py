"""The one base model and its adapter views: loading, adapter folders, quantization, model families, packing,
log-probs, generation and the memory card.

``from marl.model import MultiAdapterModel`` resolves lazily, so that importing a light module of this package
(adapter folders, quantization choices) does not load torch and peft.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel

__all__ = ["MultiAdapterModel"]


def __getattr__(name: str) -> Any:
    if name == "MultiAdapterModel":
        return importlib.import_module("marl.model.multi_adapter").MultiAdapterModel
    raise AttributeError(f"module 'marl.model' has no attribute {name!r}")
