"""A run's output folder: the names of its files, its checkpoints, its metrics file, and how a run starts in
it without mixing with, or losing, an earlier one.

Layout of ``output_dir``::

    rloo_config.json            the run's settings, the model it trained and where its prompts came from
    metrics.jsonl               one JSON record per logged update
    samples/update_NNNNNN.jsonl sample tables
    marl-rloo/                  tracker logs (tensorboard, ...), when report_to names trackers
    checkpoint-N/               adapter, optimizer, scheduler, trainer state, RNG state per process
                                (written and read by :mod:`marl.train.checkpoints`)
    adapter_config.json, adapter_model.safetensors   the final policy adapter
    training_curves.png         score, KL and RLHF reward against the episode, drawn at the end

How a run starts (:func:`plan_start`, then :meth:`RunStart.commit`): every check runs first and writes
nothing. The new run then writes nothing into ``output_dir`` until its first update is done. Only then does
it delete the run it replaces (``overwrite``, or the files of an unfinished run that had no checkpoint yet),
or cut the resumed run's metrics back to its checkpoint, and write its own files. A run that fails or is
killed before that leaves the folder exactly as it was. A deletion cut short by a kill is marked by the folder
:data:`DELETING_DIR`, so what it left behind is never taken for a run to resume.

Example:
    >>> checkpoint_name(12)
    'checkpoint-12'
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from marl.errors import ConfigError, MissingPathError, RunFolderError
from marl.model.adapters import ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

CONFIG_FILE = "rloo_config.json"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "training_curves.png"
SAMPLES_DIR = "samples"
TRACKER_DIR = "marl-rloo"
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE_FILE = "trainer_state.json"
# While it exists, every run file in the folder is a leftover of a run being deleted (see the module doc).
DELETING_DIR = ".deleting-replaced-run"
# What a run leaves in its output folder; finding any of these means the folder holds a run.
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    SAMPLES_DIR,
    TRACKER_DIR,
    ADAPTER_CONFIG_NAME,
    SAFETENSORS_WEIGHTS_NAME,
    CURVES_FILE,
)
_CHECKPOINT = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def checkpoint_name(update: int) -> str:
    return f"{CHECKPOINT_PREFIX}{update}"


def finished_line(output_dir: str | Path, policy: str, curves: str) -> str:
    """The last line of a finished run: where its policy adapter (a PEFT folder, loadable with
    ``PeftModel.from_pretrained(base, output_dir)``) is, and ``curves``: where its training curves are, or
    why they were not drawn (:func:`marl.train.curves.training_curves_note`).

    Example:
        >>> finished_line("runs/a", "policy", "training curves in runs/a/training_curves.png")
        "Done: policy adapter 'policy' written to runs/a; training curves in runs/a/training_curves.png"
    """
    return f"Done: policy adapter {policy!r} written to {output_dir}; {curves}"


def sample_table_file(output_dir: Path, update: int) -> Path:
    return output_dir / SAMPLES_DIR / f"update_{update:06d}.jsonl"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete ``checkpoint-N`` folders of ``output_dir``, oldest first.

    Example:
        >>> list_checkpoints(Path("/nonexistent"))
        []
    """
    found = [
        (int(match.group(1)), path)
        for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
        if path.is_dir() and (match := _CHECKPOINT.match(path.name))
    ]
    return [path for _, path in sorted(found)]


def previous_run_files(output_dir: str | Path) -> list[Path]:
    """Files and checkpoint folders of an earlier run in ``output_dir`` (empty if there is none), including
    half-written ones.

    Example:
        >>> previous_run_files("/nonexistent")
        []
    """
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = [directory / name for name in RUN_FILES if (directory / name).exists()]
    found.extend(sorted(directory.glob(f"{CHECKPOINT_PREFIX}*")))
    # What a kill can leave: a checkpoint being written or deleted, a file written under a temporary name.
    found.extend(sorted(directory.glob(f".{CHECKPOINT_PREFIX}*")))
    found.extend(path for name in RUN_FILES if (path := directory / f".{name}.tmp").exists())
    return found


def remove_files(files: Sequence[Path]) -> None:
    """Delete files and checkpoint folders; nothing else in their folder is touched."""
    for path in files:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


