"""Tools and environments as TRL 1.16's ``GRPOTrainer`` takes them, checked before any work.

``tools``: plain functions (sync or ``async def``) whose type hints and docstrings the chat template renders
as the tools' schemas. ``environment_factory``: a callable making one environment, or a dict of them chosen by
each example's ``environment`` column; every rollout row gets an instance of its own (reused across updates,
``reset`` with the row's example first), whose public methods are the row's tools and whose ``get_reward()``,
where it has one, is a reward source of weight 1 named after its class (:meth:`ToolBox.reward_sources`).
The rollout that calls them is :mod:`marl.rollout.tool_calls`.

Example:
    >>> def add(a: int, b: int) -> int:
    ...     '''Adds two numbers.
    ...
    ...     Args:
    ...         a: The first number.
    ...         b: The second number.
    ...     '''
    ...     return a + b
    >>> box = ToolBox([add])
    >>> [tool.__name__ for tool in box.tools_of(None)], box.reward_sources()
    (['add'], [])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from marl.errors import ConfigError, DataError
from marl.rewards.functions import FunctionReward

if TYPE_CHECKING:
    from marl.data.prompts import Prompt

# The dataset column that picks each example's environment when ``environment_factory`` is a dict.
ENVIRONMENT_COLUMN = "environment"
# Methods of an environment that are not tools.
ENVIRONMENT_METHODS = ("reset", "get_reward")


def check_tool(tool: Callable[..., Any], where: str | None = None) -> None:
    """Refuse a tool the chat template cannot describe: transformers' ``get_json_schema`` reads its type hints
    and its Google-style docstring, as the template does when it renders the tools. ``where`` names it in
    the error (default: ``tool 'its name'``).

    Example:
        >>> check_tool(lambda a: a)
        Traceback (most recent call last):
        ...
        marl.errors.ConfigError: tool '<lambda>': the model cannot be told how to call it (...
    """
    from transformers.utils import get_json_schema

    where = where or f"tool {getattr(tool, '__name__', repr(tool))!r}"
    try:
        get_json_schema(tool)
    except Exception as error:
        raise ConfigError(
            f"{where}: the model cannot be told how to call it ({error}). Give every argument a type hint "
            "and the function a Google-style docstring with an 'Args:' line per argument"
        ) from error


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """The tools of an environment instance: its public methods but ``reset`` and ``get_reward``, read on
    its class (so that reading them evaluates no property), bound to the instance."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ENVIRONMENT_METHODS and not name.startswith("_")
    ]


class ToolBox:
    """The tools and environments of a run, checked when it is built (before any model work): each tool
    described by its type hints and docstring (:func:`check_tool`), each environment factory called once to
    check its ``reset`` and its tools.

    Args:
        tools: plain functions, sync or ``async def``, offered to every row.
        environment_factory: a callable returning an environment, or a dict ``{name: callable}`` chosen by
            each example's ``environment`` column.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]] = (),
        environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
    ) -> None:
        self.tools = list(tools or [])
        for tool in self.tools:
            check_tool(tool)
        self.by_column = isinstance(environment_factory, Mapping)
        if environment_factory is None:
            self.factories: dict[str | None, Callable[[], Any]] = {}
        elif self.by_column:
            self.factories = dict(environment_factory)
        else:
            self.factories = {None: environment_factory}
        self.pool: dict[str | None, list[Any]] = {}
        self.reward_types: list[type] = []  # environment classes that own a reward, one source each
        for name, factory in self.factories.items():
            where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            if not callable(factory):
                raise ConfigError(
                    f"{where} is a {type(factory).__name__}, not a callable making an environment"
                )
            instance = factory()
            if not callable(getattr(type(instance), "reset", None)):
                raise ConfigError(
                    f"{where} made a {type(instance).__name__} without a reset method: an environment needs "
                    "reset(**example) (returning None, or text to add to the prompt)"
                )
            for method in environment_tools(instance):
                check_tool(method, f"{where}: {type(instance).__name__}.{method.__name__}")
            self.pool[name] = [instance]
            if (
                callable(getattr(type(instance), "get_reward", None))
                and type(instance) not in self.reward_types
            ):
                self.reward_types.append(type(instance))

    def __bool__(self) -> bool:
        return bool(self.tools or self.factories)

    def environment_of(self, columns: Mapping[str, Any]) -> str | None:
        """The name of an example's environment: its ``environment`` column when the factories are a dict."""
        return columns.get(ENVIRONMENT_COLUMN) if self.by_column else None

    def tools_of(self, environment: str | None) -> list[Callable[..., Any]]:
        """The tools a row of ``environment`` is offered (its environment's methods after the plain tools),
        as the chat template renders them."""
        if environment not in self.pool:
            return list(self.tools)
        return [*self.tools, *environment_tools(self.pool[environment][0])]

    def check_examples(self, columns: Sequence[Mapping[str, Any]], name: str) -> None:
        """Refuse, before any work, an example whose ``environment`` column names no environment."""
        if not self.by_column:
            return
        for index, row in enumerate(columns):
            if row.get(ENVIRONMENT_COLUMN) not in self.factories:
                raise DataError(
                    f"{name} row {index}: environment={row.get(ENVIRONMENT_COLUMN)!r} is not one of "
                    f"environment_factory's {sorted(map(str, self.factories))}; fix the 'environment' column"
                )

    def reward_sources(self) -> list[FunctionReward]:
        """One reward source per environment class that has ``get_reward``, named after the class: a row is
        scored by its environment's ``get_reward()`` when the environment is of exactly that class (else not
        judged), as TRL scores it."""
        return [FunctionReward(environment_reward(kind), kind.__name__) for kind in self.reward_types]

    def environments(self, names: Sequence[str | None]) -> list[Any]:
        """One instance per row (rows of ``names``), drawn from the pool of each environment, which grows only
        when a batch needs more instances of it than were ever made."""
        handed: dict[str | None, int] = {}
        chosen = []
        for name in names:
            pool, index = self.pool[name], handed.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed[name] = index + 1
            chosen.append(pool[index])
        return chosen


