"""GRPO and REINFORCE++ advantages: properties of their definitions, partially judged groups, and statistics
over processes that do not depend on the split."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rloo_math import random_rollout, shape_in_lockstep

from marl.algo.advantages import configured_estimator, get_advantage_estimator
from marl.algo.normalized_advantages import GRPO_STD_EPSILON, grpo_advantages, reinforce_pp_advantages
from marl.algo.shaping import ShapedRewards, shape_rewards

finite = st.floats(-50, 50, allow_nan=False, allow_infinity=False)


def groups(k: int, num_prompts: int, data) -> tuple[torch.Tensor, torch.Tensor]:
    values = data.draw(st.lists(finite, min_size=k * num_prompts, max_size=k * num_prompts))
    judged = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=k * num_prompts, max_size=k * num_prompts))
    )
    rewards = torch.tensor(values, dtype=torch.float64)
    return torch.where(judged, rewards, torch.full_like(rewards, math.nan)), judged


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(2, 6),
    num_prompts=st.integers(1, 4),
    scale=st.sampled_from(["group", "batch", "none"]),
    data=st.data(),
)
def test_grpo_partially_judged_groups(k, num_prompts, scale, data):
    rewards, judged = groups(k, num_prompts, data)
    advantages = grpo_advantages(rewards, judged, k, scale_rewards=scale)
    assert torch.isfinite(advantages).all()
    per_prompt, judged_per_prompt = advantages.view(k, -1), judged.view(k, -1)
    lonely = judged_per_prompt.sum(dim=0) < 2
    assert (advantages[~judged] == 0).all()  # unjudged: no advantage
    assert (per_prompt[:, lonely] == 0).all()  # a judged completion without a judged sibling: none either
    # the group-mean baseline: a group's judged advantages sum to zero whatever the scale
    torch.testing.assert_close(per_prompt.sum(dim=0), torch.zeros(per_prompt.shape[1], dtype=torch.float64))
    # unjudged rows are never read
    shuffled = torch.where(judged, rewards, torch.full_like(rewards, 1e6))
    torch.testing.assert_close(grpo_advantages(shuffled, judged, k, scale_rewards=scale), advantages)


@settings(max_examples=100, deadline=None)
@given(k=st.integers(2, 6), num_prompts=st.integers(1, 4), data=st.data())
def test_grpo_scales_by_the_unbiased_group_std_plus_trl_epsilon(k, num_prompts, data):
    rewards = torch.tensor(data.draw(st.lists(finite, min_size=k * num_prompts, max_size=k * num_prompts)))
    rewards = rewards.double()
    judged = torch.ones_like(rewards, dtype=torch.bool)
    unscaled = grpo_advantages(rewards, judged, k, scale_rewards="none")
    grouped = rewards.view(k, -1)
    torch.testing.assert_close(unscaled.view(k, -1), grouped - grouped.mean(dim=0))
    by_group = grpo_advantages(rewards, judged, k, scale_rewards="group").view(k, -1)
    torch.testing.assert_close(by_group, unscaled.view(k, -1) / (grouped.std(dim=0) + GRPO_STD_EPSILON))
    by_batch = grpo_advantages(rewards, judged, k, scale_rewards="batch")
    torch.testing.assert_close(by_batch, unscaled / (rewards.std() + GRPO_STD_EPSILON))


@settings(max_examples=100, deadline=None)
@given(k=st.integers(2, 6), num_prompts=st.integers(1, 4), data=st.data())
def test_reinforce_pp_has_batch_mean_zero_and_unit_std_over_judged_completions(k, num_prompts, data):
    rewards, judged = groups(k, num_prompts, data)
    advantages = reinforce_pp_advantages(rewards, judged, k)
    assert (advantages[~judged] == 0).all()
    selected = advantages[judged]
    spread = rewards[judged].std().item()
    if selected.numel() >= 2 and spread > 1e-3:
        assert abs(selected.mean().item()) < 1e-9
        # unit std but for the 1e-8 added to the divisor, which shows when the rewards' spread is small
        assert abs(selected.std().item() - spread / (spread + 1e-8)) < 1e-9
    elif selected.numel() < 2:
        assert (selected == 0).all()


def test_the_estimators_are_registered_and_scale_rewards_is_bound():
    assert get_advantage_estimator("reinforce_pp") is reinforce_pp_advantages
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    judged = torch.ones(4, dtype=torch.bool)
    assert torch.equal(
        configured_estimator("grpo", "none")(rewards, judged, 2, None), torch.tensor([-1.0, -2, 1, 2])
    )
    with pytest.raises(ValueError, match="scale_rewards='nope'"):
        grpo_advantages(rewards, judged, 2, scale_rewards="nope")


@pytest.mark.parametrize("estimator", [configured_estimator("grpo", "batch"), reinforce_pp_advantages])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_statistics_span_processes(estimator, seed):
    """Two processes (threads whose gather concatenates) shape like one process on the whole batch."""
    k, num_prompts = 3, 2
    halves = []
    for rank in range(2):
        raw, *rest = random_rollout(seed + 11 * rank, k * num_prompts)
        raw = torch.where(torch.arange(raw.numel()) % 4 == rank, math.nan, raw)
        halves.append((raw, *rest))

    def interleave(parts):
        grouped = torch.stack([part.view(k, num_prompts, *part.shape[1:]) for part in parts], dim=1)
        return grouped.reshape(2 * k * num_prompts, *parts[0].shape[1:])

    whole = [interleave([half[part] for half in halves]) for part in range(5)]
    one = shape_rewards(*whole, k=k, kl_coef=0.1, estimator=estimator)
    two = shape_in_lockstep(halves, k=k, kl_coef=0.1, estimator=estimator)
    for field in ShapedRewards._fields:
        if getattr(one, field) is None:  # not asked for (the sources' parts of the advantage)
            continue
        split = interleave([getattr(shaped, field) for shaped in two])
        torch.testing.assert_close(split, getattr(one, field), rtol=1e-5, atol=1e-5, equal_nan=True)
    alone = shape_rewards(*halves[0], k=k, kl_coef=0.1, estimator=estimator)
    assert not torch.allclose(alone.advantages, two[0].advantages)  # the gather matters
