"""Metric records: sums over valid tokens, the first micro-batch's ratio, the reduction to means."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from marl.algo.losses import PolicyLoss, clipped_policy_loss
from marl.algo.metrics import RolloutStats, UpdateStats, rollout_metrics, update_metrics
from marl.algo.shaping import shape_rewards
from marl.train.parallel import sum_over_processes


def policy_loss(new: list[float], old: list[float], advantages: list[float]) -> PolicyLoss:
    return clipped_policy_loss(torch.tensor(new), torch.tensor(old), torch.tensor(advantages), cliprange=0.2)


def test_update_stats_count_valid_tokens_only_and_keep_the_first_ratio():
    stats = UpdateStats()
    entropy = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    stats.add(policy_loss([0.0, 0.0], [0.0, 0.0], [1.0, -1.0]), entropy, mask)  # ratio 1
    stats.add(policy_loss([0.5, 0.5], [0.0, 0.0], [1.0, 1.0]), entropy, mask)  # ratio e^0.5, clipped
    metrics = update_metrics(sum_over_processes(stats, Accelerator(cpu=True)))
    assert metrics["policy/entropy_avg"] == pytest.approx((1.0 + 2.0 + 3.0) / 3)
    assert metrics["val/ratio_first"] == pytest.approx(1.0)
    assert metrics["val/ratio"] == pytest.approx((2 + 2 * torch.e**0.5) / 4)
    assert metrics["policy/clipfrac_avg"] == pytest.approx(0.5)


def test_rollout_metrics_are_means_over_completions_and_per_source_over_judged_ones():
    zero = torch.zeros(2, 2)
    shaped = shape_rewards(
        torch.tensor([1.0, 3.0]),
        zero - 1.0,
        zero - 2.0,
        torch.ones(2, 2, dtype=torch.bool),
        torch.tensor([True, False]),
        k=2,
        kl_coef=0.1,
    )
    rollout = SimpleNamespace(
        logprobs=zero - 1.0,
        response_mask=torch.tensor([[True, True], [True, False]]),
        contains_eos=torch.tensor([True, False]),
        contains_stop=torch.tensor([True, False]),
        scores=torch.tensor([1.0, 3.0]),
        source_scores=torch.tensor([[1.0, math.nan], [3.0, 5.0]]),  # the second source judged one completion
    )
    stats = sum_over_processes(RolloutStats.of(rollout, shaped), Accelerator(cpu=True))
    metrics = rollout_metrics(stats, ["sentiment", "length"])
    assert metrics["objective/scores"] == pytest.approx(2.0)
    assert metrics["objective/kl"] == pytest.approx(2.0)
    assert metrics["objective/entropy"] == pytest.approx(1.5)  # 2 valid tokens, then 1, of -log p = 1
    assert metrics["objective/rlhf_reward"] == pytest.approx(2.0 - 0.2)
    assert metrics["val/num_eos_tokens"] == 1.0
    assert metrics["rewards/sentiment"] == pytest.approx(2.0)
    assert metrics["rewards/length"] == pytest.approx(5.0)


def test_reward_means_are_over_judged_completions_and_unjudged_ones_are_counted():
    zero = torch.zeros(4, 1)
    shaped = shape_rewards(
        torch.tensor([1.0, math.nan, 3.0, 6.0]),
        zero,
        zero - torch.tensor([[1.0], [2.0], [3.0], [4.0]]),  # kl = 1, 2, 3, 4
        torch.ones(4, 1, dtype=torch.bool),
        torch.ones(4, dtype=torch.bool),
        k=2,
        kl_coef=0.1,
    )
    rollout = SimpleNamespace(
        logprobs=zero,
        response_mask=torch.ones(4, 1, dtype=torch.bool),
        contains_eos=torch.ones(4, dtype=torch.bool),
        contains_stop=torch.ones(4, dtype=torch.bool),
        scores=torch.tensor([1.0, math.nan, 3.0, 6.0]),
        source_scores=torch.tensor([[1.0], [math.nan], [3.0], [6.0]]),
    )
    metrics = rollout_metrics(
        sum_over_processes(RolloutStats.of(rollout, shaped), Accelerator(cpu=True)), ["f"]
    )
    assert metrics["objective/unjudged"] == 1.0
    assert metrics["objective/scores"] == pytest.approx(10.0 / 3)
    assert metrics["objective/kl"] == pytest.approx(2.5)  # every completion has a KL
    assert metrics["objective/non_score_reward"] == pytest.approx(-0.1 * (1 + 3 + 4) / 3)
    assert metrics["objective/rlhf_reward"] == pytest.approx(
        metrics["objective/scores"] + metrics["objective/non_score_reward"]
    )
    assert metrics["rewards/f"] == pytest.approx(10.0 / 3)

    nothing = shaped._replace(judged=torch.zeros(4, dtype=torch.bool))
    empty = rollout_metrics(
        sum_over_processes(RolloutStats.of(rollout, nothing), Accelerator(cpu=True)), ["f"]
    )
    assert math.isnan(empty["objective/scores"]) and empty["objective/unjudged"] == 4.0