@dataclass
class RunStart:
    """How a run starts in ``output_dir``, decided by :func:`plan_start` before anything there is touched.

    ``checkpoint``: the checkpoint it resumes from, if any. ``replace``: the run files in the folder (of an
    earlier run, or of an unfinished one) are deleted at :meth:`commit`. ``notice``: a line to show the user.
    """

    output_dir: Path
    checkpoint: Path | None = None
    replace: bool = False
    notice: str | None = None

    def commit(self, resumed_update: int) -> list[dict[str, Any]]:
        """Called by the main process once the run's first update is done, before it writes any file: delete
        the replaced run, or drop the metrics a resumed run is about to write again (returns those kept)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        deleting = self.output_dir / DELETING_DIR
        if self.replace:
            # The marker first: a kill during the deletion leaves it, and the leftovers are not taken for a
            # run.
            deleting.mkdir(exist_ok=True)
            trash = Path(tempfile.mkdtemp(dir=deleting))
            for path in previous_run_files(self.output_dir):
                os.replace(path, trash / path.name)
        if deleting.exists():
            shutil.rmtree(deleting)
        return truncate_metrics(self.output_dir, resumed_update) if self.checkpoint is not None else []


def plan_start(
    output_dir: str | Path, resume: str | os.PathLike | bool | None = None, *, overwrite: bool = False
) -> RunStart:
    """Check the output folder for a run that starts fresh, resumes (``resume``: a checkpoint folder, or
    ``True`` for the latest in ``output_dir``) or replaces the run there (``overwrite``); nothing is written.

    Refused: a folder that holds a run when neither ``resume`` nor ``overwrite`` is given, ``resume=True`` in
    a finished run that has no checkpoint, a checkpoint path without its trainer state, and an output folder
    that cannot be created. ``resume=True`` with no checkpoint yet (a run stopped before its first one)
    starts the run from the beginning.

    Example:
        >>> plan_start("/nonexistent/run")
        RunStart(output_dir=PosixPath('/nonexistent/run'), checkpoint=None, replace=False, notice=None)
    """
    directory = Path(output_dir)
    _check_can_create(directory)
    if resume and overwrite:
        raise ConfigError(
            "--resume_from_checkpoint continues the run in --output_dir while --overwrite_output_dir would "
            "delete it: pass only one"
        )
    # Leftovers of a deletion cut short are neither checkpoints nor a finished run.
    leftovers = (directory / DELETING_DIR).exists()
    found = previous_run_files(directory)
    if resume is True:
        checkpoints = [] if leftovers else list_checkpoints(directory)
        if checkpoints:
            read_metrics(directory)  # a damaged metrics file is named now, not after the first update
            return RunStart(directory, checkpoint=checkpoints[-1])
        if (directory / SAFETENSORS_WEIGHTS_NAME).is_file() and not leftovers:
            raise RunFolderError(
                f"{directory} holds a finished run (its final adapter {SAFETENSORS_WEIGHTS_NAME}) and no "
                f"{CHECKPOINT_PREFIX}N folder to resume from. Pass --overwrite_output_dir to train it "
                "again, or another --output_dir"
            )
        notice = f"{directory} has no checkpoint yet: the run starts from the beginning"
        if found:
            notice += (
                f" and replaces the files of the unfinished run ({_names(found)}) after its first update"
            )
        return RunStart(directory, replace=True, notice=notice)
    if resume:
        path = Path(resume)
        if not (path / TRAINER_STATE_FILE).is_file():
            raise MissingPathError(
                f"{path} is not a checkpoint of this trainer (no {TRAINER_STATE_FILE}); pass a "
                f"{CHECKPOINT_PREFIX}N folder, or --resume_from_checkpoint latest"
            )
        read_metrics(directory)
        return RunStart(directory, checkpoint=path)
    if found and not overwrite:
        raise RunFolderError(
            f"{directory} already holds a run ({_names(found)}). Choose another output_dir, pass "
            "--overwrite_output_dir to replace that run, or --resume_from_checkpoint latest to "
            "continue it (in Python: train(overwrite_output_dir=True) or train(resume_from_checkpoint=True))"
        )
    return RunStart(directory, replace=bool(found))


def _names(paths: Sequence[Path]) -> str:
    return ", ".join(path.name for path in paths[:5]) + (", ..." if len(paths) > 5 else "")


def _check_can_create(directory: Path) -> None:
    """The output folder, or the nearest folder above it that exists, must be a writable folder."""
    if directory.exists() and not directory.is_dir():
        raise RunFolderError(f"--output_dir {directory} is a file: pass a folder")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RunFolderError(f"--output_dir {directory} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(
            f"--output_dir {directory} cannot be written: no permission to write in {existing}"
        )


# ---------------------------------------------------------------------- metrics


def json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats become null: JSON has no NaN.

    Example:
        >>> json_safe({"loss": float("nan"), "update": 3})
        {'loss': None, 'update': 3}
    """
    return {
        key: (value if not isinstance(value, float) or math.isfinite(value) else None)
        for key, value in record.items()
    }


