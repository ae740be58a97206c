"""Prompts: datasets, tokenisation, chat rendering and padding.

- :func:`load_prompt_dataset` turns ``--dataset_name`` into a ``datasets.Dataset`` with a ``prompt``
  column: the bundled Rotten Tomatoes prompts, a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file or a
  folder of them, or a dataset hub name (the only case that may reach the network, because the user named it).
- :func:`tokenize_prompt` and :func:`left_pad` prepare prompts the same way for training and evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.errors import DataError

if TYPE_CHECKING:
    import datasets
    import torch

ROTTEN_TOMATOES = "rotten-tomatoes"
# Splits of the bundled prompts: RL training prompts, and held-out prompts from other movies.
ROTTEN_TOMATOES_SPLITS = {"train": "rl", "test": "eval", "eval": "eval", "validation": "eval"}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def dataset_name_field(help_prefix: str = "Prompts"):
    """The ``--dataset_name`` flag of the commands that read prompts (one definition, one help text)."""
    from dataclasses import field

    return field(
        default=ROTTEN_TOMATOES,
        metadata={
            "help": f"{help_prefix}: '{ROTTEN_TOMATOES}' (bundled), a local .json/.jsonl/.csv/.parquet "
            "file or folder, or a dataset hub name (the only option that reaches the network)."
        },
    )


def tokenize_prompt(tokenizer: Any, prompt: Any, where: str = "prompt") -> tuple[list[int], str]:
    """Token ids and text of one prompt: plain text as it is, a conversation through the chat template.

    A conversation is a list of ``{"role", "content"}`` messages, rendered by TRL's own
    ``apply_chat_template`` as TRL's trainers render a prompt: with a generation prompt, or, when it ends in
    an assistant message, with that message left open, to be continued. Training and evaluation both
    tokenize through this function, so their prompts look the same to the model.

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
        text = apply_chat_template({"prompt": prompt}, tokenizer)["prompt"]
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
# Preference pairs (reward-adapter training)
