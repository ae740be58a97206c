"""Predicting the peak memory of an RLOO run from its config and the model's ``config.json``, no weights read.

The plan of one process is, per phase of the run:

    peak(phase) = resident + working set of the phase (traced, :mod:`marl.plan.phases`) + runtime

- **resident**: the base as stored (NF4 / int8 layers counted as bitsandbytes stores them, the rest in the
  compute dtype, also next to a quantized base), every adapter (policy LoRA in float32, reward LoRAs and
  score heads, the reference copy when the reference is the initial policy) and AdamW's two float32 moments
  of the policy LoRA, which exist from the first optimizer step on and stay;
- **working set**: what the phase makes and holds at once, traced by running the family's own code on the
  meta device with the run's shapes: the sampling chunk's KV cache, the scoring chunk's activations and
  log-softmax pieces, the update micro-batch's saved activations, transients and LoRA gradients;
- **runtime**: what the framework itself takes once it has run a model: on CUDA the context, library
  handles and kernels (:data:`CUDA_RUNTIME_BYTES`, measured on one GPU), on CPU the libraries' pages and
  buffers above the imports (:data:`CPU_RUNTIME_BYTES`, measured on tiny models: see
  ``benchmarks/results/*-memory-plan.md``).

``load`` is the resident base plus, on a GPU, the largest tensor in the checkpoint's dtype on its way (read,
converted or quantized one at a time) and, on CPU, the checkpoint's memory map, read whole before the load
closes it; an unquantized CPU base in the checkpoint's dtype is the file's memory map itself.

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
from pathlib import Path
from typing import Any

import torch

from marl.config.device import DEVICE_FIELDS, Device, resolve_device_settings
from marl.errors import ConfigError
from marl.plan.parts import (
    SweepShape,
    gathered_layer_bytes,
    load_extra_bytes,
    rollout_record_bytes,
    stored_base_bytes,
)
from marl.plan.phases import (
    PhaseShapes,
    as_under_autocast,
    autocast_dtype,
    autocast_weight_copies,
    graph_buffer_bytes,
    logit_head_of,
    quantize_stand_in,
    sampling_peak,
    scoring_peak,
    untied_head_bytes,
    update_peak,
)
from marl.plan.records import (
    MemoryPlan,
    PhasePlan,
    PlanTarget,
)
from marl.plan.trace import meta_causal_lm


def meta_base(model_config: Any, quantization: str | None, dtype: torch.dtype) -> torch.nn.Module:
    """The base of ``model_config`` on the meta device as marl loads it (quantized layers stood in for)."""
    causal_lm = meta_causal_lm(model_config, dtype)
    if quantization is not None:
        quantize_stand_in(causal_lm, quantization, dtype)
    return causal_lm


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
    as another system would run it (:data:`marl.plan.systems.SYSTEMS`: ``trl-rloo``, ``ppo``); ``policies``:
    a sweep of that many policies trained at once on the one base, each with ``config``'s shapes
    (:mod:`marl.plan.parts`; marl only)."""
    from peft import LoraConfig

    from marl.config.batch_sizes import local_batch_size
    from marl.model.build import wrap_with_peft
    from marl.model.families import disable_dropout
    from marl.model.forward import enable_gradient_checkpointing
    from marl.plan.systems import SYSTEMS, check_plannable

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
    # micro-batch at a time, a run's (marl.plan.parts)
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
        scoring = scoring_peak(peft_model, head, scoring_shapes, 1, full_logits=layout.full_logits)
        update = update_peak(
            peft_model, head, shapes, full_logits=layout.full_logits, value_pass=layout.value_model
        )
        # the graph sampler keeps its bucket's buffers for the run (a sharded base decodes with the static
        # sampler's loop, marl.rollout.graph_sampler)
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
