"""A model on the ``meta`` device as marl would load it, and the bytes its tensors would take.

A model built from its ``config.json`` on the meta device holds no weights, and every operation on meta
tensors computes shapes only, so the forward and backward passes of an 8B model run here in seconds.
:class:`LiveBytes` watches every tensor such a pass creates: a storage counts from the operation that made
it until Python drops its last reference (autograd's saved tensors included), and the largest sum seen is
the pass's peak. That is what an allocator must hold for the pass, with the family's own layers, norms,
activations, rotary embeddings and the LoRA wrappers PEFT puts on them.

Where the meta device does not run what a GPU or CPU runs, a stand-in makes what the real code makes:

- attention: scaled-dot-product attention falls back to its math form there (it keeps a ``heads x T x S``
  probability matrix), where the fused kernels of both devices keep only the output and one float32
  log-sum-exp per query and head. :func:`fused_attention_stand_in` creates exactly what those kernels create
  and save; :func:`meta_causal_lm` builds models with it;
- quantized bases: every ``nn.Linear`` but the LM head becomes a :class:`QuantizedLinearStandIn`, which makes
  what bitsandbytes makes (the weight dequantized to the compute dtype for each product, in the forward and
  again in the backward pass, never kept) and keeps the input's dtype as bitsandbytes does; the parameters
  transformers leaves unquantized stay in the compute dtype, as marl keeps them
  (:func:`marl.model.quantization.prepare_quantized_base`), and :func:`stored_base_bytes` counts the base as
  bitsandbytes stores it;
- mixed precision: :func:`as_under_autocast` makes the LoRA products and the LM head allocate what
  ``torch.autocast`` allocates.

Example:
    >>> with LiveBytes() as live:
    ...     a = torch.empty(1024, device="meta")
    ...     b = torch.empty(256, device="meta")
    ...     del a
    ...     c = torch.empty(512, device="meta")
    >>> live.peak, live.current
    (5120, 3072)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from marl.errors import ConfigError
from marl.model.memory import NF4_DOUBLE_QUANT_BITS_PER_PARAMETER

# The attention implementation of models built by meta_causal_lm.
STAND_IN_ATTENTION = "marl_fused_attention_stand_in"


def _input_bytes(args: tuple, kwargs: dict) -> int:
    return args[0].numel() * args[0].element_size()


# Operations whose kernels make a temporary that no dispatched operation shows, with its size: CPU and CUDA
# compute logsumexp as ``(x - max).exp_()`` summed, one tensor the size of the input while the kernel runs
# (measured on CPU: the C heap in use rose by the input's size above what this count saw).
KERNEL_TEMPORARIES = {torch.ops.aten.logsumexp.default: _input_bytes}


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the ``with`` block that are still referenced: ``current`` now,
    ``peak`` the largest sum seen. Storages made before the block (weights) are not counted; the
    temporaries of :data:`KERNEL_TEMPORARIES` count in the peak while their operation runs.

    ``mark()`` starts a new peak from what is live now (``peak = current``), so that one pass can be
    measured after another.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        # storages an operation received that the block did not make (weights, inputs made before it): a view
        # of one (a transposed weight) is no new memory
        self._outside: dict[int, weakref.ref] = {}

    def mark(self) -> None:
        self.peak = self.current

    def _release(self, key: int) -> None:
        size, _ = self._live.pop(key, (0, None))
        self.current -= size

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._outside:
            return
        size = storage.nbytes()
        self._live[key] = (size, weakref.ref(storage, lambda _, key=key: self._release(key)))
        self.current += size
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = storage._cdata
                if key not in self._live and key not in self._outside:
                    # forgotten when it goes: its address may then hold a storage made here
                    self._outside[key] = weakref.ref(storage, lambda _, key=key: self._outside.pop(key, None))
        temporary = KERNEL_TEMPORARIES.get(func)
        if temporary is not None:
            self.peak = max(self.peak, self.current + temporary(args, kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel creates and keeps: the output, one float32 log-sum-exp per query and
    head, a float copy of a boolean mask (torch converts it to an additive one), and (saved for the backward
    pass) its inputs."""

    @staticmethod
    def forward(ctx: Any, query, key, value, mask):
        output = torch.zeros_like(query)
        log_sum_exp = torch.zeros(query.shape[:-1], dtype=torch.float32, device=query.device)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        inputs = (query, key, value) if mask is None else (mask, query, key, value)
        ctx.save_for_backward(*inputs, output, log_sum_exp)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        query, key, value = ctx.saved_tensors[-5:-2]
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), None


