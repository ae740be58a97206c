"""What a rollout hands on: :class:`Samples` (what a sampler drew) and :class:`Rollout` (with what the update
needs). Both are k-major: row ``j * P + i`` is sample ``j`` of prompt ``i``, and ``prompt_index`` names each
row's prompt (its leave-one-out group).

Example:
    >>> from marl.rollout.prompts import Prompt, PromptBatch
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marl.model.rows import PackedRows, pack_rows
from marl.rollout import stops

if TYPE_CHECKING:
    from marl.rewards.trl_calls import RewardLog
    from marl.rollout.prompts import PromptBatch


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
        its first stop token (:mod:`marl.rollout.stops`) and decoded. Any sampler that draws token ids ends
        here, so every sampler cuts, masks and decodes alike."""
        responses, contains_stop = stops.truncate_after_stop_token(responses, stop_token_ids, pad_token_id)
        lengths = stops.response_lengths(responses, stop_token_ids)
        response_mask = stops.response_mask(lengths, responses.shape[1])
        contains_eos = (stops.is_stop_token(responses, eos_token_ids) & response_mask).any(dim=1)
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
            response_mask=response_mask,
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
    def completion_ids(self) -> list[list[int]]:
        """Each completion's token ids through its stop token, as TRL hands them to reward functions."""
        return [row[mask].tolist() for row, mask in zip(self.response_ids, self.response_mask, strict=True)]

    @property
    def group_size(self) -> int:
        """Rows per prompt (``k``), read from the first prompt's group."""
        return int((self.prompt_index == self.prompt_index[0]).sum())

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
    reference ``[B, T]`` (``None`` where the algorithm does not read them, :mod:`marl.algo.scoring_passes`:
    the update's forward then provides the policy's), the reward's weighted scores ``[B]`` (NaN where no
    source judged a completion) and each source's own scores ``[B, S]``; ``reward_log``: what reward functions
    logged while scoring it (:class:`marl.rewards.trl_calls.RewardLog`: sample-table columns and metrics)."""

    logprobs: torch.Tensor = None
    ref_logprobs: torch.Tensor = None
    scores: torch.Tensor = None
    source_scores: torch.Tensor = None
    reward_log: RewardLog | None = None
