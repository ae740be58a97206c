"""Rows that share one forward pass over the base: each prompt packed once before its completions
(:func:`pack_rows`), and each row through its own adapter (:func:`route_rows`).

Packing. RLOO scores ``k`` completions of every prompt, and an unshared forward pass over ``k`` rows of
``[prompt, completion_j]`` computes the prompt ``k`` times. Here the rows of one prompt become one sequence
``[prompt, completion_1, ..., completion_k]`` whose attention mask lets each completion see the prompt and its
own earlier tokens only, with positions that restart after the prompt for every completion. Each completion
token then sees exactly the keys it sees in its own row, at the same positions, so the numbers match the
unshared pass up to float rounding; the prompt is computed once, and in a backward pass the gradients of all
``k`` completions flow into that one computation. Forward tokens per group: ``P + k·T``, not ``k·(P+T)``.

The mask is 4-D, in the form the attention implementation takes (boolean for SDPA, additive for eager), and
transformers passes it on unchanged. Families whose layers need another mask (sliding windows) or carry
recurrent state (Mamba layers) are detected by :func:`check_packing`, and then rows are computed unshared.

Routing. Each row of a batch through its own adapter, with gradients: the rows of several policies (and of
their references) in one forward (and backward) pass over the shared base. A sweep routes its decode and its
scoring passes this way; its update runs each policy's micro-batch in that policy's own view instead
(:mod:`marl.train.training_parts` says why).

PEFT routes rows by name with ``model(..., adapter_names=[...])``: every LoRA layer runs the base product once
for the whole batch and adds each adapter's delta to its own rows only (``LoraLayer._mixed_batch_forward``;
``"__base__"`` rows get no delta). PEFT refuses that argument in training mode, because a LoRA dropout
drawn for a mixed batch would differ from the dropout of each adapter's own batch. marl switches every dropout
off at load (and checks it), so a routed batch computes, row for row, what each row's own view computes; the
gradient of a row's loss reaches its own adapter only, since the other adapters never see that row.

Some families flatten the batch before a layer (OPT's MLP takes ``[rows * tokens, hidden]``): a 2-D input
whose first dimension is a multiple of the rows gets each row's name once per token, in the row-major order of
that flattening. Mixture-of-experts layers send a permuted subset of tokens to each expert, which no per-row
name can follow: such models are refused.

PEFT's mixed batch indexes each adapter's rows with a Python list in every layer: on a GPU that is a copy
from the host per adapter and layer, and the row sets change shape as rows leave, so no CUDA graph can
capture it. On a GPU :func:`route_rows` therefore runs every plain LoRA ``Linear`` layer as ONE stacked LoRA
(:func:`stacked_lora_delta`): the A matrices of the routed adapters concatenated, one product for every row,
each row keeping only its own adapter's columns (``torch.where`` on the row's adapter position, a device
tensor made once per set of names), then one product with the concatenated B matrices, scaled per row. Its
shapes depend only on the batch, so a compiled decode step captures it. It computes every adapter's LoRA
for every row (r / hidden of the base's FLOPs per adapter), which a CPU, bound by FLOPs, pays for: a CPU keeps
PEFT's path (timed in docs/guides/sweeps.md). Both give each row what its own view gives (within rounding),
and each adapter's gradient comes from its own rows only: the columns a row does not keep are zero.

:func:`route_rows` keeps the routing until the context exits; it reads a :class:`RowRoutes` at every call,
so a decode whose finished rows leave the batch names its remaining rows before each step. The caller runs
the backward pass inside the context: a layer under gradient checkpointing computes its forward again
during the backward pass, and that second forward must be routed the same way.

Example:
    >>> packed = pack_rows(
    ...     prompt_ids=torch.tensor([[0, 5, 6], [0, 5, 6]]), prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1]]),
    ...     response_ids=torch.tensor([[7, 8], [9, 2]]), response_mask=torch.tensor([[1, 1], [1, 1]]).bool(),
    ...     prompt_index=torch.tensor([0, 0]), dtype=torch.bool)
    >>> packed.input_ids, packed.position_ids
    (tensor([[5, 6, 7, 8, 9, 2]]), tensor([[0, 1, 2, 3, 2, 3]]))
    >>> with model.routed(["positive", "negative", BASE_VIEW]):  # doctest: +SKIP
    ...     logprobs = model.token_logprobs(ids, mask, response_start=8)
    ...     (logprobs.sum(dim=1) * advantages).mean().backward()
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from peft.tuners.lora import LoraLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from marl.errors import ConfigError
from marl.model.adapters import BASE_VIEW
from marl.model.families import prompt_cache_can_be_shared

# The probe decides structure (is the 4-D mask honoured, are explicit positions used), not rounding. It
# compares final hidden states per position, relative to their norm, so a logit transform (soft-capping, a
# small logit_scale) cannot shrink a structural difference. Rounding: every stored activation is rounded to
# the compute dtype (relative error eps / 2), and the packed and unshared layouts round differently, far less
# than a structural failure (another completion's tokens attended to) moves them (docs/concepts/exactness.md).
# Allowed: PROBE_EPS_MULTIPLE * eps of the compute dtype, at least PROBE_FLOOR (in fp32 rounding is never the
# question): bf16 3.1e-2, fp16 3.9e-3, fp32 1e-4.
PROBE_EPS_MULTIPLE = 4
PROBE_FLOOR = 1e-4


@dataclass(frozen=True)
class PackedRows:
    """Rows packed by prompt: ``G`` sequences of length ``L``.

    ``predictors[r, t]`` is the flat index (into ``G * L``) of the hidden state that predicts token ``t`` of
    row ``r``'s completion; ``completion_slots[r, t]`` the flat index of that token itself. Rows keep the
    order they were given in.
    """

    input_ids: torch.Tensor  # [G, L]
    attention_mask: torch.Tensor  # [G, 1, L, L] additive
    position_ids: torch.Tensor  # [G, L]
    predictors: torch.Tensor  # [R, T]
    completion_slots: torch.Tensor  # [R, T]
    prompt_slots: torch.Tensor  # [R, W]: flat index of each left-padded prompt position (masked ones: -1)


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    dtype: torch.dtype,
) -> PackedRows:
    """Pack rows ``[prompt (left-padded), completion (right-padded)]`` by ``prompt_index``: the rows of one
    prompt share one sequence and its prompt is stored once."""
    device = response_ids.device
    rows, width = prompt_ids.shape
    steps = response_ids.shape[1]
    groups: dict[int, list[int]] = {}
    for row, index in enumerate(prompt_index.tolist()):
        groups.setdefault(index, []).append(row)
    lengths = {index: int(prompt_mask[members[0]].sum()) for index, members in groups.items()}
    length = max(lengths[index] + len(members) * steps for index, members in groups.items())

    input_ids = torch.zeros(len(groups), length, dtype=torch.long, device=device)
    position_ids = torch.zeros(len(groups), length, dtype=torch.long, device=device)
    # segment of every packed position: 0 prompt, j + 1 the j-th completion of the group, -1 padding
    segments = torch.full((len(groups), length), -1, dtype=torch.long, device=device)
    predictors = torch.zeros(rows, steps, dtype=torch.long, device=device)
    completion_slots = torch.zeros(rows, steps, dtype=torch.long, device=device)
    prompt_slots = torch.full((rows, width), -1, dtype=torch.long, device=device)
    offsets = torch.arange(steps, device=device)
    for group, (index, members) in enumerate(groups.items()):
        prompt_length = lengths[index]
        base = group * length
        real = prompt_mask[members[0]].bool()
        input_ids[group, :prompt_length] = prompt_ids[members[0]][real]
        position_ids[group, :prompt_length] = torch.arange(prompt_length, device=device)
        segments[group, :prompt_length] = 0
        for slot, row in enumerate(members):
            start = prompt_length + slot * steps
            input_ids[group, start : start + steps] = response_ids[row]
            position_ids[group, start : start + steps] = prompt_length + offsets
            segments[group, start : start + steps] = slot + 1
            completion_slots[row] = base + start + offsets
            # token 0 is predicted by the prompt's last token, token t by the completion's token t - 1
            predictors[row] = base + torch.where(offsets == 0, prompt_length - 1, start + offsets - 1)
            prompt_slots[row, real] = base + torch.arange(prompt_length, device=device)
    return PackedRows(
        input_ids=input_ids,
        attention_mask=_block_mask(segments, dtype),
        position_ids=position_ids,
        predictors=predictors,
        completion_slots=completion_slots,
        prompt_slots=prompt_slots,
    )


def _block_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[G, 1, L, L]`` mask: a position sees earlier positions of the prompt and of its own segment; padding
    sees only itself (a row with nothing to attend to would give NaN). Boolean (True: attend) for SDPA,
    additive in ``dtype`` for eager attention."""
    length = segments.shape[1]
    index = torch.arange(length, device=segments.device)
    causal = index[None, :] <= index[:, None]
    query, key = segments[:, :, None], segments[:, None, :]
    allowed = causal & (key >= 0) & (query >= 0) & ((key == 0) | (key == query))
    allowed |= torch.eye(length, dtype=torch.bool, device=segments.device)
    if dtype == torch.bool:
        return allowed[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def read_slots(packed: PackedRows, read_positions: torch.Tensor) -> torch.Tensor:
    """Map positions in the unpacked ``[prompt, completion]`` rows (e.g. where a reward is read) to flat
    packed indices."""
    width = packed.prompt_slots.shape[1]
    rows = torch.arange(read_positions.shape[0], device=read_positions.device)
    in_completion = read_positions >= width
    completion = packed.completion_slots[rows, (read_positions - width).clamp(min=0)]
    prompt = packed.prompt_slots[rows, read_positions.clamp(max=width - 1)]
    return torch.where(in_completion, completion, prompt)


def attention_window(config: object) -> int | None:
    """The sliding-window length of a model's attention, ``None`` when every layer attends to all positions.

    A packed sequence is longer than each of its rows, so a window that the packed positions would exceed
    changes what a completion sees; such batches are computed unshared.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def packing_mask_dtype(model: Any) -> torch.dtype:
    """Boolean masks for SDPA attention, additive masks in the compute dtype for eager attention."""
    implementation = model.config._attn_implementation
    return torch.bool if implementation == "sdpa" else model.dtype


def probe_tolerance(dtype: torch.dtype) -> float:
    """Relative difference of hidden states that rounding in ``dtype`` explains (``PROBE_EPS_MULTIPLE``).

    Example:
        >>> [round(probe_tolerance(dtype), 6) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
        [0.0001, 0.003906, 0.03125]
    """
    return max(PROBE_FLOOR, PROBE_EPS_MULTIPLE * torch.finfo(dtype).eps)


def coarser_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The floating dtype with the largest rounding error (epsilon) of ``dtypes``.

    A quantized base keeps float32 activations between its layers while bitsandbytes computes each layer in
    the model's compute dtype (bfloat16 on CUDA): the hidden states are float32, their rounding is bf16's.

    Example:
        >>> coarser_dtype(torch.float32, torch.bfloat16), coarser_dtype(torch.float16, torch.float32)
        (torch.bfloat16, torch.float16)
    """
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


def check_packing(model: Any) -> str | None:
    """Why packed rows would not give the model's unshared hidden states, or ``None`` when they do, on a
    probe: prompts of unequal lengths (left padding) and a completion cut short, run in the model's own dtype,
    device and attention implementation. Models whose layers carry state between positions (Mamba) or that
    ignore a 4-D mask fail it; differences that rounding in the compute dtype explains do not
    (:func:`probe_tolerance` of the coarser of the hidden states' dtype and the model's compute dtype)."""
    if not prompt_cache_can_be_shared(model.peft_model.get_base_model()):
        return "some of its layers carry state from one position to the next (e.g. Mamba layers)"
    prompt_ids = torch.tensor([[5, 9, 13, 17, 21, 25], [0, 0, 0, 7, 11, 15]])
    prompt_mask = (torch.arange(6) >= torch.tensor([[0], [3]])).long()
    response_ids = torch.tensor([[30, 31, 32, 33], [34, 35, 36, 0], [40, 41, 42, 43], [44, 45, 46, 47]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]).bool()
    prompt_index = torch.tensor([0, 1, 0, 1])
    vocab = model.config.vocab_size
    device = model.device
    prompt_ids, response_ids = prompt_ids % vocab, response_ids % vocab
    prompt_ids, prompt_mask = prompt_ids[prompt_index].to(device), prompt_mask[prompt_index].to(device)
    response_ids, response_mask = response_ids.to(device), response_mask.to(device)
    # the mask the training path builds: its dtype must suit the attention kernel, not the weights' dtype
    packed = pack_rows(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        prompt_index.to(device),
        packing_mask_dtype(model),
    )
    query_responses = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    width = prompt_ids.shape[1]
    with model.policy(), model._inference():
        # the hidden state that predicts each completion token, as token_logprobs reads it
        unshared = model._hidden_states(query_responses, attention_mask)[:, width - 1 : -1]
        try:
            hidden = model._hidden_states(packed.input_ids, packed.attention_mask, packed.position_ids)
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            return f"its forward does not take a 4-D attention mask ({type(error).__name__}: {error})"
    shared = hidden.reshape(-1, hidden.shape[-1])[packed.predictors]
    shared, unshared = shared[response_mask].float(), unshared[response_mask].float()
    difference = float(((shared - unshared).norm(dim=-1) / unshared.norm(dim=-1)).max())
    rounding = coarser_dtype(hidden.dtype, model.dtype)
    tolerance = probe_tolerance(rounding)
    if not difference <= tolerance:
        return (
            f"packed rows differ from unshared rows by {difference:.2e} on a probe (rounding in "
            f"{rounding} explains up to {tolerance:.1e})"
        )
    return None


# ------------------------------------------------------------------ routing rows by adapter


def check_row_adapters(row_adapters: Sequence[str], known: Sequence[str]) -> list[str]:
    """``row_adapters`` as a list, after checking that each is an adapter on the base or ``BASE_VIEW``.

    Example:
        >>> check_row_adapters(("a", "__base__", "a"), known=["a", "b"])
        ['a', '__base__', 'a']
        >>> check_row_adapters(["c"], known=["a", "b"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: rows routed to ['c'], which is no adapter on this base; its adapters: ...
    """
    names = list(row_adapters)
    if not names:
        raise ConfigError("no rows to route: pass one adapter name per row of the batch")
    unknown = sorted(set(names) - set(known) - {BASE_VIEW})
    if unknown:
        raise ConfigError(
            f"rows routed to {unknown}, which is no adapter on this base; its adapters: {list(known)} "
            f"(or {BASE_VIEW!r} for the base alone)"
        )
    return names


def routing_problem(config: Any) -> str | None:
    """Why rows of this model cannot be routed per row, or ``None``.

    Example:
        >>> from transformers import LlamaConfig, MixtralConfig
        >>> routing_problem(LlamaConfig()) is None
        True
        >>> routing_problem(MixtralConfig())
        'its mixture-of-experts layers (8 experts) compute a permuted subset of the tokens in each expert'
    """
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        return (
            f"its mixture-of-experts layers ({experts} experts) compute a permuted subset of the tokens in "
            "each expert"
        )
    return None


def per_input_row(row_adapters: list[str], inputs: int) -> list[str]:
    """The names for a layer input of ``inputs`` rows: one per row, or, for a batch flattened to
    ``[rows * tokens, hidden]``, each row's name once per token (a count that fits neither is left for PEFT to
    refuse).

    Example:
        >>> per_input_row(["a", "b"], 4)
        ['a', 'a', 'b', 'b']
    """
    if inputs != len(row_adapters) and inputs % len(row_adapters) == 0:
        tokens = inputs // len(row_adapters)
        return [name for name in row_adapters for _ in range(tokens)]
    return row_adapters


class RowRoutes:
    """The adapter name of each row of the next forward passes; :attr:`names` may be replaced between passes
    (a decode names the rows still decoding before each step). :attr:`adapters` are the adapters of the
    first names, in order; :meth:`index` gives each row's position among them on a device.

    Example:
        >>> routes = RowRoutes(["a", "b", "a", "__base__"])
        >>> routes.adapters, routes.index("cpu").tolist()
        (('a', 'b'), [0, 1, 0, -1])
        >>> routes.names = [routes.names[row] for row in (1, 2)]
        >>> routes.names, routes.index("cpu").tolist()
        (['b', 'a'], [1, 0])
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.adapters = tuple(dict.fromkeys(name for name in names if name != BASE_VIEW))
        self.names = list(names)

    @property
    def names(self) -> list[str]:
        return self._names

    @names.setter
    def names(self, names: Sequence[str]) -> None:
        self._names, self._index = list(names), None

    def follow(self, names: Sequence[str], index: torch.Tensor) -> None:
        """Name the rows ``names`` whose positions are already on the device in ``index`` (a decode keeps
        them in a buffer of fixed address, which a captured step reads in place)."""
        self._names, self._index = list(names), index

    def index(self, device: torch.device | str) -> torch.Tensor:
        """Each row's position in :attr:`adapters` (``-1``: the base alone), made once per set of names."""
        if self._index is None or self._index.device != torch.device(device):
            positions = [self.adapters.index(name) if name != BASE_VIEW else -1 for name in self._names]
            self._index = torch.tensor(positions, dtype=torch.long, device=device)
        return self._index


class LoraStack(NamedTuple):
    """A layer's routed adapters stacked (:func:`lora_stack`): ``names``, the layer's adapters among the
    routed ones; ``owner``, the position (among the routed adapters) of each stacked rank; ``scaling``, each
    routed adapter's scaling in this layer (zero where it lacks the adapter)."""

    names: tuple[str, ...]
    owner: torch.Tensor
    scaling: torch.Tensor


# Each layer's stacks, kept while the layer lives: a decode compiled for CUDA graphs reads them at fixed
# addresses, so every routing of the same adapters gets the same tensors (no new capture, no copy per replay).
_STACKS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, LoraStack]] = weakref.WeakKeyDictionary()