_planning = threading.local()  # set while this thread runs the stand-in attention
_patch_lock = threading.Lock()
_patch_users = 0  # calls of fused_attention_stand_in under way (on any thread)
_torch_kernel: Any = None  # torch's own SDPA while the stand-in is installed


def _kernel_or_stand_in(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):  # fmt: skip
    """torch's SDPA, except on a thread inside :func:`fused_attention_stand_in`, where the call allocates what
    the fused kernels allocate and computes nothing."""
    if getattr(_planning, "active", False):
        return _FusedAttention.apply(query, key, value, attn_mask)
    return _torch_kernel(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)  # fmt: skip


@contextlib.contextmanager
def _sdpa_replaced() -> Iterator[None]:
    """torch's SDPA replaced by :func:`_kernel_or_stand_in` for the duration (other threads still get torch's
    kernel through it); torch's own function is back once no call needs the replacement."""
    global _patch_users, _torch_kernel
    functional = torch.nn.functional
    with _patch_lock:
        if _patch_users == 0:
            _torch_kernel = functional.scaled_dot_product_attention
            functional.scaled_dot_product_attention = _kernel_or_stand_in
        _patch_users += 1
    _planning.active = True
    try:
        yield
    finally:
        _planning.active = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                functional.scaled_dot_product_attention = _torch_kernel


