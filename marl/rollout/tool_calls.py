"""The tool-calling rollout, turn by turn, as TRL 1.16's ``GRPOTrainer`` runs it, on any sampler
(the tools and environments it calls: :mod:`marl.rollout.toolbox`):

1. turn 1: ``sampler.sample(batch, k)``: each prompt computed once for its ``k`` completions;
2. each turn is parsed as TRL parses it (its own ``parse_response``, the template's tool-call format); the
   rows whose turn calls tools call them (an exception becomes the result ``{"error": str(e)}``), and the
   results are appended through the chat template;
3. the rows still calling tools decode their next turn, each row on its own (``sampler.sample(rows, 1)``:
   their histories differ), until a turn calls no tool, ``max_tool_calling_iterations`` turns were taken or
   the completion's budget (``response_length``, TRL's ``max_completion_length``) is spent. A result that
   would not fit ends the row without it, and a turn is cut to what is left. Every row keeps its own turn
   count; a row that is done waits, and so does a process whose rows are all done while another's decode.

The completion is every turn with the tools' results between them; ``tool_mask`` is False on the results,
which neither the loss nor the KL reads, and lengths count the model's tokens only
(:attr:`marl.rollout.completions.Samples.model_mask`).

Example:
    >>> calling = ToolCalling(ToolBox([add]), tokenizer, None, ends, 256, 4096, None)  # doctest: +SKIP
    >>> samples = calling.rollout(sampler, prompts, k=4)  # doctest: +SKIP
    >>> samples.turns[0]  # doctest: +SKIP
    [{'role': 'assistant', 'content': '', 'tool_calls': [...]}, {'role': 'tool', ...}, ...]
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from marl.errors import ConfigError
from marl.rollout.toolbox import ENVIRONMENT_COLUMN, ToolBox, environment_tools

if TYPE_CHECKING:
    from marl.data.prompts import Prompt, PromptBatch
    from marl.rollout.completions import Samples
    from marl.rollout.samplers import Sampler


def tool_suffix_ids(
    tokenizer: Any, tool_messages: Sequence[Mapping[str, Any]], chat_template: str | None
) -> list[int]:
    """The ids that follow an assistant turn when ``tool_messages`` answer it, up to the next assistant
    header: the difference between a short conversation rendered with and without them (cut, as TRL cuts
    it, after the turn's end-of-sequence id, which some templates follow with a newline)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    before = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    kwargs = {"tokenize": True, "return_dict": False, "chat_template": chat_template}
    prefix = list(tokenizer.apply_chat_template(before, add_generation_prompt=False, **kwargs))
    full = list(
        tokenizer.apply_chat_template(before + list(tool_messages), add_generation_prompt=True, **kwargs)
    )
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ConfigError(
            "tools: the chat template renders an assistant turn differently once tool results follow it, so "
            "the results cannot be appended to the sampled ids; use a template that keeps earlier turns"
        )
    return full[len(prefix) :]


# ------------------------------------------------------------------------------------------------------------
# The rollout


@dataclass(frozen=True)
class TurnEnds:
    """What ends a turn (the sampler's stop ids; the EOS ids among them, for the EOS count) and the pad id."""

    stop_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @classmethod
    def of(cls, tokenizer: Any, model: Any, stop_at_eos: bool, stop_token_id: int | None) -> TurnEnds:
        """The ends of ``model``'s turns as its sampler ends completions (``--stop_token``,
        ``--stop_token_id``)."""
        from marl.model.sampling import eos_token_ids, pad_token_id

        eos = eos_token_ids(tokenizer, model.generation_config)
        stop = eos if stop_at_eos else (() if stop_token_id is None else (stop_token_id,))
        return cls(tuple(stop), tuple(eos), pad_token_id(tokenizer))


@dataclass
class ToolCalling:
    """A run's tool-calling rollout, built once: its tools and environments, the tokenizer and the template it
    renders with (:func:`prepare_tool_template`), the ends of a turn, the completion's budget and the
    model's context, ``max_iterations`` (TRL's ``max_tool_calling_iterations``; ``None``: no limit), and
    ``any_process``: where the processes decode together (a sharded base), whether any of them has a row
    left to decode (elsewhere ``bool``: each process's own rows decide)."""

    box: ToolBox
    tokenizer: Any
    chat_template: str | None
    ends: TurnEnds
    response_length: int
    context_length: int | None
    max_iterations: int | None
    any_process: Callable[[bool], bool] = bool

    def rollout(self, sampler: Sampler, prompts: Sequence[Prompt], k: int) -> Samples:
        """:func:`tool_rollout` of ``prompts`` with these settings."""
        return tool_rollout(
            sampler,
            prompts,
            k,
            self.box,
            self.tokenizer,
            response_length=self.response_length,
            context_length=self.context_length,
            max_iterations=self.max_iterations,
            ends=self.ends,
            chat_template=self.chat_template,
            any_process=self.any_process,
        )


def conversation_text(turns: Sequence[Mapping[str, Any]]) -> str:
    """A completion's turns as the sample table shows them: each assistant turn with its tool calls, each
    tool result, one per line.

    Example:
        >>> print(conversation_text([
        ...     {"role": "assistant", "content": "", "tool_calls": [
        ...         {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        ...     {"role": "tool", "name": "add", "content": "3"},
        ...     {"role": "assistant", "content": "It is 3."},
        ... ]))
        assistant: [add(a=1, b=2)]
        tool add: 3
        assistant: It is 3.
    """
    lines = []
    for message in turns:
        if message["role"] == "tool":
            lines.append(f"tool {message.get('name', '')}: {message['content']}")
            continue
        calls = [
            f"[{call['function']['name']}("
            + ", ".join(
                f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                for key, value in (call["function"].get("arguments") or {}).items()
            )
            + ")]"
            for call in message.get("tool_calls") or []
            if "function" in call
        ]
        lines.append(" ".join(part for part in ["assistant:", message.get("content") or "", *calls] if part))
    return "\n".join(lines)


@dataclass
class ToolRow:
    """One row's conversation while it is sampled: its prompt's ids, the completion so far (every turn and the
    results between them), which of those ids are the model's, the log-prob each model token was drawn with
    (0 at the results; ``None`` where the sampler keeps none), its messages and its tool counts."""

    prompt_ids: list[int]
    tools: list[Callable[..., Any]]
    completion_ids: list[int] = dataclasses.field(default_factory=list)
    model_tokens: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = dataclasses.field(default_factory=list)
    turns: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: int = 0
    failures: int = 0

    def add_turn(self, ids: list[int], logprobs: list[float] | None, message: dict[str, Any] | None) -> None:
        self.completion_ids += ids
        self.model_tokens += [True] * len(ids)
        self.logprobs = None if logprobs is None or self.logprobs is None else self.logprobs + logprobs
        if message:
            self.turns.append(message)

    def pending_calls(self) -> list[dict[str, Any]]:
        """The tool calls of the row's last turn (none once a turn called no tool)."""
        return (
            (self.turns[-1].get("tool_calls") or [])
            if self.turns and self.turns[-1]["role"] == "assistant"
            else []
        )


def call_tools(row: ToolRow, calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Run one turn's tool calls, as TRL does: each call counted, a call of an unknown tool or one that raises
    answered by ``{"error": str(e)}`` and counted as a failure, the ``async def`` tools of the turn awaited
    together. Returns the tool messages, in the order of the calls."""
    named = {tool.__name__: tool for tool in row.tools}
    results: list[Any] = [None] * len(calls)
    names: list[str] = []
    waiting = []
    for index, call in enumerate(calls):
        row.calls += 1
        if call.get("type") != "function":
            row.failures += 1
            names.append(call.get("name", "unknown"))
            results[index] = {"error": f"Unsupported tool call type: {call.get('type')}"}
            continue
        function = call["function"]
        names.append(function["name"])
        try:
            tool = named.get(function["name"])
            if tool is None:
                raise ValueError(f"Tool {function['name']} not found.")
            if inspect.iscoroutinefunction(tool):
                waiting.append((index, tool(**function["arguments"])))
            else:
                results[index] = tool(**function["arguments"])
        except Exception as error:
            row.failures += 1
            results[index] = {"error": str(error)}
    if waiting:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(coroutine for _, coroutine in waiting), return_exceptions=True)

        for (index, _), result in zip(waiting, asyncio.run(gather()), strict=True):
            if isinstance(result, Exception):
                row.failures += 1
                result = {"error": str(result)}
            results[index] = result
    return [
        {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
        for name, result in zip(names, results, strict=True)
    ]


def tool_rollout(
    sampler: Sampler,
    prompts: Sequence[Prompt],
    k: int,
    box: ToolBox,
    tokenizer: Any,
    *,
    response_length: int,
    context_length: int | None,
    max_iterations: int | None,
    ends: TurnEnds,
    chat_template: str | None = None,
    any_process: Callable[[bool], bool] = bool,
) -> Samples:
    """``k`` completions of every prompt, each a conversation of turns and tool results (see the module
    docstring), k-major as every rollout: row ``j * P + i`` completes prompt ``i``.

    ``any_process(flag)``: whether ``flag`` holds on any process; every process decodes as many turns as the
    process with the most (a process with no row left decodes one row it throws away), so that processes
    whose decode talks to the others stay in step. ``ends``: the ids that end a turn and the pad id.
    ``chat_template``: the template to render with (:func:`prepare_tool_template`; ``None``: the
    tokenizer's)."""
    from trl.chat_template_utils import parse_response

    from marl.data.prompts import Prompt, tokenize_prompt

    rows_prompts = [prompts[i] for _ in range(k) for i in range(len(prompts))]
    names = [box.environment_of(prompt.columns) for prompt in rows_prompts]
    environments = box.environments(names) if box.factories else []
    row_prompts = []
    for row, prompt in enumerate(rows_prompts):
        messages = list(prompt.messages)
        if environments:
            example = {"prompt": prompt.messages, **prompt.columns}
            if box.by_column:
                example.pop(ENVIRONMENT_COLUMN, None)
            observation = environments[row].reset(**example)
            if observation is not None:  # the observation joins the last message, as TRL adds it
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        if environments or chat_template is not None:
            ids, text = tokenize_prompt(
                tokenizer, messages, tools=box.tools_of(names[row]), chat_template=chat_template
            )
            prompt = Prompt(tuple(ids), text, messages, prompt.columns)
        row_prompts.append(prompt)
    # each row calls its own environment's methods: the tools are bound to the row's instance
    rows = [
        ToolRow(
            list(prompt.ids), [*box.tools, *(environment_tools(environments[row]) if environments else [])]
        )
        for row, prompt in enumerate(row_prompts)
    ]

    # Turn 1: each prompt once for its k completions, where its k rows still share it.
    shared = all(
        row_prompts[j * len(prompts) + i].ids == row_prompts[i].ids
        for j in range(k)
        for i in range(len(prompts))
    )
    if shared:
        first = sampler.sample(sampler.batch(row_prompts[: len(prompts)]), k)
    else:
        first = sampler.sample(sampler.batch(row_prompts), 1)
    for row, ids, logprobs in zip(rows, *_sampled_turns(first), strict=True):
        row.add_turn(
            ids,
            logprobs,
            parse_response(tokenizer, ids, prefix=row.prompt_ids, tools=row.tools) if ids else None,
        )

    turns_left = max_iterations if max_iterations is not None else float("inf")
    calling = [row for row in rows if row.pending_calls()]
    while any_process(bool(calling) and turns_left > 0):
        continuing, contexts = [], []
        for row in calling if turns_left > 0 else []:
            kept_turns = len(row.turns)
            row.turns += call_tools(row, row.pending_calls())
            suffix = tool_suffix_ids(tokenizer, row.turns[kept_turns:], chat_template)
            context = row.prompt_ids + row.completion_ids + suffix
            too_long = len(row.completion_ids) + len(suffix) > response_length or (
                context_length is not None and len(context) >= context_length
            )
            if too_long:  # the results do not fit: the row ends as it is, without them
                del row.turns[kept_turns:]
                continue
            row.completion_ids += suffix
            row.model_tokens += [False] * len(suffix)
            row.logprobs = None if row.logprobs is None else row.logprobs + [0.0] * len(suffix)
            continuing.append(row)
            contexts.append(Prompt(tuple(context), ""))
        if not any_process(bool(contexts)):  # every result was too long to append, on every process
            break
        # A process with nothing to decode decodes a row it throws away while another process decodes.
        batch = sampler.batch(contexts or [Prompt(tuple(rows[0].prompt_ids), "")])
        turn = sampler.sample(batch, 1)
        for row, context, ids, logprobs in zip(continuing, contexts, *_sampled_turns(turn), strict=False):
            budget = response_length - len(row.completion_ids)
            ids = ids[:budget]
            logprobs = None if logprobs is None else logprobs[:budget]
            message = (
                parse_response(tokenizer, ids, prefix=list(context.ids), tools=row.tools) if ids else None
            )
            row.add_turn(ids, logprobs, message)
        calling = [row for row in continuing if row.pending_calls()]
        turns_left -= 1
    return _samples(
        rows, row_prompts, len(prompts), environments, sampler.batch(row_prompts), tokenizer, ends
    )


def _sampled_turns(samples: Samples) -> tuple[list[list[int]], list[list[float] | None]]:
    """Each row's sampled ids through its stop token, and the log-probs they were drawn with (``None`` each
    where the sampler keeps none)."""
    ids = samples.completion_ids
    if samples.sampled_logprobs is None:
        return ids, [None] * len(ids)
    kept = [
        row[mask].tolist() for row, mask in zip(samples.sampled_logprobs, samples.response_mask, strict=True)
    ]
    return ids, kept


def _samples(
    rows: Sequence[ToolRow],
    prompts: Sequence[Prompt],
    groups: int,
    environments: list[Any],
    batch: PromptBatch,
    tokenizer: Any,
    ends: TurnEnds,
) -> Samples:
    """The rollout's record of finished conversations: completions right-padded, a row complete where its last
    token ends a turn (a stop token), ``tool_mask`` False on the tools' results."""
    from marl.rollout.completions import Samples, is_stop_token

    device = batch.ids.device
    width = max(1, *(len(row.completion_ids) for row in rows))
    pad = ends.pad_token_id
    responses = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    model = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    kept = all(row.logprobs is not None for row in rows)
    logprobs = torch.zeros(len(rows), width, device=device) if kept else None
    for index, row in enumerate(rows):
        length = len(row.completion_ids)
        responses[index, :length] = torch.tensor(row.completion_ids, dtype=torch.long)
        valid[index, :length] = True
        model[index, :length] = torch.tensor(row.model_tokens)
        if logprobs is not None:
            logprobs[index, :length] = torch.tensor(row.logprobs)
    lengths = valid.sum(dim=1)
    last = responses.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1))
    stop_ids, eos_ids = ends.stop_token_ids, ends.eos_token_ids
    ended = is_stop_token(last, stop_ids).squeeze(1) & (lengths > 0)
    return Samples(
        prompt_texts=[prompt.text for prompt in prompts],
        completions=tokenizer.batch_decode([row.completion_ids for row in rows], skip_special_tokens=True),
        prompt_ids=batch.ids,
        prompt_mask=batch.mask,
        response_ids=responses,
        response_mask=valid,
        contains_stop=ended,
        contains_eos=is_stop_token(last, eos_ids).squeeze(1) & (lengths > 0),
        prompt_index=torch.arange(groups, device=device).repeat(len(rows) // groups),
        prompt_messages=[prompt.messages for prompt in prompts],
        prompt_columns=[dict(prompt.columns) for prompt in prompts],
        sampled_logprobs=logprobs,
        tool_mask=model,
        turns=[row.turns for row in rows],
        environments=environments,
        tool_calls=torch.tensor([row.calls for row in rows], device=device),
        tool_failures=torch.tensor([row.failures for row in rows], device=device),
    )
