"""End-to-end: RLOO on a tiny model raises a reward; the same run without a learning rate does not."""

from __future__ import annotations

import math
import statistics

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer

PROMPTS = ["the movie", "a film about", "review:", "good", "bad acting", "the plot", "write a", "an honest"]
UPDATES = 40
WINDOW = 5


def count_e(prompts: list[str], completions: list[str]) -> list[float]:
    """+1 for every letter 'e' in the completion."""
    return [float(completion.count("e")) for completion in completions]


def run(model_dir, output_dir, learning_rate: float) -> list[dict]:
    config = RLOOConfig(
        output_dir=str(output_dir),
        model_name_or_path=str(model_dir),
        rloo_k=4,
        per_device_train_batch_size=16,
        num_ppo_epochs=1,
        total_episodes=16 * UPDATES,
        learning_rate=learning_rate,
        response_length=8,
        kl_coef=0.01,
        lora_r=8,
        lora_alpha=16,
        # the tiny random model's logits are nearly flat; LoRA on the LM head lets the policy sharpen them
        lora_target_modules=["q_proj", "v_proj", "lm_head"],
        num_sample_generations=0,
        seed=0,
    )
    torch.manual_seed(0)
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = RLOOTrainer(
        config, model, tokenizer, datasets.Dataset.from_dict({"prompt": PROMPTS}), reward_funcs=count_e
    )
    return trainer.train()


@pytest.mark.slow
def test_scores_rise_with_learning_and_not_without(tiny_llama_dir, tmp_path):
    history = run(tiny_llama_dir, tmp_path / "learn", learning_rate=1e-2)
    scores = [record["objective/scores"] for record in history]
    first, last = statistics.mean(scores[:WINDOW]), statistics.mean(scores[-WINDOW:])
    assert last > first + 2.0, f"scores did not rise: first {first:.2f}, last {last:.2f}"
    assert last > 2 * first
    assert all(math.isfinite(record["objective/kl"]) for record in history)
    assert history[-1]["objective/kl"] > 0  # the policy moved away from the reference

    # control: the same run without updates stays where it started, so the margin above means learning
    frozen = [
        record["objective/scores"] for record in run(tiny_llama_dir, tmp_path / "frozen", learning_rate=0.0)
    ]
    assert statistics.mean(frozen[-WINDOW:]) < statistics.mean(frozen[:WINDOW]) + 1.0
    assert statistics.mean(frozen[-WINDOW:]) < last - 2.0
