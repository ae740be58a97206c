"""A tiny RLOO run as most trainer tests build one: eight short prompts, a reward that counts the letter e,
two updates' worth of mini-batches and epochs, a fresh policy LoRA on a saved tiny model."""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer

from support.tiny import tiny_rloo_config

PROMPTS = ["the movie", "a film about", "review:", "good", "bad acting", "the plot", "write a", "an honest"]


def count_e(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(completion.count("e")) for completion in completions]


def prompt_dataset(prompts=PROMPTS) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": list(prompts)})


def tiny_config(output_dir: Path, **overrides) -> RLOOConfig:
    settings = dict(
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=48,  # 3 updates of 16 completions
        learning_rate=1e-2,
        seed=3,
    )
    return tiny_rloo_config(output_dir, **{**settings, **overrides})


def build(model_dir: Path, config: RLOOConfig, reward_fn=count_e, dataset=None, **model_overrides):
    config.model_name_or_path = str(model_dir)
    torch.manual_seed(0)  # the fresh LoRA's initialisation
    model = MultiAdapterModel.from_config(config, **model_overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return RLOOTrainer(config, model, tokenizer, dataset or prompt_dataset(), reward_funcs=reward_fn)


def abstain_on_every_fourth(prompts, completions):
    """Judges 3 completions of 4: the 1st, 5th, ... of each call get ``None`` (no score)."""
    return [None if index % 4 == 0 else score for index, score in enumerate(count_e(prompts, completions))]
