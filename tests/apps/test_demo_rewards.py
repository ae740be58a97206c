"""``marl demo --rewards``: the choice of rewards, their weights and the checks no reward sees."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from marl.apps.cli import demo_main
from marl.apps.demo import DemoArguments, demo_rloo_config, verdict_rows
from marl.apps.demo.rewards import (
    SHIPPED_ADAPTERS_DIR,
    TOPIC_ADAPTER_NAME,
    TOPIC_SPREAD_SHARE,
    balancing_weight,
    parse_rewards,
    reward_adapter_entries,
    topic_weighing,
    weigh_rewards,
)
from marl.apps.demo.verdict import topicality_summary
from marl.errors import ConfigError

from support.tiny import refused


@pytest.mark.parametrize(
    "value", ["topic", "sentiment,sentiment", "sentiment,fluency", "", "sentiment;topic"]
)
def test_bad_rewards_are_refused_in_one_line(value, capsys):
    with pytest.raises(ConfigError, match="--rewards="):
        DemoArguments(rewards=value)
    line = refused(capsys, demo_main, ["--rewards", value])
    assert line.startswith("marl demo: error: --rewards=") and "'sentiment,topic'" in line


def test_rewards_name_the_adapters_of_the_run(tmp_path):
    assert parse_rewards("sentiment") == ("sentiment",) and parse_rewards(" topic ,sentiment") == (
        "topic",
        "sentiment",
    )
    entries = reward_adapter_entries(("sentiment", "topic"), {"sentiment": "s", "topic": "t"})
    config = demo_rloo_config(DemoArguments(rewards="sentiment,topic"), tmp_path, entries, [1.0, 0.4])
    assert config.reward_adapter_folders() == {"reward": "s", "topic": "t"}
    assert config.reward_weights == [1.0, 0.4]
    assert config.reward_normalization == "sum"  # the demo's default is unchanged
    per_reward = DemoArguments(reward_normalization="per_reward")
    per_reward_config = demo_rloo_config(per_reward, tmp_path, entries)
    assert (per_reward_config.reward_normalization, per_reward_config.scale_rewards) == (
        "per_reward",
        "group",
    )
    assert config.scale_rewards is None
    # One reward: the single-reward demo's adapter, named as before.
    assert reward_adapter_entries(("sentiment",), {"sentiment": "s", "topic": "t"}) == ["s"]


def test_the_shipped_adapters_are_found_from_the_package():
    assert (SHIPPED_ADAPTERS_DIR / "README.md").is_file()
    assert DemoArguments().reward_adapter.startswith(str(SHIPPED_ADAPTERS_DIR))
    assert DemoArguments().topic_reward_adapter == str(SHIPPED_ADAPTERS_DIR / TOPIC_ADAPTER_NAME)
    assert (Path(DemoArguments().topic_reward_adapter) / "adapter_config.json").is_file()  # shipped


@given(
    st.lists(st.floats(-5, 5), min_size=2, max_size=20),
    st.lists(st.floats(-5, 5), min_size=2, max_size=20),
)
def test_the_balancing_weight_equalises_the_spreads(reference, other):
    import statistics

    weight = balancing_weight(reference, other)
    assert weight > 0 and math.isfinite(weight)
    if statistics.pstdev(other) > 1e-6 and statistics.pstdev(reference) > 0:
        scaled = [weight * value for value in other]
        assert statistics.pstdev(scaled) == pytest.approx(statistics.pstdev(reference), rel=1e-6, abs=1e-9)
    elif statistics.pstdev(reference) == 0 or statistics.pstdev(other) == 0:
        assert weight == 1.0


@given(
    st.lists(st.floats(-5, 5), min_size=3, max_size=20),
    st.lists(st.floats(-5, 5), min_size=3, max_size=20),
)
def test_the_on_topic_weight_spreads_its_scores_a_fixed_share_of_the_sentiment_spread(sentiment, topic):
    import statistics

    topic = (topic * len(sentiment))[: len(sentiment)]  # scores of the same completions
    assume(statistics.pstdev(sentiment) > 1e-3 and statistics.pstdev(topic) > 1e-3)
    weighing = topic_weighing(sentiment, topic)
    weighted_spread = statistics.pstdev([weighing["weight"] * value for value in topic])
    # The weight is rounded to 3 decimals, as it is printed.
    assert weighted_spread == pytest.approx(
        TOPIC_SPREAD_SHARE * statistics.pstdev(sentiment), abs=5e-4 * statistics.pstdev(topic) + 1e-9
    )
    assert weighing["completions"] == len(sentiment)


def test_a_spread_too_small_for_the_ratio_falls_back_to_weight_one():
    # Found by the property above: a subnormal spread made the ratio overflow to inf.
    assert balancing_weight([0.0, 1.0], [0.0, 2.2250738585e-313]) == 1.0


def test_a_given_topic_weight_is_used_as_given():
    said = []
    weighing = weigh_rewards(None, None, [], 0.25, say=said.append)
    assert weighing["weights"] == [1.0, 0.25] and weighing["how"] == "--topic_weight"
    assert said == ["reward = 1 × sentiment + 0.250 × on-topic"]


def test_the_verdict_adds_the_film_and_distinct_2_rows():
    summary = {
        "base": {"reward_score": 0.0, "judge_score": 0.1},
        "policy": {"reward_score": 1.0, "judge_score": 0.5},
        "comparison": {"win_rate": 0.85},
        "judge_reward_correlation": 0.3,
    }
    base = ["the film is slow", "a plot of small things", "it is a bore"]
    drifted = ["an immersive creative journey", "an immersive creative journey", "a film of joy"]
    summary["topicality"] = topicality_summary(base, drifted)
    rows = verdict_rows(summary, seconds=700.0, num_prompts=200)
    assert len(rows) == 6 and [row[3] for row in rows[4:]] == [False, False]
    summary["topicality"] = topicality_summary(base, base)
    assert [row[3] for row in verdict_rows(summary, 700.0, 200)[4:]] == [True, True]


def test_an_unknown_reward_normalization_is_refused_in_one_line(capsys):
    line = refused(capsys, demo_main, ["--reward_normalization", "gdpo"])
    assert line.startswith("marl demo: error: --reward_normalization 'gdpo'") and "'per_reward'" in line
