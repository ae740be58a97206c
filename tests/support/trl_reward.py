"""What the tests of :mod:`marl.integrations.trl` build: the policy as a TRL user builds it (a PeftModel), a
reward adapter whose LoRA really changes the base (random B matrices), TRL's separately loaded reward model
(``AutoModelForSequenceClassification`` + ``PeftModel.from_pretrained``, as TRL documents), and a real
``GRPOTrainer`` whose own ``_calculate_rewards`` scores with both."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from marl.model.quantization import bitsandbytes_config

from support.families import FAMILY_SPECS


def _exclude(family: str | None) -> list[str] | None:
    return list(FAMILY_SPECS[family].lora_exclude_modules) or None if family else None


def load_base(
    auto_class, base_dir: Path, quantization: str | None = None, dtype: torch.dtype = torch.float32, **options
):
    """A base as TRL users load it, in ``dtype`` (or 4-bit NF4 computing in ``dtype``)."""
    if quantization is not None:
        options["quantization_config"] = bitsandbytes_config(quantization, dtype)
    return auto_class.from_pretrained(base_dir, dtype=dtype, **options)


def policy_model(
    base_dir: Path,
    family: str | None = None,
    quantization: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """The policy a TRL user hands the trainer: a causal LM wrapped with a LoRA (``init_lora_weights=False``:
    random B matrices, so that the policy differs from the base); QLoRA prepared as PEFT documents. PEFT
    keeps the LoRA tensors in float32 on a 16-bit base."""
    base = load_base(AutoModelForCausalLM, base_dir, quantization, dtype)
    if quantization is not None:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4, target_modules="all-linear", init_lora_weights=False, exclude_modules=_exclude(family)
    )
    return get_peft_model(base, config)


def random_reward_adapter(base_dir: Path, directory: Path, family: str | None = None, seed: int = 1) -> Path:
    """A RewardTrainer-layout adapter (SEQ_CLS LoRA + score head) whose LoRA moves the scores."""
    torch.manual_seed(seed)
    classifier = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    config = LoraConfig(
        task_type="SEQ_CLS", r=4, target_modules="all-linear", init_lora_weights=False,
        exclude_modules=_exclude(family),
    )  # fmt: skip
    get_peft_model(classifier, config).save_pretrained(directory)
    return directory


def separate_reward_model(
    base_dir: Path, adapter_dir: Path, quantization: str | None = None, dtype: torch.dtype = torch.float32
):
    """TRL's documented way: a second copy of the base as a sequence classifier, with the adapter on it."""
    classifier = load_base(AutoModelForSequenceClassification, base_dir, quantization, dtype, num_labels=1)
    return PeftModel.from_pretrained(classifier, str(adapter_dir))


def grpo_config(output_dir: Path, config_class=None, **overrides):
    """A small CPU run's ``GRPOConfig`` (or ``config_class``, e.g. ``RLOOConfig``, with the same settings)."""
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(output_dir), use_cpu=True, report_to="none", num_generations=2,
        per_device_train_batch_size=4, max_completion_length=6, bf16=False, seed=0, logging_steps=1,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return (config_class or GRPOConfig)(**{**settings, **overrides})


def trl_scores(trainer, tokenizer, prompts: list, texts: list[str]) -> torch.Tensor:
    """``trainer._calculate_rewards`` (TRL's own code) on completions given as texts: ``[rows, funcs]``."""
    from marl.data.prompts import is_conversation

    conversational = is_conversation(prompts[0])
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    completion_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    inputs = [{"prompt": prompt} for prompt in prompts]
    return trainer._calculate_rewards(inputs, prompts, completions, completion_ids)
