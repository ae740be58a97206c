"""Prompts: datasets, tokenisation, chat rendering and padding, and the tokenised prompts of a rollout.

- :func:`load_prompt_dataset` turns ``--dataset_name`` into a ``datasets.Dataset`` with a ``prompt``
  column: the bundled Rotten Tomatoes prompts, a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file or a
  folder of them, or a dataset hub name (the only case that may reach the network, because the user named it).
- :func:`tokenize_prompt` and :func:`left_pad` prepare prompts the same way for training and evaluation.
- :func:`prepare_prompts` tokenises a dataset's prompts once (a tokenizer is slow next to a forward pass and a
  run reads every prompt many times); :func:`prompts_for_update` picks an update's prompts as a function of
  the update number alone (so a resumed run sees the same data); :class:`PromptBatch` is what a sampler reads.

Example:
    >>> batch = PromptBatch.of([Prompt((5, 6), "a b"), Prompt((7,), "c")], pad_token_id=0)
    >>> batch.ids, batch.mask
    (tensor([[5, 6],
            [0, 7]]), tensor([[1, 1],
            [0, 1]]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.errors import DataError

if TYPE_CHECKING:
    import datasets
    import torch

    from marl.config.batch_sizes import BatchSizes

ROTTEN_TOMATOES = "rotten-tomatoes"
# Splits of the bundled prompts: RL training prompts, and held-out prompts from other movies.
ROTTEN_TOMATOES_SPLITS = {"train": "rl", "test": "eval", "eval": "eval", "validation": "eval"}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def dataset_name_field(help_prefix: str = "Prompts"):
    """The ``--dataset_name`` flag of the commands that read prompts (one definition, one help text)."""
    return field(
        default=ROTTEN_TOMATOES,
        metadata={
            "help": f"{help_prefix}: '{ROTTEN_TOMATOES}' (bundled), a local .json/.jsonl/.csv/.parquet "
            "file or folder, or a dataset hub name (the only option that reaches the network)."
        },
    )


def tokenize_prompt(
    tokenizer: Any,
    prompt: Any,
    where: str = "prompt",
    *,
    tools: Sequence[Any] | None = None,
    chat_template: str | None = None,
) -> tuple[list[int], str]:
    """Token ids and text of one prompt: plain text as it is, a conversation through the chat template.

    A conversation is a list of ``{"role", "content"}`` messages, rendered by TRL's own
    ``apply_chat_template`` as TRL's trainers render a prompt: with a generation prompt, or, when it ends in
    an assistant message, with that message left open, to be continued. Training and evaluation both
    tokenize through this function, so their prompts look the same to the model. ``tools``: the functions the
    template describes to the model (:mod:`marl.rollout.tool_calls`); ``chat_template``: a template to render
    with instead of the tokenizer's.

    Example:
        >>> ids, text = tokenize_prompt(tokenizer, [{"role": "user", "content": "Hi"}])  # doctest: +SKIP
    """
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"], prompt
    is_conversation = isinstance(prompt, list) and all(
        isinstance(message, dict) and "role" in message and "content" in message for message in prompt
    )
    if not is_conversation or not prompt:
        raise DataError(
            f"{where}: a prompt must be a string or a list of {{'role', 'content'}} messages, "
            f"got {type(prompt).__name__}: {str(prompt)[:80]!r}"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where} is a conversation but the tokenizer has no chat template; set "
            "tokenizer.chat_template or use plain-text prompts"
        )
    from trl.data_utils import apply_chat_template  # TRL's own rendering of a prompt-only example

    try:
        template = {} if chat_template is None else {"chat_template": chat_template}
        text = apply_chat_template({"prompt": prompt}, tokenizer, list(tools or []), **template)["prompt"]
    except ValueError as error:  # TRL refuses a prompt whose last message is neither user, tool nor assistant
        raise DataError(
            f"{where}: {error}; end the conversation with a user message (an assistant one to continue it)"
        ) from error
    return tokenizer(text, add_special_tokens=False)["input_ids"], text


def is_conversation(prompt: Any) -> bool:
    """Whether ``prompt`` is a conversation (a list of ``{"role", "content"}`` messages), as TRL's
    ``is_conversational`` decides it: by its first message.

    Example:
        >>> is_conversation([{"role": "user", "content": "Hi"}]), is_conversation("Hi")
        (True, False)
    """
    from trl.data_utils import is_conversational

    # TRL's test reads the first message; an empty list has none (TRL's would raise on it)
    return isinstance(prompt, list) and bool(prompt) and is_conversational({"prompt": prompt})


def reward_model_text(
    tokenizer: Any, prompt: Any, completion: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """The text a reward model reads for ``prompt`` and its ``completion``, as TRL 1.16's ``RLOOTrainer`` and
    ``GRPOTrainer`` build it: a plain prompt followed by the completion text; a conversation followed by the
    completion as an assistant message, rendered whole through the chat template (no generation prompt), which
    is also how ``RewardTrainer`` renders conversational pairs. ``completion`` is a text or, as TRL passes
    it, a list of messages. ``chat_template_kwargs``: the trainer's ``chat_template_kwargs``, which TRL
    passes to the template there too.

    Example:
        >>> reward_model_text(tokenizer, "The film", " is fine")  # doctest: +SKIP
        'The film is fine'
        >>> reward_model_text(tokenizer, [{"role": "user", "content": "Hi"}], "Hello")  # doctest: +SKIP
        '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n'
    """
    if not is_conversation(prompt):
        return prompt + completion
    from trl.data_utils import apply_chat_template

    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    # TRL's trainers render {"messages": prompt + completion} for a reward model with this very function
    example = {"messages": list(prompt) + list(completion)}
    return apply_chat_template(example, tokenizer, **(chat_template_kwargs or {}))["text"]


def reward_model_ids(
    tokenizer: Any, prompt: Any, completion: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """:func:`reward_model_text` tokenised as TRL tokenises it for a reward model: whole, with no special
    tokens added."""
    text = reward_model_text(tokenizer, prompt, completion, chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of token-id lists padded on the left to the longest one.

    Example:
        >>> left_pad([[5, 6], [7]], pad_token_id=0)
        (tensor([[5, 6],
                [0, 7]]), tensor([[1, 1],
                [0, 1]]))
    """
    import torch
    from trl.trainer.utils import pad  # TRL's own padding of its trainers' prompts

    rows = [torch.tensor(ids, dtype=torch.long) for ids in sequences]
    input_ids = pad(rows, padding_value=pad_token_id, padding_side="left")
    attention_mask = pad([torch.ones_like(row) for row in rows], padding_value=0, padding_side="left")
    return input_ids, attention_mask


