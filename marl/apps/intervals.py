"""95% intervals of the demo's verdict, so that a reader sees which differences the 200 held-out prompts
can tell apart.

- the win rate over the base: a Wilson score interval for a binomial proportion over the prompts
  (:func:`wilson_interval`), a tie counting half a win as in the win rate itself;
- the share of completions naming the film and the VADER gain: a bootstrap over the prompts with a fixed
  seed (:func:`bootstrap_intervals`), base and policy resampled with the same prompts (paired);
- distinct-2 (and the policy's distinct-2 as a multiple of the base's): the same, but each resample is half
  of the prompts drawn without replacement (half-sampling). Drawn with replacement, a resample repeats
  completions, and a repeated completion's bigrams are all repeats: distinct-2 falls by itself (0.74 → 0.52 on
  a synthetic set) and spreads twice as widely as it does between independent sets of 200 completions;
  half-samples spread as those do (measured: std 0.0085 against 0.0088).

Every interval is the percentile interval moved by ``measured − mean over resamples``, so that it centres on
the measured value (for a mean the move is about 0; a half-sample's distinct-2 is higher than the whole
set's).

Example:
    >>> [round(bound, 3) for bound in wilson_interval(8, 10)]
    [0.49, 0.943]
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy

# Resamples of every bootstrap interval, and their fixed seed (the intervals of a run are reproducible).
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95

Interval = tuple[float, float]


def wilson_interval(successes: float, trials: int, confidence: float = CONFIDENCE) -> Interval:
    """The Wilson score interval of the proportion ``successes / trials`` (``successes`` may hold halves, a
    tie counting half); ``(nan, nan)`` without trials.

    Example:
        >>> [round(bound, 4) for bound in wilson_interval(0, 20)]
        [0.0, 0.1611]
    """
    if trials <= 0:
        return (math.nan, math.nan)
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials))
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_intervals(
    statistics_of: Mapping[str, Callable[[Sequence[int]], float]],
    size: int,
    *,
    seed: int = BOOTSTRAP_SEED,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    half_samples: bool = False,
) -> dict[str, Interval]:
    """Bootstrap intervals of statistics of ``size`` items: each statistic is called with the indices of a
    resample (``size`` drawn with replacement, or with ``half_samples`` ``size // 2`` without; the same
    indices for every statistic: paired) and returns a number. The interval is the percentile interval moved
    by ``statistic(all) − mean over resamples`` (see the module docstring).

    Example:
        >>> values = [1.0, 2.0, 3.0, 4.0]
        >>> low, high = bootstrap_intervals({"mean": lambda rows: sum(values[i] for i in rows) / len(rows)},
        ...                                 4)["mean"]
        >>> low < 2.5 < high
        True
    """
    if size < (2 if half_samples else 1):
        raise ValueError(f"a bootstrap of {size} items: too few")
    generator = random.Random(seed)
    draws = {name: [] for name in statistics_of}
    for _ in range(resamples):
        if half_samples:
            rows = generator.sample(range(size), size // 2)
        else:
            rows = [generator.randrange(size) for _ in range(size)]
        for name, statistic in statistics_of.items():
            draws[name].append(statistic(rows))
    tail = (1 - confidence) / 2
    intervals = {}
    for name, statistic in statistics_of.items():
        values = draws[name]
        shift = statistic(range(size)) - statistics.fmean(values)
        # numpy's default quantile: linear between the neighbouring order statistics
        low, high = numpy.quantile(values, [tail, 1 - tail])
        intervals[name] = (float(low) + shift, float(high) + shift)
    return intervals


def _bigrams(text: str) -> list[tuple[str, str]]:
    return list(itertools.pairwise(text.lower().split()))


def _distinct_2(bigrams: Sequence[list[tuple[str, str]]], rows: Sequence[int]) -> float:
    """:func:`marl.data.fixed_rules.distinct_2` of the completions ``rows`` (their bigrams precomputed)."""
    chosen = [pair for row in rows for pair in bigrams[row]]
    return len(set(chosen)) / len(chosen) if chosen else 0.0


def verdict_intervals(
    base_texts: Sequence[str],
    policy_texts: Sequence[str],
    base_judge: Sequence[float],
    policy_judge: Sequence[float],
    comparison: Mapping[str, Any],
) -> dict[str, Any]:
    """The 95% intervals of the verdict's checks, from one completion per prompt of base and policy (in the
    order of the prompts), their judge scores and the win-rate counts (``wins``, ``ties``, ``losses``):
    ``win_rate`` (Wilson), ``judge_gain`` (mean policy − base judge score), and per model ``film_share`` and
    ``distinct_2``, with ``distinct_2_ratio`` (policy / base), all bootstrapped over the prompts, paired
    (distinct-2 by half-samples).

    Example:
        >>> out = verdict_intervals(["a fine film", "dull"], ["a great film", "a great cast"], [0.1, 0.0],
        ...                         [0.6, 0.5], {"wins": 2, "ties": 0, "losses": 0})
        >>> sorted(out), [round(bound, 3) for bound in out["win_rate"]]
        (['base', 'distinct_2_ratio', 'judge_gain', 'policy', 'win_rate'], [0.342, 1.0])
    """
    from marl.data.fixed_rules import names_the_film

    size = len(base_texts)
    if not size or {len(policy_texts), len(base_judge), len(policy_judge)} != {size}:
        raise ValueError(
            "verdict_intervals needs one base and one policy completion and judge score per prompt"
        )
    bigrams = {
        "base": [_bigrams(text) for text in base_texts],
        "policy": [_bigrams(text) for text in policy_texts],
    }
    named = {
        "base": [names_the_film(text) for text in base_texts],
        "policy": [names_the_film(text) for text in policy_texts],
    }
    gains = [policy - base for policy, base in zip(policy_judge, base_judge, strict=True)]

    def ratio(rows: Sequence[int]) -> float:
        base = _distinct_2(bigrams["base"], rows)
        return _distinct_2(bigrams["policy"], rows) / base if base else math.nan

    means: dict[str, Callable[[Sequence[int]], float]] = {
        "judge_gain": lambda rows: statistics.fmean(gains[row] for row in rows)
    }
    of_the_set: dict[str, Callable[[Sequence[int]], float]] = {"distinct_2_ratio": ratio}
    for model in ("base", "policy"):
        means[f"{model}/film_share"] = lambda rows, m=model: sum(named[m][row] for row in rows) / len(rows)
        of_the_set[f"{model}/distinct_2"] = lambda rows, m=model: _distinct_2(bigrams[m], rows)
    bootstrapped = bootstrap_intervals(means, size)
    if size >= 2:
        bootstrapped |= bootstrap_intervals(of_the_set, size, half_samples=True)
    else:
        bootstrapped |= {name: (math.nan, math.nan) for name in of_the_set}
    trials = comparison["wins"] + comparison["ties"] + comparison["losses"]
    return {
        "win_rate": wilson_interval(comparison["wins"] + 0.5 * comparison["ties"], trials),
        "judge_gain": bootstrapped["judge_gain"],
        "distinct_2_ratio": bootstrapped["distinct_2_ratio"],
        **{
            model: {name: bootstrapped[f"{model}/{name}"] for name in ("film_share", "distinct_2")}
            for model in ("base", "policy")
        },
    }


def format_interval(interval: Sequence[float] | None, spec: str) -> str:
    """`` [low, high]`` with the format ``spec`` (e.g. ``".1%"``), or nothing without an interval.

    Example:
        >>> format_interval((0.709, 0.825), ".1%"), format_interval(None, ".3f")
        (' [70.9%, 82.5%]', '')
    """
    if interval is None:
        return ""
    low, high = interval
    return f" [{low:{spec}}, {high:{spec}}]"
