"""Running a model's own code on the ``meta`` device and counting the bytes its tensors would take.

A model built from its ``config.json`` on the meta device holds no weights, and every operation on meta
tensors computes shapes only, so the forward and backward passes of an 8B model run here in a second or two.
:class:`LiveBytes` watches every tensor such a pass creates: a storage counts from the operation that made
it until Python drops its last reference (autograd's saved tensors included), and the largest sum seen is
the pass's peak. That is what an allocator must hold for the pass, with the family's own layers, norms,
activations, rotary embeddings and the LoRA wrappers PEFT puts on them.

Attention is the one place where the meta device does not run what a GPU or CPU runs: scaled-dot-product
attention falls back to its math form there (it keeps a ``heads x T x S`` probability matrix), where the
fused kernels of both devices keep only the output and one float32 log-sum-exp per query and head.
:func:`fused_attention_stand_in` is an attention implementation that creates exactly what those kernels
create and save; :func:`meta_causal_lm` builds models with it.

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
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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