# ----------------------------------------------------------------------------------------------------
# Prompt datasets


def rotten_tomatoes_prompts(
    split: str = "train", num_words: int = 4, seed: int = 0, *, split_flag: str = "--dataset_train_split"
) -> datasets.Dataset:
    """Bundled "continue the review" prompts: the first ``num_words`` words of Rotten Tomatoes snippets.

    ``train`` prompts come from the ``rl`` movies of :func:`marl.data.assets.split_rotten_tomatoes`; ``test``
    (alias ``eval``/``validation``) prompts come from the held-out ``eval`` movies and never repeat a training
    prompt. The reward-adapter pairs come from a third set of movies, so the three never overlap.
    ``split_flag`` is the flag an unknown split's error tells the user to fix.

    Example:
        >>> train, held_out = rotten_tomatoes_prompts("train"), rotten_tomatoes_prompts("test")
        >>> set(train["prompt"]).isdisjoint(held_out["prompt"])
        True
    """
    from marl.data import assets

    if split not in ROTTEN_TOMATOES_SPLITS:
        raise DataError(
            f"{ROTTEN_TOMATOES!r} has the splits {sorted(ROTTEN_TOMATOES_SPLITS)}, not {split!r}: "
            f"pass one of them with {split_flag}"
        )
    parts = assets.split_rotten_tomatoes(seed=seed)
    train = assets.build_rl_prompts(parts["rl"], num_words=num_words, seed=seed)
    if ROTTEN_TOMATOES_SPLITS[split] == "rl":
        return train
    exclude = set(train["prompt"])
    return assets.build_rl_prompts(parts["eval"], num_words=num_words, seed=seed, exclude=exclude)


def rotten_tomatoes_warm_start(
    num_words: int = 4, seed: int = 0, label: int | None = None
) -> datasets.Dataset:
    """Warm-start examples for the bundled prompts (:mod:`marl.train.trl_trainers`): each snippet of the
    ``rl`` movies, the movies of the ``train`` prompts, split into its first ``num_words`` words (``prompt``)
    and the rest (``completion``). ``label`` keeps only rotten (0) or fresh (1) snippets; ``None`` keeps both.
    The held-out movies' snippets are never among them.

    Example:
        >>> examples = rotten_tomatoes_warm_start()
        >>> row = examples[0]
        >>> len(row["prompt"].split()), row["completion"].startswith(" ")
        (4, True)
        >>> held_out = set(rotten_tomatoes_prompts("test")["prompt"])
        >>> any(prompt in held_out for prompt in examples["prompt"])
        False
    """
    import datasets

    from marl.data import assets

    snippets = assets.split_rotten_tomatoes(seed=seed)["rl"]
    rows = {"prompt": [], "completion": []}
    for text, snippet_label in zip(snippets["text"], snippets["label"], strict=True):
        split = assets.split_opening(text, num_words)
        if split is not None and label in (None, snippet_label):
            rows["prompt"].append(split[0])
            rows["completion"].append(split[1])
    return datasets.Dataset.from_dict(rows)


