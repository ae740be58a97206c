"""How training runs over processes: the :class:`Parallelism` a run uses owns the ``accelerate.Accelerator``,
puts the base under torch's FSDP2 and does every collective, so that the trainer never calls one itself.

A parallelism is chosen by name (``RLOOConfig.parallelism``, flag ``--parallelism``) from
:data:`PARALLELISMS`; :func:`register_parallelism` adds one. Its factory is called as ``factory(model,
config)`` with the :class:`marl.MultiAdapterModel` and the :class:`marl.RLOOConfig` of the run, and prepares
the model in place: afterwards every process holds process 0's policy, and ``model.policy_parameters()``
are the tensors the optimizer trains.

``"replicated"`` (:class:`ReplicatedParallelism`): every process holds the whole base and samples and scores
its own prompts; only the policy LoRAs are FSDP2's, on a ``(N, 1)`` mesh (HSDP with shards of one process), so
their gradients are all-reduced in the backward pass by FSDP2 and the base stays as it was loaded (quantized
bases included).

``"fsdp2"`` (:class:`ShardedParallelism`): the base's decoder layers, its embeddings, its LM head and every
adapter are sharded over the processes (a ``(1, N)`` mesh); each process holds about ``1/N`` of the base, and
each layer is gathered for its forward and freed after it. One ``(replicate, shard)`` mesh covers both modes
(:func:`data_parallel_mesh`).

Why ``fully_shard`` in place, not a wrapper: marl never calls one wrapper's ``forward``: log-probs run the
causal LM's backbone and then its LM head chunk by chunk, rewards run the backbone under another adapter,
sampling runs the whole causal LM. A wrapper whose gradient hooks need its own forward
(``DistributedDataParallel``, or accelerate's ``prepare(model)``, which makes the model it is given the FSDP
root) would see none of these calls. ``fully_shard`` changes modules in place and hooks their own
``forward``: :func:`apply_fully_shard` shards every decoder layer, makes the backbone one root (embeddings,
final norm and the layers below it) and the LM head another, so every path marl takes runs through FSDP's
hooks (generation too, one layer at a time), and the policy LoRA's gradients are reduced in the backward pass.

The policy's tensors become ``DTensor`` parameters; :func:`full_policy_state` (every process takes part: it
gathers), :func:`load_policy_state`, :func:`local_optimizer_state` and :func:`distributed_optimizer_state`
turn them into what a PEFT folder, an optimizer file and a resume need.

With one process (no process group) nothing is wrapped: there is nothing to average or shard over. The only
collectives marl issues itself are the metric reductions, through accelerate's ``reduce`` and ``gather``.

Example:
    >>> sorted(PARALLELISMS)
    ['fsdp2', 'replicated']
    >>> get_parallelism("replicated") is ReplicatedParallelism
    True
    >>> is_distributed([torch.nn.Parameter(torch.zeros(2))])
    False
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from marl.algo.metrics import REDUCTION
from marl.errors import ConfigError
from marl.model.adapters import save_adapter
from marl.model.families import backbone
from marl.model.sampling import any_process
from marl.registry import Registry
from marl.train.launch import check_sharded_launch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from marl.config.rloo_config import RLOOConfig
    from marl.model.multi_adapter import MultiAdapterModel

Record = TypeVar("Record")


class Parallelism(Protocol):
    """What the trainer needs from the processes it runs on. ``accelerator`` is the run's
    ``accelerate.Accelerator``, for what does not depend on how the model is spread over processes: the
    trackers and the fp16 loss scaler. Gradients are averaged over processes inside :meth:`backward` (every
    process calls it for every micro-batch, finite loss or not, so that the collectives pair up)."""

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

    @property
    def shards_base(self) -> bool:
        """Whether each process holds only part of the base: every forward pass is then a collective, so
        every process runs the same forward passes (sample tables included)."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The mixed-precision context of the forward passes."""

    def prepare(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[Any, Any]:
        """The optimizer and LR scheduler as the training steps use them."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss``, averaged over processes, into the trainable parameters."""

    def clip_gradients(self, parameters: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``parameters`` to the global norm ``max_norm``; returns the norm before."""

    def save_policy_adapter(self, model: MultiAdapterModel, directory: Path, policy: str) -> None:
        """Write ``policy`` as a standard PEFT folder from the main process; every process calls it."""

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
    """Every process holds the whole base and its own copy of the policy adapter (data parallelism): the
    policy LoRAs are FSDP2's on a ``(N, 1)`` mesh, so FSDP2 starts them from process 0's values and
    all-reduces their gradients in the backward pass; the frozen base is left as loaded.

    Args:
        model: the run's model; a model on the CPU trains on the CPU.
        config: the run's config (mixed precision, trackers, output folder).
    """

    shard = False

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
        self.check_model(model)
        self.mesh = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.mesh = data_parallel_mesh(self.device.type, self.num_processes, shard=self.shard)
            apply_fully_shard(model, self.mesh, shard_frozen=self.shard)

    def check_model(self, model: MultiAdapterModel) -> None:
        """Refuse a model this parallelism cannot spread over processes (every model replicates)."""

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

    @property
    def shards_base(self) -> bool:
        return self.shard and self.mesh is not None

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.accelerator.autocast()

    def prepare(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[Any, Any]:
        return self.accelerator.prepare(optimizer, scheduler)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_gradients(self, parameters: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        norm = self.accelerator.clip_grad_norm_(parameters, max_norm)
        return full(norm) if isinstance(norm, torch.Tensor) else norm

    def save_policy_adapter(self, model: MultiAdapterModel, directory: Path, policy: str) -> None:
        state = full_policy_state(model, policy)  # a collective under FSDP2: every process
        if self.is_main_process:
            save_adapter(model.peft_model, policy, Path(directory), model.name_or_path, state=state)

    def any_process(self, flag: bool) -> bool:
        return any_process(flag, self.accelerator.device)

    def sum_over_processes(self, record: Record) -> Record:
        return sum_over_processes(record, self.accelerator)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor)

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def finish(self) -> None:
        self.accelerator.end_training()


class ShardedParallelism(ReplicatedParallelism):
    """The base sharded over the processes with FSDP2 (``--parallelism fsdp2``): decoder layers, embeddings,
    LM head and every adapter's tensors on a ``(1, N)`` mesh. Each process holds about ``1/N`` of the base;
    a layer's weights are gathered for its forward (rollout, sampling, scoring, update) and freed after it,
    so the peak adds one whole layer. Adapter views switch as without sharding: PEFT's flags live on the
    modules, which FSDP2 changes in place.

    A 4-bit bitsandbytes base is sharded too (FSDP-QLoRA): marl packs its 4-bit weights in a tensor of the
    compute dtype (:func:`marl.model.quantization.bitsandbytes_config`), which FSDP2 shards like any float
    tensor; each ``Linear4bit`` keeps its quantization state on the module, where bitsandbytes reads it when
    the gathered weight has none. An 8-bit base is refused (see :meth:`check_model`).
    """

    shard = True

    def check_model(self, model: MultiAdapterModel) -> None:
        if model.quantization == "8bit":
            raise ConfigError(
                "--parallelism fsdp2 cannot shard an 8bit bitsandbytes base: bitsandbytes keeps an 8-bit "
                "weight's scales (CB, SCB) on the Int8Params tensor itself, and FSDP2 gathers the shards "
                "into a plain tensor without them, so the layer's forward fails ('Parameter' object has no "
                "attribute 'CB'). Use --quantization 4bit with --parallelism fsdp2, or --parallelism "
                "replicated with --quantization 8bit"
            )
        storage = packed_4bit_dtype(model)
        if storage is not None and not storage.is_floating_point:
            raise ConfigError(
                f"--parallelism fsdp2 cannot shard 4-bit weights packed in {storage}: FSDP2 shards float "
                "tensors only. Load the base with BitsAndBytesConfig(bnb_4bit_quant_storage=<the compute "
                "dtype>), as MultiAdapterModel.from_pretrained does"
            )
        check_sharded_launch("fsdp2", self.num_processes)


def packed_4bit_dtype(model: MultiAdapterModel) -> torch.dtype | None:
    """The dtype the base's 4-bit weights are packed in (``None``: it has none)."""
    for parameter in model.peft_model.parameters():
        if type(parameter).__name__ == "Params4bit":
            return parameter.dtype
    return None


PARALLELISMS: Registry[ParallelismFactory] = Registry(
    "parallelism",
    "--parallelism",
    "marl.train.parallel.register_parallelism",
    {"replicated": ReplicatedParallelism, "fsdp2": ShardedParallelism},
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


# ---------------------------------------------------------------------- FSDP2: the base over processes

MESH_DIMENSIONS = ("replicate", "shard")


def data_parallel_mesh(device_type: str, num_processes: int, shard: bool) -> DeviceMesh:
    """The 2-D mesh ``(replicate, shard)`` over every process: ``(1, N)`` when ``shard``, else ``(N, 1)``."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (1, num_processes) if shard else (num_processes, 1)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMENSIONS)


def apply_fully_shard(
    model: MultiAdapterModel, mesh: DeviceMesh, *, shard_frozen: bool, reshard_after_forward: bool = True
) -> None:
    """Put ``model``'s base under FSDP2 on ``mesh``, in place, starting every process from process 0's policy.

    ``shard_frozen``: whether the frozen tensors (the base, the reward adapters, a frozen reference copy) are
    FSDP's too; without it only the trainable policy LoRAs are, and the base stays a plain tensor on every
    process (a replicated run: nothing of it is copied, a quantized base keeps its bitsandbytes tensors).
    ``reshard_after_forward``: free each layer's gathered weights after its forward (the memory saving;
    ``False`` keeps them until the backward pass).

    The policies' tensors are read before sharding and written back from process 0 (``distribute_tensor``
    with ``src_data_rank=0``): a fresh LoRA is random, and every process must start from the same one.
    """
    from torch.distributed.fsdp import fully_shard

    peft_model = model.peft_model
    names = {id(p): name for name, p in peft_model.named_parameters()}
    starting = {
        names[id(p)]: p.detach().clone() for policy in model.policies.values() for p in policy.parameters
    }
    causal_lm = peft_model.get_base_model()
    body = backbone(causal_lm)
    head = causal_lm.get_output_embeddings()
    # Tied input and output embeddings stay whole on every process (one tensor, still tied): the head runs
    # outside the backbone's forward, where FSDP2 would not gather the backbone's shard of it.
    tied = set(_shared_parameters(head, body)) if head is not None else set()
    ignored = tied if shard_frozen else {p for p in peft_model.parameters() if not p.requires_grad} | tied
    settings = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None)
    for layer in decoder_layers(body):
        fully_shard(layer, **settings)
    fully_shard(body, **settings)
    if head is not None and not tied:
        fully_shard(head, **settings)
    # bitsandbytes keeps a 4-bit layer's quantization constants on the module too; the DTensor lost them:
    # give them back, so that the memory card counts what each process holds (its shard, the constants whole)
    for module in causal_lm.modules():
        weight, state = getattr(module, "weight", None), getattr(module, "quant_state", None)
        if state is not None and isinstance(weight, DTensor) and getattr(weight, "quant_state", None) is None:
            weight.quant_state = state
    # fully_shard replaced every managed parameter by a new DTensor parameter: point the records at them
    current = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, value in starting.items():
            target = current[name]
            if isinstance(target, DTensor):
                target.copy_(distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=0))
    for policy in model.policies.values():
        policy.parameters[:] = [current[names[id(p)]] for p in policy.parameters]


def decoder_layers(body: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a backbone: the modules of its one ``nn.ModuleList`` holding the most
    parameters (``layers`` in Llama/Qwen, ``h`` in GPT-2, ``layers`` in GPT-NeoX)."""
    lists = [module for module in body.children() if isinstance(module, nn.ModuleList)]
    if not lists:
        return []
    largest = max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))
    return list(largest)


