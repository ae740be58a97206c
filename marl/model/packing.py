"""Computing each prompt once for all its completions: prompt groups packed into one sequence each.

RLOO scores ``k`` completions of every prompt, and an unshared forward pass over ``k`` rows of
``[prompt, completion_j]`` computes the prompt ``k`` times. Here the rows of one prompt become one sequence
``[prompt, completion_1, ..., completion_k]`` whose attention mask lets each completion see the prompt and its
own earlier tokens only, with positions that restart after the prompt for every completion. Each completion
token then sees exactly the keys it sees in its own row, at the same positions, so the numbers match the
unshared pass up to float rounding; the prompt is computed once, and in a backward pass the gradients of all
``k`` completions flow into that one computation. Forward tokens per group: ``P + k·T``, not ``k·(P+T)``.

The mask is 4-D, in the form the attention implementation takes (boolean for SDPA, additive for eager), and
transformers passes it on unchanged. Families whose layers need another mask (sliding windows) or carry
recurrent state (Mamba layers) are detected by :func:`check_packing`, and then rows are computed unshared.

Example:
    >>> packed = pack_rows(
    ...     prompt_ids=torch.tensor([[0, 5, 6], [0, 5, 6]]), prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1]]),
    ...     response_ids=torch.tensor([[7, 8], [9, 2]]), response_mask=torch.tensor([[1, 1], [1, 1]]).bool(),
    ...     prompt_index=torch.tensor([0, 0]), dtype=torch.bool)
    >>> packed.input_ids, packed.position_ids
    (tensor([[5, 6, 7, 8, 9, 2]]), tensor([[0, 1, 2, 3, 2, 3]]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# The probe decides structure (is the 4-D mask honoured, are explicit positions used), not rounding. It
# compares final hidden states per position, relative to their norm, so a logit transform (soft-capping, a
# small logit_scale) cannot shrink a structural difference. Rounding: every stored activation is rounded to
# the compute dtype (relative error eps / 2), and the packed and unshared layouts round differently; on the
# tiny family table the difference stays below 1.4 eps in fp16/bf16 and below 5 eps in fp32. A structural
# failure (another completion's tokens attended to) changes the hidden states by 28% or more there, and by
# O(1) on real models. Allowed: PROBE_EPS_MULTIPLE * eps of the compute dtype, at least PROBE_FLOOR (in fp32
# rounding is never the question): bf16 3.1e-2, fp16 3.9e-3, fp32 1e-4.
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
    from marl.model.generation import prompt_cache_can_be_shared

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
