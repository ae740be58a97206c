"""The base over processes with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), applied in place.

marl never calls one wrapper's ``forward``: log-probs run the causal LM's backbone and then its LM head
chunk by chunk, rewards run the backbone under another adapter, sampling runs the whole causal LM. A
wrapper whose gradient hooks need its own forward (``DistributedDataParallel``, or accelerate's
``prepare(model)``, which makes the model it is given the FSDP root) would see none of these calls.
``fully_shard`` changes modules in place and hooks their own ``forward``: :func:`apply_fully_shard` shards
every decoder layer, makes the backbone one root (embeddings, final norm and the layers below it) and the LM
head another, so every path marl takes runs through FSDP's hooks: each layer's weights are gathered for its
forward and freed after it (also in generation, one layer at a time), and the policy LoRA's gradients are
reduced in the backward pass.

One :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(replicate, shard)`` covers both modes
(:func:`data_parallel_mesh`): ``(N, 1)`` replicates (HSDP with shards of one: every process holds the whole
base, gradients are all-reduced), ``(1, N)`` shards the base over the N processes.

The policy's tensors become ``DTensor`` parameters; the helpers here turn them into what a PEFT folder, an
optimizer file and a resume need: :func:`full_policy_state` (every process takes part: it gathers),
:func:`load_policy_state`, :func:`local_optimizer_state` / :func:`distributed_optimizer_state`.

Example:
    >>> is_distributed([torch.nn.Parameter(torch.zeros(2))])
    False
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from marl.model.families import backbone

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from marl.model.multi_adapter import MultiAdapterModel

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
