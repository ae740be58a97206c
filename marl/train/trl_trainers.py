"""What marl does around a TRL trainer that trains an adapter on a (optionally 4-bit) base (threads, dtype and
the saved folder), for the reward adapter (:mod:`marl.train.reward_training`, TRL's ``RewardTrainer``) and the
supervised warm start of a policy LoRA (:func:`warm_start_policy`, TRL's ``SFTTrainer``).

The warm start is the first step of the classic RLHF recipe: fine-tune on the task's text, then optimise a
reward. The examples are prompt-completion pairs. Each prompt is tokenized as the RL loop tokenizes it
(:func:`marl.data.prompts.tokenize_prompt`) and each completion is cut to ``max_completion_tokens`` tokens
with no EOS appended (a cut snippet has not ended); the loss is on the completion tokens only. The LoRA has
the configuration the RL run would give a fresh policy, and is saved as a PEFT folder that
``RLOOConfig(policy_adapter=...)`` starts from, with a frozen copy of it as the KL reference.

Example:
    >>> from marl.data.prompts import rotten_tomatoes_warm_start
    >>> examples = rotten_tomatoes_warm_start()
    >>> summary = warm_start_policy("smollm2-135m-instruct", examples, "runs/warm-start")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.config.model import policy_lora_config
from marl.cpu.threads import apply_threads
from marl.errors import DataError, RunFolderError
from marl.model.adapters import ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from marl.model.quantization import default_compute_dtype

if TYPE_CHECKING:
    import datasets
    import torch
    from peft import LoraConfig

    from marl.cpu.threads import FreeCoreThreads

# What an adapter folder keeps: everything else PEFT or the trainer might write is left out.
ADAPTER_FILES = (ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)


def free_core_callbacks(governor: FreeCoreThreads | None) -> list[Any] | None:
    """Trainer callbacks that set the torch thread count to the free cores after every optimizer step
    (``governor`` from :func:`marl.cpu.threads.apply_threads`; none when it is ``None``)."""
    from transformers import TrainerCallback

    if governor is None:
        return None

    class FollowFreeCores(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            governor()

    return [FollowFreeCores()]


def train_in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the trainable weights to ``dtype``: for quantized bases TRL's trainers cast them to bfloat16,
    expecting bf16 autocast, while marl trains them in the compute dtype of the activations (float32 on
    CPU), as the RL update does."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)


def save_adapter_folder(peft_model: Any, output_dir: Path, base_name: str) -> None:
    """Write ``peft_model``'s adapter as the :data:`ADAPTER_FILES` of ``output_dir``, recording the base as
    the caller named it (e.g. the embedded id, not a path that only exists on this machine); the files are
    written aside first, so a folder never holds half of them."""
    peft_model.peft_config["default"].base_model_name_or_path = base_name
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".saving-", dir=output_dir) as staging:
        # Embeddings are not trained; saying so also stops PEFT from looking the base up online to decide.
        peft_model.save_pretrained(staging, safe_serialization=True, save_embedding_layers=False)
        for name in ADAPTER_FILES:
            os.replace(Path(staging) / name, output_dir / name)


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """``output_dir`` as a path, refused if it is a file or a folder that is not empty (nothing the user had
    there is overwritten)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise RunFolderError(f"--output_dir {output_dir} is a file: pass a folder")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise RunFolderError(
            f"--output_dir {output_dir} exists and is not empty; choose a new output_dir or empty it first"
        )
    return output_dir


# ------------------------------------------------------------------------------------------------------------
# Supervised warm start of a policy LoRA


