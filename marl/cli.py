"""The ``marl`` command: ``marl train-rloo``, ``marl train-reward``, ``marl evaluate`` and ``marl demo``.

Each subcommand parses its own flags with ``HfArgumentParser`` (through TRL's ``TrlParser``, so ``--config
file.yaml`` supplies defaults that command-line flags override, as in TRL's scripts) and imports torch and
transformers only when it runs, so ``marl --help`` is fast. ``examples/train_rloo_adapter.py`` is a thin
wrapper around :func:`train_rloo_main`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from marl.data import dataset_name_field
from marl.errors import ConfigError, MarlError

if TYPE_CHECKING:
    from marl.config import RLOOConfig

COMMANDS: dict[str, str] = {
    "train-rloo": "RLOO: train a policy LoRA against a reward adapter (or a reward function)",
    "train-reward": "train a reward LoRA + score head on the base from chosen/rejected pairs",
    "evaluate": "compare a policy adapter with its base on held-out prompts",
    "demo": "offline end-to-end demo on the embedded SmolLM2-135M-Instruct and Rotten Tomatoes",
}


@dataclass
class ScriptArguments:
    """Flags of ``train-rloo`` beyond :class:`marl.RLOOConfig`: data, reward function, output folder."""

    dataset_name: str = dataset_name_field()
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default=None,
        metadata={
            "help": "Split of held-out prompts for the periodic sample tables (default: training prompts)."
        },
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column that holds the prompts."})
    reward_fn: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward function(s) 'module:function' (or 'file.py:function') called as "
            "function(prompts, completions) -> one number (or None) per completion; with or instead of "
            "--reward_adapter, weighted by --reward_weights. Repeat the flag for several."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Replace the previous run in --output_dir (its metrics, checkpoints and adapter)."},
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "Continue the run in --output_dir from this checkpoint folder, or 'latest'."},
    )


def merge_repeated_list_flags(words: list[str], dataclass_types: list[type]) -> list[str]:
    """Let a list flag be repeated: ``--reward_fn a --reward_fn b`` becomes ``--reward_fn a b`` (argparse
    keeps only the last occurrence of a flag).

    Example:
        >>> words = ["--reward_fn", "a", "--rloo_k", "2", "--reward-fn", "b"]
        >>> merge_repeated_list_flags(words, [ScriptArguments])
        ['--reward_fn', 'a', 'b', '--rloo_k', '2']
    """
    import dataclasses

    list_fields = {
        item.name
        for kind in dataclass_types
        for item in dataclasses.fields(kind)
        if str(item.type).startswith("list[")
    }
    values: dict[str, list[str]] = {}
    rest: list[str] = []
    current = None
    for word in words:
        name = word[2:].replace("-", "_") if word.startswith("--") and "=" not in word else None
        if name is not None:
            current = name if name in list_fields else None
            if current is None:
                rest.append(word)
            else:
                values.setdefault(current, [])
            continue
        if current is not None:
            values[current].append(word)
        else:
            rest.append(word)
    merged = [item for name, items in values.items() for item in (f"--{name}", *items)]
    return merged + rest


def _parser(dataclass_types: list[type], prog: str):
    from trl import TrlParser

    return TrlParser(dataclass_types, prog=prog)


def parse_train_rloo_args(
    argv: Sequence[str] | None = None, prog: str = "marl train-rloo"
) -> tuple[ScriptArguments, RLOOConfig]:
    """Parse ``train-rloo`` flags (and ``--config file.yaml``) into script arguments and an ``RLOOConfig``.

    ``--reward-adapter`` and every other flag also work with dashes instead of underscores.

    Example:
        >>> script, config = parse_train_rloo_args(["--reward-adapter", "rm", "--rloo_k", "4"])
        >>> config.reward_adapter, config.rloo_k
        (['rm'], 4)
    """
    from marl.config import RLOOConfig

    words = merge_repeated_list_flags(
        list(sys.argv[1:] if argv is None else argv), [ScriptArguments, RLOOConfig]
    )
    script, config = _parser([ScriptArguments, RLOOConfig], prog).parse_args_and_config(words)
    if not script.reward_fn and not config.reward_adapter:
        raise ConfigError(
            "no reward: pass --reward_adapter DIR (a reward LoRA from `marl train-reward`) and/or "
            "--reward_fn module:function"
        )
    if script.resume_from_checkpoint is not None and script.overwrite_output_dir:
        raise ConfigError(
            "--resume_from_checkpoint continues the run in --output_dir while --overwrite_output_dir would "
            "delete it: pass only one"
        )
    return script, config


def build_rloo_trainer(script: ScriptArguments, config: RLOOConfig, command: str | None = None):
    """Check the output folder, load data, reward and ONE model, print the memory card, build the trainer.

    Example:
        >>> script, config = parse_train_rloo_args(["--reward_adapter", "rm", "--output_dir", "runs/a"])
        >>> trainer = build_rloo_trainer(script, config)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    import torch
    from accelerate import PartialState
    from rich.console import Console
    from transformers import AutoTokenizer

    from marl.data import load_prompt_dataset
    from marl.rewards import load_reward_fn
    from marl.run_dir import check_output_dir, remove_files
    from marl.trainer import RLOOTrainer

    # Created before the model so that, without a GPU, every launched process joins one CPU group (a default
    # state would set itself up as a single process and the trainer would refuse the mismatch).
    state = PartialState(cpu=not torch.cuda.is_available())
    # Every process checks before any of them writes, so that all of them refuse together.
    previous = check_output_dir(
        config.output_dir,
        overwrite=script.overwrite_output_dir,
        resuming=script.resume_from_checkpoint is not None,
    )
    state.wait_for_everyone()
    if state.is_main_process:
        remove_files(previous)
    reward_functions = [load_reward_fn(spec) for spec in script.reward_fn or []]
    train_dataset = load_prompt_dataset(
        script.dataset_name, script.dataset_train_split, script.prompt_column, seed=config.seed
    )
    eval_dataset = None
    if script.dataset_test_split is not None:
        eval_dataset = load_prompt_dataset(
            script.dataset_name, script.dataset_test_split, script.prompt_column, seed=config.seed
        )
    model = config.load_model()
    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    if state.is_main_process:
        console = Console()
        if command:
            console.print(f"[bold]{command}[/bold]")
        console.print(model.memory_report())
    # The reward adapters first, then the functions: the order of --reward_weights.
    reward_funcs = [*model.rewards, *reward_functions]
    return RLOOTrainer(config, model, tokenizer, train_dataset, eval_dataset, reward_funcs=reward_funcs)


