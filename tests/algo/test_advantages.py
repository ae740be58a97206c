"""The advantage-estimator extension point: "rloo" is today's judged leave-one-out bit for bit, unknown names
are refused naming the flag, and an estimator registered from outside the package drives RLOOTrainer."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rloo_math import finite_floats, random_rollout, shaping_flags
from transformers import HfArgumentParser

from marl import RLOOConfig
from marl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    judged_leave_one_out_advantages,
    register_advantage_estimator,
)
from marl.algo.shaping import shape_rewards
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
