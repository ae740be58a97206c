"""TRL's own GRPOTrainer, scoring with a RewardTrainer adapter on the policy's base instead of a second model.

A plain TRL script: the policy is a LoRA on the base (QLoRA with ``--quantization 4bit``), GRPO samples,
scores and trains as TRL does. The one changed line is the reward: where TRL loads the reward adapter as a
second copy of the base,

    classifier = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    reward = PeftModel.from_pretrained(classifier, reward_adapter)

marl loads it onto the policy's own PeftModel (built before the trainer, which is then given that model and
no ``peft_config``). Defaults: the bundled SmolLM2-135M-Instruct and the shipped sentiment reward adapter.

    python examples/trl_grpo_with_reward_adapter.py --output_dir runs/trl-grpo --max_steps 10
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import GRPOConfig, GRPOTrainer

from marl.data.assets import EMBEDDED_MODEL_ID, resolve_model_path
from marl.integrations.trl import reward_adapter_function

PROMPTS = ["The film", "This movie is", "I watched it and", "The plot", "The actors", "Overall, the story"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL_ID, help="base model folder (default: bundled)")
    parser.add_argument("--reward_adapter", default="adapters/smollm2-135m-rotten-tomatoes-reward")
    parser.add_argument("--quantization", choices=["none", "4bit"], default="none")
    parser.add_argument("--output_dir", default="runs/trl-grpo")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--max_completion_length", type=int, default=24)
    args = parser.parse_args()

    base_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    quantization = None
    if args.quantization == "4bit":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(
        base_path, dtype=torch.float32, quantization_config=quantization
    )
    if quantization is not None:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))

    reward = reward_adapter_function(model, args.reward_adapter, tokenizer)  # the one changed line

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=args.max_completion_length,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
    )
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print(f"mean reward per step: {', '.join(f'{value:.3f}' for value in rewards)}")


if __name__ == "__main__":
    main()
