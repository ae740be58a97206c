"""Prompts of a rollout: tokenised once per run, chosen per update, left-padded per batch.

:func:`prepare_prompts` tokenises a dataset's prompts once (a tokenizer is slow next to a forward pass and a
run reads every prompt many times); :func:`prompts_for_update` picks an update's prompts as a function of the
update number alone (so a resumed run sees the same data); :class:`PromptBatch` is what a sampler reads.

Example:
    >>> batch = PromptBatch.of([Prompt((5, 6), "a b"), Prompt((7,), "c")], pad_token_id=0)
    >>> batch.ids, batch.mask
    (tensor([[5, 6],
            [0, 7]]), tensor([[1, 1],
            [0, 1]]))
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from marl.data.prompts import is_conversation, left_pad, tokenize_prompt
from marl.errors import DataError

if TYPE_CHECKING:
    from marl.config.batch_sizes import BatchSizes


@dataclass(frozen=True)
class Prompt:
    """One tokenised prompt: the ids the model reads, the text shown to reward functions and in tables, and
    for a conversation its messages (reward adapters read the conversation with each completion as the
    assistant's reply, :meth:`marl.rollout.scoring.Scorer.scoring_batch`). ``columns``: the dataset row's
    other columns, which reward functions receive as keywords (:mod:`marl.rewards.trl_calls`)."""

    ids: tuple[int, ...]
    text: str
    messages: list[dict[str, Any]] | None = None
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


def prepare_prompts(
    dataset: Any, tokenizer: Any, name: str, *, context_length: int | None, response_length: int
) -> list[Prompt]:
    """Tokenise every prompt of ``dataset`` once (a ``prompt`` column of text or conversations rendered with
    the chat template, or an ``input_ids`` column), and check that each fits the context with its completion.
    The row's other columns are kept with it (:attr:`Prompt.columns`).

    Example:
        >>> class Tokenizer:
        ...     def decode(self, ids, skip_special_tokens):
        ...         return " ".join(map(str, ids))
        >>> rows = [{"input_ids": [5, 6]}]
        >>> prepare_prompts(rows, Tokenizer(), "prompts", context_length=8, response_length=4)
        [Prompt(ids=(5, 6), text='5 6', messages=None)]
        >>> prepare_prompts(rows, Tokenizer(), "prompts", context_length=5, response_length=4)
        Traceback (most recent call last):
        ...
        marl.errors.DataError: 1 prompt(s) of prompts (longest 2 tokens) plus response_length=4 exceed ...
    """
    if dataset is None or len(dataset) == 0:
        raise DataError(f"{name} is empty; pass a dataset with at least one prompt")
    columns = list(dataset.column_names) if hasattr(dataset, "column_names") else list(dataset[0].keys())
    if "prompt" not in columns and "input_ids" not in columns:
        raise DataError(
            f"{name} has no 'prompt' or 'input_ids' column (columns: {columns}). Rename the prompt column, "
            "e.g. dataset.rename_column('text', 'prompt')"
        )
    use_ids = "prompt" not in columns
    # Every column but the prompt travels with it to the reward functions, as TRL passes them.
    columns_kept = [name for name in columns if name not in ("prompt", "completion", "completion_ids")]
    prompts = []
    for index in range(len(dataset)):
        row = dataset[index]
        if use_ids:
            ids = [int(token) for token in row["input_ids"]]
            text = tokenizer.decode(ids, skip_special_tokens=True)
        else:
            ids, text = tokenize_prompt(tokenizer, row["prompt"], f"{name} row {index}")
        if not ids:
            raise DataError(f"{name} row {index} has an empty prompt; remove it or give it text")
        messages = None if use_ids or not is_conversation(row["prompt"]) else list(row["prompt"])
        columns = {name: row[name] for name in columns_kept}
        prompts.append(Prompt(tuple(ids), text, messages, columns))
    longest = max(len(prompt.ids) for prompt in prompts)
    if context_length is not None and longest + response_length > context_length:
        too_long = sum(len(prompt.ids) + response_length > context_length for prompt in prompts)
        raise DataError(
            f"{too_long} prompt(s) of {name} (longest {longest} tokens) plus "
            f"response_length={response_length} "
            f"exceed the model's context of {context_length} tokens. Filter or shorten those prompts, or "
            "lower "
            "--response_length"
        )
    return prompts


def context_length(model: Any) -> int | None:
    """The longest sequence ``model``'s positions allow (``config.max_position_embeddings``), None if its
    config does not say."""
    return getattr(model.config, "max_position_embeddings", None)


def prepare_text_prompts(
    prompts: Sequence[Any],
    tokenizer: Any,
    name: str,
    *,
    model: Any,
    response_length: int,
    columns: Sequence[Mapping[str, Any]] | None = None,
) -> list[Prompt]:
    """:func:`prepare_prompts` for a list of prompts (text or conversations), checked against ``model``'s
    context; ``columns``: each prompt's other dataset columns."""
    rows = columns or [{} for _ in prompts]
    return prepare_prompts(
        [{**row, "prompt": prompt} for prompt, row in zip(prompts, rows, strict=True)],
        tokenizer,
        name,
        context_length=context_length(model),
        response_length=response_length,
    )


def prompts_for_update(
    prompts: Sequence[Prompt], update: int, process_index: int, sizes: BatchSizes, seed: int
) -> list[Prompt]:
    """The prompts of process ``process_index`` for update ``update`` (0-based).

    The order is an endless concatenation of seeded permutations of the dataset, so the data position is a
    function of the update number alone and a resumed run sees the same prompts. Processes take consecutive
    slices of each update's prompts.

    Example:
        >>> from types import SimpleNamespace
        >>> sizes = SimpleNamespace(prompts_per_update=4, prompts_per_process=2)
        >>> prompts = [Prompt((token,), str(token)) for token in range(6)]
        >>> first = prompts_for_update(prompts, 0, 0, sizes, 1) + prompts_for_update(prompts, 0, 1, sizes, 1)
        >>> len({prompt.text for prompt in first})  # one update: 4 different prompts over both processes
        4
        >>> prompts_for_update(prompts, 2, 1, sizes, 1) == prompts_for_update(prompts, 2, 1, sizes, 1)
        True
    """
    start = update * sizes.prompts_per_update + process_index * sizes.prompts_per_process
    chosen = []
    for position in range(start, start + sizes.prompts_per_process):
        epoch, offset = divmod(position, len(prompts))
        chosen.append(prompts[_epoch_order(seed + epoch, len(prompts))[offset]])
    return chosen


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, size: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class PromptBatch:
    """Prompts left-padded to one width: ``ids`` and ``mask`` are ``[P, L]``; ``columns``: each prompt's
    other dataset columns."""

    texts: list[str]
    ids: torch.Tensor
    mask: torch.Tensor
    messages: list[list[dict[str, Any]] | None]
    columns: list[Mapping[str, Any]] = field(default_factory=list)

    @classmethod
    def of(
        cls, prompts: Sequence[Prompt], pad_token_id: int, device: torch.device | str = "cpu"
    ) -> PromptBatch:
        ids, mask = left_pad([prompt.ids for prompt in prompts], pad_token_id)
        messages = [prompt.messages for prompt in prompts]
        columns = [prompt.columns for prompt in prompts]
        return cls([prompt.text for prompt in prompts], ids.to(device), mask.to(device), messages, columns)
