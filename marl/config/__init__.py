"""The settings of a run, in one place: :class:`RLOOConfig` and the field groups it is made of.

- :mod:`marl.config.rloo_config`: :class:`RLOOConfig`, every setting of a run (the CLI's flags), with where
  completions stop and when checkpoints are written;
- :mod:`marl.config.algorithms`: the algorithm presets (``--algorithm``) and the settings they fill in;
- :mod:`marl.config.batch_sizes`: the batch arithmetic (rollout, mini- and micro-batches, processes) and
  ``--fit``;
- :mod:`marl.config.model`: the base and its adapters (quantization, LoRA defaults, reference modes, rewards);
- :mod:`marl.config.device`: the settings chosen for the device when not given, and ``--graph_capture``;
- :mod:`marl.config.sampler_correction`: the sampler correction (``--vllm_importance_sampling_*``);
- :mod:`marl.config.sweep`: ``--sweep`` grids and what may differ between their policies;
- :mod:`marl.config.checks`: the field checks every settings dataclass of marl runs.

Example:
    >>> from marl.config import RLOOConfig
    >>> RLOOConfig(rloo_k=4).rloo_k
    4
"""

from marl.config.batch_sizes import BatchSizes
from marl.config.model import reward_adapter_folders
from marl.config.rloo_config import REPORT_TO_CHOICES, SCHEDULER_CHOICES, RLOOConfig

__all__ = ["REPORT_TO_CHOICES", "SCHEDULER_CHOICES", "BatchSizes", "RLOOConfig", "reward_adapter_folders"]
