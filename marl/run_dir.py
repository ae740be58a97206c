"""A run's output folder: the names of its files, its checkpoints, its metrics file, and the check that a new
run never mixes with, or silently replaces, an earlier one.

Layout of ``output_dir``::

    rloo_config.json            the run's settings and the model it trained
    metrics.jsonl               one JSON record per logged update
    samples/update_NNNNNN.jsonl sample tables
    checkpoint-N/               adapter, optimizer, scheduler, trainer state, RNG state per process
    adapter_config.json, adapter_model.safetensors   the final policy adapter

Example:
    >>> checkpoint_name(12)
    'checkpoint-12'
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.adapters import ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from marl.errors import CheckpointError, MissingPathError, RunFolderError

CONFIG_FILE = "rloo_config.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_DIR = "samples"
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
# What a run leaves in its output folder; finding any of these means the folder holds a run.
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SAMPLES_DIR, ADAPTER_CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME)
_CHECKPOINT = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def checkpoint_name(update: int) -> str:
    return f"{CHECKPOINT_PREFIX}{update}"


def rng_state_file(process_index: int) -> str:
    return f"rng_state_{process_index}.pt"


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
    half-written checkpoints.

    Example:
        >>> previous_run_files("/nonexistent")
        []
    """
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = [directory / name for name in RUN_FILES if (directory / name).exists()]
    found.extend(sorted(directory.glob(f"{CHECKPOINT_PREFIX}*")))
    found.extend(sorted(directory.glob(f".{CHECKPOINT_PREFIX}*.tmp")))
    return found


def check_output_dir(output_dir: str | Path, *, overwrite: bool, resuming: bool) -> list[Path]:
    """Refuse to write over a previous run unless ``overwrite`` or ``resuming``; return the files a fresh run
    would replace (none when resuming).

    Example:
        >>> check_output_dir("/nonexistent/run", overwrite=False, resuming=False)
        []
    """
    directory = Path(output_dir)
    if directory.exists() and not directory.is_dir():
        raise RunFolderError(f"--output_dir {directory} is a file: pass a folder")
    previous = previous_run_files(directory)
    if previous and not (overwrite or resuming):
        names = ", ".join(path.name for path in previous[:5])
        raise RunFolderError(
            f"--output_dir {directory} already holds a run ({names}). Pass another --output_dir, "
            "--overwrite_output_dir to replace that run, or --resume_from_checkpoint to continue it"
        )
    return [] if resuming else previous


def remove_files(files: Sequence[Path]) -> None:
    """Delete files and checkpoint folders; nothing else in their folder is touched."""
    for path in files:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


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


def truncate_metrics(output_dir: Path, last_update: int) -> list[dict[str, Any]]:
    """Drop the records written after ``last_update`` (a resumed run writes those updates again); returns the
    records kept."""
    metrics_file = output_dir / METRICS_FILE
    if not metrics_file.exists():
        return []
    kept = [
        line for line in metrics_file.read_text().splitlines() if json.loads(line)["update"] <= last_update
    ]
    metrics_file.write_text("".join(line + "\n" for line in kept))
    return [json.loads(line) for line in kept]


def write_run_config(output_dir: Path, settings: dict[str, Any]) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / CONFIG_FILE).write_text(json.dumps(settings, indent=2, default=str) + "\n")


def write_sample_table(output_dir: Path, update: int, rows: list[dict[str, Any]]) -> None:
    """Print a table of sample completions (prompt, completion, score) and save it as JSON lines."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"samples at update {update}", show_lines=True)
    for column in ("prompt", "completion", "score"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["prompt"], row["completion"], f"{row['score']:.4f}")
    Console().print(table)
    path = sample_table_file(output_dir, update)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ---------------------------------------------------------------------- checkpoints


def rng_state() -> dict[str, Any]:
    """Every random generator a run draws from: Python, NumPy, torch (and CUDA)."""
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def staging_folder(output_dir: Path, update: int) -> Path:
    """Where checkpoint ``update`` is written before :func:`publish_checkpoint` renames it."""
    return output_dir / f".{checkpoint_name(update)}.tmp"


def publish_checkpoint(output_dir: Path, update: int, save_total_limit: int | None) -> Path:
    """Rename a complete staging folder to ``checkpoint-N`` (so a checkpoint folder is always complete), then
    prune the oldest checkpoints beyond ``save_total_limit``."""
    final = output_dir / checkpoint_name(update)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging_folder(output_dir, update), final)
    if save_total_limit is not None:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old)
    return final


def resolve_checkpoint(output_dir: Path, checkpoint: str | os.PathLike | bool) -> Path:
    """A checkpoint folder: ``True`` means the latest in ``output_dir``."""
    if checkpoint is True:
        found = list_checkpoints(output_dir)
        if not found:
            raise MissingPathError(
                f"resume_from_checkpoint=True but {output_dir} has no {CHECKPOINT_PREFIX}N folder; pass a "
                "checkpoint path, or start without resume_from_checkpoint"
            )
        return found[-1]
    path = Path(checkpoint)
    if not (path / TRAINER_STATE_FILE).is_file():
        raise MissingPathError(f"{path} is not a checkpoint of this trainer (no {TRAINER_STATE_FILE})")
    return path


def write_checkpoint(
    folder: Path, *, model: Any, policy: str, optimizer: Any, scheduler: Any, trainer_state: dict[str, Any]
) -> None:
    """The shared files of a checkpoint (written by the main process): the policy adapter, the optimizer and
    scheduler states and the trainer state. Each process adds its RNG state with :func:`write_rng_state`."""
    import torch

    remove_files([folder])
    folder.mkdir(parents=True)
    model.save_policy_adapter(folder, policy)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
    torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)
    (folder / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")


def write_rng_state(folder: Path, process_index: int) -> None:
    import torch

    torch.save(rng_state(), folder / rng_state_file(process_index))


@dataclass
class Checkpoint:
    """What a checkpoint folder holds, read back."""

    path: Path
    trainer_state: dict[str, Any]
    adapter: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]


def read_checkpoint(path: Path, process_index: int, device: Any) -> Checkpoint:
    """Read every file of a checkpoint; a missing or damaged file is named in the error."""
    import torch
    from safetensors.torch import load_file

    def read(name: str, load: Any) -> Any:
        file = path / name
        if not file.is_file():
            raise MissingPathError(
                f"checkpoint {path} is incomplete: {name} is missing; resume from another one"
            )
        try:
            return load(file)
        except Exception as error:
            raise CheckpointError(
                f"cannot read {file} ({type(error).__name__}: {error}); the checkpoint is damaged: resume "
                "from "
                "another one"
            ) from error

    return Checkpoint(
        path=path,
        trainer_state=read(TRAINER_STATE_FILE, lambda file: json.loads(file.read_text())),
        adapter=read(SAFETENSORS_WEIGHTS_NAME, lambda file: load_file(str(file), device=str(device))),
        optimizer=read(OPTIMIZER_FILE, lambda file: torch.load(file, map_location=device)),
        scheduler=read(SCHEDULER_FILE, lambda file: torch.load(file, weights_only=False)),
        rng=read(rng_state_file(process_index), lambda file: torch.load(file, weights_only=False)),
    )