def tokenized_examples(
    tokenizer: Any, examples: datasets.Dataset, max_completion_tokens: int
) -> datasets.Dataset:
    """``input_ids`` (prompt, then completion) and ``labels`` (-100 over the prompt) for each
    ``prompt``/``completion`` row; rows whose completion has no token are dropped.

    Example:
        >>> import datasets
        >>> from transformers import ByT5Tokenizer
        >>> rows = datasets.Dataset.from_dict({"prompt": ["ab"], "completion": [" cde"]})
        >>> row = tokenized_examples(ByT5Tokenizer(), rows, max_completion_tokens=2)[0]
        >>> row["input_ids"], row["labels"]  # ByT5 ends the prompt "ab" with its EOS (1)
        ([100, 101, 1, 35, 102], [-100, -100, -100, 35, 102])
    """
    import datasets

    from marl.data.prompts import tokenize_prompt

    input_ids, labels = [], []
    for prompt, completion in zip(examples["prompt"], examples["completion"], strict=True):
        prompt_ids, _ = tokenize_prompt(tokenizer, prompt, where="warm-start prompt")
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"][:max_completion_tokens]
        if completion_ids:
            input_ids.append(list(prompt_ids) + completion_ids)
            labels.append([-100] * len(prompt_ids) + completion_ids)
    return datasets.Dataset.from_dict({"input_ids": input_ids, "labels": labels})


def warm_start_policy(
    model_name_or_path: str,
    examples: datasets.Dataset,
    output_dir: str | os.PathLike,
    *,
    lora_config: LoraConfig | None = None,
    quantization: str | None = "4bit",
    learning_rate: float = 3e-4,
    num_train_epochs: float = 1.0,
    batch_size: int = 16,
    max_completion_tokens: int = 20,
    seed: int = 0,
    threads: int = 0,
    gradient_checkpointing: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Fine-tune a policy LoRA on ``examples`` (columns ``prompt``, ``completion``) with TRL's SFTTrainer and
    save it to ``output_dir`` as a PEFT folder. ``lora_config`` defaults to the fresh policy LoRA of an RL run
    (:func:`marl.config.model.policy_lora_config`); the learning rate decays linearly to zero.
    ``gradient_checkpointing`` trades compute for activation memory (off: the demo's model is small).

    Returns the number of examples and optimizer steps, the mean training loss, the first and last logged loss
    (every 5 steps) and the wall time.

    Example:
        >>> warm_start_policy("smollm2-135m-instruct", examples, "runs/warm-start")  # doctest: +SKIP
        {'examples': 739, 'optimizer_steps': 47, ...}
    """
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from marl.data.assets import resolve_model_path
    from marl.model.loading import load_base, load_tokenizer

    output_dir = check_output_dir(output_dir)  # an adapter already there is not overwritten
    started = time.perf_counter()
    dtype = dtype or default_compute_dtype()
    path = resolve_model_path(model_name_or_path)
    tokenizer = load_tokenizer(path)
    train_rows = tokenized_examples(tokenizer, examples, max_completion_tokens)
    if len(train_rows) == 0:
        raise DataError("no warm-start example has a completion with a token: give non-empty completions")
    torch.manual_seed(seed)  # the LoRA's initial weights
    model = load_base(AutoModelForCausalLM, path, quantization=quantization, dtype=dtype)
    governor = apply_threads(threads, model.device.type)
    with tempfile.TemporaryDirectory(prefix="marl-warm-start-") as scratch:
        config = SFTConfig(
            output_dir=scratch,
            num_train_epochs=num_train_epochs,
            learning_rate=learning_rate,
            lr_scheduler_type="linear",
            per_device_train_batch_size=batch_size,
            seed=seed,
            bf16=dtype == torch.bfloat16,
            activation_checkpointing=gradient_checkpointing,
            logging_steps=5,
            save_strategy="no",
            report_to="none",
            push_to_hub=False,
        )
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=train_rows,
            processing_class=tokenizer,
            peft_config=lora_config or policy_lora_config(),
            callbacks=free_core_callbacks(governor),
        )
        train_in_compute_dtype(trainer.model, dtype)
        train_output = trainer.train()
        peft_model = trainer.model

    save_adapter_folder(peft_model, output_dir, model_name_or_path)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "examples": len(train_rows),
        "optimizer_steps": trainer.state.global_step,
        "train_loss_mean": train_output.training_loss,
        "train_loss_first_logged": losses[0] if losses else None,
        "train_loss_last_logged": losses[-1] if losses else None,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