def fused_attention_stand_in(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention implementation (transformers' ``AttentionInterface``) for the meta device: transformers'
    own SDPA attention (its mask slicing, its repetition of key/value heads for grouped-query attention under
    a mask, its output layout) with the fused kernel's allocations in place of the kernel."""
    from transformers.integrations import sdpa_attention

    with _sdpa_replaced():
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_stand_in_attention() -> None:
    """Make :data:`STAND_IN_ATTENTION` a name transformers knows (idempotent). Its masks are SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(STAND_IN_ATTENTION, fused_attention_stand_in)
    AttentionMaskInterface.register(STAND_IN_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def meta_causal_lm(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device in ``dtype``, with the fused-attention stand-in where it
    would use SDPA, in eval mode. No weights are read or allocated; ``config`` is left as it was.

    Example:
        >>> from transformers import LlamaConfig
        >>> model = meta_causal_lm(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, vocab_size=100), torch.float32)
        >>> model.device.type, model.config._attn_implementation == STAND_IN_ATTENTION
        ('meta', True)
    """
    from transformers import AutoModelForCausalLM

    register_stand_in_attention()
    config = copy.deepcopy(config)  # from_config writes the dtype and attention implementation into it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    # The implementation a loaded model gets: SDPA (then its fused kernel's allocations stand in), or
    # another one (eager attention for soft-capped logits), which runs on the meta device as it is.
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(STAND_IN_ATTENTION)
    return model.eval()


class _DequantizedProduct(torch.autograd.Function):
    """``x @ W.T`` where W exists in the compute dtype only during the product (bitsandbytes' 4-bit and
    8-bit matmuls on a frozen weight): dequantized in the forward pass, again in the backward pass, and
    nothing but the packed weight kept in between."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_features: int) -> torch.Tensor:
        weight = torch.empty(out_features, x.shape[-1], dtype=x.dtype, device=x.device)
        ctx.in_features, ctx.out_features = x.shape[-1], out_features
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = torch.empty(ctx.out_features, ctx.in_features, dtype=grad.dtype, device=grad.device)
        return grad @ weight, None


class QuantizedLinearStandIn(nn.Linear):
    """A meta ``nn.Linear`` that computes as bitsandbytes' ``Linear4bit`` / ``Linear8bitLt`` does: the input
    cast to the compute dtype, a product with a weight dequantized for it, the output cast back."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, quantization: str) -> None:
        super().__init__(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            device="meta",
            dtype=compute_dtype,
        )
        self.weight.requires_grad_(False)
        self.quantization = quantization

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = x.to(self.weight.dtype)
        out = _DequantizedProduct.apply(compute, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def quantize_stand_in(causal_lm: nn.Module, quantization: str, compute_dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` but the LM head by a :class:`QuantizedLinearStandIn`; the other floating
    parameters stay in the compute dtype (:func:`marl.model.quantization.prepare_quantized_base`); returns
    how many layers."""
    head = causal_lm.get_output_embeddings()
    replaced = 0
    for module in list(causal_lm.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not head:
                setattr(module, child_name, QuantizedLinearStandIn(child, compute_dtype, quantization))
                replaced += 1
    return replaced


def autocast_dtype(mixed_precision: str, device: str) -> torch.dtype | None:
    """The dtype a run's mixed precision (``RLOOConfig.mixed_precision``) computes in on ``device``, or
    ``None`` without autocast (marl runs float32 on CPU).

    Example:
        >>> autocast_dtype("bf16", "cuda"), autocast_dtype("fp16", "cpu"), autocast_dtype("no", "cuda")
        (torch.bfloat16, None, None)
    """
    if device != "cuda" or mixed_precision == "no":
        return None
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float16


def autocast_weight_copies(trainable_parameters: int, autocast: torch.dtype | None) -> dict[str, int]:
    """autocast keeps the copy it casts of every float32 weight that requires a gradient (the policy LoRA)
    until its region ends, gradients on or off. The trace of a pass without gradients makes those copies
    and lets them go at once (:func:`as_under_autocast`), so sampling and scoring add them as a part; the
    update's trace keeps them for the backward pass already. A part, or nothing without autocast."""
    if autocast is None:
        return {}
    name = str(autocast).removeprefix("torch.")
    return {f"policy LoRA cast to {name} (autocast)": trainable_parameters * autocast.itemsize}


def as_under_autocast(peft_model: nn.Module, dtype: torch.dtype) -> None:
    """Make ``peft_model``'s LoRA products and LM head allocate what they allocate under
    ``torch.autocast(dtype)``, which the meta device does not run: autocast computes a linear layer on
    ``dtype`` copies of its input and weight, and the backward pass keeps both. So PEFT's float32 copy of a
    LoRA input (it casts to the LoRA weights' dtype) is kept as a ``dtype`` copy, half the bytes, and a
    float32 LM head (an unquantized float32 base under bf16 autocast) is copied to ``dtype`` at every call
    (the sampler's and each log-prob chunk's); a head already in ``dtype`` is not copied."""
    from peft.tuners.lora import LoraLayer

    def autocast_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if linear.bias is None else linear.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), linear.weight.to(dtype), bias)

    linears = [peft_model.get_base_model().get_output_embeddings()]
    for module in peft_model.modules():
        if isinstance(module, LoraLayer):
            linears += [*module.lora_A.values(), *module.lora_B.values()]
    for linear in linears:
        if type(linear) is nn.Linear:
            linear.forward = functools.partial(autocast_linear, linear)


def untied_head_bytes(causal_lm: nn.Module) -> int:
    """Bytes of an LM head that is not the input embedding (a sequence classifier has none)."""
    head, embedding = causal_lm.get_output_embeddings(), causal_lm.get_input_embeddings()
    if head is None or head.weight is embedding.weight:
        return 0
    return head.weight.numel() * head.weight.element_size()


def meta_base(model_config: Any, quantization: str | None, dtype: torch.dtype) -> torch.nn.Module:
    """The base of ``model_config`` on the meta device as marl loads it (quantized layers stood in for)."""
    causal_lm = meta_causal_lm(model_config, dtype)
    if quantization is not None:
        quantize_stand_in(causal_lm, quantization, dtype)
    return causal_lm


def check_plannable(causal_lm: Any) -> None:
    """Refuse a model the planner does not model: one whose cache holds other states than attention keys
    and values (Mamba layers; marl samples those with ``generate``).

    Example:
        >>> from transformers import LlamaConfig
        >>> check_plannable(meta_causal_lm(LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=1, num_attention_heads=4, vocab_size=100), torch.float32))
    """
    from marl.model.sampling import static_decode_problem

    problem = static_decode_problem(causal_lm)
    if problem is not None:
        raise ConfigError(
            f"marl plan cannot plan model_type {causal_lm.config.model_type!r}: {problem}; it plans models "
            "whose layers are all attention"
        )


# Each NF4 weight's quantization state also holds its own code books: the 16 NF4 values and the 256 values of
# the nested 8-bit map (float32), and the nested offset.
NF4_STATE_BYTES_PER_TENSOR = (16 + 256 + 1) * 4


def _linear_parameter_bytes(parameter: torch.Tensor, layer: QuantizedLinearStandIn) -> int:
    if layer.quantization == "4bit":
        return round(parameter.numel() * NF4_DOUBLE_QUANT_BITS_PER_PARAMETER / 8) + NF4_STATE_BYTES_PER_TENSOR
    return parameter.numel() + 4 * layer.out_features  # int8 + one float32 scale per output row


def stored_base_bytes(causal_lm: torch.nn.Module) -> tuple[int, int]:
    """(bytes as stored, parameters) of a meta base built by :func:`meta_base`; tied tensors once."""
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
