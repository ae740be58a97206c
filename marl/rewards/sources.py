"""Where scores come from: reward adapters on the shared base, user functions of the texts, their weighted
sum,
and the judges that evaluate a policy.

A reward source has a ``name`` and a ``score(batch)`` method: given a :class:`ScoringBatch` (the rollout's
rows as ids and as text) it returns one float32 score per row. :class:`WeightedRewards` combines several
sources as ``Σ_i w_i · r_i``, as TRL's ``reward_funcs`` with ``reward_weights`` do.

``None`` from a reward function means "this source does not judge this completion" (NaN works the same way,
as in TRL): the completion's reward is then the weighted sum over the sources that did judge it. A completion
that no source judged has no reward: it is left out of its prompt's leave-one-out baseline and gets advantage
0 (:func:`marl.algo.shaping.shape_rewards`); only an update in which no completion was judged is skipped,
with a warning. Infinite scores from a function, a wrong count or a non-number are errors that name the
function.

Example:
    >>> length = FunctionReward(lambda prompts, completions: [len(c) for c in completions], "length")
    >>> batch = ScoringBatch(["Say"], [" hi!"], torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
    >>> WeightedRewards([length], [0.5]).score(batch).total
    tensor([2.])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from marl.data.prompts import import_function, is_conversation, left_pad, reward_model_ids
from marl.errors import ConfigError, DataError
from marl.model.generation import pad_token_id

if TYPE_CHECKING:
    from marl.model.multi_adapter import MultiAdapterModel
    from marl.model.packing import PackedRows

RewardFunction = Callable[..., Sequence[float | None]]


class ScoringChunk(NamedTuple):
    """Rows of a :class:`ScoringBatch` a reward adapter scores in one pass: whole prompt groups, as ids with
    their attention mask, and packed (each shared prefix once, :mod:`marl.model.packing`) or ``None``."""

    rows: torch.Tensor
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
    ``conversations``: each row's prompt messages when it is a conversation (``None`` for a plain prompt)."""

    prompts: list[str]
    completions: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    chunks: Sequence[ScoringChunk] | None = None
    conversations: list[list[dict[str, Any]] | None] | None = None


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a ``name`` and a ``score(batch) -> float32 [B]`` method (NaN where it does not judge)."""

    name: str

    def score(self, batch: ScoringBatch) -> torch.Tensor: ...


def check_scores(scores: Any, expected: int, name: str, *, allow_none: bool = False) -> list[float | None]:
    """``scores`` as a list of floats; raise, naming ``name``, unless it is ``expected`` finite real numbers.
    With ``allow_none``, ``None`` (and NaN) stand for "not judged" and come back as ``None``.

    Accepts lists, tuples, numpy arrays and 1-D torch tensors; items may be numpy scalars or 0-d tensors.

    Example:
        >>> check_scores([1, 0.5], 2, "my_reward")
        [1.0, 0.5]
        >>> check_scores([None, float("nan"), torch.tensor(float("nan")), 2], 4, "my_reward", allow_none=True)
        [None, None, None, 2.0]
    """
    if hasattr(scores, "tolist") and not isinstance(scores, list | tuple):
        scores = scores.tolist()
    if not isinstance(scores, list | tuple):
        raise DataError(
            f"{name} returned a {type(scores).__name__}; it must return a list of {expected} numbers, one "
            "per "
            "completion"
        )
    if len(scores) != expected:
        raise DataError(
            f"{name} returned {len(scores)} scores for {expected} completions; it must return one per "
            "completion, in order"
        )
    values: list[float | None] = []
    for index, score in enumerate(scores):
        if getattr(score, "ndim", None) == 0 and hasattr(score, "item"):  # a numpy scalar or a 0-d tensor
            score = score.item()
        if allow_none and (score is None or (isinstance(score, float) and math.isnan(score))):
            values.append(None)
            continue
        if isinstance(score, bool) or not isinstance(score, numbers.Real):
            raise DataError(f"{name} returned {score!r} at position {index}; scores must be real numbers")
        if not math.isfinite(score):
            raise DataError(f"{name} returned {score!r} at position {index}; scores must be finite numbers")
        values.append(float(score))
    return values


def call_user_function(function: Callable[..., Any], where: str, *arguments: Any) -> Any:
    """Call a function the user wrote (a reward function, a judge). An exception it raises is the user's to
    fix in their own code, so it ends the command with one line naming the function; ``--debug`` shows the
    traceback into it.

    Example:
        >>> call_user_function(lambda texts: 1 / 0, "judge 'mine:score'", ["a"])
        Traceback (most recent call last):
        ...
        marl.errors.DataError: judge 'mine:score' raised ZeroDivisionError: division by zero. Fix that ...
    """
    try:
        return function(*arguments)
    except Exception as error:
        raise DataError(
            f"{where} raised {type(error).__name__}: {error}. Fix that function (--debug shows the traceback)"
        ) from error


class AdapterReward:
    """A reward adapter of the model on the ids as they were sampled, ``rows_per_pass`` rows per pass."""

    def __init__(self, model: MultiAdapterModel, adapter: str | None = None, rows_per_pass: int = 64) -> None:
        self.model = model
        self.name = model.get_reward(adapter).name
        self.rows_per_pass = rows_per_pass

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        ids, mask, step = batch.input_ids, batch.attention_mask, self.rows_per_pass
        if batch.chunks is None:
            spans = [slice(start, start + step) for start in range(0, ids.shape[0], step)]
            chunks = [ScoringChunk(span, ids[span], mask[span], None) for span in spans]
        else:
            chunks = batch.chunks
        scores = torch.empty(ids.shape[0], dtype=torch.float32, device=ids.device)
        for rows, chunk_ids, chunk_mask, packed in chunks:
            scores[rows] = self.model.compute_reward_score(chunk_ids, chunk_mask, self.name, packed)
        return scores


class FunctionReward:
    """A user function ``function(prompts, completions) -> one number (or None) per completion``, its output
    checked on every call. Calling it returns the checked list.

    Example:
        >>> reward = FunctionReward(lambda prompts, texts: [len(t) for t in texts], "length")
        >>> reward(["Say hi"], ["hi!"])
        [3.0]
    """

    def __init__(self, function: RewardFunction, name: str | None = None) -> None:
        if not callable(function):
            raise ConfigError(
                f"a reward function must be callable(prompts, completions), got {type(function).__name__}"
            )
        self.function = function
        self.name = name or getattr(function, "__name__", type(function).__name__)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[float | None]:
        where = f"reward function {self.name!r}"
        output = call_user_function(self.function, where, list(prompts), list(completions))
        return check_scores(output, len(completions), where, allow_none=True)

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        values = [math.nan if value is None else value for value in self(batch.prompts, batch.completions)]
        return torch.tensor(values, dtype=torch.float32, device=batch.input_ids.device)


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
        the
        assistant's turn, as ``RewardTrainer`` saw conversations, and no EOS is added."""
        eos = self.tokenizer.eos_token_id
        rows = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = reward_model_ids(self.tokenizer, prompt, completion)
            rows.append(ids if is_conversation(prompt) else [*ids, eos])
        device = self.model.device
        scores = []
        for start in range(0, len(rows), self.rows_per_pass):
            input_ids, attention_mask = left_pad(rows[start : start + self.rows_per_pass], eos)
            scores.append(
                self.model.compute_reward_score(input_ids.to(device), attention_mask.to(device), self.name)
            )
        return torch.cat(scores)


