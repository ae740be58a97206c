"""The configuration reference page, generated from ``RLOOConfig``'s dataclass fields when the site is built,
so that it cannot drift from the code: each field's name, type, default (as a reader would write it, per
``--algorithm`` preset where the preset sets it), help text, choices, and TRL's name where TRL calls it
otherwise (``marl.algo.from_trl.SAME_MEANING``, the owner of that mapping).

The fields are grouped by the ``# --- section ---`` comments of the class's source.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from marl.algo.from_trl import SAME_MEANING, field_table
from marl.config import RLOOConfig
from marl.config.algorithms import PRESETS

MARKER = "<!-- configuration-reference -->"
SECTION = re.compile(r"^\s*# --- (.+?) ---\s*$")
FIELD_LINE = re.compile(r"^\s{4}(\w+):")


def sections() -> dict[str, str]:
    """Each field's section, from the ``# --- name ---`` comments above it in ``RLOOConfig``'s source."""
    current, owner = "settings", {}
    for line in inspect.getsource(RLOOConfig).splitlines():
        if match := SECTION.match(line):
            current = match.group(1)
        elif (match := FIELD_LINE.match(line)) and match.group(1) not in owner:
            owner[match.group(1)] = current
    return owner


def readable(value: Any) -> str:
    """A default as one writes it on the command line or in Python: ``unset`` for None, lists spaced."""
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(str(item) for item in value) or "(none)"
    return str(value)


def default_text(item: dataclasses.Field, by_preset: dict[str, Any]) -> str:
    """The field's default; where the ``--algorithm`` presets set it to different values, each preset's."""
    missing = item.default is dataclasses.MISSING
    default = item.default_factory() if missing else item.default  # type: ignore[misc]
    if item.name != "algorithm" and len({repr(value) for value in by_preset.values()}) > 1:
        return "by `--algorithm`: " + ", ".join(f"{name} `{readable(v)}`" for name, v in by_preset.items())
    resolved = next(iter(by_preset.values()))
    if default is None and resolved is not None:
        return f"`{readable(resolved)}` (every preset)"
    return f"`{readable(default)}`"


def trl_text(name: str) -> str:
    """TRL's name for the field where it differs, and how a converted field of the same name changes unit."""
    trl_names = [trl for trl, marl in SAME_MEANING.items() if marl == name and trl != name]
    if trl_names:
        return ", ".join(f"`{trl}`" for trl in trl_names)
    for table in (field_table(_trl_class("GRPOConfig")), field_table(_trl_class("RLOOConfig"))):
        outcome = table.get(name)
        same_meaning = outcome is None or outcome.reason == "same meaning under marl's name"
        if outcome is not None and outcome.outcome == "converted" and not same_meaning:
            return f"`{name}` ({outcome.reason})"
    return ""


def _trl_class(name: str) -> type:
    import trl

    return getattr(trl, name)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def configuration_markdown() -> str:
    """The tables of the configuration reference, one section per group of fields."""
    owner = sections()
    by_preset = {preset: RLOOConfig(algorithm=preset) for preset in PRESETS}
    groups: dict[str, list[str]] = {}
    for item in dataclasses.fields(RLOOConfig):
        choices = item.metadata.get("choices")
        help_text = item.metadata.get("help", "")
        if choices:
            help_text += f" Choices: {', '.join(map(str, choices))}."
        values = {preset: getattr(config, item.name) for preset, config in by_preset.items()}
        row = (
            f"| `--{item.name}` | `{_cell(str(item.type))}` | {_cell(default_text(item, values))} | "
            f"{_cell(help_text)} | {trl_text(item.name)} |"
        )
        groups.setdefault(owner.get(item.name, "settings"), []).append(row)
    parts = []
    for title, rows in groups.items():
        heading = f"## {title[0].upper()}{title[1:]}"
        parts += [heading, "", "| flag | type | default | what it does | TRL's name |"]
        parts += ["|---|---|---|---|---|", *rows, ""]
    return "\n".join(parts)
