"""Checkpoints of a run: what a ``checkpoint-N`` folder holds, how it is written so that it is always
complete, and how it is read back and checked against the run that resumes from it.

A checkpoint holds the policy adapter (a standard PEFT folder, whole, written by the main process also when
the policy is sharded), the optimizer state (``optimizer.pt``; under FSDP2 one file per process with that
process's shards, ``optimizer_<process>.pt``), the scheduler state, the fp16 loss scaler's state (only in
fp16 runs), the trainer state and one RNG state per process. It is written into a staging folder
and renamed to ``checkpoint-N`` once complete, so a kill at any moment leaves either no ``checkpoint-N`` or a
complete one. Every file that cannot be read is named in the error.

Example:
    >>> rng_state_file(1)
    'rng_state_1.pt'
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.errors import CheckpointError, MissingPathError, PhaseMemoryError
from marl.model.adapters import SAFETENSORS_WEIGHTS_NAME
from marl.train import parallel
from marl.train.run_dir import (
    CONFIG_FILE,
    TRAINER_STATE_FILE,
    checkpoint_name,
    list_checkpoints,
    remove_files,
)

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.train.parallel import Parallelism

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
# The fp16 loss scaler (torch.amp.GradScaler): its scale and growth tracker decide which steps overflow and
# are skipped, so a resumed fp16 run restores them to skip the steps an uninterrupted run skips.
SCALER_FILE = "scaler.pt"
# The fields of trainer_state.json that resuming reads.
TRAINER_STATE_FIELDS = ("update", "skipped_optimizer_steps", "world_size", "batch_size", "num_total_batches")


@dataclass
class SaveSchedule:
    """When a run checkpoints: after every ``steps``-th update (0: never by updates) and after the first
    update that ends ``minutes`` or more after the last checkpoint (0: never by time), counted from
    :meth:`start`. ``clock`` gives seconds (``time.monotonic``; a test passes its own).

    Under several processes the main process's clock decides and every process follows it (one collective
    per update), so that every process takes part in the same checkpoints.

    Example:
        >>> now = iter([0.0, 300.0, 700.0, 800.0]).__next__
        >>> schedule = SaveSchedule(steps=0, minutes=10, clock=now)
        >>> schedule.start()
        >>> [schedule.due(update, lambda late: late) for update in (1, 2, 3)]
        [False, True, False]
    """

    steps: int
    minutes: float
    clock: Callable[[], float] = time.monotonic
    last: float = field(default=0.0, init=False)

    def start(self) -> None:
        self.last = self.clock()

    def due(self, update: int, main_process_says: Callable[[bool], bool]) -> bool:
        """Whether to checkpoint after ``update``; ``main_process_says(flag)`` is the main process's
        ``flag`` on every process (e.g. ``lambda f: parallelism.any_process(is_main and f)``)."""
        by_steps = self.steps > 0 and update % self.steps == 0
        if self.minutes <= 0:
            return by_steps
        now = self.clock()
        by_time = main_process_says(now - self.last >= self.minutes * 60)
        if by_steps or by_time:
            self.last = now
        return by_steps or by_time


def rng_state_file(process_index: int) -> str:
    return f"rng_state_{process_index}.pt"


def optimizer_file(process_index: int) -> str:
    """The optimizer file of one process when the optimizer's state is sharded (FSDP2)."""
    return f"optimizer_{process_index}.pt"


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


@dataclass
class UpdateStart:
    """What a run held at an update's start, so that an error stopping that update can still checkpoint the
    update before, as a checkpoint due then would have: the random state, and each policy's schedule, rate
    and skipped-step count. ``snapshots`` (the policies' copies when the update took them) and ``stepped`` (an
    optimizer step of this update began) say whether the policies' weights can be put back.

    Example:
        >>> start = UpdateStart.of(trainers)  # doctest: +SKIP
        >>> start.put_back(trainers)  # after an error: False when the weights are lost  # doctest: +SKIP
        True
    """

    rng: dict[str, Any]
    schedules: list[dict[str, Any]]
    rates: list[float]
    skipped: list[int]
    snapshots: list[Any] = field(default_factory=list)
    stepped: bool = False

    @classmethod
    def of(cls, trainers: Any) -> UpdateStart:
        updates = [trainer.parts.policy_update for trainer in trainers]
        return cls(
            rng=rng_state(),
            schedules=[copy.deepcopy(update.scheduler.state_dict()) for update in updates],
            rates=[update.last_learning_rate for update in updates],
            skipped=[trainer.state.skipped_optimizer_steps for trainer in trainers],
        )

    def put_back(self, trainers: Any) -> bool:
        """Every policy and the random state as at the start; ``False`` (nothing changed) when an optimizer
        step began and no copy of the weights was kept."""
        if self.stepped and not self.snapshots:
            return False
        for snapshot in self.snapshots if self.stepped else []:
            snapshot.restore()
        for trainer, schedule, rate, skipped in zip(
            trainers, self.schedules, self.rates, self.skipped, strict=True
        ):
            trainer.parts.policy_update.scheduler.load_state_dict(copy.deepcopy(schedule))
            trainer.parts.policy_update.last_learning_rate = rate
            trainer.state.skipped_optimizer_steps = skipped
        set_rng_state(self.rng)
        return True


