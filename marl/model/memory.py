"""Memory accounting: what one base with adapters costs, and what separate model copies would cost.

Pure functions over tensors, modules and configs, so that the memory card of a loaded ``MultiAdapterModel``
and the "physical floor" of a benchmark are computed the same way. Bytes are bytes as stored: a 4-bit NF4
weight counts its packed bytes plus its quantization constants (absmax, nested absmax, code books), an 8-bit
weight its int8 bytes plus its per-row scales. A tensor sharded over processes (a ``DTensor``, under
``--parallelism fsdp2``) counts the shard this process holds: the card shows one process's memory.

Example:
    >>> lora_parameter_count(4096, 4096, r=16)
    131072
    >>> format_bytes(adamw_training_bytes(1_000_000))
    '16.0 MB'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# fp32 weight + fp32 gradient + two fp32 AdamW moments.
ADAMW_BYTES_PER_FP32_PARAMETER = 16
# NF4 with double quantization (QLoRA paper): 4 bits per weight + 0.127 bits of constants at block size 64.
NF4_DOUBLE_QUANT_BITS_PER_PARAMETER = 4.127


def format_bytes(num_bytes: float) -> str:
    """Human-readable decimal bytes (kB = 1000 B), as disk and GPU vendors count.

    Example:
        >>> format_bytes(3_870_000_000)
        '3.87 GB'
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num_bytes) >= scale:
            value = num_bytes / scale
            return f"{value:.2f} {unit}" if unit == "GB" else f"{value:.1f} {unit}"
    return f"{int(num_bytes)} B"


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a ``DTensor``'s local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensor_bytes(tensor: torch.Tensor) -> int:
    tensor = local_tensor(tensor)
    return tensor.numel() * tensor.element_size()


def _quantization_tensors(parameter: torch.Tensor) -> list[torch.Tensor]:
    """The extra tensors bitsandbytes keeps next to a quantized weight."""
    extras: list[torch.Tensor] = []
    quant_state = getattr(parameter, "quant_state", None)
    while quant_state is not None:  # 4-bit: absmax + code (+ offset and a nested state with double quant)
        for name in ("absmax", "code", "offset"):
            value = getattr(quant_state, name, None)
            if isinstance(value, torch.Tensor):
                extras.append(value)
        quant_state = getattr(quant_state, "state2", None)
    scales = getattr(parameter, "SCB", None)  # 8-bit: one scale per output row
    if isinstance(scales, torch.Tensor):
        extras.append(scales)
    return extras


def stored_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of ``tensors`` as stored, quantization constants included, each storage counted once.

    ``seen`` (storage pointers already counted) lets several calls share one de-duplication.

    Example:
        >>> weight = torch.zeros(10, 10)
        >>> stored_bytes([weight, weight])
        400
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        for part in [local_tensor(tensor), *_quantization_tensors(tensor)]:
            key = part.untyped_storage().data_ptr() if part.numel() else id(part)
            if key in seen:
                continue
            seen.add(key)
            total += _tensor_bytes(part)
    return total


