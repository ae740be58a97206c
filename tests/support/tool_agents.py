"""Tool-calling agents on tiny models, a scripted policy driving them through TRL 1.16's ``GRPOTrainer``
and through marl.

Two tiny saved models whose chat templates are TRL's own tool-calling templates
(``trl.chat_template_utils``): a Qwen2 model with ``qwen2_5_chat_template`` (Hermes format: ``<tool_call>``
JSON ``</tool_call>``, turns closed by ``<|im_end|>``, its eos; a pad token of its own) and a Llama model
with ``llama3_1_chat_template`` (a bare ``{"name": ..., "parameters": ...}`` JSON turn, one call per turn,
turns closed by ``<|eot_id|>``, its eos; pad is the eos, as Llama-3 users set it).

The policy is a script, not the model (:class:`Script`): from a row's context (its prompt, every earlier
turn and tool result) it writes the next turn in the template's format, by the task the prompt names
(``task=NAME``, :func:`plan`) and the tool results so far, so rows stop at different turns: at once, after
one or two tool calls, after an unknown tool or a tool that raises, at the length limit, or when a tool's
result would not fit. Rows whose contexts are equal (the ``k`` rows of a prompt before they diverge) are told
apart by their order in the call, which TRL (prompt-major rows) and marl (k-major rows) both keep within a
prompt.

- :func:`trl_tool_run`: a real ``GRPOTrainer`` whose ``_generate_single_turn`` is the script (on that
  instance only), one ``_generate_and_score_completions`` and one ``compute_loss``.
- ``--sampler scripted`` (:class:`ScriptedSampler`, written against marl's ``Sampler`` protocol alone): the
  same script on each row's context, for marl's tool loop.

Both sides start from the same LoRA policy (:func:`set_policy_weights`), away from its reference, so that the
KL term of the loss reads the model's log-probs.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from support.families import build_family_tokenizer

K = 2
MAX_COMPLETION_LENGTH = 256
LORA_R, LORA_ALPHA = 4, 8
BETA = 0.04
SAMPLER_NAME = "scripted"
TEMPLATES = ("qwen2", "llama3")


# ------------------------------------------------------------------------------------------------------------
# Tools and an environment, described by their type hints and docstrings


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divides one integer by another.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b  # b=0 raises: the call's result is {"error": "division by zero"}


async def echo(text: str, times: int) -> str:
    """Repeats a text.

    Args:
        text: The text to repeat.
        times: How many times to repeat it.
    """
    return text * times


TOOLS = [add, divide, echo]
ENVIRONMENT_TOOLS = [divide, echo]  # with Calculator, whose add is the third tool


class Calculator:
    """A running total that the model adds to; its reward is the total reached and the calls it took."""

    def reset(self, **example: Any) -> str | None:
        self.total = int(example.get("start", 0))
        self.calls = 0
        return f" Start at {self.total}."

    def add(self, a: int, b: int) -> int:
        """Adds two integers to the running total and returns the total.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        self.total += a + b
        return self.total

    def get_reward(self) -> float:
        return self.total / 10 + self.calls


class Notepad:
    """Notes the model writes down; it owns no reward (its rows are not judged by Calculator's)."""

    def reset(self, **example: Any) -> str | None:
        self.notes: list[str] = []
        return None

    def note(self, text: str) -> int:
        """Writes a note down and returns how many notes there are.

        Args:
            text: The note.
        """
        self.notes.append(text)
        return len(self.notes)


def tool_messages_reward(completions: list[list[dict]], **_: Any) -> list[float]:
    """The number of tool results in the conversation, plus a hundredth of the last message's length."""
    return [
        sum(message["role"] == "tool" for message in completion) + len(str(completion[-1]["content"])) / 100
        for completion in completions
    ]


def completion_ids_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """Reads every id of the completion, the tools' results included: their count and the last id."""
    return [len(ids) / 100 + ids[-1] / 1000 for ids in completion_ids]


def environment_calls_reward(environments: list[Calculator], **_: Any) -> list[float]:
    """Reads the environments, one per completion, as TRL passes them: the calls each one took, halved."""
    return [environment.calls / 2 for environment in environments]


