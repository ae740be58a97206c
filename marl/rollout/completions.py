"""Sampled completions: :class:`Samples` (what a sampler drew, cut after its stop token) and :class:`Rollout`
(with what the update needs). Both are k-major: row ``j * P + i`` is sample ``j`` of prompt ``i``, and
``prompt_index`` names each row's prompt (its leave-one-out group).

A model may have several terminators (Llama-3's ``eos_token_id`` is a list): ``stop_token_ids`` holds every id
that ends a completion. The stop token is part of the completion (the action), and the reward reads it.

Example:
    >>> from marl.data.prompts import Prompt, PromptBatch
    >>> class Tokenizer:
    ...     def batch_decode(self, rows, skip_special_tokens):
    ...         return [" ".join(map(str, row)) for row in rows]
    >>> prompts = PromptBatch.of([Prompt((5,), "a"), Prompt((6,), "b")], pad_token_id=0)
    >>> responses = torch.tensor([[7, 2, 9], [8, 8, 8], [2, 4, 4], [9, 9, 2]])  # k=2, k-major
    >>> ids = dict(stop_token_ids=(2,), eos_token_ids=(2,), pad_token_id=0)
    >>> samples = Samples.from_responses(prompts, 2, responses, **ids, tokenizer=Tokenizer())
    >>> samples.completions, samples.prompt_index.tolist(), samples.lengths.tolist()
    (['7 2', '8 8 8', '2', '9 9 2'], [0, 1, 0, 1], [2, 3, 1, 3])
    >>> [rows.tolist() for rows in samples.group_rows(1)], samples.select(torch.tensor([1, 3])).completions
    ([[0, 2], [1, 3]], ['8 8 8', '9 9 2'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marl.algo.tensors import model_tokens
from marl.model.rows import PackedRows, pack_rows

if TYPE_CHECKING:
    from marl.data.prompts import PromptBatch
    from marl.rewards.trl_calls import RewardLog


@dataclass
class Samples:
    """Sampled completions, k-major, cut after their stop token. Every tensor has one row per completion."""

    prompt_texts: list[str]
    completions: list[str]
    prompt_ids: torch.Tensor  # [B, L], left-padded
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor  # [B, T]; padding after the stop token
    response_mask: torch.Tensor  # [B, T] bool: the valid tokens, through the stop token
    contains_stop: torch.Tensor  # [B] bool
    contains_eos: torch.Tensor  # [B] bool: an end-of-sequence id among the valid tokens
    prompt_index: torch.Tensor  # [B]: which prompt of the batch each row completes (its group)
    prompt_messages: list[list[dict[str, Any]] | None]  # a conversation's messages, None for a plain prompt
    # the prompt's other dataset columns, for reward functions (empty: none)
    prompt_columns: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    # [B, T] float32: the log-prob the sampler drew each token with (read where response_mask is set); None
    # where the sampler does not keep them (``generate``)
    sampled_logprobs: torch.Tensor | None = None
    # With tools (marl.rollout.tool_calls): [B, T] bool, True on the model's own tokens and False on the
    # tools' results between its turns, which no loss or KL reads; None without tools.
    tool_mask: torch.Tensor | None = None
    # each row's completion as messages: the assistant's turns with their tool calls, and the tool results
    turns: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)
    environments: list[Any] = dataclasses.field(default_factory=list)  # each row's environment instance
    tool_calls: torch.Tensor | None = None  # [B] the tool calls of each row
    tool_failures: torch.Tensor | None = None  # [B] those that failed (an error result)

    @classmethod
    def from_responses(
        cls,
        prompts: PromptBatch,
        k: int,
        responses: torch.Tensor,
        *,
        stop_token_ids: tuple[int, ...],
        eos_token_ids: tuple[int, ...],
        pad_token_id: int,
        tokenizer: Any,
        sampled_logprobs: torch.Tensor | None = None,
    ) -> Samples:
        """The record of sampled ids ``responses`` ``[k * P, T]`` (k-major) of ``prompts``: each row cut after
        its first stop token (:func:`truncate_after_stop_token`) and decoded. Any sampler that draws token ids
        ends here, so every sampler cuts, masks and decodes alike."""
        responses, contains_stop = truncate_after_stop_token(responses, stop_token_ids, pad_token_id)
        lengths = response_lengths(responses, stop_token_ids)
        valid = response_mask(lengths, responses.shape[1])
        contains_eos = (is_stop_token(responses, eos_token_ids) & valid).any(dim=1)
        completions = tokenizer.batch_decode(
            [row[:length].tolist() for row, length in zip(responses, lengths.tolist(), strict=True)],
            skip_special_tokens=True,
        )
        return cls(
            prompt_texts=prompts.texts * k,
            completions=completions,
            prompt_ids=prompts.ids.repeat(k, 1),
            prompt_mask=prompts.mask.repeat(k, 1),
            response_ids=responses,
            response_mask=valid,
            contains_stop=contains_stop,
            contains_eos=contains_eos,
            prompt_index=torch.arange(prompts.ids.shape[0], device=responses.device).repeat(k),
            prompt_messages=prompts.messages * k,
            prompt_columns=(prompts.columns or [{} for _ in prompts.texts]) * k,
            sampled_logprobs=sampled_logprobs,
        )

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def query_responses(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    @property
    def model_mask(self) -> torch.Tensor:
        """The valid tokens the model sampled (:func:`model_tokens`)."""
        return model_tokens(self)

    @property
    def completion_ids(self) -> list[list[int]]:
        """Each completion's token ids through its stop token, as TRL hands them to reward functions."""
        return [row[mask].tolist() for row, mask in zip(self.response_ids, self.response_mask, strict=True)]

    @property
    def group_size(self) -> int:
        """Rows per prompt (``k``), read from the first prompt's group."""
        return int((self.prompt_index == self.prompt_index[0]).sum())

    def prompts_shared(self) -> bool:
        """Whether every row's prompt is its group's first row's (with environments, a row's ``reset`` may add
        its own text to its prompt: such rows cannot be packed by prompt).

        Example:
            >>> ids, ones = torch.tensor([[5], [6], [5], [7]]), torch.ones(4, 1)
            >>> groups = torch.tensor([0, 1, 0, 1])
            >>> rows = Samples([], [], ids, ones, ones, ones, ones, ones, groups, [None] * 4)
            >>> rows.prompts_shared(), rows.select(torch.tensor([0, 2])).prompts_shared()
            (False, True)
        """
        first: dict[int, int] = {}
        for row, group in enumerate(self.prompt_index.tolist()):
            same_as = first.setdefault(group, row)
            if not (
                torch.equal(self.prompt_ids[row], self.prompt_ids[same_as])
                and torch.equal(self.prompt_mask[row], self.prompt_mask[same_as])
            ):
                return False
        return True

    def pack(self, mask_dtype: torch.dtype) -> PackedRows:
        """These rows packed by prompt (:mod:`marl.model.rows`): each prompt once, then its completions."""
        return pack_rows(
            self.prompt_ids,
            self.prompt_mask,
            self.response_ids,
            self.response_mask,
            self.prompt_index,
            mask_dtype,
        )

    def group_rows(self, groups_per_chunk: int) -> list[torch.Tensor]:
        """The rows of ``groups_per_chunk`` prompts at a time, prompts in order of first appearance."""
        prompts = list(dict.fromkeys(self.prompt_index.tolist()))
        chunks = []
        for start in range(0, len(prompts), groups_per_chunk):
            chosen = torch.tensor(prompts[start : start + groups_per_chunk], device=self.prompt_index.device)
            chunks.append(torch.nonzero(torch.isin(self.prompt_index, chosen)).flatten())
        return chunks

    def select(self, rows: torch.Tensor) -> Samples:
        """The same record for the given rows only (a micro-batch)."""
        positions = rows.tolist()
        values = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                values[field.name] = value[rows]
            elif isinstance(value, list) and value:  # a list per row
                values[field.name] = [value[i] for i in positions]
            else:  # a pass the rollout skipped, a field this record lacks, or one of the whole rollout
                values[field.name] = value
        return type(self)(**values)


@dataclass
class Rollout(Samples):
    """Samples with what the update needs: float32 log-probs under the policy at sampling time and under the
    reference ``[B, T]`` (``None`` where the algorithm does not read them,
    :mod:`marl.algo.scoring_passes`: the update's forward then provides the policy's), the reward's weighted
    scores ``[B]`` (NaN where no source
    judged a completion) and each source's own scores ``[B, S]``; ``reward_log``: what reward functions logged
    while scoring it (:class:`marl.rewards.trl_calls.RewardLog`: sample-table columns and metrics)."""

    logprobs: torch.Tensor = None
    ref_logprobs: torch.Tensor = None
    scores: torch.Tensor = None
    source_scores: torch.Tensor = None
    reward_log: RewardLog | None = None


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
