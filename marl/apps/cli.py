"""The ``marl`` command: ``marl train-rloo``, ``marl train-reward``, ``marl evaluate`` and ``marl demo``.

Each subcommand parses its own flags with ``HfArgumentParser`` (through TRL's ``TrlParser``, so ``--config
file.yaml`` supplies defaults that command-line flags override, as in TRL's scripts) and imports torch and
transformers only when it runs, so ``marl --help`` is fast. ``examples/train_rloo_adapter.py`` and
``examples/train_reward_adapter.py`` are thin wrappers around :func:`train_rloo_main` and
:func:`train_reward_main`.

Every subcommand runs inside :func:`error_boundary`: input the user can fix (a :class:`marl.errors.MarlError`:
bad flags, files, data, adapters, models, checkpoints, user functions) ends the program with one line on
stderr and exit code 2, the code argparse uses for bad flags. ``--debug`` (or ``MARL_DEBUG=1``) shows its
traceback too. Ctrl-C ends it with one line saying what was kept and how to go on, and exit code 130. Any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.data.prompts import dataset_name_field
from marl.errors import ConfigError, MarlError
from marl.validation import check_fields

if TYPE_CHECKING:
    from marl.config import RLOOConfig

# argparse's exit code for a command line it cannot use; marl uses it for every error in the input.
INPUT_ERROR_EXIT_CODE = 2
# What a shell reports for a program stopped by Ctrl-C (128 + SIGINT).
INTERRUPTED_EXIT_CODE = 130
DEBUG_FLAG = "--debug"
DEBUG_ENVIRONMENT_VARIABLE = "MARL_DEBUG"

COMMANDS: dict[str, str] = {
    "train-rloo": "RLOO: train a policy LoRA against a reward adapter (or a reward function)",
    "train-reward": "train a reward LoRA + score head on the base from chosen/rejected pairs",
    "evaluate": "compare a policy adapter with its base on held-out prompts",
    "demo": "offline end-to-end demo on the embedded SmolLM2-135M-Instruct and Rotten Tomatoes",
}


# TRL 1.x names (RLOOConfig / GRPOConfig, and the RLOO trainer before it) of settings marl names otherwise.
# They are not aliases: a TRL name gets a one-line hint with marl's flag.
TRL_FLAG_HINTS: dict[str, str] = {
    "num_generations": "marl's flag is --rloo_k (completions per prompt)",
    "max_completion_length": "marl's flag is --response_length (maximum new tokens per completion)",
    "beta": "marl's flag is --kl_coef (weight of the KL penalty)",
    "num_iterations": "marl's flag is --num_ppo_epochs (passes over each rollout)",
    "epsilon": "marl's flag is --cliprange (PPO clip range)",
    "epsilon_high": "marl's clip range is symmetric: --cliprange",
    "normalize_advantages": "marl's flag is --normalize_advantage",
    "steps_per_generation": "marl's flag is --num_mini_batches (optimizer steps per rollout and epoch)",
    "reward_funcs": "marl's flags are --reward_fn module:function and --reward_adapter DIR",
    "reward_model_path": "marl's flag is --reward_adapter DIR (a reward LoRA + score head)",
    "sft_model_path": "marl's flags are --model_name_or_path and --policy_adapter DIR",
    "max_prompt_length": "marl does not cut prompts: a prompt too long for the context with its completion "
    "is refused",
}


def trl_flag_hints(names: Sequence[str]) -> str:
    """The hints for the TRL flag names among ``names`` (flags or config keys), one sentence each.

    Example:
        >>> print(trl_flag_hints(["--num-generations", "4", "--seed"]))
        --num_generations is a TRL name: marl's flag is --rloo_k (completions per prompt)
    """
    found = [
        name
        for word in names
        if (name := str(word).removeprefix("--").split("=")[0].replace("-", "_")) in TRL_FLAG_HINTS
    ]
    return "; ".join(f"--{name} is a TRL name: {TRL_FLAG_HINTS[name]}" for name in found)


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
        metadata={
            "help": "Replace the previous run in --output_dir (its metrics, checkpoints and adapter); it is "
            "deleted once the new run has finished its first update, and kept if the new run stops before."
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Continue the run in --output_dir from this checkpoint folder, or 'latest' (a "
            "run stopped before its first checkpoint then starts from the beginning)."
        },
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class CommonArguments:
    """Flags of every subcommand."""

    debug: bool = field(
        default=False,
        metadata={
            "help": "On an error in the input, show its traceback too "
            f"(or set {DEBUG_ENVIRONMENT_VARIABLE}=1)."
        },
    )


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
        >>> with error_boundary("marl demo", []):
        ...     raise ConfigError("rloo_k=1 is too small. Set --rloo_k 2 or more")
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    try:
        yield
    except MarlError as error:
        if _debugging(words):
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(INPUT_ERROR_EXIT_CODE) from None
    except KeyboardInterrupt:
        if _debugging(words):
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


def command_line(prog: str, words: Sequence[str]) -> str:
    """The command a user types to run ``prog`` with ``words`` (a script's ``prog`` is run with python).

    Example:
        >>> command_line("marl evaluate", ["--policy_adapter", "runs/my run"])
        "marl evaluate --policy_adapter 'runs/my run'"
    """
    program = prog if prog.startswith("marl ") else f"python {shlex.quote(sys.argv[0] or prog)}"
    return " ".join([program, *([shlex.join(words)] if words else [])])


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


def _words(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)


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


def parse_flags(dataclass_types: list[type], prog: str, words: Sequence[str]) -> tuple[Any, ...]:
    """Parse ``words`` (and ``--config file.yaml``) into one instance of each dataclass type.

    The config file is checked here so that a missing file, bad YAML or an unknown key is named in one line.
    """
    from trl import TrlParser

    parser = TrlParser([*dataclass_types, CommonArguments], prog=prog)
    _describe_negative_flags(parser)
    _check_config_file(words, parser)
    *parsed, _common, unknown = parser.parse_args_and_config(list(words), return_remaining_strings=True)
    if unknown:
        hints = trl_flag_hints([word for word in unknown if word.startswith("--")])
        raise ConfigError(f"unknown flags {unknown}: {hints or f'see `{prog} --help` for the flags'}")
    return tuple(parsed)


def _describe_negative_flags(parser: argparse.ArgumentParser) -> None:
    """``HfArgumentParser`` gives ``--no_X`` (of a setting that is on by default) the help of ``--X``; say
    what it does instead."""
    for action in parser._actions:
        negative = [option for option in action.option_strings if option.startswith("--no_")]
        if negative and isinstance(action, argparse._StoreFalseAction):
            action.help = f"Turn --{action.dest} off (as --{action.dest} false); it is on by default."
            action.default = argparse.SUPPRESS  # its own default (False) is not the setting's


def _check_config_file(words: Sequence[str], parser: argparse.ArgumentParser) -> None:
    import yaml

    if "--config" not in words:
        return
    position = list(words).index("--config")
    if position + 1 >= len(words):
        raise ConfigError("--config needs a YAML file: --config run.yaml")
    path = Path(words[position + 1])
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        settings = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read the config file {path} ({type(error).__name__}: {error})") from error
    if not isinstance(settings, dict):
        raise ConfigError(f"the config file {path} must hold a YAML mapping of flag names to values")
    known = {action.dest for action in parser._actions} | {"env"}
    unknown = [str(key) for key in settings if key not in known]
    if unknown:
        hints = trl_flag_hints(unknown)
        raise ConfigError(
            f"the config file {path} has unknown settings {unknown}: "
            + (
                hints
                or f"use the flag names of `{parser.prog} --help` with underscores (e.g. reward_adapter, not "
                "reward-adapter)"
            )
        )


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

    words = merge_repeated_list_flags(_words(argv), [ScriptArguments, RLOOConfig])
    script, config = parse_flags([ScriptArguments, RLOOConfig], prog, words)
    if not script.reward_fn and not config.reward_adapter:
        raise ConfigError(
            "no reward: pass --reward_adapter DIR (a reward LoRA from `marl train-reward`) and/or "
            "--reward_fn module:function"
        )
    return script, config


def build_rloo_trainer(script: ScriptArguments, config: RLOOConfig, command: str | None = None):
    """Check everything (output folder, data, reward functions, ONE model with its adapters, the trainer's own
    checks), print the memory card, and return the trainer. Nothing is written: the run writes into its output
    folder only once it has done its first update (see :mod:`marl.train.run_dir`).

    Example:
        >>> script, config = parse_train_rloo_args(["--reward_adapter", "rm", "--output_dir", "runs/a"])
        >>> trainer = build_rloo_trainer(script, config)  # doctest: +SKIP
        >>> trainer.train(**train_arguments(script))  # doctest: +SKIP
    """
    from marl.data.assets import resolve_model_path
    from marl.data.prompts import load_prompt_dataset
    from marl.train.run_dir import plan_start

    # The checks that need no model come first, and before torch is imported, so that a typo fails at once.
    arguments = train_arguments(script)
    plan_start(  # train() repeats this check before it starts
        config.output_dir, arguments["resume_from_checkpoint"], overwrite=arguments["overwrite_output_dir"]
    )
    train_dataset = load_prompt_dataset(
        script.dataset_name, script.dataset_train_split, script.prompt_column, seed=config.seed
    )
    eval_dataset = None
    if script.dataset_test_split is not None:
        eval_dataset = load_prompt_dataset(
            script.dataset_name,
            script.dataset_test_split,
            script.prompt_column,
            seed=config.seed,
            split_flag="--dataset_test_split",
        )
    resolve_model_path(config.model_name_or_path)

    import torch
    from accelerate import PartialState
    from rich.console import Console

    from marl.model.build import load_tokenizer
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.rewards import RewardParts, RewardSetting, plan_rewards
    from marl.train.trainer import RLOOTrainer

    # The reward adapters first, then the functions: the order of --reward_weights. Planned before the model
    # loads, so that a --reward_fn typo fails at once.
    rewards = plan_rewards(
        [
            *(RewardSetting("adapter", name) for name in config.reward_adapter_folders()),
            *(RewardSetting("function", spec) for spec in script.reward_fn or []),
        ]
    )
    # Created before the model so that, without a GPU, every launched process joins one CPU group (a default
    # state would set itself up as a single process and the trainer would refuse the mismatch).
    state = PartialState(cpu=not torch.cuda.is_available())
    model = MultiAdapterModel.from_config(config)
    tokenizer = load_tokenizer(model.name_or_path)
    if state.is_main_process:
        console = Console()
        if command:
            console.print(f"[bold]{command}[/bold]")
        console.print(model.memory_report())
    return RLOOTrainer(
        config,
        model,
        tokenizer,
        train_dataset,
        eval_dataset,
        reward_funcs=rewards.build(RewardParts(model, tokenizer, config.local_rollout_forward_batch_size)),
        dataset_source=dataset_record(script),
    )


def dataset_record(script: ScriptArguments) -> dict[str, Any]:
    """Where the run's prompts came from, for ``rloo_config.json``: the dataset (and its absolute path when
    local), the splits really read (``None``: a whole file; a test split of ``None`` with no test prompts)
    and the prompt column.

    Example:
        >>> record = dataset_record(ScriptArguments(dataset_test_split="test"))
        >>> record["dataset_name"], record["train_split"], record["test_split"], record["prompt_column"]
        ('rotten-tomatoes', 'train', 'test', 'prompt')
    """
    from marl.data.prompts import prompt_source

    train = prompt_source(script.dataset_name, script.dataset_train_split)
    test_split = script.dataset_test_split
    return {
        "dataset_name": train["dataset_name"],
        "dataset_path": train["dataset_path"],
        "train_split": train["split"],
        "test_split": None if test_split is None else prompt_source(script.dataset_name, test_split)["split"],
        "prompt_column": script.prompt_column,
    }


def train_arguments(script: ScriptArguments) -> dict[str, Any]:
    """The arguments of ``RLOOTrainer.train`` that the output-folder flags ask for.

    Example:
        >>> train_arguments(ScriptArguments(resume_from_checkpoint="latest"))
        {'resume_from_checkpoint': True, 'overwrite_output_dir': False}
    """
    resume = script.resume_from_checkpoint
    return {
        "resume_from_checkpoint": True if resume == "latest" else resume,
        "overwrite_output_dir": script.overwrite_output_dir,
    }


def train_rloo_main(argv: Sequence[str] | None = None, prog: str = "marl train-rloo") -> Any:
    """Entry point of ``marl train-rloo`` and ``examples/train_rloo_adapter.py``; returns the trainer.

    Example:
        >>> train_rloo_main(["--reward_adapter", "rm", "--output_dir", "runs/a"])  # doctest: +SKIP
    """
    words = _words(argv)
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
            f"after {trainer.state.update} of {trainer.sizes.num_total_batches} updates; {saved}. Resume "
            f"with: {command_line(prog, resume_words(words))}"
        )

    with error_boundary(prog, words, interrupted):
        script, config = parse_train_rloo_args(words, prog)
        trainer = build_rloo_trainer(script, config, command=f"{prog} {shlex.join(words)}")
        trainer.train(**train_arguments(script))
    return trainer


# ----------------------------------------------------------------------------------------------------
# Other subcommands


def evaluate_main(argv: Sequence[str] | None = None, prog: str = "marl evaluate") -> dict[str, Any]:
    """Entry point of ``marl evaluate``.

    Example:
        >>> evaluate_main(["--policy_adapter", "runs/a", "--reward_adapter", "rm"])  # doctest: +SKIP
    """
    words = _words(argv)

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
    words = _words(argv)

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
    words = _words(argv)
    with error_boundary(prog, words):
        from marl.apps.demo import DemoArguments, run_demo

        (arguments,) = parse_flags([DemoArguments], prog, words)
        return run_demo(arguments)


HANDLERS: dict[str, Callable[[list[str], str], Any]] = {
    "train-rloo": train_rloo_main,
    "train-reward": train_reward_main,
    "evaluate": evaluate_main,
    "demo": demo_main,
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
