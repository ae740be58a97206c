"""The parts of a plan besides the phases' traced working sets: the base as stored, what loading holds besides
the weights, the layers fsdp2 gathers, the rollout's records, and what a sweep of several policies on the one
base multiplies.

A sweep (issue 44: several policy LoRAs trained at once on one base) holds per policy: its LoRA, AdamW's two
moments, its reference copy when that is its reference, its LoRA gradients (from its first backward of a
mini-batch until its optimizer step: while one policy runs its micro-batch, the other policies' gradients
wait) and its rollout records. As the sweep trainer runs the phases: the decode samples every policy's rows
of a chunk in one batched pass, each row routed through its own policy (a chunk of
``local_rollout_forward_batch_size`` rows per policy): its working set is that of ``policies`` times the
rows. Scoring runs the same chunks of ``local_rollout_forward_batch_size`` rows as a run (rows of several
policies in one chunk, each through its own adapter), and the update runs ONE policy's micro-batch at a time
(``per_device_train_batch_size`` rows, in that policy's own view, :mod:`marl.train.training_parts`): neither
working set grows with the number of policies.

Example:
    >>> sweep = SweepShape(policies=4)
    >>> sweep.rows(8), sweep.other_policies
    (32, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marl.errors import ConfigError
from marl.model.memory import NF4_DOUBLE_QUANT_BITS_PER_PARAMETER
from marl.plan.phases import QuantizedLinearStandIn

if TYPE_CHECKING:
    from marl.plan.records import PlanTarget


@dataclass(frozen=True)
class SweepShape:
    """How many policies train at once on the one base (1: an ordinary run)."""

    policies: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.policies, int) or isinstance(self.policies, bool) or self.policies < 1:
            raise ConfigError(f"policies={self.policies!r}: a sweep plans 1 or more policies")

    def rows(self, rows_per_policy: int) -> int:
        """Rows of a pass that holds every policy's ``rows_per_policy`` rows at once (a decode chunk)."""
        return rows_per_policy * self.policies

    @property
    def other_policies(self) -> int:
        return self.policies - 1


# Each NF4 weight's quantization state also holds its own code books: the 16 NF4 values and the 256 values of
# the nested 8-bit map (float32), and the nested offset.
NF4_STATE_BYTES_PER_TENSOR = (16 + 256 + 1) * 4


def _linear_parameter_bytes(parameter: torch.Tensor, layer: QuantizedLinearStandIn) -> int:
    if layer.quantization == "4bit":
        return round(parameter.numel() * NF4_DOUBLE_QUANT_BITS_PER_PARAMETER / 8) + NF4_STATE_BYTES_PER_TENSOR
    return parameter.numel() + 4 * layer.out_features  # int8 + one float32 scale per output row


def stored_base_bytes(causal_lm: torch.nn.Module) -> tuple[int, int]:
    """(bytes as stored, parameters) of a meta base built by :func:`marl.plan.planner.meta_base`; tied
    tensors once."""
    total, count, seen = 0, 0, set()
    for module in causal_lm.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            count += parameter.numel()
            if isinstance(module, QuantizedLinearStandIn) and name == "weight":
                total += _linear_parameter_bytes(parameter, module)
            else:
                total += parameter.numel() * parameter.element_size()
    return total, count


def checkpoint_bytes(model_config: Any, parameters: int) -> int:
    """Bytes of the model's safetensors checkpoint: its parameters in the dtype ``config.json`` names."""
    name = str(
        getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "float32"
    )
    dtype = getattr(torch, name.removeprefix("torch."), torch.float32)
    return parameters * torch.empty((), dtype=dtype).element_size()


def load_extra_bytes(
    model_config: Any, base: torch.nn.Module, quantization: str | None, target: PlanTarget, parameters: int
) -> dict[str, int]:
    """What loading holds besides the weights: on a GPU, the tensor on its way from the checkpoint (read,
    converted or quantized one at a time). On CPU, the checkpoint's memory map: transformers keeps every
    shard's map open until the whole checkpoint is loaded, so each page read stays resident in the process
    until then (measured: a 4-bit SmolLM2-135M load peaks at 771-846 MiB above the imports, its 538 MB fp32
    checkpoint plus the 4-bit base; a load that only converts the dtype is the same code, not measured). An
    unquantized CPU base in the checkpoint's dtype is that map itself, nothing besides."""
    checkpoint = checkpoint_bytes(model_config, parameters)
    same_dtype = checkpoint == parameters * torch.empty((), dtype=target.dtype).element_size()
    if target.device == "cpu":
        return {} if quantization is None and same_dtype else {"checkpoint memory map (read)": checkpoint}
    largest = max((p.numel() for p in base.parameters()), default=0)
    return {"largest tensor in transit": checkpoint_bytes(model_config, largest)}


def gathered_layer_bytes(base: torch.nn.Module, shards: int) -> dict[str, int]:
    """Under fsdp2, a decoder layer's parameters are gathered whole while it runs (and the next one is
    prefetched): two layers' worth."""
    if shards == 1:
        return {}
    from marl.model.families import backbone

    layers = getattr(backbone(base), "layers", None)
    if layers is None or not len(layers):
        return {}
    layer_bytes = stored_base_bytes(layers[0])[0]
    return {"gathered layers (fsdp2)": 2 * layer_bytes * (shards - 1) // shards}


def rollout_record_bytes(config: Any, target: PlanTarget, sweep: SweepShape = SweepShape()) -> int:
    """The rollout's tensors kept through scoring and the update: ids, masks and positions (int64) of every
    row and its float32 log-probs, reference log-probs, scores and advantages; of every policy of a sweep."""
    from marl.config.batch_sizes import local_batch_size

    rows = local_batch_size(config) * sweep.policies
    width = target.prompt_length + config.response_length
    return rows * (4 * width * 8 + 3 * config.response_length * 4 + 16)
