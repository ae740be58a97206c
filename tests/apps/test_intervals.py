"""The verdict's 95% intervals: Wilson against SciPy's own, the bootstrap's properties, and the verdict rows
that show them."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marl.apps.demo.verdict import format_interval, topicality_summary, verdict_intervals, verdict_rows
from marl.apps.evaluate.ranking import bootstrap_intervals, wilson_interval
from marl.data.fixed_rules import distinct_2, film_share


@settings(max_examples=200, deadline=None)
@given(trials=st.integers(1, 500), data=st.data())
def test_wilson_equals_scipys_wilson_interval(trials, data):
    scipy_stats = pytest.importorskip("scipy.stats")
    successes = data.draw(st.integers(0, trials))
    expected = scipy_stats.binomtest(successes, trials).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(expected.low, abs=1e-12) and high == pytest.approx(expected.high, abs=1e-12)


def test_wilson_counts_a_tie_as_half_and_needs_trials():
    low, high = wilson_interval(143 + 0.5 * 23, 200)  # the 77.2% of issue 43's unseen seed
    assert low < 0.772 < high and 0.70 < low < 0.72 and 0.82 < high < 0.83
    assert all(math.isnan(bound) for bound in wilson_interval(0, 0))


def test_the_bootstrap_is_reproducible_paired_and_centred_on_the_measured_value():
    generator = random.Random(1)
    words = [f"w{index}" for index in range(60)]  # distinct-2 about 0.75, as the demo's texts
    texts = [" ".join(generator.choice(words) for _ in range(12)) for _ in range(200)]
    rows_of = {"distinct_2": lambda rows: distinct_2([texts[row] for row in rows])}
    first = bootstrap_intervals(rows_of, len(texts))
    assert first == bootstrap_intervals(rows_of, len(texts))  # a fixed seed
    assert first != bootstrap_intervals(rows_of, len(texts), seed=1)
    low, high = first["distinct_2"]
    measured = distinct_2(texts)
    # centred: the raw percentile interval of distinct-2 sits below the measured value (repeats); this is not
    assert low < measured < high and abs((low + high) / 2 - measured) < 0.25 * (high - low)
    half_low, half_high = bootstrap_intervals(rows_of, len(texts), half_samples=True)["distinct_2"]
    assert half_low < measured < half_high and half_high - half_low < 0.7 * (high - low)


def test_half_samples_spread_as_independent_sets_do():
    """Why distinct-2 is half-sampled: its spread over half-samples of one set of 200 completions matches its
    spread over independent sets of 200; resampling with replacement doubles it (module docstring)."""
    words = [f"w{index}" for index in range(60)]

    def texts(generator):
        return [
            " ".join(generator.choice(words) for _ in range(generator.randint(6, 14))) for _ in range(200)
        ]

    generator = random.Random(5)
    independent = [distinct_2(texts(generator)) for _ in range(150)]
    true_width = 2 * 1.96 * statistics.stdev(independent)
    one = texts(random.Random(100))
    rows_of = {"distinct_2": lambda rows: distinct_2([one[row] for row in rows])}
    low, high = bootstrap_intervals(rows_of, 200, half_samples=True, resamples=300)["distinct_2"]
    assert high - low == pytest.approx(true_width, rel=0.3)
    low, high = bootstrap_intervals(rows_of, 200, resamples=300)["distinct_2"]
    assert high - low > 1.6 * true_width
    same = {"a": lambda rows: len(set(rows)) / len(rows), "b": lambda rows: len(set(rows)) / len(rows)}
    paired = bootstrap_intervals(same, 50)
    assert paired["a"] == paired["b"]  # every statistic sees the same resamples


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_the_film_share_interval_has_the_binomial_width(share):
    texts = ["a fine film" if index < share * 200 else "a fine day" for index in range(200)]
    out = verdict_intervals(texts, texts, [0.0] * 200, [0.0] * 200, {"wins": 0, "ties": 200, "losses": 0})
    low, high = out["base"]["film_share"]
    half_width = 1.96 * math.sqrt(share * (1 - share) / 200)
    assert low < film_share(texts) < high
    assert (high - low) / 2 == pytest.approx(half_width, rel=0.15)
    assert out["distinct_2_ratio"] == pytest.approx((1.0, 1.0))  # the same texts: paired, exactly 1
    assert out["judge_gain"] == (0.0, 0.0) and out["win_rate"][0] < 0.5 < out["win_rate"][1]


def test_a_collapsed_policy_is_told_apart_and_the_rows_show_the_intervals():
    generator = random.Random(2)
    words = [f"w{index}" for index in range(60)]
    base = [" ".join(generator.choice(words) for _ in range(10)) for _ in range(200)]
    collapsed = ["a great film with a great cast" if index % 2 else base[index] for index in range(200)]
    judge_base = [generator.random() for _ in range(200)]
    judge_policy = [score + 0.1 for score in judge_base]
    comparison = {"wins": 200, "ties": 0, "losses": 0, "win_rate": 1.0}
    intervals = verdict_intervals(base, collapsed, judge_base, judge_policy, comparison)
    assert intervals["distinct_2_ratio"][1] < 0.9  # the whole interval misses the 0.9× target
    assert intervals["judge_gain"] == pytest.approx((0.1, 0.1))
    summary = {
        "base": {"reward_score": 0.0, "judge_score": 0.4},
        "policy": {"reward_score": 1.0, "judge_score": 0.5},
        "comparison": comparison,
        "judge_reward_correlation": 0.3,
        "topicality": topicality_summary(base, collapsed),
        "intervals": intervals,
    }
    rows = {row[0]: row[2] for row in verdict_rows(summary, 700.0, 200)}
    low, high = intervals["win_rate"]
    assert rows["VADER win rate, policy vs base"] == f"100.0% [{low:.1%}, {high:.1%}]"
    film = rows["stays on the film: completions naming it (fixed word list)"]
    assert film.count("[") == 2 and " → policy " in film
    variety = rows["varied text: distinct-2"]
    assert variety.endswith(f"×{format_interval(intervals['distinct_2_ratio'], '.2f')})")