def append_metrics(output_dir: Path, record: dict[str, Any]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    with (output_dir / METRICS_FILE).open("a") as handle:
        handle.write(json.dumps(json_safe(record)) + "\n")


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """The records of the run folder's ``metrics.jsonl`` (:func:`read_metrics_file`); none without one.

    Example:
        >>> read_metrics(Path("/nonexistent"))
        []
    """
    metrics_file = output_dir / METRICS_FILE
    return read_metrics_file(metrics_file) if metrics_file.exists() else []


def read_metrics_file(metrics_file: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, one per logged update. A last line without its newline was cut
    off by a kill and is left out; any other line that is not a record is an error naming file and line."""
    lines = Path(metrics_file).read_text().split("\n")
    complete = lines[:-1]  # the part after the last newline is either empty or a record cut off
    records = []
    for number, line in enumerate(complete, start=1):
        try:
            record = json.loads(line)
            records.append({"update": int(record["update"]), **record})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise RunFolderError(
                f"{metrics_file} line {number} is not a metrics record ({type(error).__name__}: {error}); "
                "delete that line, or the file, to resume"
            ) from error
    return records


def truncate_metrics(output_dir: Path, last_update: int) -> list[dict[str, Any]]:
    """Drop the records written after ``last_update`` (a resumed run writes those updates again); returns the
    records kept. The file is replaced in one step, so a kill never leaves it half written."""
    if not (output_dir / METRICS_FILE).exists():
        return []
    kept = [record for record in read_metrics(output_dir) if record["update"] <= last_update]
    write_atomically(output_dir / METRICS_FILE, "".join(json.dumps(record) + "\n" for record in kept))
    return kept


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it over ``path``."""
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    os.replace(staging, path)


def run_settings(
    config: Any, model: Any, policy: str, world_size: int, dataset: dict[str, Any]
) -> dict[str, Any]:
    """What ``rloo_config.json`` records: the config, the model that was really trained (its ``policy``
    adapter), the number of processes and their launcher (:mod:`marl.train.launch`) and where the prompts came
    from (``dataset``)."""
    from marl.train.launch import current_launch

    return {
        **asdict(config),
        # the settings chosen for the device, not given, and why (marl.config.device)
        "chosen_for_device": dict(getattr(config, "chosen_for_device", {})),
        "model": {
            "name_or_path": model.name_or_path,
            "quantization": model.quantization,
            "dtype": str(model.dtype).removeprefix("torch."),
            "policy": policy,
            "reference": model.policies[policy].reference_mode,
            "gradient_checkpointing": model.gradient_checkpointing,
        },
        "world_size": world_size,
        "launcher": current_launch().launcher,
        "dataset": dataset,
    }


# The reward kinds (marl.rewards.reward_kinds) by the class of the source they build.
REWARD_KIND_NAMES = {"AdapterReward": "adapter", "EosTerminatedAdapterReward": "eos_adapter"}


def reward_record(reward: Any) -> list[dict[str, Any]]:
    """Each reward source of ``reward`` (a :class:`marl.rewards.WeightedRewards`) as ``rloo_config.json``
    records it: its metric name, its weight and what it is (a reward adapter, or the function by module and
    name), so that a run's reward functions are on record beside its ``--reward_adapter`` folders.

    Example:
        >>> from marl.rewards import FunctionReward, WeightedRewards
        >>> reward_record(WeightedRewards([FunctionReward(len, "length")], [0.5]))
        [{'name': 'length', 'weight': 0.5, 'kind': 'function', 'function': 'builtins:len'}]
    """
    records = []
    for source, name, weight in zip(reward.sources, reward.names, reward.weights, strict=True):
        kind = REWARD_KIND_NAMES.get(type(source).__name__, type(source).__name__)
        record: dict[str, Any] = {"name": name, "weight": weight, "kind": kind}
        function = getattr(source, "function", None)
        while isinstance(function, functools.partial):  # the function a partial wraps, as TRL names it
            function = function.func
        if function is not None:
            qualname = getattr(function, "__qualname__", type(function).__qualname__)
            record |= {"kind": "function", "function": f"{getattr(function, '__module__', '?')}:{qualname}"}
        records.append(record)
    return records


def tracker_config(config: Any) -> dict[str, Any]:
    """The config as trackers such as tensorboard accept it: scalars and strings only.

    Example:
        >>> from marl.config import RLOOConfig
        >>> settings = tracker_config(RLOOConfig(report_to=["tensorboard"]))
        >>> settings["rloo_k"], settings["report_to"], settings["quantization"]
        (2, "['tensorboard']", 'none')
    """

    def value_of(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value if value is not None else "none"
        return str(value)

    return {key: value_of(value) for key, value in asdict(config).items()}


# rloo_config.json's record of the sizes the out-of-memory guard halved (marl.train.memory_guard), as printed.
RETRIED_KEY = "retried_smaller"
MICRO_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")


def resume_retried_micro_batch(output_dir: Path, configs: Sequence[Any]) -> tuple[str, str] | None:
    """Set ``configs`` (a run's, or a sweep's members') to the micro-batch the run in ``output_dir`` was
    retried at after its update ran out of memory (its ``rloo_config.json``), when the effective batch is the
    one typed; returns the typed and the retried micro-batch as flags, or ``None`` when there is none."""
    try:
        recorded = json.loads((output_dir / CONFIG_FILE).read_text())
        micro, steps = (int(recorded[key]) for key in MICRO_BATCH)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    retried = any(change.startswith("out of memory in update") for change in recorded.get(RETRIED_KEY, []))
    first = configs[0]
    typed = first.per_device_train_batch_size, first.gradient_accumulation_steps
    if not retried or micro >= typed[0] or micro * steps != typed[0] * typed[1]:
        return None
    for config in configs:
        config.per_device_train_batch_size, config.gradient_accumulation_steps = micro, steps
    flags = "--per_device_train_batch_size {} --gradient_accumulation_steps {}"
    return flags.format(*typed), flags.format(micro, steps)


def write_run_config(output_dir: Path, settings: dict[str, Any]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(output_dir / CONFIG_FILE, json.dumps(settings, indent=2, default=str) + "\n")


def sample_rows(
    prompts: Sequence[str], completions: Sequence[str], scores: Sequence[float], extra: dict[str, list[Any]]
) -> list[dict[str, Any]]:
    """The sample table's rows: prompt, completion and score of each completion, then the columns reward
    functions logged for it with ``log_extra`` (TRL's extra columns of its completions table).

    Example:
        >>> sample_rows(["p"], [" c"], [0.5], {"parsed": [True]})
        [{'prompt': 'p', 'completion': ' c', 'score': 0.5, 'parsed': True}]
    """
    rows = [
        {"prompt": prompt, "completion": completion, "score": float(score)}
        for prompt, completion, score in zip(prompts, completions, scores, strict=True)
    ]
    for column, values in extra.items():
        for row, value in zip(rows, values, strict=True):
            row[column] = value
    return rows


def write_sample_table(output_dir: Path, update: int, rows: list[dict[str, Any]]) -> None:
    """Print a table of sample completions (prompt, completion, score and any column a reward function
    logged) and save it as JSON lines."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"samples at update {update}", show_lines=True)
    columns = list(dict.fromkeys(name for row in rows for name in row))
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(
            *(f"{row[name]:.4f}" if name == "score" else str(row.get(name, "")) for name in columns)
        )
    Console().print(table)
    path = sample_table_file(output_dir, update)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
