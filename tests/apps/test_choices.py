"""A value that is not one of a flag's choices ends the command with one line naming the flag and its choices
(not argparse's whole usage), for every field of every subcommand that has choices: those argparse checks
(``choices`` metadata, e.g. ``--cpu_allocator``) and those the settings check when they are built
(``--quantization``, ``--reference``, ``--algorithm``, ...)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing

import pytest

from marl.apps.cli import COMMANDS
from marl.apps.demo import DemoArguments
from marl.apps.evaluate import EvaluateArguments
from marl.apps.flags import parse_flags
from marl.apps.plan import PlanArguments
from marl.apps.train_rloo import ScriptArguments, parse_train_rloo_args
from marl.config import RLOOConfig
from marl.errors import ConfigError
from marl.train.reward_training import RewardAdapterArguments

# The settings dataclasses of each subcommand (its flags; test_every_flag_of_a_command_is_in_the_table).
COMMAND_SETTINGS = {
    "train-rloo": [ScriptArguments, RLOOConfig],
    "plan": [PlanArguments, RLOOConfig],
    "evaluate": [EvaluateArguments],
    "train-reward": [RewardAdapterArguments],
    "demo": [DemoArguments],
}
BOGUS = "bogus"


def _parser(command: str):
    from trl import TrlParser

    return TrlParser(COMMAND_SETTINGS[command], prog=f"marl {command}")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_a_command_is_in_the_table(command, capsys):
    with pytest.raises(SystemExit):
        COMMANDS[command].run(["--help"], f"marl {command}")
    shown = capsys.readouterr().out
    usage = shown.split("\n\n")[0]  # the usage lists every flag
    listed = {flag.replace("-", "_").removeprefix("no_") for flag in re.findall(r"--([a-z0-9_-]+)", usage)}
    assert listed - {"debug", "config"} == {action.dest for action in _parser(command)._actions} - {"help"}
    # a bare "%" in a help text is a format directive to argparse: it prints the flag's whole record
    assert "option_strings" not in shown


ARGPARSE_CHOICES = [
    (command, action.option_strings[0], tuple(action.choices))
    for command in COMMAND_SETTINGS
    for action in _parser(command)._actions
    if action.choices
]


def test_argparse_checks_the_choices_of_cpu_allocator_at_least():
    assert ("train-rloo", "--cpu_allocator", ("heap", "maps")) in ARGPARSE_CHOICES


@pytest.mark.parametrize("command, flag, choices", ARGPARSE_CHOICES)
def test_a_value_argparse_refuses_is_one_line(command, flag, choices, capsys):
    words = [flag, BOGUS] + (["--reward_adapter", "rm"] if command == "train-rloo" else [])
    with pytest.raises(SystemExit) as exit_info:
        COMMANDS[command].run(words, f"marl {command}")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage:" not in err and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    assert line.startswith(f"marl {command}: error: {flag}: invalid choice: '{BOGUS}'")
    assert all(choice in line for choice in choices)


def _takes_text(hint) -> bool:
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(option is str or typing.get_args(option) == (str,) for option in options)


TEXT_FIELDS = sorted(
    (settings.__name__, item.name)
    for settings in {kind for kinds in COMMAND_SETTINGS.values() for kind in kinds}
    for item in dataclasses.fields(settings)
    if item.init and _takes_text(typing.get_type_hints(settings)[item.name])
)
SETTINGS = {kind.__name__: kind for kinds in COMMAND_SETTINGS.values() for kind in kinds}


def refusal(settings_name: str, name: str | None) -> str | None:
    """The error a bogus value of the text field ``name`` gets before any work, or ``None`` if it is taken:
    train-rloo's fields through its whole parsing (registry names are checked there), the others' through
    their own flags."""
    given = {} if name is None else {name: BOGUS}  # None: the settings' defaults alone
    words = [word for key, value in given.items() for word in (f"--{key}", value)]
    try:
        if settings_name in ("RLOOConfig", "ScriptArguments"):
            reward = [] if name in ("reward_adapter", "reward_fn", "reward") else ["--reward_adapter", "rm"]
            parse_train_rloo_args([*words, *reward], device="cpu")
        else:
            settings = SETTINGS[settings_name]
            required = [
                word
                for item in dataclasses.fields(settings)
                if item.init
                and item.name != name
                and item.default is item.default_factory is dataclasses.MISSING
                for word in (f"--{item.name}", "out")
            ]
            parse_flags([settings], "marl", [*words, *required])
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("settings_name, name", TEXT_FIELDS)
def test_a_text_value_the_settings_refuse_is_one_line_naming_the_flag(settings_name, name):
    message = refusal(settings_name, name)
    about_another_flag = message == refusal(settings_name, None)  # e.g. evaluate's required flags
    assert message is None or ("\n" not in message and (name in message or about_another_flag)), message


@pytest.mark.parametrize(
    "name",
    ["quantization", "reference", "algorithm", "kl_placement", "lr_scheduler_type", "reward_normalization",
     "report_to", "sampler", "parallelism", "advantage_estimator", "loss_type", "scale_rewards",
     "importance_sampling_level", "stop_token"],
)  # fmt: skip
def test_the_fields_with_a_set_of_values_refuse_one_outside_it(name):
    """The sweep above cannot pass by taking everything: the fields with a fixed set of values refuse."""
    assert ("RLOOConfig", name) in TEXT_FIELDS
    assert refusal("RLOOConfig", name) is not None