def stop_with_checkpoints(trainers: Any, start: UpdateStart, resumed: int, error: BaseException) -> None:
    """An error stopped the update in progress: put every policy back as it was at the update's start and
    save its last completed update, then say where in ``error`` (``error.checkpoint`` of an out-of-memory
    error, else a note its one line ends with). Not under several processes (the others would wait in the
    checkpoint's collectives) nor when the update changed the weights and kept no copy of them."""
    first = trainers[0]
    if first.state.update == resumed:  # nothing done since the start: what is saved is what there is
        said = first.checkpoint_before_stopping(resumed)
    elif first.parts.parallelism.num_processes > 1:
        said = "Nothing newer than the last checkpoint was saved: the other processes could not join in."
    elif not start.put_back(trainers):
        said = (
            f"Update {first.state.update + 1} was stopped after it had changed the policy, so update "
            f"{first.state.update} could not be saved; resume from the last checkpoint."
        )
    else:  # every member of a sweep at the same update
        saved = [trainer.checkpoint_before_stopping(resumed) for trainer in trainers]
        said = saved[0]  # the members are saved at the same update: the first one's sentence speaks for all
    if isinstance(error, PhaseMemoryError):
        folder = first.output_dir / checkpoint_name(first.state.update)
        error.checkpoint = str(folder) if folder.exists() else None
    elif not isinstance(error, KeyboardInterrupt):  # Ctrl-C's line lists the checkpoints itself
        error.add_note(said)


def staging_folder(output_dir: Path, update: int) -> Path:
    """Where checkpoint ``update`` is written before :func:`publish_checkpoint` renames it."""
    return output_dir / f".{checkpoint_name(update)}.tmp"


def publish_checkpoint(output_dir: Path, update: int, save_total_limit: int | None) -> Path:
    """Rename a complete staging folder to ``checkpoint-N`` (so a checkpoint folder is always complete), then
    prune the oldest checkpoints beyond ``save_total_limit``."""
    final = output_dir / checkpoint_name(update)
    if final.exists():  # written before by a run that resumed from an earlier checkpoint
        _delete_checkpoint(final)
    os.replace(staging_folder(output_dir, update), final)
    if save_total_limit is not None:
        for old in list_checkpoints(output_dir)[:-save_total_limit]:
            _delete_checkpoint(old)
    return final


def _delete_checkpoint(folder: Path) -> None:
    # Renamed out of the way first: a kill during the deletion leaves a hidden folder, never a checkpoint-N
    # with files missing that --resume_from_checkpoint latest would pick.
    doomed = folder.with_name(f".{folder.name}.deleting")
    remove_files([doomed])
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def save_checkpoint(
    output_dir: Path,
    update: int,
    *,
    parallelism: Parallelism,
    model: MultiAdapterModel,
    policy: str,
    optimizer: Any,
    scheduler: Any,
    trainer_state: dict[str, Any],
    save_total_limit: int | None,
) -> None:
    """Write ``output_dir/checkpoint-N`` (N = ``update``) atomically: a staging folder renamed once complete.
    Every process calls it: the main process writes the shared files, each process its RNG state (and its
    optimizer shards when the policy is FSDP2's)."""
    import torch

    staging = staging_folder(output_dir, update)
    adapter_state = parallel.full_policy_state(model, policy)  # gathers the shards: every process
    per_process = parallel.is_distributed(model.policy_parameters(policy))
    if parallelism.is_main_process:
        write_checkpoint(
            staging,
            model=model,
            policy=policy,
            optimizer=None if per_process else optimizer,
            scheduler=scheduler,
            scaler=parallelism.accelerator.scaler,
            trainer_state=trainer_state,
            adapter_state=adapter_state,
        )
    parallelism.wait()
    write_rng_state(staging, parallelism.process_index)
    if per_process:
        local = parallel.local_optimizer_state(optimizer.state_dict())
        torch.save(local, staging / optimizer_file(parallelism.process_index))
    parallelism.wait()
    if parallelism.is_main_process:
        publish_checkpoint(output_dir, update, save_total_limit)
    parallelism.wait()


