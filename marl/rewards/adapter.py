"""Reward adapters on the shared base as reward sources, and the one loop that scores rows with them.

A reward adapter is read one of two ways, each a reward kind (:mod:`marl.rewards.reward_kinds`):

- ``"adapter"`` (:class:`AdapterReward`): the rows as they were sampled, in the rollout's prompt-group chunks
  (each shared prompt computed once);
- ``"eos_adapter"`` (:class:`EosTerminatedAdapterReward`): every text re-tokenised and ended with EOS, as the
  shipped adapter was trained (the demo trains with it, ``marl evaluate`` reports it).

Both, and TRL's view of an adapter (:class:`marl.integrations.trl.TrainerRewardAdapter`), score through
:func:`score_chunks`, ``rows_per_pass`` rows per forward pass.

Example:
    >>> [chunk.input_ids.tolist() for chunk in padded_chunks([[5], [6, 7]], 0, rows_per_pass=2)]
    [[[0, 5], [6, 7]]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from marl.data.prompts import is_conversation, left_pad, reward_model_ids
from marl.errors import ConfigError
from marl.rewards.batch import RewardBuilder, ScoringBatch, ScoringChunk

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel


def padded_chunks(
    rows: Sequence[Sequence[int]], pad_token_id: int, rows_per_pass: int, device: Any = None
) -> list[ScoringChunk]:
    """Token-id rows as :class:`ScoringChunk` s of ``rows_per_pass`` rows, each left-padded with
    ``pad_token_id`` to its own longest row (the padding is masked, so it changes no score).

    Example:
        >>> [chunk.rows for chunk in padded_chunks([[1], [2], [3]], 0, rows_per_pass=2)]
        [slice(0, 2, None), slice(2, 3, None)]
    """
    chunks = []
    for start in range(0, len(rows), rows_per_pass):
        input_ids, attention_mask = left_pad(rows[start : start + rows_per_pass], pad_token_id)
        span = slice(start, start + input_ids.shape[0])
        chunks.append(ScoringChunk(span, input_ids.to(device), attention_mask.to(device), None))
    return chunks


class RewardScorer(Protocol):
    """What :func:`score_chunks` scores with: a model carrying reward adapters by name
    (:class:`~marl.model.multi_adapter.MultiAdapterModel`, or a TRL trainer's PEFT model through
    :class:`marl.integrations.trl.TrainerRewardAdapter`)."""

    def compute_reward_score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, name: str | None, packed: Any
    ) -> torch.Tensor: ...


def score_chunks(
    model: RewardScorer, adapter: str, chunks: Sequence[ScoringChunk], num_rows: int, device: Any
) -> torch.Tensor:
    """Float32 scores ``[num_rows]`` on ``device`` of reward adapter ``adapter``, one forward pass per chunk
    (packed when the chunk carries its packed form).

    Example:
        >>> chunks = padded_chunks(rows, tokenizer.eos_token_id, rows_per_pass=64)  # doctest: +SKIP
        >>> score_chunks(model, "reward", chunks, len(rows), model.device)  # doctest: +SKIP
        tensor([0.4100, -1.2000])
    """
    scores = torch.empty(num_rows, dtype=torch.float32, device=device)
    for rows, input_ids, attention_mask, packed in chunks:
        scores[rows] = model.compute_reward_score(input_ids, attention_mask, adapter, packed).to(device)
    return scores


class AdapterReward:
    """A reward adapter of the model on the ids as they were sampled, ``rows_per_pass`` rows per pass.

    Example:
        >>> AdapterReward(model, "sentiment").score(batch)  # doctest: +SKIP
        tensor([0.4100, -1.2000])
    """

    def __init__(self, model: MultiAdapterModel, adapter: str | None = None, rows_per_pass: int = 64) -> None:
        self.model = model
        self.name = model.get_reward(adapter).name
        self.rows_per_pass = rows_per_pass

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        ids, mask, step = batch.input_ids, batch.attention_mask, self.rows_per_pass
        chunks = batch.chunks
        if chunks is None:
            spans = [slice(start, start + step) for start in range(0, ids.shape[0], step)]
            chunks = [ScoringChunk(span, ids[span], mask[span], None) for span in spans]
        return score_chunks(self.model, self.name, chunks, ids.shape[0], ids.device)


class EosTerminatedAdapterReward:
    """A reward adapter's score of ``prompt + completion`` always followed by EOS, as the shipped adapter
    was trained: on complete texts ending in EOS.

    Read at the last word of a completion cut off by the length limit, such an adapter scores it out of
    distribution, and a policy can raise that score just by stopping early. Appending EOS to every text makes
    finished and cut-off completions comparable, so only what the text says moves the score. The demo trains
    with it, and ``marl evaluate`` reports it.

    Example:
        >>> reward = EosTerminatedAdapterReward(model, tokenizer)  # doctest: +SKIP
        >>> reward.score_texts(["The film is"], [" a delight."])  # doctest: +SKIP
        tensor([2.3100])
    """

    def __init__(
        self, model: MultiAdapterModel, tokenizer: Any, adapter: str | None = None, rows_per_pass: int = 64
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token to end the scored texts with")
        self.model = model
        self.tokenizer = tokenizer
        self.name = model.get_reward(adapter).name
        self.rows_per_pass = rows_per_pass

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        prompts = batch.prompts
        if batch.conversations is not None:
            prompts = [
                text if messages is None else messages
                for text, messages in zip(batch.prompts, batch.conversations, strict=True)
            ]
        return self.score_texts(prompts, batch.completions).to(batch.input_ids.device)

    def score_texts(self, prompts: Sequence[Any], completions: Sequence[str]) -> torch.Tensor:
        """Scores of plain prompts read as ``prompt + completion + EOS``; a conversation is read as TRL
        renders it for a reward model (:func:`marl.data.prompts.reward_model_text`): the chat template closes
        the assistant's turn, as ``RewardTrainer`` saw conversations, and no EOS is added."""
        eos = self.tokenizer.eos_token_id
        rows = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = reward_model_ids(self.tokenizer, prompt, completion)
            rows.append(ids if is_conversation(prompt) else [*ids, eos])
        device = self.model.device
        chunks = padded_chunks(rows, eos, self.rows_per_pass, device)
        return score_chunks(self.model, self.name, chunks, len(rows), device)


def adapter_kind(spec: str) -> RewardBuilder:
    """The ``"adapter"`` reward kind: reward adapter ``spec`` (its name on the model) read on the rows as
    sampled (:class:`AdapterReward`); ``marl train-rloo --reward_adapter`` builds these.

    Example:
        >>> build = adapter_kind("sentiment")
        >>> build(RewardParts(model, tokenizer)).name  # doctest: +SKIP
        'sentiment'
    """
    return lambda parts: AdapterReward(parts.model, spec, parts.rows_per_pass)


def eos_adapter_kind(spec: str) -> RewardBuilder:
    """The ``"eos_adapter"`` reward kind: reward adapter ``spec`` read on each complete text ending in EOS
    (:class:`EosTerminatedAdapterReward`), as ``marl demo`` trains and ``marl evaluate`` reports.

    Example:
        >>> build = eos_adapter_kind("reward")
        >>> build(RewardParts(model, tokenizer)).name  # doctest: +SKIP
        'reward'
    """
    return lambda parts: EosTerminatedAdapterReward(parts.model, parts.tokenizer, spec, parts.rows_per_pass)