REWARD_FUNCS = [tool_messages_reward, completion_ids_reward]
# What each side is given: plain tools, or an environment owning a reward beside the plain tools (and a reward
# function that reads the environments).
SETUPS: dict[str, dict[str, Any]] = {
    "tools": dict(tools=TOOLS),
    "environment": dict(
        tools=ENVIRONMENT_TOOLS,
        environment_factory=Calculator,
        reward_funcs=[*REWARD_FUNCS, environment_calls_reward],
    ),
    # each example's ``environment`` column picks one (see examples(environments=...))
    "environments": dict(
        tools=ENVIRONMENT_TOOLS, environment_factory={"calculator": Calculator, "notepad": Notepad}
    ),
}


# ------------------------------------------------------------------------------------------------------------
# Tiny models with TRL's tool-calling templates


@dataclass(frozen=True)
class ToolTemplate:
    """One tool-calling chat template: its tokens, how a tool call is written and where a turn starts."""

    name: str
    architecture: str
    special_tokens: tuple[str, ...]
    eos: str
    bos: str | None
    pad_is_eos: bool
    result_marker: str  # text that opens each tool result in the context
    one_call_per_turn: bool

    @property
    def chat_template(self) -> str:
        from trl.chat_template_utils import llama3_1_chat_template, qwen2_5_chat_template

        return qwen2_5_chat_template if self.name == "qwen2" else llama3_1_chat_template

    def call_text(self, calls: Sequence[tuple[str, dict]]) -> str:
        """The text of a turn that makes ``calls`` (without its end token)."""
        if self.name == "qwen2":
            return "\n".join(
                f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
                for name, arguments in calls
            )
        (name, arguments), *more = calls
        assert not more, "Llama-3.1's template makes one tool call per turn"
        return json.dumps({"name": name, "parameters": arguments})


