"""The ``marl`` command: ``marl train-rloo``, ``marl train-reward``, ``marl evaluate`` and ``marl demo``.

Each subcommand imports its heavy modules (torch, transformers) only when it runs, so ``marl --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, str] = {
    "train-rloo": "RLOO: train a policy LoRA against a reward adapter (or a reward function)",
    "train-reward": "train a reward LoRA + score head on the base from chosen/rejected pairs",
    "evaluate": "compare a policy adapter with its base on held-out prompts",
    "demo": "offline end-to-end demo on the embedded SmolLM2-135M-Instruct and Rotten Tomatoes prompts",
}


def _demo(argv: list[str], prog: str) -> None:
    from marl.demo import DemoArguments, run_demo

    parser = argparse.ArgumentParser(prog=prog, description=COMMANDS["demo"])
    parser.add_argument("--num_prompts", type=int, default=DemoArguments.num_prompts)
    parser.add_argument("--max_new_tokens", type=int, default=DemoArguments.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=DemoArguments.temperature)
    parser.add_argument("--seed", type=int, default=DemoArguments.seed)
    run_demo(DemoArguments(**vars(parser.parse_args(argv))))


def _train_reward(argv: list[str], prog: str) -> None:
    from marl.reward_training import main as train_reward_main

    train_reward_main(argv, prog=prog)


def _not_ready(name: str) -> Callable[[list[str], str], None]:
    def run(argv: list[str], prog: str) -> None:
        raise SystemExit(f"{prog}: not available in this version of marl yet")

    return run


HANDLERS: dict[str, Callable[[list[str], str], None]] = {
    "train-rloo": _not_ready("train-rloo"),
    "train-reward": _train_reward,
    "evaluate": _not_ready("evaluate"),
    "demo": _demo,
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: it lists the subcommands; each subcommand parses its own flags."""
    parser = argparse.ArgumentParser(
        prog="marl",
        description="RLHF with RLOO on one base model: policy, reference and reward as adapters.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``marl`` console script.

    Example:
        >>> main(["demo", "--num_prompts", "2"])  # doctest: +SKIP
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not arguments or arguments[0] not in COMMANDS:
        parser.parse_args(arguments)  # prints the help or the "invalid choice" error and exits
        return
    command, rest = arguments[0], arguments[1:]
    HANDLERS[command](rest, f"marl {command}")


if __name__ == "__main__":
    main()
