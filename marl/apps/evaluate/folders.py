"""The policy folders ``marl evaluate`` is given: run folders, or a sweep's folder whose member folders are
runs; what each run recorded (its ``rloo_config.json``); and the checks, made before any model loads, that
several policies can be evaluated on one base with one way of sampling.

Example:
    >>> policy_labels(["runs/sweep/lr-1e-4", "runs/sweep/lr-3e-4"])
    ['lr-1e-4', 'lr-3e-4']
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from marl.errors import AdapterError, ConfigError

# Names a policy's label may not take: the other keys of a row of eval_completions.jsonl.
RESERVED_LABELS = ("base", "prompt", "")


def run_record(folder: str | Path) -> dict[str, Any]:
    """What the run that wrote the policy folder ``folder`` (its run folder, or one of its ``checkpoint-N``
    folders) recorded in its ``rloo_config.json``; ``{}`` when there is no readable record."""
    from marl.train.run_dir import CONFIG_FILE

    folder = Path(folder)
    for config_file in (folder / CONFIG_FILE, folder.parent / CONFIG_FILE):
        if config_file.is_file():
            try:
                record = json.loads(config_file.read_text())
            except (OSError, ValueError):
                return {}
            return record if isinstance(record, dict) else {}
    return {}


def sweep_members(folder: Path) -> list[Path]:
    """The member run folders of a sweep's folder, in name order: its sub-folders that hold a run's record or
    a policy adapter; ``[]`` when ``folder`` is a policy folder itself or holds no run. A member without its
    adapter (an unfinished run) is refused."""
    from marl.model.adapters import ADAPTER_CONFIG_NAME as CONFIG_NAME
    from marl.train.run_dir import CONFIG_FILE

    if not folder.is_dir() or (folder / CONFIG_NAME).is_file():
        return []
    members = sorted(
        sub
        for sub in folder.iterdir()
        if sub.is_dir() and ((sub / CONFIG_NAME).is_file() or (sub / CONFIG_FILE).is_file())
    )
    for member in members:
        if not (member / CONFIG_NAME).is_file():
            raise AdapterError(
                f"--policy_adapter {folder}: its member {member.name} has no policy adapter ({CONFIG_NAME}): "
                "its run has not finished. Finish or resume it, or pass the finished members with "
                "--policy_adapter DIR each"
            )
    return members


def policy_folders(given: Sequence[str]) -> list[str]:
    """The policy folders of ``--policy_adapter`` (each repeat of the flag): a folder as given, or a sweep's
    folder replaced by its members (:func:`sweep_members`). A folder named twice is refused.

    Example:
        >>> policy_folders(["runs/a", "runs/b"])  # folders that do not exist are checked when loaded
        ['runs/a', 'runs/b']
    """
    folders: list[str] = []
    for text in given:
        members = sweep_members(Path(text))
        folders.extend([str(member) for member in members] or [text])
    seen: dict[Path, str] = {}
    for folder in folders:
        resolved = Path(folder).resolve()
        if resolved in seen:
            raise ConfigError(
                f"--policy_adapter names {folder} twice ({seen[resolved]}): name each policy folder once"
            )
        seen[resolved] = folder
    return folders


def policy_labels(folders: Sequence[str]) -> list[str]:
    """How the results name each policy: its folder's name, or its whole path where names repeat (or would
    be mistaken for another key of the results)."""
    names = [Path(folder).name for folder in folders]
    return [
        str(Path(folder).resolve()) if names.count(name) > 1 or name in RESERVED_LABELS else name
        for folder, name in zip(folders, names, strict=True)
    ]


def check_one_base(folders: Sequence[str]) -> None:
    """Refuse policies trained on different bases (each adapter's ``adapter_config.json`` records its base):
    a ranking samples every policy on the one base that is loaded. Folders that are not policies are refused
    here, before any model loads."""
    from marl.model.adapters import read_policy_folder, same_model

    remedy = "pass it with --reward_adapter, and give --policy_adapter the folders of policies"
    bases = {
        folder: read_policy_folder(folder, allow_pickle=False, flag="--policy_adapter", remedy=remedy).config
        for folder in folders
    }
    first_folder = folders[0]
    first = bases[first_folder].get("base_model_name_or_path")
    for folder, config in bases.items():
        base = config.get("base_model_name_or_path")
        if first and base and not same_model(base, first):
            raise AdapterError(
                f"--policy_adapter {first_folder} and {folder} were trained on different bases ({first!r}, "
                f"{base!r}): a ranking samples every policy on one base. Evaluate them separately"
            )


def check_same_settings(values: dict[str, Any], flag: str) -> None:
    """Refuse several policies whose runs sampled differently (``values``: policy folder → the run's value of
    the setting of ``flag``) when the flag is unset: every policy of a ranking is sampled one way.

    Example:
        >>> check_same_settings({"runs/a": 0.7, "runs/b": 1.0}, "--temperature")
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: the policies' runs differ in --temperature (runs/a: 0.7, runs/b: 1.0): ...
    """
    if len({json.dumps(value, default=str) for value in values.values()}) <= 1:
        return
    differing = ", ".join(f"{folder}: {value}" for folder, value in values.items())
    if flag == "--model_name_or_path":
        raise ConfigError(
            f"the policies' runs trained on different bases ({differing}): a ranking samples every policy "
            "on one base. Evaluate them separately"
        )
    raise ConfigError(
        f"the policies' runs differ in {flag} ({differing}): pass {flag} to sample every policy the same way"
    )
