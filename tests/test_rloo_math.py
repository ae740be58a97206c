"""RLOO math against reference vectors, properties and the REINFORCE gradient identity."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marl import rloo

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
    vectorised = rloo.leave_one_out_advantages(torch.tensor(SEED_REWARDS, dtype=torch.float64), k=4)
    assert vectorised.tolist() == leave_one_out_loop(SEED_REWARDS, k=4)
    assert vectorised[0].item() == -4.0
    assert vectorised[7].item() == pytest.approx(4.0 / 3.0, abs=1e-12)


def test_seed_vector_float32_matches_loop():
    vectorised = rloo.leave_one_out_advantages(torch.tensor(SEED_REWARDS), k=4)
    torch.testing.assert_close(vectorised, torch.tensor(leave_one_out_loop(SEED_REWARDS, k=4)))


finite_floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 6), num_prompts=st.integers(1, 5), data=st.data())
def test_group_advantages_sum_to_zero(k, num_prompts, data):
    values = data.draw(st.lists(finite_floats, min_size=k * num_prompts, max_size=k * num_prompts))
    advantages = rloo.leave_one_out_advantages(torch.tensor(values, dtype=torch.float64), k=k)
    group_sums = advantages.view(k, num_prompts).sum(dim=0)
    torch.testing.assert_close(group_sums, torch.zeros(num_prompts, dtype=torch.float64), atol=1e-8, rtol=0)
    torch.testing.assert_close(advantages, torch.tensor(leave_one_out_loop(values, k), dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(first=finite_floats, second=finite_floats)
def test_k2_gives_plus_minus_the_difference(first, second):
    advantages = rloo.leave_one_out_advantages(torch.tensor([first, second], dtype=torch.float64), k=2)
    # with k = 2 the baseline is the other sample: A = ±(r_0 − r_1), twice the deviation from the pair's mean
    assert advantages[0].item() == pytest.approx(first - second, abs=1e-9)
    assert advantages[1].item() == pytest.approx(second - first, abs=1e-9)
    centred = torch.tensor([first, second], dtype=torch.float64) - (first + second) / 2
    torch.testing.assert_close(advantages, 2 * centred)


def test_leave_one_out_rejects_bad_group_sizes():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo.leave_one_out_advantages(torch.ones(4), k=1)
    with pytest.raises(ValueError, match="groups of k=3"):
        rloo.leave_one_out_advantages(torch.ones(4), k=3)


def test_truncate_after_stop_token_keeps_the_stop_and_pads_the_rest():
    responses = torch.tensor([[5, 6, 1, 7, 1], [5, 6, 7, 8, 9], [1, 5, 5, 5, 5]])
    truncated, contains = rloo.truncate_after_stop_token(responses, stop_token_ids=(1,), pad_token_id=0)
    assert truncated.tolist() == [[5, 6, 1, 0, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]]
    assert contains.tolist() == [True, False, True]


def test_lengths_and_mask_when_pad_equals_eos():
    # pad == eos == 1: the EOS must stay valid (it is part of the action) and the padding after it must not.
    responses = torch.tensor([[5, 6, 1, 1, 1], [5, 1, 1, 1, 1]])
    lengths = rloo.response_lengths(responses, stop_token_ids=(1,))
    assert lengths.tolist() == [3, 2]
    mask = rloo.response_mask(lengths, responses.shape[1])
    assert mask.tolist() == [[True, True, True, False, False], [True, True, False, False, False]]
    assert rloo.response_lengths(responses, stop_token_ids=()).tolist() == [5, 5]


def test_several_stop_tokens_each_end_a_completion():
    # Llama-3.x-Instruct ends turns with <|eot_id|> as well as <|end_of_text|>: both must stop
    responses = torch.tensor([[5, 7, 2, 9, 9], [5, 6, 6, 3, 2], [5, 6, 6, 6, 6]])
    truncated, contains = rloo.truncate_after_stop_token(responses, stop_token_ids=(2, 3), pad_token_id=0)
    assert truncated.tolist() == [[5, 7, 2, 0, 0], [5, 6, 6, 3, 0], [5, 6, 6, 6, 6]]
    assert contains.tolist() == [True, True, False]
    assert rloo.response_lengths(responses, stop_token_ids=(2, 3)).tolist() == [3, 4, 5]


def test_missing_eos_penalty_lowers_only_completions_without_eos():
    scores = torch.tensor([0.5, 0.5, -1.0])
    contains_eos = torch.tensor([True, False, False])
    penalised = rloo.apply_missing_eos_penalty(scores, contains_eos, penalty=1.5)
    assert penalised.tolist() == [0.5, -1.0, -2.5]


def test_normalize_reward_z_scores_then_clips():
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 100.0])
    normalised = rloo.normalize_and_clip_rewards(scores, clip_range=10.0)
    assert abs(normalised.mean().item()) < 1e-6
    assert normalised.std().item() == pytest.approx(1.0, abs=1e-5)
    clipped = rloo.normalize_and_clip_rewards(scores, clip_range=0.5)
    assert clipped.max().item() == pytest.approx(0.5)
    assert clipped.min().item() >= -0.5
    assert not torch.equal(clipped, normalised)
    # identical scores normalise to zeros instead of NaN
    assert rloo.normalize_and_clip_rewards(torch.full((4,), 3.0), 1.0).tolist() == [0.0] * 4


def test_sequence_kl_and_rlhf_reward_ignore_invalid_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -1.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    kl = rloo.sequence_kl(logprobs, ref_logprobs, mask)
    assert kl.tolist() == [-0.5, 0.5]
    reward, non_score = rloo.rlhf_rewards(torch.tensor([1.0, 1.0]), kl, kl_coef=0.1)
    torch.testing.assert_close(non_score, torch.tensor([0.05, -0.05]))
    torch.testing.assert_close(reward, torch.tensor([1.05, 0.95]))


def test_larger_kl_coef_lowers_reward_of_drifting_completions():
    scores = torch.tensor([1.0, 1.0])
    kl = torch.tensor([0.0, 3.0])
    low, _ = rloo.rlhf_rewards(scores, kl, kl_coef=0.01)
    high, _ = rloo.rlhf_rewards(scores, kl, kl_coef=0.5)
    assert high[0] == low[0]
    assert high[1] < low[1]


def test_normalize_advantage_rescales_to_unit_std_and_keeps_order():
    advantages = rloo.leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 9.0]), k=2)
    normalised = rloo.standardize(advantages)
    assert normalised.std().item() == pytest.approx(1.0, abs=1e-5)
    assert abs(normalised.mean().item()) < 1e-6
    assert torch.equal(torch.argsort(normalised), torch.argsort(advantages))
    assert not torch.allclose(normalised, advantages)


def test_k3_kl_is_non_negative_zero_on_agreement_and_masked():
    generator = torch.Generator().manual_seed(0)
    new = -torch.rand(4, 6, generator=generator) * 3
    ref = -torch.rand(4, 6, generator=generator) * 3
    mask = torch.rand(4, 6, generator=generator) > 0.3
    k3 = rloo.token_level_k3_kl(new, ref, mask)
    assert (k3 >= 0).all()
    assert (k3[~mask] == 0).all()
    assert (k3[mask] > 0).any()
    assert (rloo.token_level_k3_kl(new, new, mask) == 0).all()


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

    far = rloo.token_level_k3_kl(far_new, far_ref, mask).sum()
    clean = rloo.token_level_k3_kl(clean_new, clean_ref, mask).sum()
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
    new_seq = rloo.masked_sum(new_logprobs, mask)
    advantages = torch.tensor([1.0, -1.0])
    policy = rloo.clipped_policy_loss(new_seq, new_seq.detach(), advantages, cliprange=0.2).loss
    (grad_policy_only,) = torch.autograd.grad(policy, logits, retain_graph=True)
    penalty = 0.1 * rloo.token_level_k3_kl(new_logprobs, ref_logprobs, mask).sum(dim=1).mean()
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
    ppo = rloo.clipped_policy_loss(logprob, logprob.detach(), advantage, cliprange=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.loss, logits)

    assert ppo.ratio.item() == 1.0
    assert not ppo.clipped.any()
    torch.testing.assert_close(ppo_grad, reinforce_grad)
    # our losses are minimised, the blog's objectives are maximised: the gradients differ by the sign only
    torch.testing.assert_close(-ppo_grad, torch.tensor(BLOG_GRADIENT), atol=1e-4, rtol=0)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    new = torch.tensor([math.log(1.5), math.log(0.5)], requires_grad=True)
    old = torch.zeros(2)
    out = rloo.clipped_policy_loss(new, old, torch.tensor([1.0, -1.0]), cliprange=0.2)
    assert out.clipped.tolist() == [True, True]
    (grad,) = torch.autograd.grad(out.loss, new)
    assert grad.tolist() == [0.0, 0.0]
    inside = rloo.clipped_policy_loss(new, old, torch.tensor([-1.0, 1.0]), cliprange=0.2)
    assert inside.clipped.tolist() == [False, False]


def test_shape_rewards_penalises_then_normalises_then_folds_the_kl_in():
    raw = torch.tensor([1.0, 2.0, 3.0, 4.0])  # k=2, P=2
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -9.0], [-1.0, -1.0], [-1.0, -1.0]])
    ref_logprobs = torch.tensor([[-2.0, -1.0], [-2.0, -1.0], [-1.0, -3.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    stopped = torch.tensor([True, False, True, True])
    shaped = rloo.shape_rewards(
        raw, logprobs, ref_logprobs, mask, stopped, k=2, kl_coef=0.5, missing_eos_penalty=10.0
    )
    assert shaped.scores.tolist() == [1.0, -8.0, 3.0, 4.0]
    assert shaped.kl.tolist() == [1.0, 0.0, 2.0, 0.0]  # the masked -9 is not counted
    assert shaped.non_score_reward.tolist() == [-0.5, 0.0, -1.0, 0.0]
    assert shaped.rlhf_reward.tolist() == [0.5, -8.0, 2.0, 4.0]
    torch.testing.assert_close(shaped.advantages, rloo.leave_one_out_advantages(shaped.rlhf_reward, 2))

    normalised = rloo.shape_rewards(
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
    advantages = rloo.shape_rewards(
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
        return rloo.shape_rewards(
            raw, logprobs, ref_logprobs, mask, stopped, k=4, kl_coef=0.3, token_level_kl=token_level_kl
        ).advantages

    assert torch.equal(advantages(references[0], True), advantages(references[1], True))
    torch.testing.assert_close(advantages(references[0], True), rloo.leave_one_out_advantages(raw, 4))
    assert not torch.allclose(advantages(references[0], False), advantages(references[1], False))