def check_tool_prompts(box: ToolBox, prompts: Sequence[Prompt], name: str) -> None:
    """Refuse, before any work, prompts a tool-calling rollout cannot run: a plain-text prompt (the model's
    turns and the tools' results are messages) or an example naming no environment."""
    for index, prompt in enumerate(prompts):
        if prompt.messages is None:
            raise not_a_conversation(name, index)
    box.check_examples([prompt.columns for prompt in prompts], name)


def check_tool_dataset(dataset: Any, name: str) -> None:
    """:func:`check_tool_prompts`' refusal of plain-text prompts, on a dataset's ``prompt`` column."""
    from marl.data.prompts import is_conversation

    column = dataset["prompt"] if "prompt" in dataset.column_names else [None]
    for index, prompt in enumerate(column):
        if not is_conversation(prompt):
            raise not_a_conversation(name, index)


def not_a_conversation(name: str, index: int) -> DataError:
    return DataError(
        f"{name} row {index}: tools need conversations, a list of {{'role', 'content'}} messages; give the "
        "'prompt' column messages, e.g. [{'role': 'user', 'content': text}]"
    )


def environment_reward(kind: type) -> Callable[..., list[float | None]]:
    """The reward function of environment class ``kind``: each row's ``get_reward()`` where its environment
    is of exactly that class, ``None`` elsewhere (awaited where ``get_reward`` is ``async def``)."""
    if inspect.iscoroutinefunction(kind.get_reward):

        async def get_reward(environments: Sequence[Any], **_: Any) -> list[float | None]:
            return [await env.get_reward() if type(env) is kind else None for env in environments]

    else:

        def get_reward(environments: Sequence[Any], **_: Any) -> list[float | None]:
            return [env.get_reward() if type(env) is kind else None for env in environments]

    return get_reward


# ------------------------------------------------------------------------------------------------------------
# The chat template


def prepare_tool_template(tokenizer: Any) -> str | None:
    """Make ``tokenizer`` ready for tool calls as TRL's ``GRPOTrainer`` does, or refuse in one line: its chat
    template must render a whole tool-calling exchange (TRL's ``supports_tool_calling``); a template TRL
    knows gets its response parser (``add_response_schema``) unless the tokenizer has one. Returns the chat
    template to render with: TRL's training template where the tokenizer's does not keep earlier turns as
    they were rendered (which the tool results' ids rely on), else ``None`` (the tokenizer's own)."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    if not supports_tool_calling(tokenizer):
        raise ConfigError(
            "tools need a chat template that renders tool calls and tool results (Qwen2.5/Qwen3's or "
            "Llama-3.1's, e.g. trl.chat_template_utils.qwen2_5_chat_template); this tokenizer's does not. "
            "Give it one: tokenizer.chat_template, saved in the model's folder "
            "(docs/guides/agents-with-tools.md)"
        )
    if (
        getattr(tokenizer, "response_template", None) is None
        and getattr(tokenizer, "response_schema", None) is None
    ):
        try:
            add_response_schema(tokenizer)
        except ValueError as error:
            raise ConfigError(
                "tools: the model's turns cannot be parsed for tool calls: TRL knows no response parser for "
                "this chat template. Set tokenizer.response_template (transformers' response parsing) or use "
                "a template TRL knows (Qwen2.5/Qwen3, Llama-3.1)"
            ) from error
    if is_chat_template_prefix_preserving(tokenizer):
        return None
    return get_training_chat_template(tokenizer)