class RewardScores(NamedTuple):
    """The weighted sum per row (NaN where no source judged it) and each source's own scores ``[B, S]``."""

    total: torch.Tensor
    per_source: torch.Tensor


class WeightedRewards:
    """Several reward sources combined as ``Σ_i w_i · r_i`` over the sources that judged each row.

    Source names label the logged ``rewards/<name>`` metrics; repeated names get a ``_2``, ``_3``... suffix.
    """

    def __init__(self, sources: Sequence[RewardSource], weights: Sequence[float] | None = None) -> None:
        if not sources:
            raise ConfigError("no reward: give at least one reward adapter or reward function")
        weights = [1.0] * len(sources) if weights is None else [float(weight) for weight in weights]
        if len(weights) != len(sources):
            names = [source.name for source in sources]
            raise ConfigError(
                f"{len(weights)} reward weights for {len(sources)} reward sources {names}: give one weight "
                "per "
                "source (--reward_weights), in the order of the sources, or none for weight 1 each"
            )
        if not all(math.isfinite(weight) for weight in weights):
            raise ConfigError(f"reward weights must be finite numbers, got {weights}")
        self.sources = list(sources)
        self.weights = weights
        self.names: list[str] = []
        for source in self.sources:
            name, count = source.name, 1
            while name in self.names:
                count += 1
                name = f"{source.name}_{count}"
            self.names.append(name)

    def score(self, batch: ScoringBatch) -> RewardScores:
        per_source = torch.stack([source.score(batch).float() for source in self.sources], dim=1)
        weights = torch.tensor(self.weights, dtype=torch.float32, device=per_source.device)
        judged = ~torch.isnan(per_source)
        total = torch.where(judged, per_source * weights, torch.zeros_like(per_source)).sum(dim=1)
        total = torch.where(judged.any(dim=1), total, torch.full_like(total, math.nan))
        return RewardScores(total, per_source)


