"""Several policies ranked on the same held-out prompts, what ``marl evaluate`` prints for several policy
folders (a sweep's members, say), and the 95% intervals of the ranking and of the demo's verdict.

Every policy samples the same prompts with the same seeds and the base samples them once
(:func:`marl.apps.evaluate.scores.generate_and_score` with ``policies``), so every policy's scores pair with
every other's prompt by prompt. :func:`rank_policies` orders the policies by their mean judge score and gives
each number a 95% interval:

- the mean judge score and the mean reward score: a bootstrap over the prompts (:func:`bootstrap_intervals`);
- the judge win rate over the base: a Wilson score interval (:func:`wilson_interval`), a tie counting half;
- the gap to the first: the mean over the prompts of (this policy's judge score − the first's), a paired
  bootstrap. When its interval holds 0 these prompts cannot tell the policy from the first: the table marks
  it ``≈ #1``, else ``< #1``;
- distinct-2 of the completions: half of the prompts drawn without replacement (half-samples), since a
  resample drawn with replacement repeats completions, whose bigrams are all repeats, which lowers distinct-2
  by itself and widens its spread (docs/guides/demo.md).

Every bootstrap draws the same resamples (paired) with a fixed seed, so a ranking is reproducible, and every
interval is the percentile interval moved by ``measured − mean over resamples``, so that it centres on the
measured value.

Example:
    >>> differing_settings({"a": {"learning_rate": 1e-4, "seed": 0, "output_dir": "runs/a"},
    ...                     "b": {"learning_rate": 3e-4, "seed": 0, "output_dir": "runs/b"}})
    {'a': {'learning_rate': 0.0001}, 'b': {'learning_rate': 0.0003}}
    >>> [round(bound, 3) for bound in wilson_interval(8, 10)]
    [0.49, 0.943]
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy

from marl.apps.evaluate.scores import JUDGE_NAMES, win_rate

if TYPE_CHECKING:
    from marl.apps.evaluate.scores import ScoredCompletions

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
    by ``statistic(all) − mean over resamples``, so that it centres on the measured value.

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


# Settings of a run's rloo_config.json that say where it ran and what its adapter is called, not how it
# trained (a sweep names each member's folder and policy): never shown as a difference.
IGNORED_SETTINGS = frozenset(
    {"output_dir", "logging_dir", "run_name", "resume_from_checkpoint", "overwrite_output_dir", "dataset",
     "launcher", "model", "policy_adapter_name", "fit", "fit_memory_gb", "fit_chosen"}
)  # fmt: skip


@dataclass(frozen=True)
class RankedPolicy:
    """One policy's place in the ranking, its measurements and their 95% intervals (``None``: not measured;
    the first policy has no gap to itself)."""

    rank: int
    name: str
    judge_score: float
    judge_interval: Interval
    win_rate: float
    win_interval: Interval
    wins: int
    ties: int
    losses: int
    gap_to_first: float | None
    gap_interval: Interval | None
    reward_score: float | None
    reward_interval: Interval | None
    kl: float | None
    distinct_2: float
    distinct_2_interval: Interval
    length: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def tied_with_first(self) -> bool | None:
        """Whether the prompts cannot tell this policy from the first (its gap's interval holds 0)."""
        if self.gap_interval is None:
            return None
        low, high = self.gap_interval
        return bool(low <= 0.0 <= high)


def differing_settings(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each policy, the settings of its run (its ``rloo_config.json``) whose values are not the same for
    every policy, in name order; where a run ran (:data:`IGNORED_SETTINGS`) is left out."""
    keys = sorted(set().union(*(set(run) for run in runs.values())) - IGNORED_SETTINGS)

    def spelled(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    differing = [key for key in keys if len({spelled(run.get(key)) for run in runs.values()}) > 1]
    return {name: {key: run.get(key) for key in differing} for name, run in runs.items()}


def _mean(values: Sequence[float], rows: Sequence[int]) -> float:
    return statistics.fmean(values[row] for row in rows)


def rank_policies(
    samples: Mapping[str, ScoredCompletions],
    base: ScoredCompletions,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[RankedPolicy]:
    """The policies of ``samples`` (name → its completions, measured on the prompts ``base`` was) ranked by
    mean judge score (then win rate over the base), each with its 95% intervals; ``settings``: each policy's
    differing settings (:func:`differing_settings`), shown beside it.

    Example:
        >>> from marl.apps.evaluate.scores import ScoredCompletions
        >>> def scored(judge):
        ...     return ScoredCompletions(completions=["a good film"] * 4, judge_scores=judge, lengths=[3] * 4)
        >>> ranked = rank_policies({"a": scored([0.1, 0.2, 0.1, 0.2]), "b": scored([0.5, 0.6, 0.5, 0.7])},
        ...                        scored([0.0, 0.0, 0.0, 0.0]))
        >>> [(policy.rank, policy.name, policy.tied_with_first) for policy in ranked]
        [(1, 'b', None), (2, 'a', False)]
    """
    size = len(base.judge_scores)
    if not size or any(len(record.judge_scores) != size for record in samples.values()):
        raise ValueError("rank_policies needs a judge score of every prompt for the base and every policy")
    comparisons = {name: win_rate(record.judge_scores, base.judge_scores) for name, record in samples.items()}
    means = {name: record.means() for name, record in samples.items()}
    order = sorted(samples, key=lambda name: (-means[name].judge_score, -comparisons[name].win_rate))
    first = samples[order[0]].judge_scores
    statistic: dict[str, Callable[[Sequence[int]], float]] = {}
    for name in order:
        judged = samples[name].judge_scores
        statistic[f"{name}/judge"] = lambda rows, values=judged: _mean(values, rows)
        gaps = [mine - best for mine, best in zip(judged, first, strict=True)]
        statistic[f"{name}/gap"] = lambda rows, values=gaps: _mean(values, rows)
        rewards = samples[name].reward_scores
        if rewards and not any(math.isnan(value) for value in rewards):  # a function's None: no interval
            statistic[f"{name}/reward"] = lambda rows, values=rewards: _mean(values, rows)
    intervals = bootstrap_intervals(statistic, size)
    bigrams = {name: [_bigrams(text) for text in samples[name].completions] for name in order}
    of_the_set: dict[str, Callable[[Sequence[int]], float]] = {}
    for name, pairs in bigrams.items():
        of_the_set[name] = lambda rows, pairs=pairs: _distinct_2(pairs, rows)
    diversity = (
        bootstrap_intervals(of_the_set, size, half_samples=True)
        if size >= 2
        else {name: (math.nan, math.nan) for name in order}
    )
    ranked = []
    for rank, name in enumerate(order, start=1):
        comparison, scores = comparisons[name], means[name]
        ranked.append(
            RankedPolicy(
                rank=rank,
                name=name,
                judge_score=scores.judge_score,
                judge_interval=intervals[f"{name}/judge"],
                win_rate=comparison.win_rate,
                win_interval=wilson_interval(comparison.wins + 0.5 * comparison.ties, size),
                wins=comparison.wins,
                ties=comparison.ties,
                losses=comparison.losses,
                gap_to_first=None if rank == 1 else scores.judge_score - means[order[0]].judge_score,
                gap_interval=None if rank == 1 else intervals[f"{name}/gap"],
                reward_score=scores.reward_score,
                reward_interval=intervals.get(f"{name}/reward"),
                kl=scores.kl,
                distinct_2=_distinct_2(bigrams[name], range(size)),
                distinct_2_interval=diversity[name],
                length=scores.length,
                settings=dict((settings or {}).get(name, {})),
            )
        )
    return ranked


def _number(value: float | None, spec: str = ".3f") -> str:
    return "—" if value is None or math.isnan(value) else f"{value:{spec}}"


def _with_interval(value: float | None, interval: Interval | None, spec: str = ".3f") -> str:
    if value is None or math.isnan(value):
        return "—"
    if interval is None or any(math.isnan(bound) for bound in interval):
        return f"{value:{spec}}"
    return f"{value:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def _setting(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def ranking_table(
    ranked: Sequence[RankedPolicy],
    base: ScoredCompletions,
    title: str = "Policies ranked on held-out prompts",
    judge: str = "vader",
):
    """A rich table of :func:`rank_policies`' output, best first, and the base's row last."""
    from rich.table import Table

    judge_name = JUDGE_NAMES.get(judge, judge)
    table = Table(
        title=title,
        caption="95% intervals; gap to #1: paired bootstrap over the prompts, ≈ #1 where it holds 0 (these "
        "prompts cannot tell the two apart)",
    )
    columns = ["#", "policy", "settings that differ", f"judge score ({judge_name})",
               f"{judge_name} win rate vs base", "judge gap to #1", "reward score", "KL to base",
               "distinct-2", "length"]  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in columns[1:3] else "right")
    for policy in ranked:
        gap = "—"
        if policy.gap_to_first is not None:
            mark = "≈ #1" if policy.tied_with_first else "< #1"
            gap = f"{_with_interval(policy.gap_to_first, policy.gap_interval, '+.3f')} {mark}"
        low, high = policy.win_interval
        table.add_row(
            str(policy.rank),
            policy.name,
            ", ".join(f"{key}={_setting(value)}" for key, value in policy.settings.items()) or "—",
            _with_interval(policy.judge_score, policy.judge_interval),
            f"{policy.win_rate:.1%} [{low:.1%}, {high:.1%}]",
            gap,
            _with_interval(policy.reward_score, policy.reward_interval),
            _number(policy.kl),
            _with_interval(policy.distinct_2, policy.distinct_2_interval),
            _number(policy.length, ".1f"),
        )
    scores = base.means()
    pairs = [_bigrams(text) for text in base.completions]
    table.add_row(
        "",
        "base",
        "",
        _number(scores.judge_score),
        "—",
        "—",
        _number(scores.reward_score),
        "—",
        _number(_distinct_2(pairs, range(len(pairs)))),
        _number(scores.length, ".1f"),
    )
    return table