def load_checkpoint(
    path: Path,
    *,
    parallelism: Parallelism,
    model: MultiAdapterModel,
    policy: str,
    optimizer: Any,
    scheduler: Any,
    planned: tuple[int, int],
) -> dict[str, Any]:
    """Restore the policy adapter, optimizer, schedule, loss scaler and RNG of the checkpoint at ``path``
    after :func:`check_resumable` (``planned`` as there); returns its trainer state."""
    from peft.utils import get_peft_model_state_dict

    saved = read_checkpoint(path, parallelism.process_index, parallelism.device)
    policy_state = get_peft_model_state_dict(model.peft_model, adapter_name=policy)
    check_resumable(
        saved,
        world_size=parallelism.num_processes,
        planned=planned,
        adapter_shapes={key: tuple(tensor.shape) for key, tensor in policy_state.items()},
    )
    parallel.load_policy_state(model, policy, saved.adapter)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    if parallel.is_distributed(parameters):
        check_optimizer_shards(saved, parameters)
        optimizer.load_state_dict(parallel.distributed_optimizer_state(saved.optimizer, parameters))
    else:
        optimizer.load_state_dict(saved.optimizer)
    scheduler.load_state_dict(saved.scheduler)
    restore_loss_scaler(saved, parallelism.accelerator.scaler)
    set_rng_state(saved.rng)
    return saved.trainer_state


def write_checkpoint(
    folder: Path,
    *,
    model: Any,
    policy: str,
    optimizer: Any,
    scheduler: Any,
    trainer_state: dict[str, Any],
    scaler: Any = None,
    adapter_state: dict[str, Any] | None = None,
) -> None:
    """The shared files of a checkpoint (written by the main process): the policy adapter (``adapter_state``:
    its tensors already gathered from the shards), the optimizer state (``None``: each process writes its own
    shards), the scheduler state, the loss scaler's state when there is one (``accelerator.scaler``: fp16
    only) and the trainer state. Each process adds its RNG state with :func:`write_rng_state`."""
    import torch

    from marl.model.adapters import save_adapter

    remove_files([folder])
    folder.mkdir(parents=True)
    save_adapter(model.peft_model, policy, folder, model.name_or_path, state=adapter_state)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
    torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)
    if scaler is not None:
        torch.save(scaler.state_dict(), folder / SCALER_FILE)
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
    scaler: dict[str, Any] | None  # None: the checkpoint holds no scaler state (written without one)


def read_checkpoint(path: Path, process_index: int, device: Any) -> Checkpoint:
    """Read every file of a checkpoint; a missing or damaged file is named in the error. The adapter is read
    onto ``device``; the optimizer state onto the CPU, for ``optimizer.load_state_dict`` to place."""
    import torch
    from safetensors.torch import load_file

    # safetensors refuses "cpu:0", the CPU device of each process of a multi-process CPU run
    place = "cpu" if torch.device(device).type == "cpu" else str(device)

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
        trainer_state=read(TRAINER_STATE_FILE, _read_trainer_state),
        adapter=read(SAFETENSORS_WEIGHTS_NAME, lambda file: load_file(str(file), device=place)),
        # Not mapped to the device: torch's load_state_dict moves the moments to their parameter's device
        # and keeps AdamW's `step` counters where a stepped optimizer holds them, on the CPU (unless fused or
        # capturable); a `step` on the GPU would cost a device sync at every optimizer step.
        optimizer=read(
            OPTIMIZER_FILE if (path / OPTIMIZER_FILE).is_file() else optimizer_file(process_index),
            lambda file: torch.load(file, map_location="cpu"),
        ),
        scheduler=read(SCHEDULER_FILE, lambda file: torch.load(file, weights_only=False)),
        rng=read(rng_state_file(process_index), lambda file: torch.load(file, weights_only=False)),
        scaler=read(SCALER_FILE, torch.load) if (path / SCALER_FILE).is_file() else None,
    )


