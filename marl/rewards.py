"""Where RLOO scores come from: the model's reward adapter, or a user function of the texts.

Every source's :meth:`~RewardSource.score` takes a :class:`ScoringBatch` (the rollout's rows as ids and as
text)
and returns one float32 score per row. A user function's output is checked by :func:`marl.data.check_scores`
(one number per
completion, in order); a non-finite score passes the check, and the trainer then skips that update with a
warning.

Example:
    >>> length = FunctionReward(lambda prompts, completions: [len(c) for c in completions], "length")
    >>> batch = ScoringBatch(["Say"], [" hi!"], torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
    >>> length.score(batch)
    tensor([4.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from marl.data import check_scores, prompt_text
from marl.errors import ConfigError

if TYPE_CHECKING:
    from marl.model import MultiAdapterModel

RewardFunction = Callable[[list[str], list[str]], Sequence[float]]


@dataclass(frozen=True)
class ScoringBatch:
    """Rows to score: prompt and completion texts, and prompt + completion as ids with their attention mask
    (masked positions are padding; the completion ends at its stop token)."""

    prompts: list[str]
    completions: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a ``name`` and a ``score(batch) -> float32 [B]`` method."""

    name: str

    def score(self, batch: ScoringBatch) -> torch.Tensor: ...


def as_reward_source(
    reward: RewardFunction | RewardSource | None, model: MultiAdapterModel, rows_per_pass: int
) -> RewardSource:
    """``None``: the model's reward adapter; a :class:`RewardSource` as it is; a function of
    ``(prompts, completions)``: a checked :class:`FunctionReward`."""
    if reward is None:
        return AdapterReward(model, rows_per_pass)
    if isinstance(reward, RewardSource):
        return reward
    return FunctionReward(reward)


class AdapterReward:
    """The model's reward adapter on the ids as they were sampled, ``rows_per_pass`` rows per forward pass."""

    def __init__(self, model: MultiAdapterModel, rows_per_pass: int = 64) -> None:
        if not model.has_reward_adapter:
            raise ConfigError(
                "no reward: the model has no reward adapter and no reward_fn was given. Load it with "
                "reward_adapter=DIR, or pass reward_fn=callable(prompts, completions) -> list of floats"
            )
        self.model = model
        self.rows_per_pass = rows_per_pass
        self.name = "reward adapter"

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        step = self.rows_per_pass
        ids, mask = batch.input_ids, batch.attention_mask
        scores = [
            self.model.compute_reward_score(ids[start : start + step], mask[start : start + step])
            for start in range(0, ids.shape[0], step)
        ]
        return torch.cat(scores)


class FunctionReward:
    """A user function ``function(prompts, completions) -> one number per completion``, output checked."""

    def __init__(self, function: RewardFunction, name: str | None = None) -> None:
        if not callable(function):
            raise ConfigError(
                f"reward_fn must be callable(prompts, completions), got {type(function).__name__}"
            )
        self.function = function
        self.name = name or getattr(function, "__name__", type(function).__name__)

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        values = check_scores(
            self.function(batch.prompts, batch.completions),
            len(batch.completions),
            f"reward_fn {self.name}",
            allow_non_finite=True,
        )
        return torch.tensor(values, dtype=torch.float32, device=batch.input_ids.device)


class EosTerminatedAdapterReward:
    """The reward adapter's score of ``prompt + completion`` always followed by EOS, as the shipped adapter
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

    def __init__(self, model: MultiAdapterModel, tokenizer: Any, rows_per_pass: int = 64) -> None:
        if not model.has_reward_adapter:
            raise ConfigError("the model has no reward adapter: load it with reward_adapter=DIR")
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no EOS token to end the scored texts with")
        self.model = model
        self.tokenizer = tokenizer
        self.rows_per_pass = rows_per_pass
        self.name = "reward adapter (texts ending in EOS)"

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        return self.score_texts(batch.prompts, batch.completions).to(batch.input_ids.device)

    def score_texts(self, prompts: Sequence[Any], completions: Sequence[str]) -> torch.Tensor:
        from marl.data import left_pad

        eos = self.tokenizer.eos_token_id
        rows = [
            [*self.tokenizer(prompt_text(prompt) + completion, add_special_tokens=False)["input_ids"], eos]
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        device = self.model.device
        scores = []
        for start in range(0, len(rows), self.rows_per_pass):
            input_ids, attention_mask = left_pad(rows[start : start + self.rows_per_pass], eos)
            scores.append(self.model.compute_reward_score(input_ids.to(device), attention_mask.to(device)))
        return torch.cat(scores)