def load_prompt_dataset(
    dataset_name: str,
    split: str = "train",
    prompt_column: str = "prompt",
    *,
    seed: int = 0,
    max_prompts: int | None = None,
    split_flag: str = "--dataset_train_split",
) -> datasets.Dataset:
    """Load prompts from ``dataset_name`` and return them with the prompt text in a column named ``prompt``
    and the dataset's other columns beside it (reward functions receive them, :mod:`marl.rewards.trl_calls`).

    ``dataset_name`` is ``"rotten-tomatoes"`` (bundled, offline), a local ``.json``/``.jsonl``/``.csv``/
    ``.parquet`` file, a folder of such files (split names come from file names such as ``train.jsonl``),
    or a dataset hub name. Prompts may be plain strings or conversations (lists of ``{"role", "content"}``).
    ``max_prompts`` keeps the first that many rows. ``split_flag``: the flag that chose ``split``, named in
    the error when the split is missing or empty.

    Example:
        >>> prompts = load_prompt_dataset("rotten-tomatoes", "test", max_prompts=3)
        >>> prompts.column_names, len(prompts)
        (['prompt'], 3)
    """
    if dataset_name == ROTTEN_TOMATOES:
        dataset = rotten_tomatoes_prompts(split, seed=seed, split_flag=split_flag)
    else:
        dataset = _load_local_or_hub(dataset_name, split, split_flag)
    dataset = _select_prompt_column(dataset, prompt_column, dataset_name)
    if len(dataset) == 0:
        raise DataError(f"split {split!r} of {dataset_name!r} is empty: pick another {split_flag}")
    if max_prompts is not None:
        dataset = dataset.select(range(min(max_prompts, len(dataset))))
    return dataset


def prompt_source(dataset_name: str, split: str) -> dict[str, Any]:
    """What :func:`load_prompt_dataset` reads for ``dataset_name`` and ``split``: the dataset as given, its
    absolute path when it is a local file or folder, and the split really read, ``None`` for a single file
    (a file has no splits: it is read whole whatever split is named).

    Example:
        >>> prompt_source("rotten-tomatoes", "test")
        {'dataset_name': 'rotten-tomatoes', 'dataset_path': None, 'split': 'test'}
    """
    path = Path(dataset_name).expanduser()
    local = dataset_name != ROTTEN_TOMATOES and path.exists()
    return {
        "dataset_name": dataset_name,
        "dataset_path": str(path.resolve()) if local else None,
        "split": None if local and path.is_file() else split,
    }


def describe_prompt_source(source: dict[str, Any]) -> str:
    """``source`` (from :func:`prompt_source`) in words.

    Example:
        >>> describe_prompt_source(prompt_source("rotten-tomatoes", "test"))
        "split 'test' of rotten-tomatoes"
        >>> describe_prompt_source({"dataset_name": "p.jsonl", "dataset_path": "/d/p.jsonl", "split": None})
        'the whole file /d/p.jsonl (a file has no splits)'
    """
    where = source["dataset_path"] or source["dataset_name"]
    if source["split"] is None:
        return f"the whole file {where} (a file has no splits)"
    return f"split {source['split']!r} of {where}"


def _load_local_or_hub(dataset_name: str, split: str, split_flag: str) -> datasets.Dataset:
    import datasets

    path = Path(dataset_name).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(file_suffix(path))
        if builder is None:
            raise DataError(
                f"{path} has an unknown dataset file type {path.suffix!r}: use one of "
                f"{', '.join(sorted(FILE_BUILDERS))} (or a folder of such files)"
            )
        return read_dataset_files(path, builder, data_files={split: str(path)})[split]
    if path.is_dir():
        files = [f for f in sorted(path.rglob("*")) if f.is_file() and not f.name.startswith(".")]
        builders = {FILE_BUILDERS[file_suffix(f)] for f in files if file_suffix(f) in FILE_BUILDERS}
        if not builders:
            raise DataError(
                f"the folder {path} holds no dataset file: put {', '.join(sorted(FILE_BUILDERS))} files in it"
            )
        if len(builders) > 1:
            raise DataError(
                f"the folder {path} mixes dataset file types ({', '.join(sorted(builders))}): keep one type"
            )
        return _pick_split(read_dataset_files(path, str(path)), split, dataset_name, split_flag)
    if _looks_like_path(dataset_name):
        raise DataError(f"no such dataset file or folder: {path}")
    try:
        loaded = datasets.load_dataset(dataset_name)
    except Exception as error:
        raise DataError(
            f"could not load the dataset {dataset_name!r} from the hub ({type(error).__name__}: {error}). "
            f"Offline, pass a local file or folder, or {ROTTEN_TOMATOES!r} for the bundled prompts"
        ) from error
    return _pick_split(loaded, split, dataset_name, split_flag)


