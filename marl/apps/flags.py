"""How every ``marl`` command reads its words and flags: ``HfArgumentParser`` dataclasses through TRL's
``TrlParser``.

``--config file.yaml`` supplies defaults that command-line flags override, as in TRL's scripts; the file is
checked here so that a missing file, bad YAML or an unknown key is named in one line. A list flag may be
repeated, and a TRL flag name that marl spells otherwise gets a one-line hint with marl's flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marl.errors import ConfigError

# ``--debug`` (or MARL_DEBUG=1) shows the traceback of an error in the input too (marl.apps.cli).
DEBUG_FLAG = "--debug"
DEBUG_ENVIRONMENT_VARIABLE = "MARL_DEBUG"


def argv_words(argv: Sequence[str] | None) -> list[str]:
    """The words of a command: ``argv``, or the process's own arguments when ``None``.

    Example:
        >>> argv_words(("--seed", "1"))
        ['--seed', '1']
    """
    return list(sys.argv[1:] if argv is None else argv)


# TRL 1.x names (RLOOConfig / GRPOConfig, and the RLOO trainer before it) of settings marl names otherwise.
# They are not aliases: a TRL name gets a one-line hint with marl's flag.
TRL_FLAG_HINTS: dict[str, str] = {
    "num_generations": "marl's flag is --rloo_k (completions per prompt)",
    "max_completion_length": "marl's flag is --response_length (maximum new tokens per completion)",
    "beta": "marl's flag is --kl_coef (weight of the KL penalty)",
    "num_iterations": "marl's flag is --num_ppo_epochs (passes over each rollout)",
    "epsilon": "marl's flag is --cliprange (PPO clip range)",
    "normalize_advantages": "marl's flag is --normalize_advantage",
    "steps_per_generation": "marl's flag is --num_mini_batches (optimizer steps per rollout and epoch: "
    "steps_per_generation / gradient_accumulation_steps)",
    "generation_batch_size": "marl's completions per update are per_device_train_batch_size × "
    "gradient_accumulation_steps × --num_mini_batches",
    "max_steps": "marl's flag is --total_episodes (completions in total; TRL's max_steps counts optimizer "
    "steps, marl.algo.from_trl.rloo_config_from_trl converts it)",
    "top_p": "marl samples with --temperature alone (no top_p, top_k or min_p)",
    "top_k": "marl samples with --temperature alone (no top_p, top_k or min_p)",
    "min_p": "marl samples with --temperature alone (no top_p, top_k or min_p)",
    "use_peft": "marl always trains a LoRA policy adapter: drop the flag (--lora_r, --lora_alpha and "
    "--lora_target_modules shape it)",
    "lora_dropout": "marl trains without dropout (the update must see the function the rollout sampled): "
    "drop the flag",
    "max_length": "marl's flag is --response_length (new tokens per completion); prompts are never cut",
    "reward_funcs": "marl's flags are --reward_fn module:function and --reward_adapter DIR",
    "reward_model_path": "marl's flag is --reward_adapter DIR (a reward LoRA + score head)",
    "tools": "marl's flag is --tool module:function (repeat it for several tools)",
    "environment_factory": "marl's flag is --environment module:Factory",
    "sft_model_path": "marl's flags are --model_name_or_path and --policy_adapter DIR",
    "max_prompt_length": "marl does not cut prompts: a prompt too long for the context with its completion "
    "is refused",
}


def flag_hints(names: Sequence[str], known: Sequence[str]) -> str:
    """A hint per unknown flag among ``names``: the TRL name's marl flag, else the closest ``known`` flag.

    Example:
        >>> print(flag_hints(["--rlook", "3", "--top_p", "0.9"], ["rloo_k", "temperature", "seed"]))
        --top_p is a TRL name: marl samples with --temperature alone ...; --rlook: did you mean --rloo_k?
    """
    import difflib

    hints = [trl_flag_hints([word]) for word in names]
    for word, hint in zip(names, list(hints), strict=True):
        name = str(word).removeprefix("--").split("=")[0].replace("-", "_")
        if not hint and str(word).startswith("--"):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hints.append(f"--{name}: did you mean --{close[0]}?" if close else "")
    return "; ".join(hint for hint in hints if hint)


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
class CommonArguments:
    """Flags of every subcommand."""

    debug: bool = field(
        default=False,
        metadata={
            "help": "On an error in the input, show its traceback too "
            f"(or set {DEBUG_ENVIRONMENT_VARIABLE}=1)."
        },
    )


def merge_repeated_list_flags(words: list[str], dataclass_types: list[type]) -> list[str]:
    """Let a list flag be repeated: ``--reward_fn a --reward_fn b`` becomes ``--reward_fn a b`` (argparse
    keeps only the last occurrence of a flag).

    Example:
        >>> @dataclass
        ... class Flags:
        ...     reward_fn: list[str] | None = None
        ...     rloo_k: int = 2
        >>> words = ["--reward_fn", "a", "--rloo_k", "2", "--reward-fn", "b"]
        >>> merge_repeated_list_flags(words, [Flags])
        ['--reward_fn', 'a', 'b', '--rloo_k', '2']
    """
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

    Example:
        >>> @dataclass
        ... class Flags:
        ...     rloo_k: int = 2
        >>> parse_flags([Flags], "marl x", ["--rloo-k", "4"])
        (Flags(rloo_k=4),)
    """
    from trl import TrlParser

    parser = TrlParser([*dataclass_types, CommonArguments], prog=prog)
    # No abbreviations: TRL's --epsilon would otherwise be taken as marl's --epsilon_high, not get its hint.
    parser.allow_abbrev = False
    _describe_negative_flags(parser)
    _let_unset_switches_stand_alone(parser)
    parser.error = _one_line_error  # type: ignore[method-assign]  # argparse's own prints the whole usage
    _check_config_file(words, parser)
    words = merge_repeated_list_flags(list(words), list(dataclass_types))  # every command's list flags
    *parsed, _common, unknown = parser.parse_args_and_config(words, return_remaining_strings=True)
    if unknown:
        known = [action.dest for action in parser._actions]
        hints = flag_hints([word for word in unknown if word.startswith("--")], known)
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