TOOL_TEMPLATES = {
    "qwen2": ToolTemplate(
        name="qwen2",
        architecture="qwen2",
        special_tokens=("<|im_start|>", "<|im_end|>"),
        eos="<|im_end|>",
        bos=None,
        pad_is_eos=False,
        result_marker="<tool_response>",
        one_call_per_turn=False,
    ),
    "llama3": ToolTemplate(
        name="llama3",
        architecture="llama",
        special_tokens=(
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
        pad_is_eos=True,
        result_marker="<|start_header_id|>ipython<|end_header_id|>",
        one_call_per_turn=True,
    ),
}


def template_of(tokenizer: Any) -> ToolTemplate:
    """The :class:`ToolTemplate` whose chat template ``tokenizer`` has."""
    for template in TOOL_TEMPLATES.values():
        if tokenizer.chat_template == template.chat_template:
            return template
    raise ValueError("the tokenizer's chat template is neither of TOOL_TEMPLATES")


# Ordinary tokens for the pieces of the tools' JSON schemas, which the byte-level vocabulary (trained on film
# reviews) spells nearly byte by byte: they halve the prompts the templates render with the tools.
SCHEMA_TOKENS = [
    "        ", "    ", '"type": ', '"integer"', '"description": ', '"function"', '"parameters"',
    '"properties"', '"required"', '"string"', '"object"', '"name": ', '"return": ', "The ", "integer",
    '{"type": "function", "function": {"name": ',
]  # fmt: skip


def build_tool_tokenizer(name: str):
    """The byte-level tokenizer of the family table with the template's special tokens, eos, BOS and
    :data:`SCHEMA_TOKENS`."""
    template = TOOL_TEMPLATES[name]
    tokenizer = build_family_tokenizer(
        template.special_tokens, pad_is_eos=template.pad_is_eos, with_bos=False
    )
    tokenizer.add_tokens(SCHEMA_TOKENS)
    tokenizer.eos_token = template.eos
    if template.bos is not None:
        tokenizer.bos_token = template.bos
    if template.pad_is_eos:
        tokenizer.pad_token = template.eos
    tokenizer.chat_template = template.chat_template
    return tokenizer


def save_tool_model(name: str, directory: Path, seed: int = 0) -> Path:
    """Build the tiny model of template ``name`` (hidden 64, 2 layers, fp32; positions for the long prompts
    the tool schemas make) and save it with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    template = TOOL_TEMPLATES[name]
    tokenizer = build_tool_tokenizer(name)
    config = AutoConfig.for_model(
        template.architecture,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        top_k=0,
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------------------
# The scripted policy


@dataclass(frozen=True)
class Unended:
    """A turn's text written without the turn's end token (it runs into the length limit)."""

    text: str


# A turn: a list of tool calls, a final answer (closed by the eos), or Unended text.
Turn = list[tuple[str, dict]] | str | Unended


def plan(task: str, results: int, sample: int, one_call_per_turn: bool) -> Turn:
    """What a row of ``task`` writes once ``results`` tool results are in its context; ``sample`` tells
    equal contexts apart (0 for the first row of the call with that context, 1 for the next), so the k rows
    of a prompt differ where their contexts are still equal."""
    if task == "answer":
        return f"It is {'very ' * sample}done."
    if task == "one-call":  # a sync tool or an async one
        if results == 0:
            return [("add", {"a": 2, "b": 3})] if sample == 0 else [("echo", {"text": "ab", "times": 3})]
        return "The result is back."
    if task == "two-calls":  # two calls in two turns, or (where the template allows) both in one turn
        if results == 0:
            both = sample == 1 and not one_call_per_turn
            return [("add", {"a": 1, "b": 2})] + ([("add", {"a": 3, "b": 4})] if both else [])
        return [("add", {"a": 3, "b": 4 + 10 * sample})] if results == 1 else "Both sums are back."
    if task == "fail":  # an unknown tool, or a tool that raises: either is a failed call
        if results == 0:
            return [("multiply", {"a": 2, "b": 3})] if sample == 0 else [("divide", {"a": 1, "b": 0})]
        return "That went wrong."
    if task == "long":  # an answer past the length limit, or a tool result that does not fit what is left
        if results == 0:
            return [("add", {"a": 5, "b": 5})] if sample == 0 else [("echo", {"text": "long ", "times": 150})]
        return Unended("so " * 200)
    raise ValueError(f"no plan for task {task!r}")


TASKS = ("answer", "one-call", "two-calls", "fail", "long")
TASK = re.compile(r"task=([a-z-]+)")


class Script:
    """The scripted policy of a tokenizer's template: :meth:`turns` writes the next turn of each context,
    at most ``max_new_tokens`` ids (what one generation call may write)."""

    def __init__(self, tokenizer: Any, max_new_tokens: int = MAX_COMPLETION_LENGTH) -> None:
        self.tokenizer = tokenizer
        self.template = template_of(tokenizer)
        self.max_new_tokens = max_new_tokens

    def turns(self, contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        seen: Counter = Counter()
        written = []
        for context in contexts:
            key = tuple(context)
            written.append(self.next_turn(list(context), seen[key])[: self.max_new_tokens])
            seen[key] += 1
        return written

    def next_turn(self, context: list[int], sample: int) -> list[int]:
        text = self.tokenizer.decode(context, skip_special_tokens=False)
        task = TASK.findall(text)[-1]
        results = text.count(self.template.result_marker)
        planned = plan(task, results, sample, self.template.one_call_per_turn)
        if isinstance(planned, Unended):
            return self.ids(planned.text)
        if isinstance(planned, str):
            return self.ids(planned + self.template.eos)
        return self.ids(self.template.call_text(planned) + self.template.eos)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def examples(tasks: Sequence[str] = TASKS, environments: Sequence[str] = ()) -> list[dict]:
    """One conversational example per task; ``start`` is a column the environment's ``reset`` reads; with
    ``environments``, an ``environment`` column naming them in turn."""
    rows = [
        {"prompt": [{"role": "user", "content": f"Please do task={task}."}], "start": index}
        for index, task in enumerate(tasks)
    ]
    for index, row in enumerate(rows if environments else []):
        row["environment"] = environments[index % len(environments)]
    return rows


# ------------------------------------------------------------------------------------------------------------
# The same LoRA policy on both sides


def set_policy_weights(model: torch.nn.Module) -> int:
    """Give every LoRA weight of ``model`` a fixed value from its name (the adapter's name left out), so
    that TRL's and marl's policies are the same function, away from the reference; returns how many
    tensors were set."""
    lora = [(name, p) for name, p in model.named_parameters() if "lora_" in name]
    with torch.no_grad():
        for name, parameter in lora:
            key = re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", name)
            key = key[key.index("layers.") :]
            seed = sum(ord(c) * (i + 1) for i, c in enumerate(key)) % 1000
            values = torch.sin(torch.arange(parameter.numel(), dtype=torch.float32) + seed) * 0.3
            parameter.copy_(values.view_as(parameter))
    return len(lora)


# ------------------------------------------------------------------------------------------------------------
# TRL's side


def trl_config(output_dir: Path | str, rows: int, **overrides: Any):
    """The ``GRPOConfig`` both sides run with (marl's through ``rloo_config_from_trl``)."""
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        bf16=False,
        beta=BETA,
        num_generations=K,
        per_device_train_batch_size=rows,
        max_completion_length=MAX_COMPLETION_LENGTH,
        seed=0,
        logging_steps=1,
        max_steps=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own deprecated default it reads
        return GRPOConfig(**{**settings, **overrides})


def lora_config():
    """The policy LoRA of both sides: marl's default targets (``all-linear``), rank and alpha as above."""
    from marl.config.model import policy_lora_config

    return policy_lora_config(LORA_R, LORA_ALPHA, "all-linear")


def trl_tool_run(
    model_dir: Path,
    rows: Sequence[dict],
    *,
    output_dir: Path,
    tools: Sequence[Callable] | None = None,
    environment_factory: Any = None,
    reward_funcs: Sequence[Callable] = REWARD_FUNCS,
    max_tool_calling_iterations: int | None = None,
    **config: Any,
) -> dict[str, Any]:
    """One generation of TRL 1.16's ``GRPOTrainer`` on ``rows`` (one example per prompt, each taken ``K``
    times, prompt-major as its sampler gives them), the script writing every turn, then the loss of that
    batch. Returns TRL's rows (prompt-major): ``completion_ids`` (lists), ``tool_mask`` (lists of 0/1),
    ``rewards`` (per reward function, its name: values), ``advantages``, ``loss``, ``completions`` (the
    messages), ``metrics`` (what ``_generate`` and ``_compute_loss`` logged, one value each) and the
    trainer."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = trl_config(
        output_dir, K * len(rows), max_tool_calling_iterations=max_tool_calling_iterations, **config
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=list(reward_funcs),
            args=args,
            train_dataset=Dataset.from_list(list(rows)),
            processing_class=tokenizer,
            tools=list(tools) if tools else None,
            environment_factory=environment_factory,
            peft_config=lora_config(),
        )
    set_policy_weights(trainer.model)
    script = Script(trainer.processing_class, args.max_completion_length)

    def scripted_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # generation on the regular path gets one row per completion (the sampler repeated each prompt)
        return script.turns(prompt_ids), None

    trainer._generate_single_turn = scripted_turn
    inputs = [dict(row) for row in rows for _ in range(K)]
    trainer.model.eval()  # TRL divides by no accumulation count in eval mode, as marl's loss functions do not
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            batch = trainer._generate_and_score_completions(inputs)
        loss = trainer.compute_loss(trainer.model, batch)
    lengths = batch["completion_mask"].sum(dim=1).tolist()
    tool_mask = batch.get("tool_mask")
    return {
        "trainer": trainer,
        "completion_ids": [row[:n].tolist() for row, n in zip(batch["completion_ids"], lengths, strict=True)],
        "tool_mask": None
        if tool_mask is None
        else [row[:n].tolist() for row, n in zip(tool_mask, lengths, strict=True)],
        "rewards": {name: list(trainer._logs["rewards"][name]) for name in trainer.reward_func_names},
        "advantages": batch["advantages"].tolist(),
        "loss": loss.item(),
        "completions": list(trainer._logs["completion"]),
        "metrics": {name: values[-1] for name, values in trainer._metrics["eval"].items() if values},
    }


# ------------------------------------------------------------------------------------------------------------
# marl's side: the script as a registered sampler


class ScriptedSampler:
    """A marl ``Sampler`` whose completions are the script's turns: each row's context is its prompt's ids
    without padding, rows k-major (row ``j * P + i``: sample ``j`` of prompt ``i``). ``calls`` records how
    many prompts each call had and their ``k``."""

    def __init__(self, model: Any, tokenizer: Any, settings: Any) -> None:
        from marl.model.sampling import eos_token_ids, pad_token_id

        self.tokenizer = tokenizer
        self.settings = settings
        self.device = model.device
        self.eos_token_ids = eos_token_ids(tokenizer, model.generation_config)
        self.pad_token_id = pad_token_id(tokenizer)
        self.script = Script(tokenizer, settings.response_length)
        self.calls: list[tuple[int, int]] = []  # (prompts, k) of each sample call

    def batch(self, prompts):
        from marl.data.prompts import PromptBatch

        return PromptBatch.of(prompts, self.pad_token_id, self.device)

    def sample(self, prompts, k: int, *, view: str = "policy"):
        from marl.rollout.completions import Samples

        self.calls.append((prompts.ids.shape[0], k))
        unpadded = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.ids, prompts.mask, strict=True)]
        contexts = unpadded * k  # k-major
        turns = self.script.turns(contexts)
        width = max(len(turn) for turn in turns)
        responses = torch.full((len(turns), width), self.pad_token_id, dtype=torch.long)
        for row, turn in enumerate(turns):
            responses[row, : len(turn)] = torch.tensor(turn)
        return Samples.from_responses(
            prompts,
            k,
            responses.to(prompts.ids.device),
            stop_token_ids=self.eos_token_ids,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            tokenizer=self.tokenizer,
        )

    def policy_weights_changed(self) -> None:
        """Nothing to refresh: the script reads no weights."""


def register_scripted_sampler() -> str:
    """Register :class:`ScriptedSampler` as ``--sampler scripted`` (once per process); returns its name."""
    from marl.rollout.samplers import SAMPLERS, register_sampler

    if SAMPLER_NAME not in SAMPLERS:
        register_sampler(SAMPLER_NAME, ScriptedSampler)
    return SAMPLER_NAME


def marl_tool_run(
    model_dir: Path,
    rows: Sequence[dict],
    *,
    output_dir: Path,
    tools: Sequence[Callable] | None = None,
    environment_factory: Any = None,
    reward_funcs: Sequence[Callable] = REWARD_FUNCS,
    max_tool_calling_iterations: int | None = None,
    processes: int = 1,
    parallelism: str = "replicated",
    **config: Any,
) -> dict[str, Any]:
    """marl's side of :func:`trl_tool_run`: ``RLOOTrainer`` with the config ``rloo_config_from_trl`` makes of
    the same ``GRPOConfig``, ``--sampler scripted``, the same LoRA policy; one rollout, its shaped rewards and
    one update. On ``processes`` processes each takes its share of the prompts (the ``GRPOConfig`` given
    per device). Returns this process's rows in TRL's prompt-major order of the examples (``rows``: the
    whole batch's examples, each row's example found by its ``start`` column) with ``examples`` (which example
    each returned row completes), ``loss`` (this process's loss of the update: its tokens' share over every
    process's loss tokens), the rollout's ``metrics``, the ``config`` and the ``rollout``."""
    import time

    from datasets import Dataset
    from transformers import AutoTokenizer

    from marl import MultiAdapterModel, RLOOTrainer
    from marl.algo.from_trl import rloo_config_from_trl
    from marl.train.trainer import update_policies

    args = trl_config(
        Path(output_dir) / "trl-args",
        K * len(rows) // processes,
        max_tool_calling_iterations=max_tool_calling_iterations,
        **config,
    )
    marl_config = rloo_config_from_trl(
        args,
        model_name_or_path=str(model_dir),
        sampler=register_scripted_sampler(),
        lora_r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_target_modules=["all-linear"],
        num_sample_generations=0,
        save_steps=0,
        parallelism=parallelism,
    )
    model = MultiAdapterModel.from_config(marl_config)
    set_policy_weights(model.peft_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RLOOTrainer(
            marl_config,
            model,
            AutoTokenizer.from_pretrained(model_dir),
            Dataset.from_list(list(rows)),
            reward_funcs=list(reward_funcs),
            tools=tools,
            environment_factory=environment_factory,
        )
        rollout = trainer.rollout()
        shaped = trainer.shaped_rewards(rollout)
        part = trainer.update_part(rollout, shaped)
        stats = update_policies([part], trainer.phases, update=1)[0][0]
        metrics = trainer.report(rollout, shaped, stats, (time.perf_counter(), 0))
    # marl's row j * P + i completes prompt i; TRL's rows are example-major
    prompts = rollout.prompt_index.max().item() + 1
    example_of_prompt = [rollout.prompt_columns[i]["start"] for i in range(prompts)]
    order = sorted(
        range(len(rollout.prompt_index)),
        key=lambda row: (example_of_prompt[rollout.prompt_index[row]], row // prompts),
    )
    ids, mask = rollout.completion_ids, rollout.response_mask
    tool_mask = [rollout.tool_mask[row][mask[row]].long().tolist() for row in range(len(ids))]
    return {
        "trainer": trainer,
        "rollout": rollout,
        "config": marl_config,
        "examples": [example_of_prompt[rollout.prompt_index[row]] for row in order],
        "completion_ids": [ids[row] for row in order],
        "tool_mask": [tool_mask[row] for row in order],
        "rewards": {
            name: [rollout.source_scores[row, column].item() for row in order]
            for column, name in enumerate(trainer.parts.reward.names)
        },
        "advantages": [shaped.advantages[row].item() for row in order],
        "loss": float(stats.loss / stats.completions),
        "completions": [rollout.turns[row] for row in order],
        "metrics": metrics,
        "sampler_calls": trainer.parts.sampler.calls,
    }
