"""RLOO with a reward adapter: train a policy LoRA on the same (optionally 4-bit) base as the frozen reward.

The reward is a LoRA with a score head; the reference is the base with adapters disabled.

The same program as ``marl train-rloo``; every RLOOConfig field is a flag (run with --help), and ``--config
file.yaml`` supplies defaults that flags override. For example, on the embedded model and bundled prompts:

    python examples/train_rloo_adapter.py \
        --reward-adapter adapters/smollm2-135m-rotten-tomatoes-reward --quantization 4bit \
        --dataset_name rotten-tomatoes --output_dir runs/rloo-sentiment --total_episodes 512

    accelerate launch examples/train_rloo_adapter.py --config my-run.yaml
"""

from marl.apps.cli import train_rloo_main

if __name__ == "__main__":
    train_rloo_main(prog="train_rloo_adapter.py")
