"""What every reward source shares: the rows it scores (:class:`ScoringBatch`), the protocol it follows
(:class:`RewardSource`), the loaded parts a source may read (:class:`RewardParts`) and the weighted scores
(:class:`RewardScores`).

Kept apart from the sources themselves so that the rollout, the sources and the kinds registry
(:mod:`marl.rewards.reward_kinds`) all import these types from one small module with no model code in it.

Example:
    >>> batch = ScoringBatch(["Say"], [" hi!"], torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
    >>> batch.completions
    [' hi!']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from marl.rewards.trl_calls import RewardLog

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.model.rows import PackedRows


class ScoringChunk(NamedTuple):
    """Rows of a :class:`ScoringBatch` a reward adapter scores in one pass: whole prompt groups, as ids with
    their attention mask, and packed (each shared prefix once, :mod:`marl.model.rows`) or ``None``.
    ``rows`` indexes the batch (a tensor of row numbers or a slice)."""

    rows: torch.Tensor | slice
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    packed: PackedRows | None


@dataclass(frozen=True)
class ScoringBatch:
    """Rows to score: prompt and completion texts, and the rows as a reward adapter reads them, as ids with
    their attention mask (masked positions are padding): prompt + completion as sampled for plain prompts, a
    conversation rendered with the completion as the assistant's reply
    (:func:`marl.data.prompts.reward_model_text`).
    ``chunks``, when given, splits the rows into whole prompt groups (:class:`ScoringChunk`), made once by the
    rollout, so that a reward adapter computes each shared prefix once.
    ``conversations``: each row's prompt messages when it is a conversation (``None`` for a plain prompt).
    ``completion_ids`` (each row's completion ids through its stop token), ``columns`` (each dataset column
    beside the prompt, one value per row) and ``trainer_state`` are what reward functions receive beside the
    texts (:mod:`marl.rewards.trl_calls`); what they log with ``log_extra`` and ``log_metric`` is kept in
    ``reward_log``. ``replies``: each conversation's completion parsed as TRL hands it to reward functions
    where the tokenizer parses responses (:func:`marl.rewards.trl_calls.parsed_replies`), else ``None``.
    With tools (:mod:`marl.rollout.tool_calls`): ``turns``, each completion as its messages (the assistant's
    turns and the tools' results), and ``environments``, each row's environment instance."""

    prompts: list[str]
    completions: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    chunks: Sequence[ScoringChunk] | None = None
    conversations: list[list[dict[str, Any]] | None] | None = None
    completion_ids: list[list[int]] | None = None
    columns: Mapping[str, list[Any]] | None = None
    trainer_state: Any = None
    reward_log: RewardLog = field(default_factory=RewardLog)
    replies: list[dict[str, Any] | None] | None = None
    turns: list[list[dict[str, Any]]] | None = None  # with tools: each completion's messages
    environments: list[Any] | None = None  # with environments: each row's instance


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a ``name`` and a ``score(batch) -> float32 [B]`` method (NaN where it does not judge).

    Optional: an ``int`` attribute ``rows_per_pass`` (rows per forward pass) that the source reads at each
    ``score``; the out-of-memory guard halves it with the scorer's when scoring runs out of memory."""

    name: str

    def score(self, batch: ScoringBatch) -> torch.Tensor: ...


@dataclass(frozen=True)
class RewardParts:
    """What a reward source may read once the model is loaded: the model with its reward adapters, its
    tokenizer, and how many rows to score per forward pass (``--local_rollout_forward_batch_size``)."""

    model: MultiAdapterModel
    tokenizer: Any
    rows_per_pass: int = 64


# A reward kind's factory checks its spec before the model loads and returns one of these, which builds the
# source from the loaded parts (see marl.rewards.reward_kinds).
RewardBuilder = Callable[[RewardParts], RewardSource]


class RewardScores(NamedTuple):
    """The weighted sum per row (NaN where no source judged it) and each source's own scores ``[B, S]``."""

    total: torch.Tensor
    per_source: torch.Tensor
