"""Predicting the peak memory of an RLOO run from its config and the model's ``config.json``, no weights read.

The plan of one process is, per phase of the run:

    peak(phase) = resident + working set of the phase (traced, :mod:`marl.plan.phases`) + runtime

- **resident**: the base as stored (NF4 / int8 layers counted as bitsandbytes stores them, the rest in the
  compute dtype, also next to a quantized base), every adapter (policy LoRA in float32, reward LoRAs and
  score heads, the reference copy when the reference is the initial policy) and AdamW's two float32 moments
  of the policy LoRA, which exist from the first optimizer step on and stay;
- **working set**: what the phase makes and holds at once, traced by running the family's own code on the
  meta device with the run's shapes: the sampling chunk's KV cache, the scoring chunk's activations and
  log-softmax pieces, the update micro-batch's saved activations, transients and LoRA gradients (with
  tools, the sampling chunk of a later turn too: each row after the longest conversation the limits allow,
  ``prompt_length + response_length`` tokens, decoding ``response_length`` more);
- **runtime**: what the framework itself takes once it has run a model: on CUDA the context, library
  handles and kernels (:data:`CUDA_RUNTIME_BYTES`, measured on one GPU), on CPU the libraries' pages and
  buffers above the imports (:data:`CPU_RUNTIME_BYTES`, measured on tiny models: see
  ``benchmarks/results/*-memory-plan.md``).

``load`` is the resident base plus, on a GPU, the largest tensor in the checkpoint's dtype on its way (read,
converted or quantized one at a time) and, on CPU, the checkpoint's memory map, read whole before the load
closes it; an unquantized CPU base in the checkpoint's dtype is the file's memory map itself.

A sweep (several policy LoRAs trained at once on one base, :class:`SweepShape`) holds per policy: its LoRA,
AdamW's two moments, its reference copy when that is its reference, its LoRA gradients (from its first
backward of a mini-batch until its optimizer step: while one policy runs its micro-batch, the other policies'
gradients wait) and its rollout records. Its decode samples every policy's rows of a chunk in one batched
pass (``local_rollout_forward_batch_size`` rows per policy), so its working set is that of ``policies`` times
the rows; scoring runs the same chunks as a run (rows of several policies in one chunk, each through its own
adapter) and the update runs one policy's micro-batch at a time (:mod:`marl.train.training_parts`): neither
working set grows with the number of policies.

The records: where a run is planned (:class:`PlanTarget`), each phase's parts (:class:`PhasePlan`) and the
plan (:class:`MemoryPlan`, which reads as :func:`plan_text`).

Example:
    >>> from transformers import LlamaConfig
    >>> from marl.config import RLOOConfig
    >>> model = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, vocab_size=256)
    >>> config = RLOOConfig(rloo_k=4, per_device_train_batch_size=8, response_length=16)
    >>> plan = plan_memory(config, model, PlanTarget(device="cpu", prompt_length=32))
    >>> [phase.name for phase in plan.phases]
    ['load', 'sampling', 'scoring', 'update']
    >>> plan.phase("update").parts["activations + gradients (micro-batch)"] > 0
    True
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from marl.config.batch_sizes import local_batch_size
from marl.config.device import DEVICE_FIELDS, Device, resolve_device_settings
from marl.errors import ConfigError
from marl.model.memory import format_bytes
from marl.plan.phases import (
    SYSTEMS,
    PhaseShapes,
    graph_buffer_bytes,
    logit_head_of,
    sampling_peak,
    scoring_peak,
    update_peak,
)
from marl.plan.trace import (
    as_under_autocast,
    autocast_dtype,
    autocast_weight_copies,
    check_plannable,
    meta_base,
    stored_base_bytes,
    untied_head_bytes,
)

MiB = 2**20
# CUDA context, library handles and loaded kernels a trained process holds outside the caching allocator:
# the most measured on one card (benchmarks/results/2026-11-25-memory-plan-cuda.md; others not measured).
CUDA_RUNTIME_BYTES = 800 * MiB
# CPU: what a process holds beyond its tensors once it has run a model (library pages, kernel buffers, the
# allocator's own): the median over tiny models; larger ones hold more
# (benchmarks/results/2026-11-25-memory-plan.md).
CPU_RUNTIME_BYTES = 112 * MiB
# The caching allocator keeps freed blocks and splits them: what a process reserves is above what its
# tensors hold at the peak. The planner's "fits" keeps this share of the card free.
ALLOCATOR_MARGIN = 0.10
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class PlanTarget:
    """Where and on what the run is planned: the device, its memory, the prompts' length, the processes."""

    device: str = "cuda"
    memory_gb: float | None = None  # the card's (or machine's) memory, decimal GB
    prompt_length: int = 512  # tokens of the longest prompt of a batch
    num_processes: int = 1
    compute_dtype: torch.dtype | None = None  # None: bfloat16 on CUDA, float32 on CPU (marl's default)
    # the run calls tools (marl.rollout.tool_calls): a later turn decodes each row after its conversation
    tool_turns: bool = False

    @property
    def dtype(self) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def runtime_bytes(self) -> int:
        return CUDA_RUNTIME_BYTES if self.device == "cuda" else CPU_RUNTIME_BYTES


