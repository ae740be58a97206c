"""One fixed RLOO batch trained for 2 updates, in one process or under ``torchrun`` with a ``--parallelism``;
``tests/train/test_parallel_equality.py`` compares the two.

Usage: ``python parallel_run.py MODEL_DIR REWARD_DIR OUTPUT_DIR PARALLELISM [OPTIONS]`` (one process: the
whole batch of 8 completions; N processes: each its 8 / N rows, the same global batch); OPTIONS,
comma-separated: ``bf16`` (bf16 mixed precision), ``checkpointing`` (gradient checkpointing), ``4bit`` (a
4-bit base). It writes
``report_<rank>.json``:
this process's rows' policy and reference log-probs and reward scores, the policy gradient of the first step
(whole), the policy adapter after 2 updates (whole), and the bytes of the base's parameters this process
holds (measured from its local shards).
"""

from __future__ import annotations

import json
import os
import sys

import datasets
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RLOOConfig, RLOOTrainer
from marl.model.memory import stored_bytes
from marl.rollout.completions import Rollout, Samples
from marl.train import parallel
from marl.train.trainer import update_policies
from marl.train.training_parts import UpdatePart

PROMPTS, K = 4, 2


def fixed_samples() -> Samples:
    """4 prompts × 2 completions, k-major (row j * 4 + prompt), 3 response tokens each."""
    prompt_ids = torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]]).repeat(K, 1)
    response_ids = torch.arange(8 * 3).view(8, 3) % 29 + 1
    return Samples(
        prompt_texts=["p"] * 8, prompt_messages=[None] * 8, completions=["c"] * 8,
        prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
        response_ids=response_ids, response_mask=torch.ones(8, 3, dtype=torch.bool),
        contains_stop=torch.ones(8, dtype=torch.bool), contains_eos=torch.ones(8, dtype=torch.bool),
        prompt_index=torch.arange(PROMPTS).repeat(K),
    )  # fmt: skip


def base_parameter_bytes(model: MultiAdapterModel) -> int:
    """Bytes of the base's parameters (no adapter tensor) this process holds, measured on its local shards."""
    return stored_bytes(p for name, p in model.peft_model.named_parameters() if "lora_" not in name)


def quantization_constant_bytes(model: MultiAdapterModel) -> int:
    """Bytes of the 4-bit layers' quantization constants (absmax, code, offset, nested state), which
    bitsandbytes keeps on each ``Linear4bit`` module (0 for an unquantized base)."""
    from bitsandbytes.nn import Linear4bit

    total = 0
    for module in model.peft_model.modules():
        state = module.quant_state if isinstance(module, Linear4bit) else None
        while state is not None:
            values = (state.absmax, state.code, state.offset)
            total += sum(value.numel() * value.element_size() for value in values if torch.is_tensor(value))
            state = getattr(state, "state2", None)
    return total


def main(model_dir: str, reward_dir: str, output_dir: str, parallelism: str, options: str = "") -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rows_per_process = PROMPTS * K // world
    config = RLOOConfig(
        output_dir=output_dir, model_name_or_path=model_dir, reward_adapter=reward_dir, rloo_k=K,
        lora_r=4, lora_alpha=8, per_device_train_batch_size=rows_per_process, total_episodes=16,
        num_ppo_epochs=1, num_mini_batches=1, gradient_accumulation_steps=1, learning_rate=1e-2,
        num_sample_generations=0, parallelism=parallelism, seed=0, bf16="bf16" in options.split(","),
        gradient_checkpointing="checkpointing" in options.split(","),
        quantization="4bit" if "4bit" in options.split(",") else None,
    )  # fmt: skip
    model = MultiAdapterModel.from_config(config)
    with torch.no_grad():  # a policy away from the identity; process 1 differs until process 0's is broadcast
        for parameter in model.policy_parameters():
            values = torch.sin(torch.arange(parameter.numel(), dtype=torch.float32) + 10.0 * rank)
            parameter.copy_(values.view_as(parameter) * 0.1)
    base_bytes = base_parameter_bytes(model)
    prompts = datasets.Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})
    trainer = RLOOTrainer(config, model, AutoTokenizer.from_pretrained(model_dir), prompts)
    local_rows = torch.cat([torch.arange(j * PROMPTS, (j + 1) * PROMPTS) for j in range(K)]).view(K, PROMPTS)
    local_rows = local_rows[:, rank * PROMPTS // world : (rank + 1) * PROMPTS // world].reshape(-1)
    samples = fixed_samples().select(local_rows)
    samples.prompt_index = torch.arange(PROMPTS // world).repeat(K)
    logprobs, ref_logprobs = trainer.parts.scorer.logprobs(samples)
    scores = trainer.parts.reward.score(trainer.parts.scorer.scoring_batch(samples)).total
    rollout = Rollout(**vars(samples), logprobs=logprobs, ref_logprobs=ref_logprobs, scores=scores,
                      source_scores=scores[:, None])  # fmt: skip
    advantages = torch.linspace(-1.0, 1.0, PROMPTS * K)[local_rows]

    # the first step's gradient, averaged over processes in the backward pass
    model.train()
    with model.policy():
        new = trainer.parts.scorer.completion_logprobs(rollout, None)
    trainer.parts.parallelism.backward(-(new.sum(dim=1) * advantages).mean())
    gradient = torch.cat([parallel.full(p.grad).flatten() for p in trainer.parts.policy_update.parameters])
    trainer.parts.policy_update.optimizer.zero_grad(set_to_none=True)
    model.eval()

    for update in (1, 2):
        update_policies(
            [UpdatePart(trainer.parts.policy_update, rollout, advantages)], trainer.phases, update
        )
    adapter = parallel.full_policy_state(model, trainer.parts.policy)
    peft_model = model.peft_model
    report = {
        "world": trainer.parts.parallelism.num_processes,
        "rows": local_rows.tolist(),
        "logprobs": logprobs.tolist(),
        "ref_logprobs": ref_logprobs.tolist(),
        "scores": scores.tolist(),
        "gradient": gradient.tolist(),
        "adapter": torch.cat([adapter[key].flatten() for key in sorted(adapter)]).tolist(),
        "bytes_before": base_bytes,
        "bytes_held": base_parameter_bytes(model),
        "constant_bytes": quantization_constant_bytes(model),
        "mixed_precision": trainer.parts.parallelism.accelerator.mixed_precision,
        "gradient_checkpointing": model.gradient_checkpointing,
        "tied": peft_model.get_output_embeddings().weight is peft_model.get_input_embeddings().weight,
    }
    with open(os.path.join(output_dir, f"report_{rank}.json"), "w") as handle:
        json.dump(report, handle)
    trainer.parts.parallelism.finish()


if __name__ == "__main__":
    main(*sys.argv[1:6])
