"""Fixed-rule measures of what a policy writes that no training signal sees, for evaluating policies: its
sentiment, whether a completion stays on the film, and how varied the completions are.

- :func:`gold_judge_scores`: the gold judge, VADER sentiment, from the ``vaderSentiment`` package of the
  ``demo`` extra (``pip install 'marl-rlhf[demo]'``);
- :func:`film_share`: the share of completions that name the film or a part of it, by a fixed word list;
- :func:`distinct_2`: distinct word bigrams over all bigrams of a set of completions (lower case, words split
  at whitespace), which falls when a policy collapses onto a template.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from marl.data.assets import demo_package


def gold_judge_scores(texts: Sequence[str]) -> list[float]:
    """VADER compound sentiment of each text, in [-1, 1] (positive means positive sentiment).

    Example:
        >>> good, bad = gold_judge_scores(["a wonderful, moving film", "a dull, awful mess"])
        >>> good > 0 > bad
        True
    """
    analyzer = _vader_analyzer()
    return [float(analyzer.polarity_scores(text)["compound"]) for text in texts]


def check_gold_judge() -> None:
    """Build the VADER judge now (once per process): a command whose judge it is then stops at once, before
    its model loads, when the ``demo`` extra is not installed.

    Example:
        >>> check_gold_judge()
    """
    _vader_analyzer()


@functools.lru_cache(maxsize=1)
def _vader_analyzer():
    # Building the analyzer reads its lexicon from disk; do it once per process.
    vader = demo_package("vaderSentiment.vaderSentiment", "The VADER judge")
    return vader.SentimentIntensityAnalyzer()


# Words that refer to the film under review or a part of it (whole words, any case).
FILM_WORDS = (
    "film",
    "films",
    "movie",
    "movies",
    "story",
    "character",
    "characters",
    "director",
    "cast",
    "plot",
    "acting",
    "actor",
    "actors",
    "actress",
    "performance",
    "performances",
    "scene",
    "scenes",
    "script",
    "screenplay",
    "comedy",
    "drama",
    "thriller",
    "sequel",
    "picture",
    "cinema",
)
_FILM_WORD = re.compile(r"\b(?:" + "|".join(FILM_WORDS) + r")\b", re.IGNORECASE)


def names_the_film(text: str) -> bool:
    """Whether ``text`` contains one of :data:`FILM_WORDS` as a whole word.

    Example:
        >>> names_the_film("The cast is superb"), names_the_film("a filmmaker's dream of immersive worlds")
        (True, False)
    """
    return _FILM_WORD.search(text) is not None


def film_share(completions: Sequence[str]) -> float:
    """The share of ``completions`` that name the film (:func:`names_the_film`); 0.0 for none.

    Example:
        >>> film_share(["a fine film", "an immersive journey", "the plot sags", "creative and engaging"])
        0.5
    """
    if not completions:
        return 0.0
    return sum(names_the_film(text) for text in completions) / len(completions)


def distinct_2(completions: Sequence[str]) -> float:
    """Distinct word bigrams divided by all word bigrams of ``completions`` (each completion's own bigrams,
    lower case, split at whitespace); 0.0 when there is no bigram.

    Example:
        >>> distinct_2(["a fine film", "a fine film"])
        0.5
        >>> distinct_2(["a fine film", "a dull film"])
        1.0
    """
    bigrams = [
        pair
        for text in completions
        for pair in zip(text.lower().split(), text.lower().split()[1:], strict=False)
    ]
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0
