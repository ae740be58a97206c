"""A TRL ``GRPOTrainer`` run of 2 steps under ``torchrun`` (2 CPU processes, gloo: accelerate wraps the
PeftModel in DDP), its reward the adapter folder as marl's reward function or as TRL's separately loaded
reward model; ``tests/integrations/test_trl_reward_adapter_ddp.py`` compares the two.

Usage: ``python trl_reward_ddp_run.py MODEL_DIR ADAPTER_DIR OUTPUT_DIR MODE`` with MODE ``marl`` or
``separate``. Each process takes its own prompts (their lengths differ, so the processes pad and score
different rows). It writes ``report_<rank>.json``: the steps run, the prompts this process scored, the logged
rewards, the policy adapter
after training, how DDP wrapped the model (the parameters its reducer holds, ``find_unused_parameters``),
which tensors the optimizer holds and which need gradients, how far the reward adapter moved, and the
logits of the reference read as TRL reads a fresh adapter's (``use_adapter(model, None)``, through DDP's
``module``) against a plain copy of the base.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

# the script runs as a file under torchrun: the tests' helpers are importable from their folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marl.integrations.trl import reward_adapter_function

from support.trl_reward import grpo_config, policy_model, separate_reward_model

# 8 prompts of 1 to 9 words: each process's share of a step pads to another length
PROMPTS = [
    "good",
    "a dull",
    "the movie was",
    "review of the film in one line:",
    "bad",
    "an honest and fair review",
    "the plot of this long film was, in short,",
    "write a",
]
STEPS = 2


class PromptsSeen:
    """A reward function of weight 0 that keeps the prompts this process scored (TRL passes each process's
    own rows to its reward functions)."""

    __name__ = "prompts_seen"

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompts: list[str], completions: list[str], **kwargs) -> list[float]:
        self.prompts.extend(prompts)
        return [0.0] * len(prompts)


def main(model_dir: str, adapter_dir: str, output_dir: str, mode: str) -> None:
    from trl import GRPOTrainer
    from trl.trainer.utils import use_adapter

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = policy_model(Path(model_dir))
    if mode == "marl":
        reward, processing_class = reward_adapter_function(policy, adapter_dir, tokenizer), None
    else:
        reward, processing_class = separate_reward_model(Path(model_dir), Path(adapter_dir)), tokenizer
    seen = PromptsSeen()
    reward_start = {n: p.detach().clone() for n, p in policy.named_parameters() if ".reward." in n}
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[reward, seen],
        reward_processing_classes=[processing_class, None],
        # beta > 0: TRL adds its "ref" adapter (the policy's start) and reads the reference through it
        args=grpo_config(
            Path(output_dir) / "trainer",
            max_steps=STEPS,
            learning_rate=5e-3,
            beta=0.04,
            reward_weights=[1, 0],
        ),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()

    wrapped = trainer.model_wrapped
    model = trainer.accelerator.unwrap_model(wrapped)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    ids = tokenizer(PROMPTS[:4], return_tensors="pt", padding=True)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    wrapped.eval()
    with torch.no_grad():
        with use_adapter(model, adapter_name=None):
            reference = wrapped(**ids).logits
        policy_logits = wrapped(**ids).logits
        base_logits = plain(**ids).logits
    ddp = wrapped if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else None
    report = {
        "world": trainer.accelerator.num_processes,
        "wrapper": type(wrapped).__name__,
        "steps": trainer.state.global_step,
        "prompts_seen": seen.prompts,
        "rewards": [entry["reward"] for entry in trainer.state.log_history if "reward" in entry],
        "adapter": {
            n: p.detach().flatten().tolist() for n, p in model.named_parameters() if ".default." in n
        },
        "ddp_parameters": ddp._get_ddp_logging_data()["num_parameter_tensors"] if ddp else None,
        "find_unused_parameters": ddp.find_unused_parameters if ddp else None,
        "optimized": sorted(n for n, p in model.named_parameters() if id(p) in optimized),
        "requires_grad": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "adapters": sorted(model.peft_config),
        "active_adapter": model.active_adapter,
        "reward_moved": max(
            ((model.get_parameter(n) - start).abs().max().item() for n, start in reward_start.items()),
            default=None,
        ),
        "reward_grads": sum(model.get_parameter(n).grad is not None for n in reward_start),
        "reference_gap": (reference - base_logits).abs().max().item(),
        "policy_gap": (policy_logits - base_logits).abs().max().item(),
    }
    with open(os.path.join(output_dir, f"report_{rank}.json"), "w") as handle:
        json.dump(report, handle)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:5])
