"""Will it fit on my GPU? ``marl plan``'s predicted peak for common model shapes on 8, 12, 16 and 24 GB
cards, beside the same planner's models of TRL's ``RLOOTrainer`` (with a ``peft_config``) and of PPO with
four models.

The shapes are the published ``config.json`` values of Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-3B and
Llama-3.1-8B (layers, widths, heads, vocabulary, tied embeddings); no weights are involved. Every plan is a
prediction, not a measurement: only marl's is validated (``plan_vs_measured.py``, on CPU).

    python examples/benchmarks/plan_table.py
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CARDS_GB = (8, 12, 16, 24)
SYSTEMS = ("marl", "trl-rloo", "ppo")
# Architecture values of the models' config.json files.
SHAPES = {
    "Qwen2.5-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-3B": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True),
    "Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False),
}  # fmt: skip
# The job: a 4-bit base, k = 4, 512-token prompts, 256-token completions, 2 prompts (8 completions) per
# micro-batch and per sampling chunk, bf16 mixed precision (--bf16) on CUDA.
JOB = dict(quantization="4bit", bf16=True, rloo_k=4, response_length=256, per_device_train_batch_size=8,
           local_rollout_forward_batch_size=8)  # fmt: skip
PROMPT_LENGTH = 512


def model_config(name: str):
    from transformers import AutoConfig

    values = dict(SHAPES[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None, help="Results markdown (default benchmarks/results/...)")
    options = parser.parse_args()
    import transformers

    from marl.config import RLOOConfig
    from marl.model.memory import format_bytes
    from marl.plan import PlanTarget, plan_memory
    from marl.plan.planner import CUDA_RUNTIME_BYTES

    transformers.logging.set_verbosity_error()
    target = PlanTarget(device="cuda", prompt_length=PROMPT_LENGTH)
    lines = [
        f"# Will it fit? Predicted peaks of an RLOO job ({datetime.date.today().isoformat()})",
        "",
        "Command: `python examples/benchmarks/plan_table.py`",
        "",
        "**Predictions, not measurements.** marl's planner (`marl plan`), validated against measured peaks",
        "on CPU (`*-memory-plan.md`) and on one GPU for 0.5B and 1.5B shapes (`*-memory-plan-cuda.md`);",
        "TRL's RLOOTrainer with a `peft_config` and PPO with four models are the same planner's models of",
        "those systems (`marl/plan/phases.py`), never run here. One CUDA GPU, bf16 mixed precision, NF4",
        f"base, k = {JOB['rloo_k']}, {PROMPT_LENGTH}-token prompts, {JOB['response_length']}-token",
        f"completions, {JOB['per_device_train_batch_size']} completions per micro-batch and per sampling",
        "chunk, LoRA r = 16 on every linear layer, one reward LoRA; the CUDA runtime counted as "
        f"{CUDA_RUNTIME_BYTES / 2**20:.0f} MiB. A card fits a run whose predicted peak is within 90% of its",
        "memory (the allocator's margin).",
        "",
        "| model | gradient checkpointing | system | predicted peak | phase | "
        + " | ".join(f"{gb} GB" for gb in CARDS_GB)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(CARDS_GB),
    ]
    for name in SHAPES:
        shape = model_config(name)
        for checkpointing in (False, True):
            config = RLOOConfig(**JOB, gradient_checkpointing=checkpointing, model_name_or_path=name)
            for system in SYSTEMS:
                plan = plan_memory(config, shape, target, system=system)
                fits = ["yes" if plan.peak <= gb * 1e9 * 0.9 else "no" for gb in CARDS_GB]
                label = {"marl": "marl", "trl-rloo": "TRL RLOO (model)", "ppo": "PPO 4 copies (model)"}[
                    system
                ]
                cells = [
                    name,
                    "on" if checkpointing else "off",
                    label,
                    format_bytes(plan.peak),
                    plan.peak_phase,
                ]
                lines.append("| " + " | ".join([*cells, *fits]) + " |")
                print(lines[-1], flush=True)
    stamp = datetime.date.today().isoformat()
    output = Path(options.output or REPO_ROOT / "benchmarks" / "results" / f"{stamp}-plan-table.md")
    output.write_text("\n".join(lines) + "\n")
    print(f"results: {output}", file=sys.stderr)


if __name__ == "__main__":
    main()
