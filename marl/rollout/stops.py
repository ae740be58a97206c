"""Completions end at their stop token: cutting sampled rows after it, their lengths and masks.

A model may have several terminators (Llama-3's ``eos_token_id`` is a list): ``stop_token_ids`` holds every id
that ends a completion. The stop token is part of the completion (the action), and the reward reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def truncate_after_stop_token(
    responses: torch.Tensor, stop_token_ids: Sequence[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace every token after the first stop token of each row by ``pad_token_id``.

    ``stop_token_ids`` holds every id that ends a completion (a model may have several terminators). The stop
    token itself is kept: it is part of the action and the reward model sees it.

    Returns:
        ``(truncated_responses, contains_stop)``; ``contains_stop[b]``: row ``b`` has a stop token.

    Example:
        >>> truncate_after_stop_token(torch.tensor([[5, 1, 7, 8], [9, 3, 1, 2]]), (1, 3), pad_token_id=0)
        (tensor([[5, 1, 0, 0],
                [9, 3, 0, 0]]), tensor([True, True]))
    """
    lengths = response_lengths(responses, stop_token_ids)
    positions = torch.arange(responses.shape[1], device=responses.device)
    after_stop = positions[None, :] >= lengths[:, None]
    contains_stop = is_stop_token(responses, stop_token_ids).any(dim=1)
    return responses.masked_fill(after_stop, pad_token_id), contains_stop


def is_stop_token(tokens: torch.Tensor, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """Boolean mask of the positions holding one of ``stop_token_ids`` (all False when there are none).

    Example:
        >>> is_stop_token(torch.tensor([[4, 2, 9]]), (2, 9))
        tensor([[False,  True,  True]])
    """
    ids = torch.as_tensor(list(stop_token_ids), dtype=tokens.dtype, device=tokens.device)
    return torch.isin(tokens, ids)


def response_lengths(responses: torch.Tensor, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """Number of valid tokens per row: up to and including the first stop token, or the whole row without one
    (and for every row when ``stop_token_ids`` is empty).

    Lengths come from positions, not from comparing tokens with the pad id, so a pad id equal to the EOS id
    cannot hide the EOS (the reward would then be read one token early).

    Example:
        >>> response_lengths(torch.tensor([[5, 1, 1, 1], [5, 6, 7, 8]]), (1,))
        tensor([2, 4])
    """
    batch, length = responses.shape
    full = torch.full((batch,), length, dtype=torch.long, device=responses.device)
    is_stop = is_stop_token(responses, stop_token_ids)
    first_stop = is_stop.int().argmax(dim=1)
    return torch.where(is_stop.any(dim=1), first_stop + 1, full)


def response_mask(lengths: torch.Tensor, response_length: int) -> torch.Tensor:
    """Boolean ``[B, response_length]`` mask of the valid tokens given per-row lengths.

    Example:
        >>> response_mask(torch.tensor([1, 3]), 3)
        tensor([[ True, False, False],
                [ True,  True,  True]])
    """
    positions = torch.arange(response_length, device=lengths.device)
    return positions[None, :] < lengths[:, None]
