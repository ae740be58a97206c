"""The ``marl`` command: ``marl train-rloo``, ``marl train-reward``, ``marl evaluate``, ``marl demo`` and
``marl plan``.

Each subcommand parses its own flags (:mod:`marl.apps.flags`: ``HfArgumentParser`` through TRL's
``TrlParser``, so ``--config file.yaml`` supplies defaults that command-line flags override, as in TRL's
scripts) and imports torch and transformers only when it runs, so ``marl --help`` is fast.
``examples/train_rloo_adapter.py`` and ``examples/train_reward_adapter.py`` are thin wrappers around
:func:`train_rloo_main` and :func:`train_reward_main`; ``python -m marl`` runs :func:`main`.

Every subcommand runs inside :func:`marl.apps.boundary.error_boundary`: input the user can fix ends the
program with one line on stderr and exit code 2, Ctrl-C with one line saying what was kept and how to go on
and exit code 130; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from marl.apps.boundary import argv_words, command_line, error_boundary, resume_words
from marl.apps.flags import parse_flags
from marl.apps.train_rloo import (
    ScriptArguments,
    build_rloo_trainer,
    parse_train_rloo_args,
    train_arguments,
)
from marl.errors import PhaseMemoryError

# The names tests, examples and users import from here (the console script's module).
__all__ = [
    "COMMANDS",
    "Command",
    "ScriptArguments",
    "build_rloo_trainer",
    "demo_main",
    "evaluate_main",
    "main",
    "parse_train_rloo_args",
    "plan_main",
    "train_reward_main",
    "train_rloo_main",
]


def train_rloo_main(argv: Sequence[str] | None = None, prog: str = "marl train-rloo") -> Any:
    """Entry point of ``marl train-rloo`` and ``examples/train_rloo_adapter.py``; returns the trainer.

    Example:
        >>> train_rloo_main(["--reward_adapter", "rm", "--output_dir", "runs/a"])  # doctest: +SKIP
    """
    words = argv_words(argv)
    script = trainer = None

    def interrupted() -> str:
        again = f"Run the same command again to start: {command_line(prog, words)}"
        # With --overwrite_output_dir the earlier run stays until this one's first update is done.
        if trainer is None or (script.overwrite_output_dir and trainer.state.update == 0):
            return f"before the first update; the output folder is as it was. {again}"
        from marl.train.run_dir import list_checkpoints

        checkpoints = list_checkpoints(trainer.output_dir)
        every = trainer.config.save_steps
        saved = (
            f"last checkpoint {checkpoints[-1]}"
            if checkpoints
            else f"no checkpoint saved yet ({f'one every {every} updates' if every else '--save_steps 0'}), "
            "so resuming starts from the beginning"
        )
        return (
            f"after {trainer.state.update} of {trainer.parts.sizes.num_total_batches} updates; {saved}. "
            "Resume "
            f"with: {command_line(prog, resume_words(words))}"
        )

    with error_boundary(prog, words, interrupted):
        script, config = parse_train_rloo_args(words, prog)
        trainer = build_rloo_trainer(script, config, command=f"{prog} {shlex.join(words)}")
        try:
            trainer.train(**train_arguments(script))
        except PhaseMemoryError as error:  # one line, with what marl plan advises for this card
            from marl.plan.fit import out_of_memory_advice

            error.advice = out_of_memory_advice(trainer)
            raise
    return trainer


# ----------------------------------------------------------------------------------------------------
# Other subcommands


def evaluate_main(argv: Sequence[str] | None = None, prog: str = "marl evaluate") -> dict[str, Any]:
    """Entry point of ``marl evaluate``.

    Example:
        >>> evaluate_main(["--policy_adapter", "runs/a", "--reward_adapter", "rm"])  # doctest: +SKIP
    """
    words = argv_words(argv)

    def interrupted() -> str:
        return f"before the results were written. Run the same command again: {command_line(prog, words)}"

    with error_boundary(prog, words, interrupted):
        from marl.apps.evaluate import EvaluateArguments, run_evaluation

        (arguments,) = parse_flags([EvaluateArguments], prog, words)
        return run_evaluation(arguments)


def train_reward_main(argv: Sequence[str] | None = None, prog: str = "marl train-reward") -> dict[str, Any]:
    """Entry point of ``marl train-reward`` and ``examples/train_reward_adapter.py``; returns the summary.

    Example:
        >>> train_reward_main(["--output_dir", "rm", "--max_train_pairs", "256"])  # doctest: +SKIP
    """
    words = argv_words(argv)

    def interrupted() -> str:
        return (
            "before the adapter was saved (it is written at the end). Run the same command again: "
            f"{command_line(prog, words)}"
        )

    with error_boundary(prog, words, interrupted):
        from marl.train.reward_training import RewardAdapterArguments, run

        (arguments,) = parse_flags([RewardAdapterArguments], prog, words)
        summary = run(arguments, command=shlex.join([*prog.split(), *words]))
    print(
        f"held-out pairwise accuracy {summary['eval_accuracy']:.3f} (before training "
        f"{summary['eval_accuracy_before']:.3f}) on {summary['eval_pairs_used']} pairs, "
        f"{summary['wall_time_s']:.0f} s; adapter saved to {arguments.output_dir}"
    )
    return summary


def demo_main(argv: Sequence[str] | None = None, prog: str = "marl demo") -> dict[str, Any]:
    """Entry point of ``marl demo``."""
    words = argv_words(argv)
    with error_boundary(prog, words):
        from marl.apps.demo import DemoArguments, run_demo

        (arguments,) = parse_flags([DemoArguments], prog, words)
        return run_demo(arguments)


def plan_main(argv: Sequence[str] | None = None, prog: str = "marl plan") -> Any:
    """Entry point of ``marl plan``; returns the :class:`marl.plan.MemoryPlan`.

    Example:
        >>> plan_main(["--model_name_or_path", "Qwen/Qwen2.5-0.5B", "--memory_gb", "8"])  # doctest: +SKIP
    """
    words = argv_words(argv)
    with error_boundary(prog, words):
        from marl.apps.plan import PlanArguments, run_plan
        from marl.config.rloo_config import RLOOConfig
        from marl.train.training_parts import check_components

        arguments, config = parse_flags([PlanArguments, RLOOConfig], prog, words)
        check_components(config)
        return run_plan(arguments, config)


class Command(NamedTuple):
    """A subcommand: its one-line help and the function that runs it with its flags and its program name."""

    help: str
    run: Callable[[list[str], str], Any]


COMMANDS: dict[str, Command] = {
    "train-rloo": Command(
        "RLOO: train a policy LoRA against a reward adapter (or a reward function)", train_rloo_main
    ),
    "train-reward": Command(
        "train a reward LoRA + score head on the base from chosen/rejected pairs", train_reward_main
    ),
    "evaluate": Command("compare a policy adapter with its base on held-out prompts", evaluate_main),
    "demo": Command(
        "offline end-to-end demo on the embedded SmolLM2-135M-Instruct and Rotten Tomatoes", demo_main
    ),
    "plan": Command(
        "predict the peak memory of a train-rloo run from its flags and the model's config.json", plan_main
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: it lists the subcommands; each subcommand parses its own flags."""
    parser = argparse.ArgumentParser(
        prog="marl",
        description="RLHF with RLOO on one base model: policy, reference and reward as adapters. "
        "Run `marl COMMAND --help` for a command's flags.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        subparsers.add_parser(name, help=command.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``marl`` console script.

    Example:
        >>> main(["evaluate", "--policy_adapter", "runs/a"])  # doctest: +SKIP
    """
    arguments = argv_words(argv)
    parser = build_parser()
    if not arguments or arguments[0] not in COMMANDS:
        parser.parse_args(arguments)  # prints the help or the "invalid choice" error and exits
        return
    name, rest = arguments[0], arguments[1:]
    COMMANDS[name].run(rest, f"marl {name}")


if __name__ == "__main__":
    main()
