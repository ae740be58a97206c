"""Reward functions called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls them, so that a function
written for TRL runs unchanged:

``function(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=..., log_metric=...,
**columns)``

- ``prompts``: each row's prompt as the dataset holds it: a string, or for a conversation its message list;
- ``completions``: the completion text, or for a conversation ``[{"role": "assistant", "content": text}]``;
  where the tokenizer parses responses (it has a ``response_template``, or the older ``response_schema``),
  the message TRL's ``parse_response`` makes of the completion's ids (:func:`parsed_replies`: its content,
  and e.g. its ``reasoning_content`` or ``tool_calls`` as the template splits them), as TRL 1.16 does;
- ``completion_ids``: the completion's token ids, through the stop token (as TRL passes them);
- ``trainer_state``: a ``transformers.TrainerState`` with the run's progress (see
  :func:`marl.train.training_parts.reward_trainer_state`; ``marl evaluate`` passes a fresh one);
- every other dataset column, one value per completion: a prompt's row repeated for its k completions, in
  the rows' order (k-major in marl);
- ``log_extra(column, values)`` and ``log_metric(name, value)``: what the function logs goes into the call's
  :class:`RewardLog`. In training, each ``log_metric`` name is logged with the update's metrics under that
  name, the mean of the values given during the update's rollout over all processes (as TRL averages them),
  and each ``log_extra`` column (one value per completion) is a column of the update's sample table.

A function whose signature has ``**kwargs`` gets every keyword; one without gets only the keywords it names
(so a two-argument ``f(prompts, completions)`` works too; see :func:`call_arguments` for ``f(p, c)``), and
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
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from marl.data.prompts import is_conversation
from marl.errors import DataError

# The keywords TRL reserves: a dataset column of one of these names is not passed as a column.
RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")
# The sample table's own columns: a reward function's log_extra cannot replace them.
TABLE_COLUMNS = ("prompt", "completion", "score")


@dataclass
class RewardLog:
    """What reward functions logged during one scoring call, through TRL's ``log_extra`` and ``log_metric``
    keywords: extra columns of the sample table (one value per completion, in the call's row order) and each
    metric's values.

    Example:
        >>> log = RewardLog(rows=2)
        >>> log.log_extra_for("reward function 'f'")("parsed", [True, False])
        >>> log.log_metric_for("reward function 'f'")("format/ok", 0.5)
        >>> log.extra, log.metrics
        ({'parsed': [True, False]}, {'format/ok': [0.5]})
    """

    rows: int = 0
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra_for(self, where: str) -> Callable[[str, Sequence[Any]], None]:
        """``log_extra(column, values)`` for the function ``where`` names (in its errors)."""

        def log_extra(column: str, values: Sequence[Any]) -> None:
            if not isinstance(column, str) or column in TABLE_COLUMNS or column in self.extra:
                raise DataError(
                    f"{where} called log_extra({column!r}, ...): a column is named by a string other than "
                    f"{', '.join(TABLE_COLUMNS)} (the table's own) and logged once per scoring call. Choose "
                    "another name"
                )
            values = list(values)
            if len(values) != self.rows:
                raise DataError(
                    f"{where} called log_extra({column!r}, ...) with {len(values)} values for {self.rows} "
                    "completions: pass one value per completion, in order"
                )
            self.extra[column] = values

        return log_extra

    def log_metric_for(self, where: str) -> Callable[[str, float], None]:
        """``log_metric(name, value)`` for the function ``where`` names (in its errors)."""

        def log_metric(name: str, value: float) -> None:
            if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy scalar or 0-d tensor
                value = value.item()
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise DataError(
                    f"{where} called log_metric({name!r}, {value!r}): pass a metric name (a string) and one "
                    "real number"
                )
            self.metrics.setdefault(name, []).append(float(value))

        return log_metric

    def metric_sums(self) -> dict[str, tuple[float, int]]:
        """Each metric's sum and count, what processes add up (:func:`logged_metric_means`)."""
        return {name: (math.fsum(values), len(values)) for name, values in self.metrics.items()}


def logged_metric_means(per_process: Sequence[Mapping[str, tuple[float, int]]]) -> dict[str, float]:
    """Each logged metric's mean over every value any process logged (TRL: the sum over processes divided by
    the count), by name in sorted order; ``per_process``: each process's :meth:`RewardLog.metric_sums`.

    Example:
        >>> logged_metric_means([{"ok": (1.0, 2)}, {"ok": (2.0, 1), "len": (6.0, 2)}])
        {'len': 3.0, 'ok': 1.0}
    """
    totals: dict[str, list[float]] = {}
    for sums in per_process:
        for name, (total, count) in sums.items():
            running = totals.setdefault(name, [0.0, 0])
            running[0] += total
            running[1] += count
    return {name: totals[name][0] / totals[name][1] for name in sorted(totals) if totals[name][1]}


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
    log: RewardLog | None = None  # where log_extra and log_metric write (None: a log of this call alone)
    replies: Sequence[Mapping[str, Any] | None] | None = None  # parsed conversation replies (parsed_replies)
    turns: Sequence[Sequence[Mapping[str, Any]]] | None = None  # with tools: each completion's messages
    environments: Sequence[Any] | None = None  # with environments: each row's instance, passed as TRL does

    def __post_init__(self) -> None:
        if self.log is None:
            object.__setattr__(self, "log", RewardLog())
        self.log.rows = len(self.texts)

    @property
    def completions(self) -> list[Any]:
        if self.turns is not None:  # with tools: every turn and tool result, as TRL passes them
            return [[dict(message) for message in turns] for turns in self.turns]
        replies = self.replies or [None] * len(self.texts)
        return [
            text
            if not is_conversation(prompt)
            else [dict(reply) if reply is not None else {"role": "assistant", "content": text}]
            for prompt, text, reply in zip(self.prompts, self.texts, replies, strict=True)
        ]

    def keywords(self, where: str = "a reward function") -> dict[str, Any]:
        """Every keyword TRL passes: the columns, then ``prompts``, ``completions``, ``completion_ids``,
        ``trainer_state``, ``log_extra`` and ``log_metric`` (their errors name ``where``)."""
        return {
            **{name: list(values) for name, values in self.columns.items() if name not in RESERVED_COLUMNS},
            "prompts": list(self.prompts),
            "completions": self.completions,
            "completion_ids": None
            if self.completion_ids is None
            else [list(ids) for ids in self.completion_ids],
            "trainer_state": self.trainer_state,
            "log_extra": self.log.log_extra_for(where),
            "log_metric": self.log.log_metric_for(where),
            **({} if self.environments is None else {"environments": list(self.environments)}),
        }


def parses_responses(tokenizer: Any) -> bool:
    """Whether TRL 1.16's ``GRPOTrainer`` hands a conversation's completions to reward functions parsed by
    ``parse_response``: the tokenizer has a ``response_template`` (or the older ``response_schema``).

    Example:
        >>> from types import SimpleNamespace
        >>> parses_responses(SimpleNamespace(response_template=None)), parses_responses(object())
        (False, False)
    """
    return any(
        getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema")
    )


def parsed_replies(
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    conversations: Sequence[Any],
) -> list[dict[str, Any] | None] | None:
    """Each conversation's completion as TRL 1.16 hands it to reward functions where the tokenizer parses
    responses (:func:`parses_responses`): the message TRL's own ``trl.chat_template_utils.parse_response``
    makes of its ids after its prompt's ids (``prefix``); ``None`` for a plain prompt's row, and ``None``
    for all when the tokenizer does not parse responses (the completion text is then the reply's content).

    Example:
        >>> parsed_replies(object(), [[1]], [[2, 3]], [[{"role": "user", "content": "hi"}]]) is None
        True
    """
    if not parses_responses(tokenizer) or all(messages is None for messages in conversations):
        return None
    from trl.chat_template_utils import parse_response

    return [
        None if messages is None else parse_response(tokenizer, list(ids), prefix=list(prefix))
        for prefix, ids, messages in zip(prompt_ids, completion_ids, conversations, strict=True)
    ]


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
    keyword fills and none named ``completions`` (a two-argument ``f(p, c)`` / ``f(prompts, texts)``), gets
    ``(prompts, completions)`` positionally. Otherwise a required parameter no
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
    """Whether calling ``function`` gives a coroutine: TRL's own ``is_async_callable`` (``async def``, a
    ``functools.partial`` of one, or an object whose ``__call__`` is).

    Example:
        >>> import functools
        >>> async def judge(completions, **kwargs): ...
        >>> is_async(judge), is_async(functools.partial(judge, completions=[])), is_async(len)
        (True, True, False)
    """
    from trl.trainer.utils import is_async_callable

    return is_async_callable(function)


def callable_name(function: Callable[..., Any]) -> str:
    """The name a reward function's metric carries: TRL's own ``get_callable_name`` (a ``functools.partial``
    by the function it wraps, a callable object by its class).

    Example:
        >>> import functools
        >>> def accuracy(completions, answer, **kwargs): ...
        >>> callable_name(functools.partial(functools.partial(accuracy, answer="2"))), callable_name(len)
        ('accuracy', 'len')
    """
    from trl.trainer.utils import get_callable_name

    return get_callable_name(function)


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
        keywords["log_extra"] = call.log.log_extra_for(where)
        keywords["log_metric"] = call.log.log_metric_for(where)
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
