"""Pieces of ``marl demo`` that need no real model: the training-curve PNG, the verdict and the settings."""

from __future__ import annotations

import json

import pytest

from marl.apps.demo import DemoArguments, demo_rloo_config, verdict_rows
from marl.apps.demo.arguments import DEMO_LEARNING_RATE
from marl.apps.demo.rewards import DEMO_KL_COEF, DEMO_RLOO_K, reward_recipe_flags
from marl.train.curves import PANELS, logged_panels, plot_training_curves
from marl.train.run_dir import read_metrics_file


def test_training_curves_png_from_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {
            "update": u,
            "episode": 64.0 * u,
            "objective/scores": 0.1 * u,
            "objective/kl": 0.5 * u,
            "objective/rlhf_reward": 0.1 * u - 0.025 * u,
            "objective/zero_spread_groups": 0.1,
        }
        for u in range(1, 6)
    ]
    assert len(logged_panels(records)) == len(PANELS) - 2  # no judge, no tools: neither's panel
    for record in records[::2]:  # a judge scores the held-out samples every other update
        record.update({"eval/score": 0.2, "eval/judge_score": 0.3})
    for record in records:  # a run with tools
        record.update({"tools/call_frequency": 0.5, "tools/failure_frequency": 0.0})
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert read_metrics_file(metrics) == records
    assert logged_panels(records) == list(PANELS)
    png = plot_training_curves(metrics, tmp_path / "policy" / "curves.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_with_two_reward_sources_the_curves_show_each_source_beside_the_sum(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {
            "update": u,
            "episode": 64.0 * u,
            "objective/scores": 0.1 * u,
            "rewards/reward": 0.3 * u,
            "rewards/topic": -2.0 + u,
            "advantage_share/reward": 0.7,
            "advantage_share/topic": 0.3,
            "objective/zero_spread_groups": 0.0,
            "zero_spread_groups/reward": 0.0,
            "zero_spread_groups/topic": 0.25,
        }
        for u in range(1, 4)
    ]
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    panels = dict(logged_panels(records))
    titles = list(panels)
    assert titles[0] == "reward: weighted sum of the sources (Σ w·r)"  # the sum, titled as the sum
    # then each source's own score, each titled with its name, and the shares of the advantage
    assert panels[titles[1]] == (("rewards/reward", None),) and "'reward'" in titles[1]
    assert panels[titles[2]] == (("rewards/topic", None),) and "'topic'" in titles[2]
    assert panels["share of the advantage by reward source"] == (
        ("advantage_share/reward", "reward"),
        ("advantage_share/topic", "topic"),
    )
    flat = panels["groups whose rewards are all equal (teach nothing)"]
    assert [key for key, _ in flat] == [
        "objective/zero_spread_groups",
        "zero_spread_groups/reward",
        "zero_spread_groups/topic",
    ]
    assert len(logged_panels([{key: value for key, value in records[0].items() if "topic" not in key}])) == 2
    png = plot_training_curves(metrics, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_curves_need_records(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    with pytest.raises(ValueError, match="no records"):
        plot_training_curves(metrics, tmp_path / "curves.png")


def summary(policy_reward, policy_judge, win):
    return {
        "base": {"reward_score": 0.0, "judge_score": 0.1},
        "policy": {"reward_score": policy_reward, "judge_score": policy_judge},
        "comparison": {"win_rate": win},
        "judge_reward_correlation": 0.3,
    }


def test_verdict_passes_and_misses():
    rows = verdict_rows(summary(1.0, 0.5, 0.8), seconds=700.0, num_prompts=200)
    assert [passed for *_, passed in rows] == [True, True, True, True]
    rows = verdict_rows(summary(1.0, 0.05, 0.6), seconds=1000.0, num_prompts=100)
    # Too slow, too few prompts, win rate below 70 %, and the reward adapter rose while the judge fell.
    assert [passed for *_, passed in rows] == [False, False, False, False]
    assert rows[2][2] == "60.0%"


def test_demo_config_is_the_embedded_model_in_4bit(tmp_path):
    arguments = DemoArguments(total_episodes=128, kl_coef=0.1)
    config = demo_rloo_config(arguments, tmp_path / "policy", "adapters/reward")
    assert config.model_name_or_path == "smollm2-135m-instruct" and config.quantization == "4bit"
    assert config.reward_adapter == ["adapters/reward"] and config.stop_token == "none"
    assert config.total_episodes == 128 and config.kl_coef == 0.1
    completions_per_update = arguments.per_device_train_batch_size * arguments.num_mini_batches
    assert config.batch_sizes(1, 1000).num_total_batches == 128 // completions_per_update


def test_the_kl_coefficient_defaults_by_the_number_of_rewards():
    assert DemoArguments().rewards == "sentiment,topic"  # the two-reward demo is the default
    assert DemoArguments().kl_coef == DEMO_KL_COEF[2] == 0.3
    assert DemoArguments(rewards="sentiment").kl_coef == DEMO_KL_COEF[1] == 0.15
    assert DemoArguments(rewards="sentiment", kl_coef=0.05).kl_coef == 0.05


def test_the_group_size_defaults_by_the_number_of_rewards(tmp_path):
    two, one = DemoArguments(), DemoArguments(rewards="sentiment")
    assert two.rloo_k == DEMO_RLOO_K[2] == 8 and one.rloo_k == DEMO_RLOO_K[1] == 4
    assert DemoArguments(rloo_k=2).rloo_k == 2
    for arguments in (two, one):  # the episodes per update do not depend on k
        config = demo_rloo_config(arguments, tmp_path / "policy", "adapters/reward")
        assert config.rloo_k == arguments.rloo_k
        per_update = arguments.per_device_train_batch_size * arguments.num_mini_batches
        assert config.batch_sizes(1, 1000).num_total_batches == arguments.total_episodes // per_update


def test_the_learning_rate_defaults_by_the_policy_start():
    assert DemoArguments().learning_rate == DEMO_LEARNING_RATE[False] == 1e-3
    assert DemoArguments(warm_start_epochs=1).learning_rate == DEMO_LEARNING_RATE[True] == 3e-4
    assert DemoArguments(learning_rate=5e-4).learning_rate == 5e-4


def test_reward_recipe_is_read_from_the_shipped_summary(tmp_path):
    command = (
        "python examples/train_reward_adapter.py --output_dir adapters/x --lora_last_layers 10 "
        "--learning_rate 5e-4 --output-dir=elsewhere"
    )
    (tmp_path / "training_summary.json").write_text(json.dumps({"command": command}))
    assert reward_recipe_flags(tmp_path) == ["--lora_last_layers", "10", "--learning_rate", "5e-4"]