def lora_stack(layer: nn.Module, adapters: Sequence[str], device: torch.device | str) -> LoraStack | None:
    """``layer``'s stack of ``adapters`` (positions as in ``adapters``) on ``device``, or ``None`` when it
    has none of them; made once per layer and adapters, so that no forward copies anything from the host."""
    names, owner, scaling = [], [], [0.0] * len(adapters)
    for position, name in enumerate(adapters):
        if name in layer.lora_A:
            names.append(name)
            owner += [position] * layer.lora_A[name].weight.shape[0]
            scaling[position] = layer.scaling[name]
    if not names:
        return None
    key = (tuple(adapters), tuple(owner), tuple(scaling), str(device))
    stacks_of_layer = _STACKS.setdefault(layer, {})
    if key not in stacks_of_layer:
        dtype = layer.lora_A[names[0]].weight.dtype
        stack = LoraStack(
            tuple(names),
            torch.tensor(owner, device=device),
            torch.tensor(scaling, dtype=dtype, device=device),
        )
        torch._dynamo.mark_static_address(stack.owner)
        torch._dynamo.mark_static_address(stack.scaling)
        stacks_of_layer[key] = stack
    return stacks_of_layer[key]


def stacked_lora_delta(
    layer: nn.Module, x: torch.Tensor, rows: torch.Tensor, stack: LoraStack
) -> torch.Tensor:
    """The LoRA term of every row of ``x`` under its own adapter: row ``i`` (of ``x``'s first dimension)
    gets ``B_a A_a x_i * scaling_a`` for the adapter at position ``rows[i]`` of the routed adapters, zero
    where ``rows[i]`` is ``-1`` or the layer lacks that adapter. One product with the A matrices of
    ``stack`` stacked, the ranks of other adapters zeroed per row, one with their B matrices side by side.

    Example:
        >>> from peft import LoraConfig, get_peft_model
        >>> model = get_peft_model(nn.Sequential(nn.Linear(4, 4)), LoraConfig(target_modules=["0"],
        ...                        init_lora_weights=False), adapter_name="pos")
        >>> layer, x = model.base_model.model[0], torch.randn(2, 4)
        >>> delta = stacked_lora_delta(layer, x, torch.tensor([0, -1]), lora_stack(layer, ["pos"], "cpu"))
        >>> torch.allclose(delta[0], layer.lora_B["pos"](layer.lora_A["pos"](x[0])) * layer.scaling["pos"])
        True
        >>> bool(delta[1].eq(0).all())
        True
    """
    weight_a = torch.cat([layer.lora_A[name].weight for name in stack.names])
    weight_b = torch.cat([layer.lora_B[name].weight for name in stack.names], dim=1)
    if x.dim() == 2 and x.shape[0] != rows.shape[0]:  # a flattened [rows * tokens, hidden] input
        rows = rows.repeat_interleave(x.shape[0] // rows.shape[0])
    rows = rows.view(-1, *([1] * (x.dim() - 1)))
    hidden = nn.functional.linear(x.to(weight_a.dtype), weight_a)
    hidden = torch.where(rows == stack.owner, hidden, 0)  # where, not a product: a NaN elsewhere stays there
    return nn.functional.linear(hidden, weight_b) * stack.scaling[rows.clamp(min=0)]


def stacks(layer: nn.Module, adapters: Sequence[str]) -> bool:
    """Whether :func:`stacked_lora_delta` computes what PEFT's forward computes for ``layer``: a LoRA
    ``Linear`` whose adapters here are plain (no DoRA or other variant, no bias, no dropout) and unmerged,
    with no other wrapper on its forward."""
    if not isinstance(layer, LoraLayer) or "forward" in vars(layer) or getattr(layer, "merged", False):
        return False
    for name in adapters:
        if name not in layer.lora_A:
            continue
        dropout = layer.lora_dropout[name]
        if not (
            isinstance(layer.lora_A[name], nn.Linear)
            and isinstance(layer.lora_B[name], nn.Linear)
            and layer.lora_B[name].bias is None
            and name not in getattr(layer, "lora_variant", {})
            and (isinstance(dropout, nn.Identity) or getattr(dropout, "p", 1.0) == 0)
        ):
            return False
    return True


def _stacked_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A routed LoRA layer's forward on a GPU: the base, plus each row's own LoRA term."""
    routes: RowRoutes = self._marl_routes
    result = self.base_layer(x, *args, **kwargs)
    if self.disable_adapters:  # as PEFT's forward: the base for every row
        return result
    rows = routes.index(x.device)
    if x.shape[0] != rows.shape[0] and (x.dim() != 2 or x.shape[0] % rows.shape[0]):
        raise ConfigError(f"a routed layer got {x.shape[0]} rows for {rows.shape[0]} adapter names")
    if self._marl_stack is None:
        return result
    return (result + stacked_lora_delta(self, x, rows, self._marl_stack)).to(result.dtype)


def _routed_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, LoraLayer | AuxiliaryTrainingWrapper)]


@contextlib.contextmanager
def route_rows(
    model: nn.Module, row_adapters: list[str] | RowRoutes, stacked: bool | None = None
) -> Iterator[None]:
    """Every forward of ``model``'s LoRA layers in the body runs row ``i`` of its batch through
    ``row_adapters[i]`` (the adapters must be enabled: a layer with adapters disabled computes the base for
    every row); a :class:`RowRoutes` is read at every call. ``stacked``: the plain LoRA layers run
    :func:`stacked_lora_delta` (default: on a CUDA model), the others PEFT's mixed batch. A layer called
    with another number of rows raises an error naming both counts."""
    routes = row_adapters if isinstance(row_adapters, RowRoutes) else RowRoutes(row_adapters)
    device = next(model.parameters()).device
    if stacked is None:
        stacked = device.type == "cuda"

    def pass_row_adapters(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inputs, names = args[0], routes.names
        names = per_input_row(names, inputs.shape[0]) if inputs.dim() == 2 else names
        return args, {**kwargs, "adapter_names": names}

    layers = _routed_layers(model)
    stacking = [layer for layer in layers if stacked and stacks(layer, routes.adapters)]
    handles = [
        layer.register_forward_pre_hook(pass_row_adapters, with_kwargs=True)
        for layer in layers
        if not any(layer is other for other in stacking)
    ]
    for layer in stacking:
        layer._marl_routes, layer._marl_stack = routes, lora_stack(layer, routes.adapters, device)
        layer.forward = types.MethodType(_stacked_forward, layer)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for layer in stacking:
            del layer.forward, layer._marl_routes, layer._marl_stack