@dataclass(frozen=True)
class PhasePlan:
    """One phase's predicted peak, as the parts that make it up (bytes, display order)."""

    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peak of every phase of a run on one process, and what went into it."""

    system: str
    model: str
    settings: dict[str, Any]
    resident: dict[str, int]
    phases: list[PhasePlan]
    target: PlanTarget
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(phase.total for phase in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: phase.total).name

    def phase(self, name: str) -> PhasePlan:
        return next(phase for phase in self.phases if phase.name == name)

    @property
    def budget_bytes(self) -> int | None:
        """What the run may use of ``memory_gb``: the card less the allocator margin."""
        if self.target.memory_gb is None:
            return None
        return int(self.target.memory_gb * 1e9 * (1 - ALLOCATOR_MARGIN))

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.peak <= self.budget_bytes

    def __str__(self) -> str:
        return plan_text(self)


def plan_text(plan: MemoryPlan) -> str:
    """The plan as lines: settings, what stays resident, each phase's parts and total, the peak.

    Example:
        >>> plan = MemoryPlan("marl", "m", {}, {}, [PhasePlan("update", {"resident": 10**9})], PlanTarget())
        >>> print(plan_text(plan).splitlines()[-1])
        predicted peak: 1.00 GB (update)
    """
    target = plan.target
    lines = [
        f"memory plan ({plan.system}) for {plan.model} on {target.device}"
        + (f" with {target.memory_gb:g} GB" if target.memory_gb is not None else ""),
    ]
    if plan.settings:
        lines.append("  " + ", ".join(f"{name} {value}" for name, value in plan.settings.items()))
    resident = {name: size for name, size in plan.resident.items() if size}
    if resident:
        lines.append(
            "  resident: " + ", ".join(f"{name} {format_bytes(size)}" for name, size in resident.items())
        )
    width = max(len(phase.name) for phase in plan.phases)
    for phase in plan.phases:
        parts = " + ".join(f"{name} {format_bytes(size)}" for name, size in phase.parts.items() if size)
        lines.append(f"  {phase.name.ljust(width)}  {format_bytes(phase.total):>9}  = {parts}")
    lines += [f"  note: {note}" for note in plan.notes]
    verdict = f"predicted peak: {format_bytes(plan.peak)} ({plan.peak_phase})"
    if plan.fits is not None:
        budget = format_bytes(plan.budget_bytes)
        verdict += (
            f"; fits in {target.memory_gb:g} GB (usable {budget} after the allocator margin)"
            if plan.fits
            else f"; does NOT fit in {target.memory_gb:g} GB (usable {budget} after the allocator margin)"
        )
    lines.append(verdict)
    return "\n".join(lines)


@dataclass(frozen=True)
class SweepShape:
    """How many policies train at once on the one base (1: an ordinary run).

    Example:
        >>> sweep = SweepShape(policies=4)
        >>> sweep.rows(8), sweep.other_policies
        (32, 3)
    """

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
    until then (benchmarks/results/2026-11-24-memory-plan.md; a load that only converts the dtype is the same
    code, not measured). An unquantized CPU base in the checkpoint's dtype is that map itself, nothing
    besides."""
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
    rows = local_batch_size(config) * sweep.policies
    width = target.prompt_length + config.response_length
    return rows * (4 * width * 8 + 3 * config.response_length * 4 + 16)


def _adapter_config(directory: str | None, fallback: Any) -> Any:
    """The LoraConfig of a reward adapter folder (its ``adapter_config.json`` only), else ``fallback``."""
    if directory is None:
        return fallback
    from peft import LoraConfig

    from marl.model.adapters import read_adapter_config

    saved = read_adapter_config(Path(directory), role="reward")
    return LoraConfig(
        r=saved.get("r", fallback.r),
        lora_alpha=saved.get("lora_alpha", fallback.lora_alpha),
        target_modules=saved.get("target_modules") or fallback.target_modules,
    )


def _parameter_count(peft_model: Any, adapter: str) -> int:
    return sum(p.numel() for n, p in peft_model.named_parameters() if f".{adapter}." in n and "lora_" in n)


