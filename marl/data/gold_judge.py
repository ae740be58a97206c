"""The gold judge: VADER sentiment, a fixed rule that no training signal sees, for evaluating policies.

It comes from the ``vaderSentiment`` package of the ``demo`` extra (``pip install 'marl-rlhf[demo]'``).
"""

from __future__ import annotations

import functools
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