def train_rloo_main(argv: Sequence[str] | None = None, prog: str = "marl train-rloo") -> Any:
    """Entry point of ``marl train-rloo`` and ``examples/train_rloo_adapter.py``; returns the trainer.

    Bad flags, data, reward functions or adapters end the program with a one-line error before training.

    Example:
        >>> train_rloo_main(["--reward_adapter", "rm", "--output_dir", "runs/a"])  # doctest: +SKIP
    """
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        script, config = parse_train_rloo_args(words, prog)
        trainer = build_rloo_trainer(script, config, command=f"{prog} {shlex.join(words)}")
    except (MarlError, ValueError, FileNotFoundError, ImportError) as error:
        raise SystemExit(f"{prog}: error: {error}") from error
    resume = script.resume_from_checkpoint
    try:
        trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    except MarlError as error:  # e.g. a --reward_fn that returned something unusable
        raise SystemExit(f"{prog}: error: {error}") from error
    return trainer


# ----------------------------------------------------------------------------------------------------
# Other subcommands


def evaluate_main(argv: Sequence[str] | None = None, prog: str = "marl evaluate") -> dict[str, Any]:
    """Entry point of ``marl evaluate``.

    Example:
        >>> evaluate_main(["--policy_adapter", "runs/a", "--reward_adapter", "rm"])  # doctest: +SKIP
    """
    from marl.evaluate import EvaluateArguments, run_evaluation

    (arguments,) = _parser([EvaluateArguments], prog).parse_args_and_config(
        list(sys.argv[1:] if argv is None else argv)
    )
    return run_evaluation(arguments)


def _train_reward(argv: list[str], prog: str) -> None:
    from marl.reward_training import main as train_reward_main

    train_reward_main(argv, prog=prog)


def _demo(argv: list[str], prog: str) -> None:
    from marl.demo import DemoArguments, run_demo

    (arguments,) = _parser([DemoArguments], prog).parse_args_and_config(argv)
    run_demo(arguments)


HANDLERS: dict[str, Callable[[list[str], str], Any]] = {
    "train-rloo": train_rloo_main,
    "train-reward": _train_reward,
    "evaluate": evaluate_main,
    "demo": _demo,
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: it lists the subcommands; each subcommand parses its own flags."""
    parser = argparse.ArgumentParser(
        prog="marl",
        description="RLHF with RLOO on one base model: policy, reference and reward as adapters. "
        "Run `marl COMMAND --help` for a command's flags.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``marl`` console script.

    Example:
        >>> main(["evaluate", "--policy_adapter", "runs/a"])  # doctest: +SKIP
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
