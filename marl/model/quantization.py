"""Quantized bases through bitsandbytes: the load settings and the CPU details.

Every base is loaded by :mod:`marl.model.loading`, which takes its quantization from here, so ``"4bit"`` means
the same NF4 setting everywhere. The choices and their parsing are settings (:mod:`marl.config.model`).

Example:
    >>> bitsandbytes_config("none", None) is None
    True
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from marl.config.model import parse_quantization

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import BitsAndBytesConfig


def default_compute_dtype() -> torch.dtype:
    """bfloat16 on a CUDA device that supports it, float32 elsewhere (CPU bf16 matmuls are slow, imprecise).

    Example:
        >>> import torch
        >>> default_compute_dtype() in (torch.float32, torch.bfloat16)
        True
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def bitsandbytes_config(quantization: str | None, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """The ``quantization_config`` for ``from_pretrained``: NF4 with double quantization for ``"4bit"``
    (the QLoRA setting), LLM.int8 for ``"8bit"``, ``None`` for an unquantized base.

    The 4-bit weights are packed into a tensor of the compute dtype (``bnb_4bit_quant_storage``, the
    FSDP-QLoRA setting) instead of ``uint8``: the same bytes and the same numbers (logits and gradients are
    bit-identical on the tiny Llama), and a float tensor that FSDP2 can shard (``--parallelism fsdp2``).

    Example:
        >>> import torch
        >>> settings = bitsandbytes_config("4bit", torch.float32)
        >>> settings.bnb_4bit_quant_type, settings.bnb_4bit_quant_storage
        ('nf4', torch.float32)
    """
    quantization = parse_quantization(quantization)
    if quantization is None:
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def prepare_quantized_base(
    model: nn.Module, quantization: str | None, *, frozen_float32: bool = False
) -> nn.Module:
    """Make a freshly loaded quantized base ready for adapters: freeze it, keep its 4-bit layers
    differentiable on CPU, drop LLM.int8's per-call notice, and let go of the checkpoint's pages and of the
    memory the quantization freed. An unquantized base is only frozen.

    Its non-quantized parameters (embeddings, LM head, norms, biases) stay in the dtype they were loaded in,
    the compute dtype: ``from_pretrained(dtype=...)`` has already rounded them to it, whatever the
    checkpoint's dtype, so a float32 copy (what PEFT's ``prepare_model_for_kbit_training`` makes) would hold
    the same values in twice the bytes, and under autocast the head would be cast back to bf16 at every call.
    They are frozen: nothing rounds them again. The LoRA weights and AdamW's state are float32 all the same
    (PEFT makes adapter weights float32). ``frozen_float32=True`` upcasts them as PEFT does (to compare).

    Gradient checkpointing is not switched on here; the caller decides (see ``MultiAdapterModel``).
    """
    quantization = parse_quantization(quantization)
    model.requires_grad_(False)
    if quantization is None:
        return model
    from marl.cpu.allocator import release_freed_memory

    if quantization == "4bit":
        keep_4bit_layers_differentiable_on_cpu(model)
    else:
        _silence_int8_cast_notice()
        use_one_int8_path_in_train_and_eval(model)
    if frozen_float32:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    release_checkpoint_mapping(model)
    # Quantizing cycles every float32 weight through the C heap, which keeps what they freed: give it back.
    release_freed_memory()
    return model


def release_checkpoint_mapping(model: nn.Module) -> int:
    """Give every unquantized CPU parameter and buffer of a quantized base memory of its own; returns how many
    tensors were copied.

    transformers reads a safetensors checkpoint through a memory map. The tensors a quantized load leaves
    unquantized (embeddings, norms, biases, an untied LM head) are views of that map, so the whole file stays
    mapped and every page read while quantizing stays resident (benchmarks/results/2026-11-21-cpu-smollm2.md).
    Once they are copies, the map is closed and the process keeps
    only the weights it uses. An unquantized base is left as it is: there the map IS the weights, held once.
    Tied tensors stay tied (each parameter object is copied once, in place).
    """
    import bitsandbytes as bnb

    quantized = (bnb.nn.Params4bit, bnb.nn.Int8Params)
    seen: set[int] = set()
    copied = 0
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is None or id(tensor) in seen or isinstance(tensor, quantized):
                continue
            seen.add(id(tensor))
            if tensor.device.type == "cpu" and tensor.numel():
                tensor.data = tensor.data.clone()
                copied += 1
    return copied


def keep_4bit_layers_differentiable_on_cpu(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights into its CPU inference layout; returns how many layers.

    On CPUs with AVX512-BF16, the first eval-mode no-grad forward of a ``Linear4bit`` repacks its weight for a
    fast inference kernel and keeps it that way. That kernel has no backward: a later training step silently
    gets no gradient through the base (and a layer with a bias fails). A base shared by scoring (no grad) and
    training (grad) must never be repacked.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def use_one_int8_path_in_train_and_eval(model: nn.Module) -> int:
    """Make every 8-bit layer compute the same way in train and eval mode; returns how many layers.

    On CPU, bitsandbytes multiplies by the dequantized weight in train mode but quantizes the activations to
    int8 in eval mode (LLM.int8), so the same weights give other logits (about 4e-3 apart on a tiny model):
    the rollout (eval) would score another function than the update (train) optimises. A layer without
    dropout has nothing else that depends on the mode, so each 8-bit layer runs in its train-mode path always
    (on CUDA both modes already share one kernel).
    """
    import bitsandbytes as bnb

    layers = [module for module in model.modules() if isinstance(module, bnb.nn.Linear8bitLt)]
    for layer in layers:
        layer.register_forward_pre_hook(_int8_train_path)
    return len(layers)


def _int8_train_path(module: nn.Module, args: tuple) -> None:
    module.training = True


class _DropInt8CastNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MatMul8bitLt: inputs will be cast")


def _silence_int8_cast_notice() -> None:
    """LLM.int8 computes in float16 and logs that it casts the inputs, on every layer of every forward. The
    cast is the documented behaviour of 8-bit mode, so the notice is dropped (once per process)."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8CastNotice) for f in logger.filters):
        logger.addFilter(_DropInt8CastNotice())