def restore_loss_scaler(saved: Checkpoint, scaler: Any) -> None:
    """Give ``scaler`` (``accelerator.scaler``; ``None`` outside fp16) the loss-scaler state of ``saved``.

    A checkpoint without one (written without a loss scaler, e.g. by a bf16/fp32 run) resumes with a warning:
    the scale restarts at its initial value, so the first steps may overflow and be skipped until it has
    come down again. A checkpoint's scaler state is unused by a run without a scaler.
    """
    if scaler is None:
        return
    if saved.scaler is None:
        warnings.warn(
            f"{saved.path} holds no loss-scaler state ({SCALER_FILE}): it was written before marl saved it, "
            f"or by a run without fp16. The fp16 loss scale restarts at {scaler.get_scale():g}; steps whose "
            "gradients overflow are skipped until it has come down",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    scaler.load_state_dict(saved.scaler)


def check_optimizer_shards(saved: Checkpoint, parameters: list[Any]) -> None:
    """Refuse optimizer shards that do not fit this process's shards of the policy (a checkpoint written by
    another parallelism with the same number of processes)."""
    for index, slots in saved.optimizer["state"].items():
        local_shape = tuple(parameters[int(index)].to_local().shape)
        moments = [tuple(v.shape) for v in slots.values() if hasattr(v, "shape") and v.dim() > 0]
        if any(shape != local_shape for shape in moments):
            raise CheckpointError(
                f"the optimizer state in {saved.path} was sharded another way (shards {moments[0]}, this "
                f"run's {local_shape}); resume with the --parallelism of the original run"
            )


def _read_trainer_state(file: Path) -> dict[str, Any]:
    state = json.loads(file.read_text())
    missing = [name for name in TRAINER_STATE_FIELDS if not isinstance(state.get(name), int)]
    if missing:
        raise ValueError(f"no integer {', '.join(missing)}")
    return state


def _relaunch(checkpoint: Path, processes: int) -> str:
    """How to start ``processes`` processes, with the launcher the run's ``rloo_config.json`` records."""
    try:
        launcher = json.loads((checkpoint.parent / CONFIG_FILE).read_text()).get("launcher")
    except (OSError, ValueError, AttributeError):
        launcher = None
    if launcher == "accelerate launch":
        return f"accelerate launch --num_processes {processes} ... (the launcher the run used)"
    return f"torchrun --nproc_per_node {processes} -m marl train-rloo ..." + (
        " (the launcher the run used)" if launcher == "torchrun" else ""
    )


def check_resumable(
    saved: Checkpoint,
    *,
    world_size: int,
    planned: tuple[int, int],
    adapter_shapes: dict[str, tuple[int, ...]],
) -> None:
    """Refuse a checkpoint written by another number of processes, another batch plan, or another policy LoRA
    (``planned``: this run's completions per update and its number of updates)."""
    path, state = saved.path, saved.trainer_state
    if state["world_size"] != world_size:
        raise CheckpointError(
            f"{path} was written by {state['world_size']} processes but this run has {world_size}; each "
            "process samples from its own random stream, so on another number of processes the rest of the "
            "run would not be the one this checkpoint continues. Resume with the same number of processes: "
            f"{_relaunch(path, state['world_size'])}"
        )
    if (state["batch_size"], state["num_total_batches"]) != planned:
        raise CheckpointError(
            f"{path} belongs to a run of {state['num_total_batches']} updates of {state['batch_size']} "
            f"completions, this config plans {planned[1]} updates of {planned[0]}; resume with the batch "
            "settings, total_episodes and dataset of the original run"
        )
    saved_shapes = {key: tuple(tensor.shape) for key, tensor in saved.adapter.items()}
    if saved_shapes != adapter_shapes:
        different = sorted(set(saved_shapes) ^ set(adapter_shapes)) or [
            key for key in adapter_shapes if saved_shapes[key] != adapter_shapes[key]
        ]
        raise CheckpointError(
            f"the policy adapter in {path} does not fit this run's policy LoRA (e.g. "
            f"{different[:3]}); resume "
            "with the LoRA settings (--lora_r, --lora_target_modules, --policy_adapter) of the original run"
        )