def _shared_parameters(first: nn.Module, second: nn.Module) -> list[nn.Parameter]:
    """The tensors two modules share (tied input and output embeddings)."""
    ids = {id(p) for p in second.parameters()}
    return [p for p in first.parameters() if id(p) in ids]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_policy_state(model: MultiAdapterModel, policy: str) -> dict[str, torch.Tensor]:
    """The policy adapter's tensors as a PEFT folder names them, whole and on the CPU. Under FSDP2 every
    process must call it (the shards are gathered)."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model.peft_model, adapter_name=policy)
    return {key: full(tensor).detach().to("cpu").contiguous() for key, tensor in state.items()}


def load_policy_state(model: MultiAdapterModel, policy: str, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` (whole tensors, as :func:`full_policy_state` returns them and a PEFT folder holds them,
    the same on every process) into the policy's tensors; each process keeps its own shard, no collective."""
    from peft.utils import get_peft_model_state_dict

    with torch.no_grad():
        for key, target in get_peft_model_state_dict(model.peft_model, adapter_name=policy).items():
            value = state[key].to(device=target.device, dtype=target.dtype)
            if isinstance(target, DTensor):
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
            target.copy_(value)


def is_distributed(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``parameters`` is a ``DTensor`` (the run's parameters are FSDP's)."""
    return any(isinstance(parameter, DTensor) for parameter in parameters)


def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with each ``DTensor`` replaced by this process's shard (a plain tensor that
    ``torch.save`` writes and ``torch.load`` reads without the device mesh)."""
    return {
        **state,
        "state": {
            index: {
                key: value.to_local() if isinstance(value, DTensor) else value for key, value in slots.items()
            }
            for index, slots in state["state"].items()
        },
    }


def _as_shard_of(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """``value`` (this process's shard) as a ``DTensor`` laid out as ``parameter``; plain for a plain one."""
    if not isinstance(parameter, DTensor):
        return value
    mesh, placements = parameter.device_mesh, parameter.placements
    return DTensor.from_local(
        value, mesh, placements, shape=parameter.shape, stride=parameter.stride(), run_check=False
    )


def distributed_optimizer_state(state: dict[str, Any], parameters: list[torch.Tensor]) -> dict[str, Any]:
    """The inverse of :func:`local_optimizer_state` for an optimizer over ``parameters`` (in its order): each
    shard becomes a ``DTensor`` laid out as its parameter, with the same shape."""
    restored = {}
    for index, slots in state["state"].items():
        parameter = parameters[int(index)]
        restored[index] = {
            key: _as_shard_of(value, parameter) if torch.is_tensor(value) and value.dim() > 0 else value
            for key, value in slots.items()
        }
    return {**state, "state": restored}


# ---------------------------------------------------------------------- checks and metric reductions


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


def sum_over_processes(record: Record, accelerator: Any) -> Record:
    """``record`` with every number (and every 1-D tensor, elementwise) summed over processes, except the
    fields whose metadata names another reduction (:data:`marl.algo.metrics.REDUCTION`: ``"min"`` or
    ``"max"``), in ONE collective (a gather of every process's :func:`record_values`); numbers come back as
    Python floats, tensors as float64 CPU tensors.

    Example:
        >>> from types import SimpleNamespace
        >>> from marl.algo.metrics import UpdateStats
        >>> one_process = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
        >>> sum_over_processes(UpdateStats(ratio=torch.tensor(2.0), completions=2), one_process).ratio
        2.0
    """
    fields = _reduced_fields(record)
    sizes = [torch.as_tensor(getattr(record, item.name)).numel() for item in fields]
    values = record_values(record, accelerator.device)
    if accelerator.num_processes > 1:
        each_process = accelerator.gather(values).reshape(accelerator.num_processes, -1)
        reductions = [
            item.metadata.get(REDUCTION, "sum")
            for item, size in zip(fields, sizes, strict=True)
            for _ in range(size)
        ]
        values = combine_processes(each_process, reductions)
    values = values.cpu()
    summed, offset = {}, 0
    for item, size in zip(fields, sizes, strict=True):
        part = values[offset : offset + size]
        offset += size
        value = getattr(record, item.name)
        summed[item.name] = (
            part if isinstance(value, torch.Tensor) and value.dim() > 0 else float(part.item())
        )
    return type(record)(**summed)


def _reduced_fields(record: Any) -> list[dataclasses.Field]:
    return [item for item in dataclasses.fields(record) if item.init and not item.name.startswith("_")]


def record_values(record: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    """The values of ``record`` (a dataclass of numbers and 1-D tensors), field after field, as one float64
    vector on ``device``: what :func:`sum_over_processes` gathers from each process.

    Example:
        >>> from marl.algo.metrics import UpdateStats
        >>> record_values(UpdateStats(approxkl=1.0, step_tokens=torch.tensor([3.0, 4.0])))[[0, -2, -1]]
        tensor([1., 3., 4.], dtype=torch.float64)
    """
    return torch.cat(
        [
            torch.as_tensor(getattr(record, item.name), dtype=torch.float64).to(device).reshape(-1)
            for item in _reduced_fields(record)
        ]
    )


def combine_processes(each_process: torch.Tensor, reductions: Sequence[str]) -> torch.Tensor:
    """Every process's values ``[processes, n]`` combined column by column: summed, or the minimum or the
    maximum where ``reductions`` (one a column) says ``"min"`` or ``"max"``.

    Example:
        >>> combine_processes(torch.tensor([[1.0, 4.0, 2.0], [3.0, 5.0, 0.0]]), ["sum", "min", "max"])
        tensor([4., 4., 2.])
    """
    unknown = sorted(set(reductions) - {"sum", "min", "max"})
    if unknown:
        raise ValueError(
            f"a record field asks for the reduction {unknown[0]!r}: use 'min' or 'max' (or none)"
        )
    combined = each_process.sum(dim=0)
    for kind, values in (("min", each_process.amin(dim=0)), ("max", each_process.amax(dim=0))):
        chosen = torch.tensor([reduction == kind for reduction in reductions], device=combined.device)
        combined = torch.where(chosen, values, combined)
    return combined
