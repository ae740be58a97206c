"""RLOO math against reference vectors, properties and the REINFORCE gradient identity."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marl.algo.advantages import judged_leave_one_out_advantages, leave_one_out_advantages
from marl.algo.losses import clipped_policy_loss, token_level_k3_kl
from marl.algo.shaping import (
    ShapedRewards,
    apply_missing_eos_penalty,
    normalize_and_clip_rewards,
    rlhf_rewards,
    shape_rewards,
)
from marl.algo.tensors import STD_EPSILON, masked_sum, sequence_kl, standardize
from marl.rollout.completions import response_lengths, response_mask, truncate_after_stop_token

# k = 4 samples of P = 3 prompts, k-major: row j * P + i is sample j of prompt i.
SEED_REWARDS = [1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]


def leave_one_out_loop(rewards: list[float], k: int) -> list[float]:
    """The definition written as loops: reward minus the mean of the other samples of the same prompt."""
    num_prompts = len(rewards) // k
    advantages = [0.0] * len(rewards)
    for prompt in range(num_prompts):
        for sample in range(k):
            others = [rewards[other * num_prompts + prompt] for other in range(k) if other != sample]
            advantages[sample * num_prompts + prompt] = rewards[sample * num_prompts + prompt] - sum(
                others
            ) / (k - 1)
    return advantages


def test_seed_vector_matches_loop_exactly():
    vectorised = leave_one_out_advantages(torch.tensor(SEED_REWARDS, dtype=torch.float64), k=4)
    assert vectorised.tolist() == leave_one_out_loop(SEED_REWARDS, k=4)
    assert vectorised[0].item() == -4.0
    assert vectorised[7].item() == pytest.approx(4.0 / 3.0, abs=1e-12)


def test_seed_vector_float32_matches_loop():
    vectorised = leave_one_out_advantages(torch.tensor(SEED_REWARDS), k=4)
    torch.testing.assert_close(vectorised, torch.tensor(leave_one_out_loop(SEED_REWARDS, k=4)))


finite_floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 6), num_prompts=st.integers(1, 5), data=st.data())
def test_group_advantages_sum_to_zero(k, num_prompts, data):
    values = data.draw(st.lists(finite_floats, min_size=k * num_prompts, max_size=k * num_prompts))
    advantages = leave_one_out_advantages(torch.tensor(values, dtype=torch.float64), k=k)
    group_sums = advantages.view(k, num_prompts).sum(dim=0)
    torch.testing.assert_close(group_sums, torch.zeros(num_prompts, dtype=torch.float64), atol=1e-8, rtol=0)
    torch.testing.assert_close(advantages, torch.tensor(leave_one_out_loop(values, k), dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(first=finite_floats, second=finite_floats)
def test_k2_gives_plus_minus_the_difference(first, second):
    advantages = leave_one_out_advantages(torch.tensor([first, second], dtype=torch.float64), k=2)
    # with k = 2 the baseline is the other sample: A = ±(r_0 − r_1), twice the deviation from the pair's mean
    assert advantages[0].item() == pytest.approx(first - second, abs=1e-9)
    assert advantages[1].item() == pytest.approx(second - first, abs=1e-9)
    centred = torch.tensor([first, second], dtype=torch.float64) - (first + second) / 2
    torch.testing.assert_close(advantages, 2 * centred)


def test_leave_one_out_rejects_bad_group_sizes():
    with pytest.raises(ValueError, match="k >= 2"):
        leave_one_out_advantages(torch.ones(4), k=1)
    with pytest.raises(ValueError, match="groups of k=3"):
        leave_one_out_advantages(torch.ones(4), k=3)


def test_truncate_after_stop_token_keeps_the_stop_and_pads_the_rest():
    responses = torch.tensor([[5, 6, 1, 7, 1], [5, 6, 7, 8, 9], [1, 5, 5, 5, 5]])
    truncated, contains = truncate_after_stop_token(responses, stop_token_ids=(1,), pad_token_id=0)
    assert truncated.tolist() == [[5, 6, 1, 0, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]]
    assert contains.tolist() == [True, False, True]


def test_lengths_and_mask_when_pad_equals_eos():
    # pad == eos == 1: the EOS must stay valid (it is part of the action) and the padding after it must not.
    responses = torch.tensor([[5, 6, 1, 1, 1], [5, 1, 1, 1, 1]])
    lengths = response_lengths(responses, stop_token_ids=(1,))
    assert lengths.tolist() == [3, 2]
    mask = response_mask(lengths, responses.shape[1])
    assert mask.tolist() == [[True, True, True, False, False], [True, True, False, False, False]]
    assert response_lengths(responses, stop_token_ids=()).tolist() == [5, 5]


def test_several_stop_tokens_each_end_a_completion():
    # Llama-3.x-Instruct ends turns with <|eot_id|> as well as <|end_of_text|>: both must stop
    responses = torch.tensor([[5, 7, 2, 9, 9], [5, 6, 6, 3, 2], [5, 6, 6, 6, 6]])
    truncated, contains = truncate_after_stop_token(responses, stop_token_ids=(2, 3), pad_token_id=0)
    assert truncated.tolist() == [[5, 7, 2, 0, 0], [5, 6, 6, 3, 0], [5, 6, 6, 6, 6]]
    assert contains.tolist() == [True, True, False]
    assert response_lengths(responses, stop_token_ids=(2, 3)).tolist() == [3, 4, 5]


def test_missing_eos_penalty_lowers_only_completions_without_eos():
    scores = torch.tensor([0.5, 0.5, -1.0])
    contains_eos = torch.tensor([True, False, False])
    penalised = apply_missing_eos_penalty(scores, contains_eos, penalty=1.5)
    assert penalised.tolist() == [0.5, -1.0, -2.5]


def test_normalize_reward_z_scores_then_clips():
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 100.0])
    normalised = normalize_and_clip_rewards(scores, clip_range=10.0)
    assert abs(normalised.mean().item()) < 1e-6
    assert normalised.std().item() == pytest.approx(1.0, abs=1e-5)
    clipped = normalize_and_clip_rewards(scores, clip_range=0.5)
    assert clipped.max().item() == pytest.approx(0.5)
    assert clipped.min().item() >= -0.5
    assert not torch.equal(clipped, normalised)
    # identical scores normalise to zeros instead of NaN
    assert normalize_and_clip_rewards(torch.full((4,), 3.0), 1.0).tolist() == [0.0] * 4


def test_sequence_kl_and_rlhf_reward_ignore_invalid_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -1.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    kl = sequence_kl(logprobs, ref_logprobs, mask)
    assert kl.tolist() == [-0.5, 0.5]
    reward, non_score = rlhf_rewards(torch.tensor([1.0, 1.0]), kl, kl_coef=0.1)
    torch.testing.assert_close(non_score, torch.tensor([0.05, -0.05]))
    torch.testing.assert_close(reward, torch.tensor([1.05, 0.95]))


def test_larger_kl_coef_lowers_reward_of_drifting_completions():
    scores = torch.tensor([1.0, 1.0])
    kl = torch.tensor([0.0, 3.0])
    low, _ = rlhf_rewards(scores, kl, kl_coef=0.01)
    high, _ = rlhf_rewards(scores, kl, kl_coef=0.5)
    assert high[0] == low[0]
    assert high[1] < low[1]


def test_normalize_advantage_rescales_to_unit_std_and_keeps_order():
    advantages = leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 9.0]), k=2)
    normalised = standardize(advantages)
    assert normalised.std().item() == pytest.approx(1.0, abs=1e-5)
    assert abs(normalised.mean().item()) < 1e-6
    assert torch.equal(torch.argsort(normalised), torch.argsort(advantages))
    assert not torch.allclose(normalised, advantages)


def test_k3_kl_is_non_negative_zero_on_agreement_and_masked():
    generator = torch.Generator().manual_seed(0)
    new = -torch.rand(4, 6, generator=generator) * 3
    ref = -torch.rand(4, 6, generator=generator) * 3
    mask = torch.rand(4, 6, generator=generator) > 0.3
    k3 = token_level_k3_kl(new, ref, mask)
    assert (k3 >= 0).all()
    assert (k3[~mask] == 0).all()
    assert (k3[mask] > 0).any()
    assert (token_level_k3_kl(new, new, mask) == 0).all()


@pytest.mark.parametrize("masked_gap", [200.0, math.inf])
def test_k3_kl_gradient_ignores_masked_positions_however_far_apart(masked_gap):
    """After the stop token the log-probs are unconstrained: a difference whose exp overflows there must not
    turn the gradient into NaN (0 * inf), and the gradient equals that of the same input with the masked
    positions' values set to 0."""
    new = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -4.0]])
    ref = torch.tensor([[-1.2, -1.0, -0.5], [-0.1, -2.5, -3.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    far_new, far_ref = new.clone(), ref.clone()
    far_ref[0, 2], far_new[0, 2] = 0.0, -masked_gap  # ref - new = masked_gap at a masked position
    far_new.requires_grad_(True)
    far_ref.requires_grad_(True)
    clean_new = torch.where(mask, new, torch.zeros_like(new)).requires_grad_(True)
    clean_ref = torch.where(mask, ref, torch.zeros_like(ref)).requires_grad_(True)

    far = token_level_k3_kl(far_new, far_ref, mask).sum()
    clean = token_level_k3_kl(clean_new, clean_ref, mask).sum()
    far_grads = torch.autograd.grad(far, (far_new, far_ref))
    clean_grads = torch.autograd.grad(clean, (clean_new, clean_ref))

    assert far.item() == clean.item()
    for far_grad, clean_grad in zip(far_grads, clean_grads, strict=True):
        assert torch.isfinite(far_grad).all(), far_grad
        assert torch.equal(far_grad, clean_grad)
        assert (far_grad[~mask] == 0).all()


def test_token_level_kl_adds_a_penalty_that_changes_the_gradient():
    """The token-level variant changes the loss and its gradient (summing per-token KL into the reward would
    equal the sequence-level variant: the defect this replaces)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [0, 4, 4]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ref_logprobs = torch.log_softmax(torch.randn(2, 3, 5), -1).gather(-1, tokens[..., None]).squeeze(-1)
    new_logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    new_seq = masked_sum(new_logprobs, mask)
    advantages = torch.tensor([1.0, -1.0])
    policy = clipped_policy_loss(new_seq, new_seq.detach(), advantages, cliprange=0.2).loss
    (grad_policy_only,) = torch.autograd.grad(policy, logits, retain_graph=True)
    penalty = 0.1 * token_level_k3_kl(new_logprobs, ref_logprobs, mask).sum(dim=1).mean()
    assert penalty.item() > 0
    (grad_with_kl,) = torch.autograd.grad(policy + penalty, logits)
    assert not torch.allclose(grad_policy_only, grad_with_kl)


# Blog example: logits [1, 2, 1, 1], action 1, advantage 1; gradient of +logp·A (and +ratio·A) w.r.t. logits:
BLOG_GRADIENT = [-0.1749, 0.5246, -0.1749, -0.1749]


def test_reinforce_gradient_identity():
    logits = torch.tensor([1.0, 2.0, 1.0, 1.0], requires_grad=True)
    advantage = torch.tensor([1.0])

    logprob = torch.log_softmax(logits, dim=-1)[1].reshape(1)
    reinforce_loss = -(advantage * logprob).mean()
    (reinforce_grad,) = torch.autograd.grad(reinforce_loss, logits)

    logprob = torch.log_softmax(logits, dim=-1)[1].reshape(1)
    ppo = clipped_policy_loss(logprob, logprob.detach(), advantage, cliprange=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.loss, logits)

    assert ppo.ratio.item() == 1.0
    assert not ppo.clipped.any()
    torch.testing.assert_close(ppo_grad, reinforce_grad)
    # our losses are minimised, the blog's objectives are maximised: the gradients differ by the sign only
    torch.testing.assert_close(-ppo_grad, torch.tensor(BLOG_GRADIENT), atol=1e-4, rtol=0)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    new = torch.tensor([math.log(1.5), math.log(0.5)], requires_grad=True)
    old = torch.zeros(2)
    out = clipped_policy_loss(new, old, torch.tensor([1.0, -1.0]), cliprange=0.2)
    assert out.clipped.tolist() == [True, True]
    (grad,) = torch.autograd.grad(out.loss, new)
    assert grad.tolist() == [0.0, 0.0]
    inside = clipped_policy_loss(new, old, torch.tensor([-1.0, 1.0]), cliprange=0.2)
    assert inside.clipped.tolist() == [False, False]


def test_shape_rewards_penalises_then_normalises_then_folds_the_kl_in():
    raw = torch.tensor([1.0, 2.0, 3.0, 4.0])  # k=2, P=2
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -9.0], [-1.0, -1.0], [-1.0, -1.0]])
    ref_logprobs = torch.tensor([[-2.0, -1.0], [-2.0, -1.0], [-1.0, -3.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    stopped = torch.tensor([True, False, True, True])
    shaped = shape_rewards(
        raw, logprobs, ref_logprobs, mask, stopped, k=2, kl_coef=0.5, missing_eos_penalty=10.0
    )
    assert shaped.scores.tolist() == [1.0, -8.0, 3.0, 4.0]
    assert shaped.kl.tolist() == [1.0, 0.0, 2.0, 0.0]  # the masked -9 is not counted
    assert shaped.non_score_reward.tolist() == [-0.5, 0.0, -1.0, 0.0]
    assert shaped.rlhf_reward.tolist() == [0.5, -8.0, 2.0, 4.0]
    torch.testing.assert_close(shaped.advantages, leave_one_out_advantages(shaped.rlhf_reward, 2))

    normalised = shape_rewards(
        raw,
        logprobs,
        ref_logprobs,
        mask,
        stopped,
        k=2,
        kl_coef=0.5,
        normalize_reward=True,
        reward_clip_range=1.0,
    )
    assert normalised.scores.abs().max() <= 1.0 and normalised.scores.argsort().tolist() == [0, 1, 2, 3]
    advantages = shape_rewards(
        raw, logprobs, ref_logprobs, mask, stopped, k=2, kl_coef=0.5, normalize_advantage=True
    ).advantages
    assert advantages.std().item() == pytest.approx(1.0, abs=1e-5)


def test_with_token_level_kl_advantages_come_from_the_scores_alone():
    """token_level_kl moves the KL out of the reward: the advantages ignore it (it enters the loss per token),
    while with the sequence-level penalty a different reference changes them."""
    generator = torch.Generator().manual_seed(0)
    raw = torch.rand(8, generator=generator)
    logprobs = -torch.rand(8, 5, generator=generator)
    mask = torch.ones(8, 5, dtype=torch.bool)
    stopped = torch.ones(8, dtype=torch.bool)
    references = [-torch.rand(8, 5, generator=generator) for _ in range(2)]

    def advantages(ref_logprobs, token_level_kl):
        return shape_rewards(
            raw, logprobs, ref_logprobs, mask, stopped, k=4, kl_coef=0.3, token_level_kl=token_level_kl
        ).advantages

    assert torch.equal(advantages(references[0], True), advantages(references[1], True))
    torch.testing.assert_close(advantages(references[0], True), leave_one_out_advantages(raw, 4))
    assert not torch.allclose(advantages(references[0], False), advantages(references[1], False))


# ---------------------------------------------------------------------- completions no source judged


def todays_shape_rewards(raw, logprobs, ref_logprobs, mask, stopped, *, k, kl_coef, **flags):
    """The shaping as it was before unjudged completions and gathered statistics, from the unchanged pure
    functions and the z-score written out: the oracle for a rollout where every completion is judged."""

    def z_score(values):
        if values.numel() < 2:
            return torch.zeros_like(values)
        return (values - values.mean()) / (values.std() + STD_EPSILON)

    scores = raw
    if flags["missing_eos_penalty"] is not None:
        scores = apply_missing_eos_penalty(scores, stopped, flags["missing_eos_penalty"])
    if flags["normalize_reward"]:
        scores = z_score(scores).clamp(-flags["reward_clip_range"], flags["reward_clip_range"])
    kl = sequence_kl(logprobs, ref_logprobs, mask)
    rlhf_reward, non_score_reward = rlhf_rewards(scores, kl, kl_coef)
    advantages = leave_one_out_advantages(scores if flags["token_level_kl"] else rlhf_reward, k)
    if flags["normalize_advantage"]:
        advantages = z_score(advantages)
    return scores, kl, non_score_reward, rlhf_reward, advantages


def random_rollout(seed: int, rows: int, length: int = 3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    raw = (torch.randn(rows, generator=generator, dtype=torch.float64) * 5).to(dtype)
    logprobs = -torch.rand(rows, length, generator=generator, dtype=torch.float64).to(dtype)
    ref_logprobs = -torch.rand(rows, length, generator=generator, dtype=torch.float64).to(dtype)
    mask = torch.rand(rows, length, generator=generator) < 0.8
    stopped = torch.rand(rows, generator=generator) < 0.7
    return raw, logprobs, ref_logprobs, mask, stopped


shaping_flags = st.fixed_dictionaries(
    {
        "missing_eos_penalty": st.sampled_from([None, 1.5]),
        "normalize_reward": st.booleans(),
        "reward_clip_range": st.sampled_from([0.5, 10.0]),
        "token_level_kl": st.booleans(),
        "normalize_advantage": st.booleans(),
    }
)


@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(2, 5),
    num_prompts=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    flags=shaping_flags,
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_with_every_completion_judged_shaping_is_todays_bit_for_bit(k, num_prompts, seed, flags, dtype):
    rollout = random_rollout(seed, k * num_prompts, dtype=dtype)
    shaped = shape_rewards(*rollout, k=k, kl_coef=0.1, **flags)
    expected = todays_shape_rewards(*rollout, k=k, kl_coef=0.1, **flags)
    for got, want in zip(shaped[:5], expected, strict=True):
        assert torch.equal(got, want)
    assert shaped.judged.all()
    # and the judged leave-one-out is the plain one, bit for bit
    rewards = rollout[0]
    advantages, has_advantage = judged_leave_one_out_advantages(rewards, torch.ones_like(rewards).bool(), k)
    assert torch.equal(advantages, leave_one_out_advantages(rewards, k)) and has_advantage.all()


def judged_loop(rewards: list[float], judged: list[bool], k: int) -> list[float]:
    """The definition as loops: a judged completion with judged siblings minus their mean reward; else 0."""
    num_prompts = len(rewards) // k
    advantages = [0.0] * len(rewards)
    for prompt in range(num_prompts):
        rows = [sample * num_prompts + prompt for sample in range(k)]
        for row in rows:
            others = [rewards[other] for other in rows if other != row and judged[other]]
            if judged[row] and others:
                advantages[row] = rewards[row] - sum(others) / len(others)
    return advantages


@settings(max_examples=100, deadline=None)
@given(k=st.integers(2, 6), num_prompts=st.integers(1, 5), data=st.data())
def test_the_baseline_is_the_mean_over_the_judged_others(k, num_prompts, data):
    rows = k * num_prompts
    values = data.draw(st.lists(finite_floats, min_size=rows, max_size=rows))
    judged = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    rewards = torch.tensor(
        [v if j else math.nan for v, j in zip(values, judged, strict=True)], dtype=torch.float64
    )
    advantages, has_advantage = judged_leave_one_out_advantages(rewards, torch.tensor(judged), k)
    torch.testing.assert_close(advantages, torch.tensor(judged_loop(values, judged, k), dtype=torch.float64))
    judged_per_group = torch.tensor(judged).view(k, num_prompts).sum(dim=0)
    for row in range(rows):
        alone = judged_per_group[row % num_prompts] < 2
        assert has_advantage[row] == (judged[row] and not alone)
        if not judged[row] or alone:  # unjudged, or judged without a judged sibling: no advantage at all
            assert advantages[row].item() == 0.0


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 5), num_prompts=st.integers(1, 4), seed=st.integers(0, 10_000), flags=shaping_flags)
def test_unjudged_completions_get_no_advantage_and_stay_out_of_every_statistic(k, num_prompts, seed, flags):
    raw, logprobs, ref_logprobs, mask, stopped = random_rollout(seed, k * num_prompts)
    judged = torch.rand(raw.shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.6
    holes = torch.where(judged, raw, math.nan)
    shaped = shape_rewards(holes, logprobs, ref_logprobs, mask, stopped, k=k, kl_coef=0.1, **flags)
    assert torch.equal(shaped.judged, judged)
    assert torch.isnan(shaped.scores[~judged]).all() and torch.isnan(shaped.rlhf_reward[~judged]).all()
    assert (shaped.advantages[~judged] == 0).all() and torch.isfinite(shaped.advantages).all()
    assert torch.isfinite(shaped.kl).all()
    # the non-score reward (the KL penalty) exists for every completion
    torch.testing.assert_close(shaped.non_score_reward, -0.1 * shaped.kl)


def test_normalisation_uses_judged_completions_and_completions_with_an_advantage():
    nan = math.nan
    raw = torch.tensor([1.0, 5.0, 3.0, nan, 2.0, 9.0])  # k=3, P=2: prompt 1 is 5, nan, 9
    zero = torch.zeros(6, 1)
    shaped = shape_rewards(
        raw, zero, zero, zero.bool(), torch.ones(6, dtype=torch.bool), k=3, kl_coef=0.1,
        normalize_reward=True, normalize_advantage=True,
    )  # fmt: skip
    judged = torch.tensor([1.0, 5.0, 3.0, 2.0, 9.0])
    expected_scores = (judged - judged.mean()) / (judged.std() + STD_EPSILON)
    torch.testing.assert_close(shaped.scores[~raw.isnan()], expected_scores)
    plain, has_advantage = judged_leave_one_out_advantages(shaped.rlhf_reward, ~raw.isnan(), 3)
    assert has_advantage.tolist() == [True, True, True, False, True, True]
    kept = plain[has_advantage]
    torch.testing.assert_close(
        shaped.advantages[has_advantage], (kept - kept.mean()) / (kept.std() + STD_EPSILON)
    )
    assert shaped.advantages[3].item() == 0.0


def test_a_group_with_one_judged_member_gives_it_advantage_zero_even_after_normalisation():
    raw = torch.tensor([4.0, 1.0, math.nan, 2.0])  # k=2, P=2: prompt 0 is (4, nan), prompt 1 is (1, 2)
    zero = torch.zeros(4, 1)
    stopped = torch.ones(4, dtype=torch.bool)
    for normalize_advantage in (False, True):
        shaped = shape_rewards(
            raw, zero, zero, zero.bool(), stopped, k=2, kl_coef=0.1, normalize_advantage=normalize_advantage
        )
        assert shaped.advantages[0].item() == 0.0 and shaped.advantages[2].item() == 0.0
        assert shaped.advantages[1].item() < 0 < shaped.advantages[3].item()


# ---------------------------------------------------------------------- statistics over processes


def shape_in_lockstep(rollouts: list[tuple], per_process=None, **settings) -> list[ShapedRewards]:
    """``shape_rewards`` on one rollout per process, the processes run as threads whose ``gather``
    concatenates what every thread passes, in process order (as ``accelerator.gather`` does);
    ``per_process``: one dict of keyword arguments of each process's own (e.g. its sources' scores)."""
    world = len(rollouts)
    barrier, sent, results = threading.Barrier(world), [None] * world, [None] * world

    def run(rank: int) -> None:
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            sent[rank] = tensor
            barrier.wait()
            gathered = torch.cat(list(sent))
            barrier.wait()  # everyone has read before anyone sends the next tensor
            return gathered

        own = per_process[rank] if per_process else {}
        results[rank] = shape_rewards(*rollouts[rank], gather=gather, **settings, **own)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(2, 4),
    num_prompts=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    flags=shaping_flags,
    abstain=st.booleans(),
)
def test_two_processes_shape_like_one_process_on_the_concatenated_rollout(
    k, num_prompts, seed, flags, abstain
):
    """Each process holds whole prompt groups; with gathered statistics the split does not matter."""
    halves = []
    for rank in range(2):
        raw, *rest = random_rollout(seed + 7 * rank, k * num_prompts)
        if abstain:
            raw = torch.where(torch.arange(raw.numel()) % 3 == rank, math.nan, raw)
        halves.append((raw, *rest))

    def interleave(parts: list[torch.Tensor]) -> torch.Tensor:
        """One k-major rollout of 2P prompts: sample j of prompt i of process r is row j * 2P + r * P + i."""
        grouped = torch.stack([part.view(k, num_prompts, *part.shape[1:]) for part in parts], dim=1)
        return grouped.reshape(2 * k * num_prompts, *parts[0].shape[1:])

    whole = [interleave([half[part] for half in halves]) for part in range(5)]
    one_process = shape_rewards(*whole, k=k, kl_coef=0.1, **flags)
    two_processes = shape_in_lockstep(halves, k=k, kl_coef=0.1, **flags)
    for field in ShapedRewards._fields:
        if getattr(one_process, field) is None:  # not asked for (the sources' parts of the advantage)
            continue
        split = interleave([getattr(shaped, field) for shaped in two_processes])
        torch.testing.assert_close(split, getattr(one_process, field), rtol=1e-5, atol=1e-5, equal_nan=True)


def test_per_process_statistics_differ_from_one_process():
    """Why the statistics are gathered: each process's own z-score is not the z-score of the whole batch."""
    halves = [random_rollout(seed, 4) for seed in (0, 1)]
    halves[1] = (halves[1][0] + 100.0, *halves[1][1:])
    flags = dict(k=2, kl_coef=0.1, normalize_reward=True)
    alone = [shape_rewards(*half, **flags) for half in halves]
    together = shape_in_lockstep(halves, **flags)
    assert not torch.allclose(alone[0].scores, together[0].scores, atol=1e-2)
    assert together[0].scores.max() < 0 < together[1].scores.min()  # process 1's scores are all higher