def logical_parameter_count(parameter: torch.Tensor) -> int:
    """Number of weights a parameter represents (a packed 4-bit tensor holds two per byte).

    Example:
        >>> logical_parameter_count(torch.zeros(3, 4))
        12
    """
    quant_state = getattr(parameter, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        return int(torch.Size(quant_state.shape).numel())
    return parameter.numel()


def lora_parameter_count(in_features: int, out_features: int, r: int) -> int:
    """Parameters of a rank-``r`` LoRA on a ``Linear(in_features, out_features)``: A is r x in, B is out x r.

    Example:
        >>> lora_parameter_count(64, 128, r=4)
        768
    """
    return r * (in_features + out_features)


def adamw_training_bytes(num_parameters: int, parameter_bytes: int = 4) -> int:
    """Weights + gradients + two float32 AdamW moments: 16 bytes per float32 parameter.

    Example:
        >>> adamw_training_bytes(10)
        160
    """
    return num_parameters * (2 * parameter_bytes + 8)


def quantized_weight_bytes(num_parameters: int, quantization: str | None, dtype: torch.dtype) -> int:
    """Estimated bytes of ``num_parameters`` weights stored as NF4 with double quantization, int8 (plus one
    float32 scale per row, ignored here) or ``dtype``.

    Example:
        >>> quantized_weight_bytes(1000, "4bit", torch.bfloat16)
        516
    """
    if quantization == "4bit":
        return round(num_parameters * NF4_DOUBLE_QUANT_BITS_PER_PARAMETER / 8)
    if quantization == "8bit":
        return num_parameters
    if quantization is None:
        return num_parameters * torch.empty((), dtype=dtype).element_size()
    raise ValueError(f"quantization must be None, '4bit' or '8bit', got {quantization!r}")


def kv_cache_bytes(config: Any, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Upper bound of the key/value cache for ``num_tokens`` cached tokens (summed over the batch):
    2 (K and V) x layers x kv_heads x head_dim x bytes per element, per token.

    Example:
        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        ...                      num_key_value_heads=32)
        >>> kv_cache_bytes(config, 1, torch.float16)  # Llama-2-7B: 0.5 MiB per token
        524288
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * element * num_tokens


@dataclass(frozen=True)
class MemoryReport:
    """The memory card: one shared base with adapters vs the same roles as separate model copies.

    ``separate_rloo_bytes``: policy, reference and reward each with their own base (same quantization),
    plus the same adapters, head and training state. ``separate_ppo_bytes`` adds a value model: one more
    base, a value head the size of the score head, and a trainable LoRA the size of the policy's with its
    AdamW state.
    """

    quantization: str | None
    compute_dtype: str
    base_parameters: int
    base_bytes: int
    adapter_parameters: dict[str, int]
    adapter_bytes: dict[str, int]
    score_head_bytes: int
    trainable_parameters: int
    trainable_bytes: int
    optimizer_state_bytes: int
    num_policies: int = 1
    num_rewards: int = 1
    notes: list[str] = field(default_factory=list)
    # The policies whose training state (gradients, AdamW moments) is counted: a sweep trains several.
    trained_policies: int = 1
    # The run's predicted peak per phase (``marl.plan``), when a trainer's shapes are known.
    predicted_peaks: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Base + every adapter + score head + gradients and AdamW moments of the trainable parameters."""
        return (
            self.base_bytes
            + sum(self.adapter_bytes.values())
            + self.score_head_bytes
            + self.optimizer_state_bytes
        )

    @property
    def separate_copies(self) -> int:
        """Base copies that separate models would hold: a policy and a reference per policy, and a reward
        model per reward (at least one)."""
        return 2 * self.num_policies + max(self.num_rewards, 1)

    @property
    def separate_rloo_bytes(self) -> int:
        return self.total_bytes + (self.separate_copies - 1) * self.base_bytes

    @property
    def separate_ppo_bytes(self) -> int:
        value_model = (
            self.base_bytes + self.score_head_bytes + self.trainable_bytes + self.optimizer_state_bytes
        )
        return self.separate_rloo_bytes + self.num_policies * value_model

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) lines of the card, in display order."""
        mode = self.quantization or f"unquantized ({self.compute_dtype})"
        rows = [
            ("base weights", f"{format_bytes(self.base_bytes)}  ({self.base_parameters:,} params, {mode})")
        ]
        for name, size in self.adapter_bytes.items():
            rows.append(
                (f"adapter '{name}'", f"{format_bytes(size)}  ({self.adapter_parameters[name]:,} params)")
            )
        if self.score_head_bytes:
            heads = "score head" if self.num_rewards == 1 else f"{self.num_rewards} score heads"
            rows.append((heads, format_bytes(self.score_head_bytes)))
        rows.append(
            (
                "training state",
                f"{format_bytes(self.optimizer_state_bytes)}  (grads + AdamW moments of "
                f"{self.trainable_parameters:,} trainable params"
                + (f", {self.trained_policies} policies)" if self.trained_policies > 1 else ")"),
            )
        )
        rows.append(("total (one base)", format_bytes(self.total_bytes)))
        ratio_rloo = self.separate_rloo_bytes / self.total_bytes
        ratio_ppo = self.separate_ppo_bytes / self.total_bytes
        rows.append(
            ("as separate copies", f"{format_bytes(self.separate_rloo_bytes)}  ({ratio_rloo:.2f}x: RLOO)")
        )
        rows.append(("  + value model", f"{format_bytes(self.separate_ppo_bytes)}  ({ratio_ppo:.2f}x: PPO)"))
        if self.predicted_peaks:
            phase = max(self.predicted_peaks, key=self.predicted_peaks.__getitem__)
            others = ", ".join(
                f"{name} {format_bytes(size)}" for name, size in self.predicted_peaks.items() if name != phase
            )
            rows.append(
                (
                    "predicted peak",
                    f"{format_bytes(self.predicted_peaks[phase])} in the {phase} ({others}; marl plan)",
                )
            )
        return rows

    @property
    def _scope(self) -> str:
        if self.predicted_peaks:
            return "the predicted peak includes activations and KV cache"
        return "activations and KV cache not included"

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        lines = [f"memory card (weights and training state; {self._scope})"]
        lines += [f"  {label.ljust(width)}  {value}" for label, value in self.rows()]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __rich__(self):
        from rich.table import Table

        table = Table(title="memory card", caption=self._scope, show_header=False)
        table.add_column("part")
        table.add_column("bytes")
        for label, value in self.rows():
            table.add_row(label, value)
        for note in self.notes:
            table.add_row("note", note)
        return table


def build_memory_report(model: Any, policy: str | Sequence[str] | None = None) -> MemoryReport:
    """The :class:`MemoryReport` of a loaded ``MultiAdapterModel`` (what ``model.memory_report()`` returns),
    with the training state of ``policy`` (default: the first policy), or of each of several policies trained
    together (a sweep's).

    Example:
        >>> print(build_memory_report(model))  # doctest: +SKIP
    """
    peft_model: nn.Module = model.peft_model
    adapter_names = list(model.adapter_names)
    seen: set[int] = set()
    adapter_tensors: dict[str, list[torch.Tensor]] = {name: [] for name in adapter_names}
    base_tensors: list[torch.Tensor] = []
    base_parameters = 0
    for name, parameter in peft_model.named_parameters():
        owner = next((a for a in adapter_names if f".{a}." in name and "lora_" in name), None)
        if owner is None:
            base_tensors.append(parameter)
            base_parameters += logical_parameter_count(parameter)
        else:
            adapter_tensors[owner].append(parameter)
    base_bytes = stored_bytes([*base_tensors, *(b for _, b in peft_model.named_buffers())], seen)
    adapter_bytes = {name: stored_bytes(tensors, seen) for name, tensors in adapter_tensors.items()}
    adapter_parameters = {name: sum(t.numel() for t in tensors) for name, tensors in adapter_tensors.items()}
    head_bytes = sum(stored_bytes(reward.head.parameters(), seen) for reward in model.rewards.values())
    trained = [policy] if policy is None or isinstance(policy, str) else list(policy)
    trainable = [parameter for name in trained for parameter in model.policy_parameters(name)]
    trainable_parameters = sum(local_tensor(p).numel() for p in trainable)
    trainable_bytes = sum(_tensor_bytes(p) for p in trainable)
    # Gradients match the parameters' dtype; AdamW keeps two float32 moments.
    optimizer_state_bytes = trainable_bytes + 8 * trainable_parameters
    notes = [
        f"reference of '{name}' = base with adapters disabled (no extra weights)"
        if len(model.policies) > 1
        else "reference = base with adapters disabled (no extra weights)"
        for name, adapter in model.policies.items()
        if adapter.reference_mode == "base"
    ]
    return MemoryReport(
        quantization=model.quantization,
        compute_dtype=str(model.dtype).removeprefix("torch."),
        base_parameters=base_parameters,
        base_bytes=base_bytes,
        adapter_parameters=adapter_parameters,
        adapter_bytes=adapter_bytes,
        score_head_bytes=head_bytes,
        trainable_parameters=trainable_parameters,
        trainable_bytes=trainable_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        num_policies=len(model.policies),
        num_rewards=len(model.rewards),
        notes=notes,
        trained_policies=len(trained),
    )
