"""The advantage estimators and their extension point: "rloo" is the judged leave-one-out bit for bit, GRPO
and REINFORCE++ keep the properties of their definitions on partially judged groups with statistics over
processes that do not depend on the split, unknown names are refused naming the flag, and an estimator
registered from outside the package drives RLOOTrainer."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rloo_math import finite_floats, random_rollout, shape_in_lockstep, shaping_flags
from transformers import HfArgumentParser

from marl import RLOOConfig
from marl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    GRPO_STD_EPSILON,
    configured_estimator,
    get_advantage_estimator,
    grpo_advantages,
    judged_leave_one_out_advantages,
    register_advantage_estimator,
    reinforce_pp_advantages,
)
from marl.algo.shaping import ShapedRewards, shape_rewards
from marl.algo.tensors import sequence_kl, standardize
from marl.errors import ConfigError

from support.runs import abstain_on_every_fourth, build, tiny_config


def old_judged_leave_one_out(rewards, judged, k):
    """The judged leave-one-out as it was written before the estimator registry, verbatim: the oracle."""
    per_prompt, judged_per_prompt = rewards.view(k, -1), judged.view(k, -1)
    judged_rewards = torch.where(judged_per_prompt, per_prompt, torch.zeros_like(per_prompt))
    judged_count = judged_per_prompt.sum(dim=0, keepdim=True)
    baseline = (judged_rewards.sum(dim=0, keepdim=True) - judged_rewards) / (judged_count - 1)
    has_advantage = judged_per_prompt & (judged_count >= 2)
    advantages = torch.where(has_advantage, per_prompt - baseline, torch.zeros_like(per_prompt))
    return advantages.flatten(), has_advantage.flatten()


def with_holes(values: list[float], judged: list[bool], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.tensor([v if j else math.nan for v, j in zip(values, judged, strict=True)], dtype=dtype)
    return rewards, torch.tensor(judged)


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(2, 7),
    num_prompts=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    data=st.data(),
)
def test_the_registered_rloo_is_the_judged_leave_one_out_bit_for_bit(k, num_prompts, dtype, data):
    rows = k * num_prompts
    values = data.draw(st.lists(finite_floats, min_size=rows, max_size=rows))
    judged_pattern = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    rewards, judged = with_holes(values, judged_pattern, dtype)
    expected, expected_has_advantage = old_judged_leave_one_out(rewards, judged, k)

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("leave-one-out groups lie on one process: no collective")

    for passed_gather in (None, gather):
        assert torch.equal(get_advantage_estimator("rloo")(rewards, judged, k, passed_gather), expected)
    advantages, has_advantage = judged_leave_one_out_advantages(rewards, judged, k)
    assert torch.equal(advantages, expected) and torch.equal(has_advantage, expected_has_advantage)


def old_shape_rewards(raw, logprobs, ref_logprobs, mask, stopped, *, k, kl_coef, **flags):
    """``shape_rewards`` as it was before the estimator registry, from the old leave-one-out: the oracle."""
    judged = ~torch.isnan(raw)
    scores = raw
    if flags["missing_eos_penalty"] is not None:
        scores = scores - flags["missing_eos_penalty"] * (~stopped).to(scores.dtype)
    if flags["normalize_reward"]:
        scores = standardize(scores, judged).clamp(-flags["reward_clip_range"], flags["reward_clip_range"])
    kl = sequence_kl(logprobs, ref_logprobs, mask)
    non_score_reward = -kl_coef * kl
    rlhf_reward = scores + non_score_reward
    advantages, has_advantage = old_judged_leave_one_out(
        scores if flags["token_level_kl"] else rlhf_reward, judged, k
    )
    if flags["normalize_advantage"]:
        advantages = standardize(advantages, has_advantage)
    return scores, kl, non_score_reward, rlhf_reward, advantages, judged


@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(2, 5),
    num_prompts=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    judged_share=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    flags=shaping_flags,
)
def test_shaping_with_the_default_or_the_named_rloo_is_the_old_shaping_bit_for_bit(
    k, num_prompts, seed, judged_share, flags
):
    raw, logprobs, ref_logprobs, mask, stopped = random_rollout(seed, k * num_prompts)
    judged = torch.rand(raw.shape, generator=torch.Generator().manual_seed(seed + 1)) < judged_share
    rollout = (torch.where(judged, raw, math.nan), logprobs, ref_logprobs, mask, stopped)
    expected = old_shape_rewards(*rollout, k=k, kl_coef=0.1, **flags)
    for shaped in (
        shape_rewards(*rollout, k=k, kl_coef=0.1, **flags),
        shape_rewards(*rollout, k=k, kl_coef=0.1, estimator=get_advantage_estimator("rloo"), **flags),
    ):
        assert shaped.source_advantages is None  # no sources' scores given: nothing split by source
        for got, want in zip(shaped[: len(expected)], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # equal, NaN where NaN


def test_an_unknown_estimator_is_refused_naming_the_flag_and_the_known_ones():
    with pytest.raises(ConfigError) as refused:
        get_advantage_estimator("nope")
    message = str(refused.value)
    assert "--advantage_estimator" in message and "'nope'" in message and "'rloo'" in message
    assert "register_advantage_estimator" in message  # and how to add one


def test_a_name_is_registered_once():
    with pytest.raises(ConfigError, match="'rloo' is already registered"):
        register_advantage_estimator("rloo", lambda rewards, judged, k, gather: rewards)
    assert get_advantage_estimator("rloo") is ADVANTAGE_ESTIMATORS["rloo"]


def test_the_flag_parses_and_defaults_to_rloo():
    assert RLOOConfig().advantage_estimator == "rloo"
    (config,) = HfArgumentParser(RLOOConfig).parse_args_into_dataclasses(["--advantage_estimator", "grpo"])
    assert config.advantage_estimator == "grpo"  # names are resolved when the trainer is built, not here


# ---------------------------------------------------------------------- a test-only estimator, end to end


@dataclass
class ZeroAdvantages:
    """A test-only estimator: records what it is called with and gives every completion advantage 0."""

    calls: list[dict] = field(default_factory=list)
    returned: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, rewards, judged, k, gather):
        self.calls.append({"rewards": rewards.clone(), "judged": judged.clone(), "k": k, "gather": gather})
        self.returned.append(torch.zeros_like(rewards))
        return self.returned[-1]


TEST_ESTIMATOR = "test-only-zero-advantages"


@pytest.fixture
def zero_advantages():
    estimator = ZeroAdvantages()
    register_advantage_estimator(TEST_ESTIMATOR, estimator)
    yield estimator
    del ADVANTAGE_ESTIMATORS[TEST_ESTIMATOR]


def test_an_estimator_registered_outside_the_package_drives_the_trainer(
    zero_advantages, tiny_llama_dir, tmp_path
):
    """Two updates of 16 completions (k=2) with kl_coef=0, so the rewards the estimator sees are the reward
    function's scores; its zero advantages give a zero gradient, and the adapter stays bit for bit where it
    was, while the same run with "rloo" moves it."""
    judged_scores: list[list[float]] = []

    def reward_fn(prompts, completions):
        scores = abstain_on_every_fourth(prompts, completions)
        judged_scores.append([score for score in scores if score is not None])
        return scores

    adapters = {}
    for name in (TEST_ESTIMATOR, "rloo"):
        config = tiny_config(tmp_path / name, advantage_estimator=name, kl_coef=0.0, total_episodes=32)
        trainer = build(tiny_llama_dir, config, reward_fn=reward_fn)
        before = [parameter.detach().clone() for parameter in trainer.model.policy_parameters()]
        calls_before = len(judged_scores)
        history = trainer.train()
        after = trainer.model.policy_parameters()
        adapters[name] = all(torch.equal(old, new) for old, new in zip(before, after, strict=True))
        if name == TEST_ESTIMATOR:
            test_run, test_scores = history, judged_scores[calls_before:]
            recorded = json.loads((tmp_path / name / "rloo_config.json").read_text())
            assert recorded["advantage_estimator"] == TEST_ESTIMATOR
    assert adapters == {TEST_ESTIMATOR: True, "rloo": False}  # unchanged with zero advantages only

    calls = zero_advantages.calls
    assert len(calls) == 2 and [call["k"] for call in calls] == [2, 2]
    assert all(callable(call["gather"]) for call in calls)  # the trainer's gather over processes
    all_scores = sorted(score for scores in test_scores for score in scores)
    seen = []
    for call, record in zip(calls, test_run, strict=True):
        rewards, judged = call["rewards"], call["judged"]
        assert rewards.shape == judged.shape == (16,) and judged.dtype == torch.bool
        assert torch.equal(judged, ~rewards.isnan()) and int(judged.sum()) == 12  # 1 of 4 abstained
        assert record["objective/unjudged"] == 4
        assert record["objective/scores"] == pytest.approx(rewards[judged].mean().item(), abs=1e-5)
        assert record["loss/policy_avg"] == 0.0
        seen += rewards[judged].tolist()
    assert sorted(seen) == pytest.approx(all_scores)  # the rewards are the reward function's scores
    assert all(torch.equal(advantages, torch.zeros(16)) for advantages in zero_advantages.returned)


def test_an_unknown_estimator_stops_the_trainer_with_the_flag_named(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="--advantage_estimator 'nope'"):
        build(tiny_llama_dir, tiny_config(tmp_path / "run", advantage_estimator="nope")).train()


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
    for name in ShapedRewards._fields:
        if getattr(one, name) is None:  # not asked for (the sources' parts of the advantage)
            continue
        split = interleave([getattr(shaped, name) for shaped in two])
        torch.testing.assert_close(split, getattr(one, name), rtol=1e-5, atol=1e-5, equal_nan=True)
    alone = shape_rewards(*halves[0], k=k, kl_coef=0.1, estimator=estimator)
    assert not torch.allclose(alone.advantages, two[0].advantages)  # the gather matters
