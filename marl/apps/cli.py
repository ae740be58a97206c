"""The ``marl`` command: ``marl train-rloo``, ``marl train-reward``, ``marl evaluate``, ``marl demo`` and
``marl plan``, and the error boundary every one of them runs inside.

Each subcommand parses its own flags (:mod:`marl.apps.flags`: ``HfArgumentParser`` through TRL's
``TrlParser``, so ``--config file.yaml`` supplies defaults that command-line flags override, as in TRL's
scripts) and imports torch and transformers only when it runs, so ``marl --help`` is fast.
``examples/train_rloo_adapter.py`` and ``examples/train_reward_adapter.py`` are thin wrappers around
:func:`train_rloo_main` and :func:`train_reward_main`; ``python -m marl`` runs :func:`main`.

Input the user can fix (a :class:`marl.errors.MarlError`: bad flags, files, data, adapters, models,
checkpoints, user functions) ends the program with one line on stderr and exit code 2, the code argparse uses
for bad flags; a run out of memory at the smallest size of a phase (:class:`marl.errors.PhaseMemoryError`)
with one line too and exit code 3. ``--debug`` (or ``MARL_DEBUG=1``) shows its traceback too. Ctrl-C ends it
with one line saying what was kept and how to go on, and exit code 130. Any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from marl.apps.flags import DEBUG_ENVIRONMENT_VARIABLE, DEBUG_FLAG, argv_words, parse_flags
from marl.apps.train_rloo import (
    ScriptArguments,
    build_rloo_trainer,
    parse_train_rloo_args,
    train_arguments,
)
from marl.errors import MarlError, PhaseMemoryError

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


# ----------------------------------------------------------------------------------------------------
# The error boundary

# argparse's exit code for a command line it cannot use; marl uses it for every error in the input.
INPUT_ERROR_EXIT_CODE = 2
# What a shell reports for a program stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130


def _debugging(words: Sequence[str]) -> bool:
    return DEBUG_FLAG in words or os.environ.get(DEBUG_ENVIRONMENT_VARIABLE, "") not in ("", "0")


@contextlib.contextmanager
def error_boundary(
    prog: str, words: Sequence[str], interrupted: Callable[[], str] | None = None
) -> Iterator[None]:
    """Turn a :class:`~marl.errors.MarlError` raised inside into ``prog: error: message`` on stderr and exit
    code 2, and Ctrl-C into ``prog: interrupted ...`` (the line ``interrupted()`` returns: what was kept and
    how to go on) and exit code 130, unless ``words`` hold ``--debug`` or ``MARL_DEBUG`` is set; any other
    exception passes through.

    Example:
        >>> from marl.errors import ConfigError
        >>> with error_boundary("marl demo", []):
        ...     raise ConfigError("rloo_k=1 is too small. Set --rloo_k 2 or more")
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    with _ctrl_c_noted() as signalled:
        try:
            yield
        except MarlError as error:
            if _debugging(words):
                raise
            # the notes say what a run saved before it stopped (marl.train.checkpoints.stop_with_checkpoints)
            line = " ".join([str(error), *getattr(error, "__notes__", [])])
            print(f"{prog}: error: {line}", file=sys.stderr)
            # a run out of memory at its smallest sizes has its own code (marl.errors.OUT_OF_MEMORY_EXIT_CODE)
            raise SystemExit(getattr(error, "exit_code", INPUT_ERROR_EXIT_CODE)) from None
        except BaseException as error:
            # Under a launcher, a process waiting in a collective when Ctrl-C comes may see another process
            # leave first (a "connection closed" error) before its own KeyboardInterrupt: that is Ctrl-C too.
            stopped = isinstance(error, KeyboardInterrupt) or (signalled() and isinstance(error, Exception))
            if not stopped or _debugging(words):
                raise
            # Under a launcher every process gets the signal; one line is enough.
            if os.environ.get("RANK", "0") == "0":
                line = (
                    interrupted()
                    if interrupted is not None
                    else f"nothing was saved. Run the same command again: {command_line(prog, words)}"
                )
                print(f"\n{prog}: interrupted: {line}", file=sys.stderr)
            raise SystemExit(INTERRUPTED_EXIT_CODE) from None


@contextlib.contextmanager
def _ctrl_c_noted() -> Iterator[Callable[[], bool]]:
    """For the body, a SIGINT handler that raises ``KeyboardInterrupt`` as Python's own does and remembers
    that it ran; yields the question "has Ctrl-C come?". Off the main thread, or where another handler is set,
    nothing changes (and the answer is no)."""
    import signal
    import threading

    received: list[bool] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return

    def on_ctrl_c(signum: int, frame: Any) -> None:
        received.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def command_line(prog: str, words: Sequence[str]) -> str:
    """The command a user types to run ``prog`` with ``words`` (a script's ``prog`` is run with python),
    under the launcher and with the number of processes this process was started with
    (:func:`marl.train.launch.current_launch`: e.g. ``torchrun --nproc_per_node 2 -m marl train-rloo ...``).

    Example:
        >>> command_line("marl evaluate", ["--policy_adapter", "runs/my run"])  # started without a launcher
        "marl evaluate --policy_adapter 'runs/my run'"
    """
    from marl.train.launch import current_launch

    return current_launch().command(prog, sys.argv[0] or prog, list(words))


def resume_words(words: Sequence[str]) -> list[str]:
    """``words`` with ``--resume_from_checkpoint latest`` in place of any resume or overwrite flag.

    Example:
        >>> resume_words(["--output_dir", "run", "--overwrite-output-dir", "--resume_from_checkpoint=x"])
        ['--output_dir', 'run', '--resume_from_checkpoint', 'latest']
    """
    replaced = ("--resume_from_checkpoint", "--overwrite_output_dir")
    kept: list[str] = []
    skipping = False
    for word in words:
        name = word.split("=", 1)[0].replace("-", "_") if word.startswith("--") else None
        if name is not None:
            skipping = name in [flag.replace("-", "_") for flag in replaced]
            if skipping:
                continue
        elif skipping:  # the value of a replaced flag
            skipping = False
            continue
        kept.append(word)
    return [*kept, "--resume_from_checkpoint", "latest"]


# ----------------------------------------------------------------------------------------------------
# The subcommands


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
