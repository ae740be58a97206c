"""What ``marl train-reward`` writes next to a trained reward adapter: ``training_summary.json`` (the numbers
and the settings record, as they were) and a README rendered from it.

Example:
    >>> import dataclasses
    >>> from marl.train.reward_settings import RewardTrainingSettings
    >>> summary = {"base_model": "smollm2-135m-instruct", "quantization": "4bit", "compute_dtype": "float32",
    ...     "data": "pairs", "train_pairs_used": 8, "eval_pairs_used": 4, "train_pairs_given": 8,
    ...     "eval_pairs_given": 4, "eval_accuracy": 1.0, "eval_accuracy_before": 0.5, "optimizer_steps": 2,
    ...     "wall_time_s": 3.0, "torch_threads": 2, "command": None,
    ...     "settings": dataclasses.asdict(RewardTrainingSettings()), **provenance()}
    >>> render_readme(summary).splitlines()[0]
    '# Reward adapter for `smollm2-135m-instruct`'
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from marl.environment import package_versions

SUMMARY_FILE = "training_summary.json"


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