def plan_memory(
    config: Any, model_config: Any, target: PlanTarget, system: str = "marl", policies: int = 1
) -> MemoryPlan:
    """The :class:`MemoryPlan` of an ``RLOOConfig`` (``config``) on the model of ``model_config`` (a
    transformers config, e.g. from :func:`load_model_config`) for ``target``; ``system`` plans the same job
    as another system would run it (:data:`marl.plan.phases.SYSTEMS`: ``trl-rloo``, ``ppo``); ``policies``:
    a sweep of that many policies trained at once on the one base, each with ``config``'s shapes
    (:class:`SweepShape`; marl only)."""
    from peft import LoraConfig

    from marl.model.families import disable_dropout
    from marl.model.forward import enable_gradient_checkpointing
    from marl.model.loading import wrap_with_peft

    if any(getattr(config, name) is None for name in DEVICE_FIELDS):
        # a config built in Python, its device settings not chosen yet: planned as a run on target.device
        # chooses them (marl.config.device), on a copy
        config = copy.copy(config)
        resolve_device_settings(config, Device.named(target.device))
    layout = SYSTEMS[system]
    sweep = SweepShape(policies)
    if sweep.policies > 1 and system != "marl":
        raise ConfigError(f"a sweep of {policies} policies on one base is planned for marl, not {system!r}")
    dtype, quantization = target.dtype, config.quantization
    shards = target.num_processes if config.parallelism == "fsdp2" else 1
    base = meta_base(model_config, quantization, dtype)
    check_plannable(base)
    base_bytes, base_parameters = stored_base_bytes(base)
    head_bytes = untied_head_bytes(base)
    targets = config.lora_target_modules
    policy_lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
    )
    try:
        peft_model = wrap_with_peft(base, policy_lora)
    except ValueError as error:
        raise ConfigError(f"--lora_target_modules {' '.join(targets)}: {error}") from error
    disable_dropout(peft_model)  # as marl loads every model
    policy_parameters = _parameter_count(peft_model, "default")
    rewards = list(config.reward_adapter_folders().values()) or [None]
    reward_parameters = 0
    for index, directory in enumerate(rewards):
        name = f"reward{index}"
        peft_model.add_adapter(name, _adapter_config(directory, policy_lora))
        reward_parameters += _parameter_count(peft_model, name)
        peft_model.delete_adapter(name)
    peft_model.set_adapter("default")
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    autocast = autocast_dtype(config.mixed_precision, target.device)
    if autocast is not None:
        as_under_autocast(peft_model, autocast)
    element = torch.empty((), dtype=dtype).element_size()
    hidden = model_config.get_text_config().hidden_size
    reference_copy = config.reference == "initial-policy" or (
        config.reference == "auto" and config.policy_adapter is not None
    )
    resident = layout.resident(
        base_bytes=base_bytes,
        classifier_bytes=base_bytes - head_bytes,
        policy_parameters=policy_parameters * sweep.policies,  # each policy's LoRA, AdamW and reference
        reward_bytes=(reward_parameters + len(rewards) * hidden) * element,
        num_rewards=len(rewards),
        reference_copy=reference_copy,
    )
    resident = {name: size // shards for name, size in resident.items()}
    shapes = PhaseShapes(
        prompt_length=target.prompt_length,
        response_length=config.response_length,
        rloo_k=config.rloo_k,
        rows_per_pass=config.local_rollout_forward_batch_size,
        micro_batch_rows=config.per_device_train_batch_size,
        share_prompt_prefix=config.share_prompt_prefix and layout.packs,
        gradient_checkpointing=config.gradient_checkpointing,
        temperature=config.temperature,
    )
    # a sweep decodes every policy's rows at once; scoring keeps its chunks and the update runs one policy's
    # micro-batch at a time, a run's (the module docstring)
    sampling_shapes = dataclasses.replace(shapes, rows_per_pass=sweep.rows(shapes.rows_per_pass))
    scoring_shapes = shapes
    if not layout.packs:  # generates the whole rollout at once, scores it micro-batch by micro-batch
        sampling_shapes = dataclasses.replace(shapes, rows_per_pass=local_batch_size(config))
        scoring_shapes = dataclasses.replace(shapes, rows_per_pass=config.per_device_train_batch_size)
    head = logit_head_of(peft_model)
    with warnings.catch_warnings():
        # transformers' deprecation notices about the arguments the sampler passes, once per traced call
        warnings.simplefilter("ignore", FutureWarning)
        sampling = sampling_peak(peft_model, sampling_shapes, shared_prefill=layout.packs)
        if target.tool_turns:  # the longest conversation the limits allow, then one more turn, row by row
            conversation = target.prompt_length + config.response_length
            later = dataclasses.replace(sampling_shapes, prompt_length=conversation, rloo_k=1)
            sampling = max(sampling, sampling_peak(peft_model, later, shared_prefill=False))
        scoring = scoring_peak(peft_model, head, scoring_shapes, 1, full_logits=layout.full_logits)
        update = update_peak(
            peft_model, head, shapes, full_logits=layout.full_logits, value_pass=layout.value_model
        )
        # the graph sampler keeps its bucket's buffers for the run (a sharded base decodes with the static
        # sampler's loop, marl.rollout.samplers)
        graph_buffers = (0, 0)
        if system == "marl" and config.sampler == "graph" and config.parallelism != "fsdp2":
            graph_buffers = graph_buffer_bytes(peft_model, sampling_shapes)
    held = {"graph sampler's buffers": graph_buffers[0]} if graph_buffers[0] else {}
    beyond = {"graph sampler's bucket rounding": graph_buffers[1]} if graph_buffers[1] else {}
    common = {"resident": sum(resident.values()), **gathered_layer_bytes(base, shards)}
    copies = autocast_weight_copies(policy_parameters * sweep.policies, autocast)
    runtime = {"runtime": target.runtime_bytes}
    records = {"rollout records": rollout_record_bytes(config, target, sweep)}
    if sweep.other_policies:  # the other policies' gradients wait for their optimizer steps
        gradients = 4 * policy_parameters * sweep.other_policies // shards
        update_parts = {"LoRA gradients of the other policies": gradients}
    else:
        update_parts = {}
    load = load_extra_bytes(model_config, base, quantization, target, base_parameters)
    phases = [
        PhasePlan("load", {"base weights": resident["base weights"], **load, **runtime}),
        PhasePlan("sampling", {**common, "KV cache + sampling": sampling, **beyond, **copies, **runtime}),
        PhasePlan(
            "scoring",
            {
                **common,
                "activations + log-softmax (no grad)": scoring,
                **held,
                **copies,
                **records,
                **runtime,
            },
        ),
        PhasePlan(
            "update",
            {
                **common,
                "activations + gradients (micro-batch)": update,
                **held,
                **update_parts,
                **records,
                **runtime,
            },
        ),
    ]
    settings = {
        "quantization": quantization or "none",
        "dtype": str(dtype).removeprefix("torch."),
        "rloo_k": config.rloo_k,
        "prompt_length": target.prompt_length,
        "response_length": config.response_length,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "local_rollout_forward_batch_size": config.local_rollout_forward_batch_size,
        "gradient_checkpointing": config.gradient_checkpointing,
        "share_prompt_prefix": shapes.share_prompt_prefix,
        "parallelism": f"{config.parallelism} x {target.num_processes}",
    }
    if sweep.policies > 1:
        settings["policies (sweep)"] = sweep.policies
    notes = list(layout.notes)
    if config.reward_adapter is None:
        notes.append("no --reward_adapter given: one reward LoRA shaped like the policy's is assumed")
    if target.device == "cpu" and config.cpu_allocator == "heap":
        notes.append(
            "planned for --cpu_allocator maps; with heap (the default) a CPU phase also holds the freed "
            "blocks the C heap keeps for reuse (marl.cpu.allocator: SmolLM2-135M's update: 1.45x)"
        )
    return MemoryPlan(layout.label, config.model_name_or_path, settings, resident, phases, target, notes)


def plan_for_trainer(trainer: Any, policies: int = 1) -> MemoryPlan:
    """The plan of a built ``RLOOTrainer``'s run: its config, its model's config, its device and processes,
    and its longest training prompt; with ``policies`` > 1, of a sweep of that many policies like it."""
    parallelism = trainer.parts.parallelism
    target = PlanTarget(
        device="cuda" if parallelism.device.type == "cuda" else "cpu",
        prompt_length=max(len(prompt.ids) for prompt in trainer.parts.train_prompts),
        num_processes=parallelism.num_processes,
        compute_dtype=trainer.model.dtype,
        tool_turns=trainer.parts.tool_calling is not None,
    )
    return plan_memory(trainer.config, trainer.model.config, target, policies=policies)


@functools.cache
def load_model_config(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """A transformers config from a ``config.json`` file, a model folder (its ``config.json``; no weights
    needed), the bundled model's name, or a hub id in the local hub cache. Nothing is downloaded.

    Example:
        >>> load_model_config("./no-such-model")
        Traceback (most recent call last):
        ...
        marl.errors.MissingPathError: no such model folder: ./no-such-model. Pass ...
    """
    from transformers import AutoConfig

    from marl.data.assets import resolve_model_path

    path = Path(name_or_path).expanduser()
    source = str(path) if path.is_file() and path.suffix == ".json" else resolve_model_path(name_or_path)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"cannot read the model config of --model_name_or_path {name_or_path!r}: {error}. Pass a model "
            "folder, a config.json file, or a hub id already in the local cache"
        ) from error


def with_changes(config: Any, **changes: Any) -> Any:
    """``config`` with ``changes`` (a new config, checked as any)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.update(changes)
    return type(config)(**values)