def read_dataset_files(path: Path, builder: str, **options: Any) -> datasets.DatasetDict:
    """``datasets.load_dataset(builder, **options)`` for the user's file or folder ``path``; a file that
    cannot be parsed (malformed JSON lines, an empty or ragged CSV, a damaged parquet file) is named in the
    error."""
    import datasets
    import pyarrow

    # datasets logs its own error before raising; the error raised here says it once, with the file's name.
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    # Nor its bar for turning a local file into its cache: a refusal after it would not be one line.
    bar = not datasets.are_progress_bars_disabled()
    if bar:
        datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(builder, **options)
    except (
        datasets.exceptions.DatasetGenerationError,
        pyarrow.ArrowException,
        StopIteration,  # raised by the JSON reader for an empty file
        ValueError,
        OSError,
    ) as error:
        cause = error.__cause__ or error
        raise DataError(
            f"cannot read the dataset {path} ({type(cause).__name__}: {str(cause) or 'empty file'}); fix the "
            f"file: one record per line for .jsonl, a header row and equal columns for .csv"
        ) from error
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bar:
            datasets.enable_progress_bars()


def file_suffix(path: Path) -> str:
    return path.suffix.lower()


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix.lower() in {*FILE_BUILDERS, ".txt", ".tsv"}


def _pick_split(
    loaded: datasets.DatasetDict, split: str, dataset_name: str, split_flag: str
) -> datasets.Dataset:
    if split not in loaded:
        raise DataError(
            f"{dataset_name!r} has no split {split!r}; its splits are {sorted(loaded)}: "
            f"pass one with {split_flag}"
        )
    return loaded[split]


def _select_prompt_column(
    dataset: datasets.Dataset, prompt_column: str, dataset_name: str
) -> datasets.Dataset:
    if prompt_column not in dataset.column_names:
        raise DataError(
            f"{dataset_name!r} has no column {prompt_column!r}; its columns are {dataset.column_names}. "
            "Name the column that holds the prompts with --prompt_column"
        )
    if prompt_column != "prompt":
        # The chosen column becomes "prompt"; the other columns stay, for reward functions (as in TRL).
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(prompt_column, "prompt")
    for index, prompt in enumerate(dataset["prompt"][:100]):
        if not is_prompt(prompt):
            raise DataError(
                f"row {index} of column {prompt_column!r} in {dataset_name!r} is {prompt!r}, not a prompt: "
                "prompts must be non-empty strings or lists of {'role', 'content'} messages. "
                "Name another column with --prompt_column"
            )
    return dataset


def is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(message, dict) and {"role", "content"} <= message.keys() for message in value)
    )


def prompt_text(prompt: Any) -> str:
    """The text a reader sees of a prompt: the string itself, or a conversation's last message and a newline.

    Example:
        >>> prompt_text([{"role": "user", "content": "Review the film"}])
        'Review the film\\n'
    """
    return prompt if isinstance(prompt, str) else prompt[-1]["content"] + "\n"


# ------------------------------------------------------------------------------------------------------------
# Tokenised prompts of a rollout


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
    dataset: Any,
    tokenizer: Any,
    name: str,
    *,
    context_length: int | None,
    response_length: int,
    tools_of: Callable[[Mapping[str, Any]], Sequence[Any]] | None = None,
    chat_template: str | None = None,
) -> list[Prompt]:
    """Tokenise every prompt of ``dataset`` once (a ``prompt`` column of text or conversations rendered with
    the chat template, or an ``input_ids`` column), and check that each fits the context with its completion.
    The row's other columns are kept with it (:attr:`Prompt.columns`). ``tools_of(columns)``: the tools a
    conversation's template describes (:mod:`marl.rollout.tool_calls`), rendered with ``chat_template``.

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
        columns = {name: row[name] for name in columns_kept}
        if use_ids:
            ids = [int(token) for token in row["input_ids"]]
            text = tokenizer.decode(ids, skip_special_tokens=True)
        else:
            tools = None if tools_of is None else tools_of(columns)
            where = f"{name} row {index}"
            ids, text = tokenize_prompt(
                tokenizer, row["prompt"], where, tools=tools, chat_template=chat_template
            )
        if not ids:
            raise DataError(f"{name} row {index} has an empty prompt; remove it or give it text")
        messages = None if use_ids or not is_conversation(row["prompt"]) else list(row["prompt"])
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
    import torch

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