def build_rewards(
    model: MultiAdapterModel,
    reward_funcs: Any = None,
    weights: Sequence[float] | None = None,
    rows_per_pass: int = 64,
) -> WeightedRewards:
    """The reward of a run: ``reward_funcs`` is ``None`` (every reward adapter of the model), or one or a list
    of reward adapter names, reward functions ``f(prompts, completions)`` and :class:`RewardSource` objects.

    Example:
        >>> rewards = build_rewards(model, ["sentiment", length_bonus], [1.0, 0.1])  # doctest: +SKIP
    """
    if reward_funcs is None:
        if not model.rewards:
            raise ConfigError(
                "no reward: the model has no reward adapter and no reward function was given. Load it with "
                "reward_adapter=DIR, or pass reward_funcs=callable(prompts, completions) -> list of floats"
            )
        reward_funcs = list(model.rewards)
    items = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    sources: list[RewardSource] = []
    for item in items:
        if isinstance(item, str):
            sources.append(AdapterReward(model, item, rows_per_pass))
        elif isinstance(item, RewardSource):
            sources.append(item)
        else:
            sources.append(FunctionReward(item))
    return WeightedRewards(sources, weights)


# ---------------------------------------------------------------------- user functions from the command line


def load_reward_fn(spec: str) -> FunctionReward:
    """Import ``--reward_fn module:function`` (or ``path/to/file.py:function``), called as
    ``function(prompts, completions)``; the spec names it in errors and in the ``rewards/<spec>`` metric.

    Example:
        >>> reward = load_reward_fn("my_rewards:length_bonus")  # doctest: +SKIP
    """
    return FunctionReward(import_function(spec, "--reward_fn"), spec)


class CheckedJudge:
    """A judge ``fn(texts) -> scores`` (higher is better) whose output is checked on every call.

    Example:
        >>> judge = CheckedJudge(lambda texts: [t.count("!") for t in texts], "excitement")
        >>> judge(["wow!", "ok"])
        [1.0, 0.0]
    """

    def __init__(self, function: Callable[[Sequence[str]], Any], name: str) -> None:
        self.function = function
        self.name = name

    def __call__(self, texts: Sequence[str]) -> list[float]:
        return check_scores(call_user_function(self.function, self.name, list(texts)), len(texts), self.name)


def load_judge(spec: str | None) -> CheckedJudge:
    """Import ``--judge module:function``, called as ``function(texts)``; ``None`` gives the VADER judge.

    Example:
        >>> load_judge(None)(["a wonderful film"])[0] > 0
        True
    """
    if spec is None:
        from marl.data.assets import gold_judge_scores

        return CheckedJudge(gold_judge_scores, "the VADER judge")
    return CheckedJudge(import_function(spec, "--judge"), f"judge {spec!r}")


# ---------------------------------------------------------------------- interop


class RewardAdapterFunction:
    """A reward adapter as a reward function for TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (``reward_funcs``).

    Scores ``prompt + completion`` (a conversation through the chat template) tokenised as TRL tokenises the
    texts for a reward model (no special tokens added; ``append_eos=True`` ends each text with EOS, for an
    adapter trained on texts ending in EOS), read where the adapter was trained to be read. The adapter lives
    on a :class:`~marl.model.multi_adapter.MultiAdapterModel`: pass one (it gets the adapter as ``name``
    unless it already
    has it), or a base model name/folder to load one.

    Example:
        >>> from trl import GRPOTrainer  # doctest: +SKIP
        >>> sentiment = RewardAdapterFunction("base", "adapters/rm", name="sentiment")  # doctest: +SKIP
        >>> GRPOTrainer(model=..., reward_funcs=[sentiment], ...)  # doctest: +SKIP
    """

    def __init__(
        self,
        base_or_model: Any,
        adapter_dir: str | None = None,
        *,
        name: str = "reward",
        quantization: str | None = None,
        append_eos: bool = False,
        rows_per_pass: int = 64,
    ) -> None:
        from transformers import AutoTokenizer

        from marl.model.multi_adapter import MultiAdapterModel

        if isinstance(base_or_model, MultiAdapterModel):
            model = base_or_model
            if name not in model.rewards:
                if adapter_dir is None:
                    raise ConfigError(f"the model has no reward adapter {name!r}: pass adapter_dir")
                model.add_reward_adapter(name, adapter_dir)
        else:
            if adapter_dir is None:
                raise ConfigError("pass the reward adapter folder: RewardAdapterFunction(base, adapter_dir)")
            model = MultiAdapterModel.from_pretrained(
                base_or_model, quantization=quantization, reward_adapters={name: adapter_dir}
            )
        self.model = model
        self.name = self.__name__ = name  # TRL labels its rewards/<name> metrics with __name__
        self.tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        self.append_eos = append_eos
        self.rows_per_pass = rows_per_pass

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        rows = [
            reward_model_ids(self.tokenizer, prompt, completion)
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        if self.append_eos:
            rows = [[*row, self.tokenizer.eos_token_id] for row in rows]
        pad, device = pad_token_id(self.tokenizer), self.model.device
        scores: list[float] = []
        for start in range(0, len(rows), self.rows_per_pass):
            input_ids, attention_mask = left_pad(rows[start : start + self.rows_per_pass], pad)
            batch_scores = self.model.compute_reward_score(
                input_ids.to(device), attention_mask.to(device), self.name
            )
            scores.extend(batch_scores.tolist())
        return scores