def _let_unset_switches_stand_alone(parser: argparse.ArgumentParser) -> None:
    """``HfArgumentParser`` makes a switch unset by default (``bool | None``, e.g. ``--bf16``: unset until the
    device is known) take a value; let it stand alone too (``--bf16`` means ``--bf16 true``), as the switches
    that default to false do."""
    for action in parser._actions:
        # TRL's parser carries its own copy of transformers' string_to_bool: known by its name
        switch = getattr(action.type, "__name__", "") == "string_to_bool"
        if switch and action.nargs is None and action.default is None:
            action.nargs, action.const = "?", True


def _one_line_error(message: str) -> None:
    """A flag argparse refuses (a value not among its choices, of the wrong type, or missing) in one line
    naming the flag and the fix, not argparse's whole usage.

    Example:
        >>> _one_line_error("argument --cpu_allocator/--cpu-allocator: invalid choice: 'bogus' (choose from "
        ...                 "heap, maps)")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: --cpu_allocator: invalid choice: 'bogus' (choose from heap, maps); see ...
    """
    import re

    # argparse names a flag by all its spellings ("--cpu_allocator/--cpu-allocator"): the first is enough.
    message = re.sub(r"^argument (--[\w-]+)(/--[\w-]+)*", r"\1", message)
    raise ConfigError(f"{message}; see the command's --help for its flags")


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
        hints = flag_hints([f"--{key}" for key in unknown], sorted(known))
        raise ConfigError(
            f"the config file {path} has unknown settings {unknown}: "
            + (
                hints
                or f"use the flag names of `{parser.prog} --help` with underscores (e.g. reward_adapter, not "
                "reward-adapter)"
            )
        )
