"""The verdict of ``marl demo``: its targets, and the table of checks against them, each measured value with
its 95% interval over the held-out prompts (:mod:`marl.apps.intervals`).

Example:
    >>> summary = {"base": {"reward_score": 0.1, "judge_score": 0.0},
    ...            "policy": {"reward_score": 0.9, "judge_score": 0.4},
    ...            "comparison": {"win_rate": 0.8}, "judge_reward_correlation": 0.5}
    >>> [row[0] for row in verdict_rows(summary, 600.0, 200)][2]
    'VADER win rate, policy vs base'
"""

from __future__ import annotations

from typing import Any

from marl.apps.demo.rewards import topicality_rows
from marl.apps.intervals import format_interval

# Targets of the demo: total under 15 minutes; VADER win rate >= 80% on >= 200 held-out prompts.
TARGET_SECONDS = 15 * 60
TARGET_WIN_RATE = 0.80
TARGET_EVAL_PROMPTS = 200


def verdict_rows(
    summary: dict[str, Any], seconds: float, num_prompts: int
) -> list[tuple[str, str, str, bool]]:
    """``(check, target, measured, passed)`` rows of the demo's verdict; with a ``topicality`` entry in
    ``summary`` (:func:`marl.apps.demo.rewards.topicality_summary`) also its two rows; with an ``intervals``
    entry (:func:`marl.apps.intervals.verdict_intervals`) each measured value carries its 95% interval.

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
