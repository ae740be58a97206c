"""How training runs over processes: the :class:`Parallelism` a run uses owns the ``accelerate.Accelerator``
and every collective, so that the trainer never calls one itself.

A parallelism is chosen by name (``RLOOConfig.parallelism``, flag ``--parallelism``) from
:data:`PARALLELISMS`; :func:`register_parallelism` adds one. Its factory is called as ``factory(model,
config)`` with the :class:`marl.MultiAdapterModel` and the :class:`marl.RLOOConfig` of the run.

``"replicated"`` (:class:`ReplicatedParallelism`): every process holds the whole base and its own copy of the
policy adapter; each process samples and scores its own prompts, and the policy gradients are averaged before
each optimizer step. Each collective runs on ONE flat buffer: one collective per step instead of one per LoRA
tensor (about 450 for an all-linear LoRA on a 32-layer model). With one process every collective returns at
once.

Example:
    >>> sorted(PARALLELISMS)
    ['replicated']
    >>> get_parallelism("replicated") is ReplicatedParallelism
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import broadcast

from marl.errors import ConfigError
from marl.registry import Registry

if TYPE_CHECKING:
    from marl.config import RLOOConfig
    from marl.model.multi_adapter import MultiAdapterModel

Record = TypeVar("Record")


class Parallelism(Protocol):
    """What the trainer needs from the processes it runs on. ``accelerator`` is the run's
    ``accelerate.Accelerator``, for what does not depend on how the model is spread over processes: the
    trackers and the fp16 loss scaler."""

    accelerator: Accelerator

    @property
    def process_index(self) -> int:
        """This process's index, 0 to ``num_processes - 1``."""

    @property
    def num_processes(self) -> int:
        """How many processes train together."""

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes the run's files."""

    @property
    def is_local_main_process(self) -> bool:
        """Whether this process is the first on its machine (it shows the progress bar)."""

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context of the forward passes."""

    def prepare(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[Any, Any]:
        """The optimizer and LR scheduler as the training steps use them."""

    def broadcast_initial(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Start every process from the same trainable ``parameters`` (a fresh LoRA is random)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss`` into the trainable parameters."""

    def average_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Make every process's gradients of ``parameters`` the mean over processes (before a step)."""

    def clip_gradients(self, parameters: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``parameters`` to the global norm ``max_norm``; returns the norm before."""

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is true on at least one process."""

    def sum_over_processes(self, record: Record) -> Record:
        """``record`` (a dataclass of numbers and 1-D tensors) with every value summed over processes."""

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The concatenation of every process's ``tensor`` along dimension 0, on every process."""

    def wait(self) -> None:
        """Return once every process has got here."""

    def finish(self) -> None:
        """End the run: close the trackers and release the process group."""


ParallelismFactory = Callable[["MultiAdapterModel", "RLOOConfig"], Parallelism]


class ReplicatedParallelism:
    """Every process holds the whole base and its own copy of the policy adapter (today's data parallelism):
    accelerate without a wrapped model, gradients averaged in one collective per optimizer step.

    Args:
        model: the run's model; a model on the CPU trains on the CPU.
        config: the run's config (mixed precision, trackers, output folder).
    """

    def __init__(self, model: MultiAdapterModel, config: RLOOConfig) -> None:
        # accelerate keeps one process-wide state whose mixed precision cannot change once set: a trainer that
        # ran before in this process (TRL's RewardTrainer in bf16, another RLOO run) would make this one fail.
        # Like transformers' own trainers, start a fresh state; the process group (PartialState) is kept.
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(
            # a model on the CPU trains on the CPU (also under torchrun, where accelerate would otherwise
            # ignore the launcher on machines without a GPU)
            cpu=model.device.type == "cpu",
            mixed_precision=config.mixed_precision,
            log_with=config.trackers or None,
            project_dir=config.output_dir,
            step_scheduler_with_optimizer=False,
        )
        check_devices(model.device, self.accelerator)

    @property
    def process_index(self) -> int:
        return self.accelerator.process_index

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.accelerator.is_local_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.accelerator.autocast()

    def prepare(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[Any, Any]:
        return self.accelerator.prepare(optimizer, scheduler)

    def broadcast_initial(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        broadcast_from_main(parameters, self.accelerator)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def average_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        average_gradients(parameters, self.accelerator)

    def clip_gradients(self, parameters: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(parameters, max_norm)

    def any_process(self, flag: bool) -> bool:
        return any_process(flag, self.accelerator)

    def sum_over_processes(self, record: Record) -> Record:
        return sum_over_processes(record, self.accelerator)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor)

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def finish(self) -> None:
        self.accelerator.end_training()


PARALLELISMS: Registry[ParallelismFactory] = Registry(
    "parallelism",
    "--parallelism",
    "marl.train.parallel.register_parallelism",
    {"replicated": ReplicatedParallelism},
)


def register_parallelism(name: str, factory: ParallelismFactory) -> None:
    """Make ``factory`` the parallelism named ``name`` (``--parallelism name``); a name is registered once.

    Example:
        >>> register_parallelism("my-replicated", ReplicatedParallelism)
        >>> get_parallelism("my-replicated") is ReplicatedParallelism
        True
        >>> del PARALLELISMS["my-replicated"]
    """
    PARALLELISMS.register(name, factory)


def get_parallelism(name: str) -> ParallelismFactory:
    """The factory of the parallelism named ``name``.

    Example:
        >>> get_parallelism("sharded")
        Traceback (most recent call last):
        marl.errors.ConfigError: --parallelism 'sharded' is not a registered parallelism; ...
    """
    return PARALLELISMS.lookup(name)


# ---------------------------------------------------------------------- the replicated collectives


def check_devices(model_device: torch.device, accelerator: Accelerator) -> None:
    """Refuse a model on another device than this process's, and an accelerate state made for fewer
    processes than were launched."""
    process_device = accelerator.device
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    if not same_device(model_device, process_device, current_cuda_index=current):
        raise ConfigError(
            f"the model is on {model_device} but this process trains on {process_device}. Load it there: "
            "MultiAdapterModel.from_pretrained(..., device_map={'': Accelerator().device}) (with accelerate "
            "launch every process needs its own copy on its own device)"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"launched as {launched} processes but accelerate runs {accelerator.num_processes}: an "
            "accelerate state was created earlier for another device. On CPU, launch with `torchrun "
            "--nproc_per_node N ...` and create PartialState(cpu=True) before loading the model"
        )


def same_device(first: torch.device, second: torch.device, current_cuda_index: int) -> bool:
    """Whether two devices are the same; a CUDA device without an index is the current one (accelerate names
    the only GPU of a single process ``cuda``, a model loaded there reports ``cuda:0``).

    Example:
        >>> same_device(torch.device("cuda", 0), torch.device("cuda"), current_cuda_index=0)
        True
        >>> same_device(torch.device("cuda", 1), torch.device("cuda"), current_cuda_index=0)
        False
        >>> same_device(torch.device("cpu"), torch.device("cuda", 0), current_cuda_index=0)
        False
    """
    if first.type != second.type:
        return False
    if first.type != "cuda":
        return True
    return (first.index if first.index is not None else current_cuda_index) == (
        second.index if second.index is not None else current_cuda_index
    )


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def broadcast_from_main(parameters: Sequence[torch.nn.Parameter], accelerator: Any) -> None:
    """Overwrite every process's ``parameters`` with the main process's, in one collective."""
    if accelerator.num_processes == 1:
        return
    with torch.no_grad():
        _unflatten_into(broadcast(_flatten(parameters), from_process=0), parameters)


def average_gradients(parameters: Sequence[torch.nn.Parameter], accelerator: Any) -> None:
    """Replace every parameter's gradient by its mean over processes (a missing gradient counts as zero), in
    one collective."""
    if accelerator.num_processes == 1:
        return
    gradients = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = accelerator.reduce(_flatten(gradients), reduction="mean")
    for parameter, gradient in zip(parameters, gradients, strict=True):
        parameter.grad = gradient
    with torch.no_grad():
        _unflatten_into(flat, gradients)


def any_process(flag: bool, accelerator: Any) -> bool:
    """Whether ``flag`` is true on at least one process."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum").item() > 0)


def sum_over_processes(record: Record, accelerator: Any) -> Record:
    """``record`` with every number (and every 1-D tensor, elementwise) summed over processes, in ONE
    collective; numbers come back as Python floats, tensors as float64 CPU tensors.

    Example:
        >>> from types import SimpleNamespace
        >>> from marl.algo.metrics import UpdateStats
        >>> one_process = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
        >>> sum_over_processes(UpdateStats(ratio=torch.tensor(2.0), completions=2), one_process).ratio
        2.0
    """
    fields = [item for item in dataclasses.fields(record) if item.init and not item.name.startswith("_")]
    pieces = [
        torch.as_tensor(getattr(record, item.name), dtype=torch.float64).to(accelerator.device).reshape(-1)
        for item in fields
    ]
    values = torch.cat(pieces)
    if accelerator.num_processes > 1:
        values = accelerator.reduce(values, reduction="sum")
    values = values.cpu()
    summed, offset = {}, 0
    for item, piece in zip(fields, pieces, strict=True):
        part = values[offset : offset + piece.numel()]
        offset += piece.numel()
        value = getattr(record, item.name)
        summed[item.name] = (
            part if isinstance(value, torch.Tensor) and value.dim() > 0 else float(part.item())
        )
    return type(record)(**summed)
