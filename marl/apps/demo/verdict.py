"""The verdict of ``marl demo``: its targets, the fixed-rule checks of what no reward sees (the film named,
distinct bigrams), and the table of checks against the targets, each measured value with its 95% interval
over the held-out prompts (:func:`verdict_intervals`: Wilson for the win rate, a paired bootstrap for the
rest, distinct-2 by half-samples; :mod:`marl.apps.evaluate.ranking`).

Example:
    >>> summary = {"base": {"reward_score": 0.1, "judge_score": 0.0},
    ...            "policy": {"reward_score": 0.9, "judge_score": 0.4},
    ...            "comparison": {"win_rate": 0.8}, "judge_reward_correlation": 0.5}
    >>> [row[0] for row in verdict_rows(summary, 600.0, 200)][2]
    'VADER win rate, policy vs base'
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Targets of the demo: total under 15 minutes; VADER win rate >= 80% on >= 200 held-out prompts.
TARGET_SECONDS = 15 * 60
TARGET_WIN_RATE = 0.80
TARGET_EVAL_PROMPTS = 200
# Targets of the fixed-rule checks: the policy names the film at least as often as the base, and keeps at
# least this share of the base's distinct bigrams.
TARGET_DISTINCT_2_RATIO = 0.9


def verdict_rows(
    summary: dict[str, Any], seconds: float, num_prompts: int
) -> list[tuple[str, str, str, bool]]:
    """``(check, target, measured, passed)`` rows of the demo's verdict; with a ``topicality`` entry in
    ``summary`` (:func:`topicality_summary`) also its two rows; with an ``intervals``
    entry (:func:`verdict_intervals`) each measured value carries its 95% interval.

    Example:
        >>> summary = {"base": {"reward_score": 0.1, "judge_score": 0.0},
        ...            "policy": {"reward_score": 0.9, "judge_score": 0.4},
        ...            "comparison": {"win_rate": 0.8}, "judge_reward_correlation": 0.5}
        >>> [row[3] for row in verdict_rows(summary, 600.0, 200)]
        [True, True, True, True]
    """
    base, policy = summary["base"], summary["policy"]
    reward_gain = policy["reward_score"] - base["reward_score"]
    judge_gain = policy["judge_score"] - base["judge_score"]
    win = summary["comparison"]["win_rate"]
    intervals = summary.get("intervals") or {}
    return [
        ("total time", f"< {TARGET_SECONDS // 60} min", f"{seconds / 60:.1f} min", seconds < TARGET_SECONDS),
        (
            "held-out prompts",
            f">= {TARGET_EVAL_PROMPTS}",
            str(num_prompts),
            num_prompts >= TARGET_EVAL_PROMPTS,
        ),
        (
            "VADER win rate, policy vs base",
            f">= {TARGET_WIN_RATE:.0%}",
            f"{win:.1%}{format_interval(intervals.get('win_rate'), '.1%')}",
            win >= TARGET_WIN_RATE,
        ),
        (
            "no reward hacking: VADER rises with the adapter score",
            "both gains > 0",
            f"adapter {reward_gain:+.3f}, VADER {judge_gain:+.3f}"
            f"{format_interval(intervals.get('judge_gain'), '+.3f')}, "
            f"correlation {summary['judge_reward_correlation']:+.2f}",
            reward_gain > 0 and judge_gain > 0,
        ),
        *(topicality_rows(summary["topicality"], intervals or None) if "topicality" in summary else []),
    ]


def verdict_table(rows: list[tuple[str, str, str, bool]]):
    """A rich table of :func:`verdict_rows`' rows, PASS or MISS for each."""
    from rich.table import Table

    table = Table(title="Verdict (95% intervals over the held-out prompts in brackets)")
    for column in ("check", "target", "measured", "result"):
        table.add_column(column)
    for check, target, measured, passed in rows:
        table.add_row(check, target, measured, "[green]PASS[/green]" if passed else "[red]MISS[/red]")
    return table


def topicality_summary(
    base: Sequence[str], policy: Sequence[str], reference: Sequence[str] | None = None
) -> dict[str, dict[str, float]]:
    """The fixed-rule checks of base and policy completions (and of the policy's start, ``reference``, when
    given): the share naming the film and distinct-2.

    Example:
        >>> base, policy = ["the film is fine", "a slow plot"], ["an immersive journey", "an immersive ride"]
        >>> topicality_summary(base, policy)
        {'base': {'film_share': 1.0, 'distinct_2': 1.0}, 'policy': {'film_share': 0.0, 'distinct_2': 0.75}}
    """
    from marl.data.fixed_rules import distinct_2, film_share

    named = {"base": base, "policy": policy, **({"reference": reference} if reference is not None else {})}
    return {
        name: {"film_share": film_share(texts), "distinct_2": distinct_2(texts)}
        for name, texts in named.items()
    }


def topicality_rows(
    topic: dict[str, dict[str, float]], intervals: dict[str, Any] | None = None
) -> list[tuple[str, str, str, bool]]:
    """Verdict rows ``(check, target, measured, passed)`` of :func:`topicality_summary`'s output, each value
    with its 95% interval when ``intervals`` (:func:`verdict_intervals`) is given.

    Example:
        >>> rows = topicality_rows({"base": {"film_share": 0.1, "distinct_2": 0.8},
        ...                         "policy": {"film_share": 0.2, "distinct_2": 0.7}})
        >>> [row[3] for row in rows]
        [True, False]
    """
    base, policy = topic["base"], topic["policy"]
    ratio = policy["distinct_2"] / base["distinct_2"] if base["distinct_2"] else 0.0
    intervals = intervals or {}

    def ci(model: str, name: str, spec: str) -> str:
        return format_interval(intervals.get(model, {}).get(name), spec)

    return [
        (
            "stays on the film: completions naming it (fixed word list)",
            ">= base",
            f"base {base['film_share']:.1%}{ci('base', 'film_share', '.1%')} → "
            f"policy {policy['film_share']:.1%}{ci('policy', 'film_share', '.1%')}",
            policy["film_share"] >= base["film_share"],
        ),
        (
            "varied text: distinct-2",
            f">= {TARGET_DISTINCT_2_RATIO}× base",
            f"base {base['distinct_2']:.3f}{ci('base', 'distinct_2', '.3f')} → "
            f"policy {policy['distinct_2']:.3f}{ci('policy', 'distinct_2', '.3f')} "
            f"({ratio:.2f}×{format_interval(intervals.get('distinct_2_ratio'), '.2f')})",
            ratio >= TARGET_DISTINCT_2_RATIO,
        ),
    ]


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
    from marl.apps.evaluate.ranking import _bigrams, _distinct_2, bootstrap_intervals, wilson_interval
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
