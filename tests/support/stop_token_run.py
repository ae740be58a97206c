"""A tiny RLOO run whose completions end at EOS after a different number of steps on each process, in one
process or under ``torchrun`` with a ``--parallelism`` and a ``--sampler``;
``tests/train/test_sharded_stop_token.py`` runs it under ``fsdp2`` and ``replicated`` and compares.

Usage: ``python stop_token_run.py MODEL_DIR REWARD_DIR OUTPUT_DIR PARALLELISM SAMPLER``. One update of 8
completions per process (response length 8, stopping at EOS), then a sample table of 4 held-out prompts,
which under ``fsdp2`` every process samples with its own random stream. It writes ``report_<rank>.json``: the
length of every completion this process sampled, call by call (rollout, then sample table), and the policy
adapter the run wrote.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer

RESPONSE_LENGTH = 8


def save_model_that_stops(source: str, directory: Path, scale: float = 6.0) -> Path:
    """The model in ``source`` with its LM head's EOS row replaced by a random direction of norm ``scale``:
    EOS's logit then swings with the hidden state, so completions end at EOS after a varying number of
    steps."""
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        row = torch.randn(model.config.hidden_size, generator=generator)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = row / row.norm() * scale
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(model_dir: str, reward_dir: str, output_dir: str, parallelism: str, sampler: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    config = RLOOConfig(
        output_dir=output_dir, model_name_or_path=model_dir, reward_adapter=reward_dir, rloo_k=2,
        lora_r=4, lora_alpha=8, per_device_train_batch_size=8, total_episodes=16, num_ppo_epochs=1,
        num_mini_batches=1, gradient_accumulation_steps=1, learning_rate=1e-2,
        response_length=RESPONSE_LENGTH, stop_token="eos", local_rollout_forward_batch_size=4,
        num_sample_generations=1, save_steps=0,
        parallelism=parallelism, sampler=sampler, seed=0,
    )  # fmt: skip
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = datasets.Dataset.from_dict({"prompt": [f"prompt number {i}" for i in range(8)]})
    held_out = datasets.Dataset.from_dict({"prompt": [f"held out {i}" for i in range(4)]})
    trainer = RLOOTrainer(config, model, tokenizer, prompts, held_out)
    lengths: list[list[int]] = []
    sample = trainer.parts.sampler.sample

    def recording_sample(*arguments, **options):
        samples = sample(*arguments, **options)
        lengths.append(samples.response_mask.sum(dim=1).tolist())
        return samples

    trainer.parts.sampler.sample = recording_sample
    trainer.train()
    adapter = load_file(Path(output_dir, "adapter_model.safetensors"))  # written by the run
    report = {
        "world": trainer.parts.parallelism.num_processes,
        "lengths": lengths,
        "adapter": torch.cat([adapter[key].flatten() for key in sorted(adapter)]).tolist(),
    }
    Path(output_dir, f"report_{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        save_model_that_stops(sys.argv[2], Path(sys.argv[3]))
    else:
        main(*sys.argv[1:6])
