"""Reward functions called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls them, so that a function
written for TRL runs unchanged:

``function(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns)``

- ``prompts``: each row's prompt as the dataset holds it: a string, or for a conversation its message list;
- ``completions``: the completion text, or for a conversation ``[{"role": "assistant", "content": text}]``;
- ``completion_ids``: the completion's token ids, through the stop token (as TRL passes them);
- ``trainer_state``: a ``transformers.TrainerState`` with the run's progress (see
  :func:`marl.train.reward_state.reward_trainer_state`; ``marl evaluate`` passes a fresh one);
- every other dataset column, one value per completion: a prompt's row repeated for its k completions, in
  the rows' order (k-major in marl).

A function whose signature has ``**kwargs`` gets every keyword; one without gets only the keywords it names
(so marl's older ``f(prompts, completions)`` keeps working; see :func:`call_arguments` for ``f(p, c)``), and
a required parameter that none of the keywords fills is an error naming it. ``async def`` functions are
awaited, those of one batch together (``asyncio.gather``), as TRL does. What a function returns is checked by
:func:`marl.rewards.functions.check_scores` (``None`` or NaN: not judged).

Example:
    >>> def accuracy(completions, answer, **kwargs):
    ...     return [1.0 if c[0]["content"] == a else 0.0 for c, a in zip(completions, answer)]
    >>> call = RewardCall(
    ...     prompts=[[{"role": "user", "content": "1+1?"}]] * 2,
    ...     texts=["2", "3"],
    ...     completion_ids=[[17, 0], [18, 0]],
    ...     columns={"answer": ["2", "2"]},
    ... )
    >>> call.completions
    [[{'role': 'assistant', 'content': '2'}], [{'role': 'assistant', 'content': '3'}]]
    >>> run_reward_functions([accuracy], call)
    [[1.0, 0.0]]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from marl.data.prompts import is_conversation
from marl.errors import DataError

# The keywords TRL reserves: a dataset column of one of these names is not passed as a column.
RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")


@dataclass(frozen=True)
class RewardCall:
    """The arguments of one reward-function call, one entry per completion.

    ``prompts`` hold each row's prompt as the dataset gave it (text or messages) and ``texts`` the completion
    texts; :attr:`completions` wraps a conversation's completion as TRL does. ``columns`` maps each dataset
    column to its per-completion values."""

    prompts: Sequence[Any]
    texts: Sequence[str]
    completion_ids: Sequence[Sequence[int]] | None = None
    columns: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    trainer_state: Any = None

    @property
    def completions(self) -> list[Any]:
        return [
            [{"role": "assistant", "content": text}] if is_conversation(prompt) else text
            for prompt, text in zip(self.prompts, self.texts, strict=True)
        ]

    def keywords(self) -> dict[str, Any]:
        """Every keyword TRL passes: the columns, then ``prompts``, ``completions``, ``completion_ids`` and
        ``trainer_state``."""
        return {
            **{name: list(values) for name, values in self.columns.items() if name not in RESERVED_COLUMNS},
            "prompts": list(self.prompts),
            "completions": self.completions,
            "completion_ids": None
            if self.completion_ids is None
            else [list(ids) for ids in self.completion_ids],
            "trainer_state": self.trainer_state,
        }


def columns_per_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Per-row column dicts as one list per column (a column missing from a row gives ``None`` there).

    Example:
        >>> columns_per_row([{"answer": "2"}, {"answer": "4", "id": 7}])
        {'answer': ['2', '4'], 'id': [None, 7]}
    """
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}


def call_arguments(
    function: Callable[..., Any], keywords: Mapping[str, Any], where: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(positional, keyword)`` arguments of ``function`` for ``keywords``: all of them with ``**kwargs``,
    else those it names. A function of exactly two required positional parameters, one at least that no
    keyword fills and none named ``completions`` (marl's older ``f(p, c)`` / ``f(prompts, texts)``), gets
    ``(prompts, completions)`` positionally, as marl called it before. Otherwise a required parameter no
    keyword fills is an error naming it and the keywords there are.

    Example:
        >>> keywords = {"prompts": ["p"], "completions": ["c"], "x": [3]}
        >>> call_arguments(lambda prompts, completions: 0, keywords, "f")
        ((), {'prompts': ['p'], 'completions': ['c']})
        >>> call_arguments(lambda p, c: 0, keywords, "f")
        ((['p'], ['c']), {})
        >>> call_arguments(lambda completions, answer: 0, keywords, "reward function 'f'")
        Traceback (most recent call last):
        ...
        marl.errors.DataError: reward function 'f' has a parameter 'answer' that no keyword fills: ...
    """
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: give it everything, as TRL does
        return (), dict(keywords)
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return (), dict(keywords)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        parameter
        for parameter in parameters
        if parameter.default is inspect.Parameter.empty
        and parameter.kind is not inspect.Parameter.VAR_POSITIONAL
    ]
    unfilled = [parameter for parameter in required if parameter.name not in keywords]
    legacy = len(required) == 2 and all(parameter.kind in positional for parameter in required)
    if legacy and unfilled and "completions" not in {parameter.name for parameter in required}:
        return (keywords["prompts"], keywords["completions"]), {}
    if unfilled:
        raise DataError(
            f"{where} has a parameter {unfilled[0].name!r} that no keyword fills: reward functions are "
            f"called as TRL calls them, with the keywords {sorted(keywords)} (the dataset's columns "
            "among them). Rename the parameter, or add **kwargs"
        )
    named = {
        parameter.name for parameter in parameters if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY
    }
    return (), {name: value for name, value in keywords.items() if name in named}


def is_async(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` gives a coroutine (``async def``, or an object whose ``__call__`` is).

    Example:
        >>> async def judge(completions, **kwargs): ...
        >>> is_async(judge), is_async(len)
        (True, False)
    """
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 -- a callable object's method, not callable()
    )


def _raise_as_user_error(error: Exception, where: str) -> None:
    if isinstance(error, DataError):
        raise error
    raise DataError(
        f"{where} raised {type(error).__name__}: {error}. Fix that function (--debug shows the traceback)"
    ) from error


def run_reward_functions(
    functions: Sequence[Callable[..., Any]], call: RewardCall, names: Sequence[str] | None = None
) -> list[Any]:
    """Each function's raw output for ``call``, in order: plain functions one after the other, ``async def``
    ones awaited together. An exception raised inside a function ends the command with one line naming it.
    """
    names = list(names or [getattr(function, "__name__", type(function).__name__) for function in functions])
    keywords = call.keywords()
    outputs: list[Any] = [None] * len(functions)
    pending = []
    for index, (function, name) in enumerate(zip(functions, names, strict=True)):
        where = f"reward function {name!r}"
        arguments, chosen = call_arguments(function, keywords, where)
        if is_async(function):
            pending.append((index, where, function, arguments, chosen))
            continue
        try:
            outputs[index] = function(*arguments, **chosen)
        except Exception as error:
            _raise_as_user_error(error, where)
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(
                *(function(*arguments, **chosen) for _, _, function, arguments, chosen in pending),
                return_exceptions=True,
            )

        for (index, where, *_), output in zip(pending, _run_coroutine(gather), strict=True):
            if isinstance(output, Exception):
                _raise_as_user_error(output, where)
            outputs[index] = output
    return outputs


def _run_coroutine(make: Callable[[], Any]) -> Any:
    """Run the coroutine ``make()`` returns to its end; in a thread of its own when this thread already runs
    an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
