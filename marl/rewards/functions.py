"""Functions the user wrote: reward functions (called as TRL calls them, :mod:`marl.rewards.trl_calls`) and
judges ``f(texts)``, imported from ``module:function`` (or ``path/to/file.py:function``) and checked on every
call. Judges evaluate a policy independently of its reward, so that reward hacking shows as a reward gain
without a judge gain: VADER by default, or ``--judge module:function``.

``None`` from a reward function means "this source does not judge this completion" (NaN works the same way,
as in TRL). Infinite scores, a wrong count or a non-number are errors that name the function, and so is an
exception raised inside it: the user fixes their own code, so the command ends with one line, not a
traceback into marl.

Example:
    >>> length = FunctionReward(lambda completions, **kwargs: [len(c) for c in completions], "length")
    >>> length(["Say"], [" hi!"])
    [4.0]
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from marl.data.fixed_rules import gold_judge_scores
from marl.errors import ConfigError, DataError
from marl.rewards.batch import RewardBuilder, RewardParts, RewardSource, ScoringBatch
from marl.rewards.trl_calls import RewardCall, callable_name, is_async, run_reward_functions

RewardFunction = Callable[..., Sequence[float | None]]


def import_function(spec: str, flag: str) -> Callable[..., Any]:
    """Import ``module:function`` or ``path/to/file.py:function``; ``flag`` names the option in errors.

    Example:
        >>> import_function("math:fsum", "--reward_fn")([1.0, 2.0])
        3.0
    """
    module_name, separator, function_name = spec.rpartition(":")
    if not separator or not module_name or not function_name:
        raise DataError(f"{flag} {spec!r} must look like 'module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name).expanduser())
        else:
            module = importlib.import_module(module_name)
    except Exception as error:
        raise DataError(
            f"{flag} {spec!r}: could not import {module_name!r} ({type(error).__name__}: {error}). "
            "Check the name, that the module is on PYTHONPATH (or pass a .py file path), and that it imports"
        ) from error
    function = getattr(module, function_name, None)
    if function is None:
        raise DataError(f"{flag} {spec!r}: module {module_name!r} has no attribute {function_name!r}")
    if not callable(function):
        raise DataError(f"{flag} {spec!r}: {function_name!r} is a {type(function).__name__}, not a function")
    return function


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    module_name = f"marl_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


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
            "per completion"
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


class FunctionReward:
    """A user function called as TRL calls reward functions (:mod:`marl.rewards.trl_calls`): keywords
    ``prompts``, ``completions``, ``completion_ids``, ``trainer_state`` and every dataset column, returning
    one number (or ``None``) per completion; its output is checked on every call. Calling it returns the
    checked list.

    Example:
        >>> reward = FunctionReward(lambda prompts, completions: [len(t) for t in completions], "length")
        >>> reward(["Say hi"], ["hi!"])
        [3.0]
        >>> def accuracy(completions, answer, **kwargs):
        ...     return [float(c.strip() == a) for c, a in zip(completions, answer)]
        >>> FunctionReward(accuracy)(["1+1="] * 2, [" 2", " 3"], answer=["2", "2"])
        [1.0, 0.0]
    """

    def __init__(self, function: RewardFunction, name: str | None = None, spec: str | None = None) -> None:
        if not callable(function):
            raise ConfigError(
                "a reward function must be callable as TRL calls it, f(prompts=..., completions=..., "
                f"**kwargs), got {type(function).__name__}"
            )
        self.function = function
        self.name = name or callable_name(function)
        # errors name the function as it was given (--reward_fn's module:function), the metric by its name
        self.spec = spec or self.name
        self.is_async = is_async(function)

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        return self.check(
            run_reward_functions(
                [self.function], RewardCall(prompts, completions, columns=columns), [self.spec]
            )[0],
            len(completions),
        )

    def check(self, output: Any, expected: int) -> list[float | None]:
        """``output`` as one number or ``None`` per completion, or an error naming this function."""
        return check_scores(output, expected, f"reward function {self.spec!r}", allow_none=True)

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        (output,) = run_reward_functions([self.function], reward_call(batch), [self.spec])
        return as_tensor(self.check(output, len(batch.completions)), batch)


def reward_call(batch: ScoringBatch) -> RewardCall:
    """The reward-function call of ``batch``: a conversation's messages as its prompt, every column.

    Example:
        >>> batch = ScoringBatch(["Say"], [" hi!"], torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
        >>> reward_call(batch).keywords()["prompts"]
        ['Say']
    """
    conversations = batch.conversations or [None] * len(batch.prompts)
    prompts = [
        text if messages is None else messages
        for text, messages in zip(batch.prompts, conversations, strict=True)
    ]
    return RewardCall(
        prompts, batch.completions, batch.completion_ids, batch.columns or {}, batch.trainer_state,
        batch.reward_log, batch.replies, batch.turns, batch.environments,
    )  # fmt: skip


def as_tensor(values: Sequence[float | None], batch: ScoringBatch) -> torch.Tensor:
    """Checked scores as float32 on the batch's device, NaN where not judged."""
    numbers = [math.nan if value is None else value for value in values]
    return torch.tensor(numbers, dtype=torch.float32, device=batch.input_ids.device)


def score_sources(sources: Sequence[RewardSource], batch: ScoringBatch) -> list[torch.Tensor]:
    """Each source's scores of ``batch``, in order; the reward functions among them are called with one
    :class:`~marl.rewards.trl_calls.RewardCall`, their ``async def`` ones awaited together (as TRL does).

    Example:
        >>> double = FunctionReward(lambda completions, **kwargs: [2 * len(c) for c in completions], "double")
        >>> batch = ScoringBatch(["Say"], [" hi!"], torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
        >>> score_sources([double], batch)
        [tensor([8.])]
    """
    functions = [index for index, source in enumerate(sources) if isinstance(source, FunctionReward)]
    scores: list[torch.Tensor | None] = [
        None if isinstance(source, FunctionReward) else source.score(batch) for source in sources
    ]
    if functions:
        chosen = [sources[index] for index in functions]
        outputs = run_reward_functions(
            [source.function for source in chosen], reward_call(batch), [source.spec for source in chosen]
        )
        for index, source, output in zip(functions, chosen, outputs, strict=True):
            scores[index] = as_tensor(source.check(output, len(batch.completions)), batch)
    return scores


def load_reward_fn(spec: str) -> FunctionReward:
    """Import ``--reward_fn module:function`` (or ``path/to/file.py:function``), called as TRL calls reward
    functions (:mod:`marl.rewards.trl_calls`); named after the function, as TRL names it
    (``rewards/<function>``, not the module or the file's path: :func:`marl.rewards.trl_calls.callable_name`).

    Example:
        >>> load_reward_fn("math:fsum").name
        'fsum'
    """
    return FunctionReward(import_function(spec, "--reward_fn"), spec=spec)


def function_kind(spec: str) -> RewardBuilder:
    """The ``"function"`` reward kind (``--reward_fn module:function``): the function is imported at once,
    before any model loads, so that a typo fails before the wait; it reads no model part.

    Example:
        >>> function_kind("math:fsum")(None).name
        'fsum'
    """
    reward = load_reward_fn(spec)

    def build(parts: RewardParts) -> FunctionReward:
        return reward

    return build


class CheckedJudge:
    """A judge ``fn(texts) -> scores`` (higher is better) whose output is checked on every call.

    Example:
        >>> judge = CheckedJudge(lambda texts: [t.count("!") for t in texts], "excitement")
        >>> judge(["wow!", "ok"])
        [1.0, 0.0]
        >>> CheckedJudge(len, "length")(["ab"])
        Traceback (most recent call last):
        ...
        marl.errors.DataError: length returned a int; it must return a list of 1 numbers, one per completion
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
        return CheckedJudge(gold_judge_scores, "the VADER judge")
    return CheckedJudge(import_function(spec, "--judge"), f"judge {spec!r}")
