"""marl: RLOO with the policy, the reference and the reward as adapters on one base model."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


class _DropUnusedKernelNotice(logging.Filter):
    """bitsandbytes' CPU backend logs at import, on a CPU with AVX512-BF16, that it could not fetch its fused
    4-bit inference kernel (the ``kernels`` package, from a hub). marl never runs that kernel
    (:func:`marl.model.quantization.keep_4bit_layers_differentiable_on_cpu`): that notice alone is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# Set before any marl module runs: PEFT, which marl imports everywhere, imports bitsandbytes as it loads.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropUnusedKernelNotice())

# Public names resolve lazily so that `import marl` (and the CLI's --help) stays fast: torch and
# transformers load only when a model or trainer is actually used.
_PUBLIC = {
    "MultiAdapterModel": "marl.model.multi_adapter",
    "RLOOConfig": "marl.config.rloo_config",
    "RLOOTrainer": "marl.train.trainer",
    "RewardAdapterFunction": "marl.integrations.trl",
    "SweepTrainer": "marl.train.sweep_trainer",
}

if TYPE_CHECKING:
    from marl.config.rloo_config import RLOOConfig
    from marl.integrations.trl import RewardAdapterFunction
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.train.sweep_trainer import SweepTrainer
    from marl.train.trainer import RLOOTrainer

__all__ = [
    "MultiAdapterModel", "RLOOConfig", "RLOOTrainer", "RewardAdapterFunction", "SweepTrainer", "__version__",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'marl' has no attribute {name!r}")
