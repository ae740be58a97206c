"""--reward_normalization per_reward (GDPO): against a loop over the paper's formulas, against TRL 1.16's own
"normalize_then_sum", equal to today's path with one reward where the module docstring says so, over processes
like one process, refused where undefined; each source's part of the advantage; groups that teach nothing."""

from __future__ import annotations

import functools
import math
import statistics
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rloo_math import random_rollout, shape_in_lockstep

from marl.algo.advantages import advantage_centring, get_advantage_estimator, rloo_advantages
from marl.algo.shaping import GDPO_STD_EPSILON, PerRewardNormalization, reward_normalization, shape_rewards
from marl.algo.tensors import sequence_kl, standardize
from marl.config import RLOOConfig
from marl.errors import ConfigError
from marl.train.training_parts import check_components

NAN = math.nan


def per_reward(estimator: str, scale: str | None) -> PerRewardNormalization:
    return reward_normalization(
        RLOOConfig(advantage_estimator=estimator, scale_rewards=scale, reward_normalization="per_reward")
    )


def sources_for(seed: int, rows: int, num_sources: int, abstain: float) -> torch.Tensor:
    """``[rows, S]`` float64 scores on different scales, NaN where a source abstains; a few ties."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([10.0**source for source in range(num_sources)], dtype=torch.float64)
    scores = torch.randn(rows, num_sources, generator=generator, dtype=torch.float64) * scales
    scores = torch.where(torch.rand(rows, num_sources, generator=generator) < 0.2, scores.round(), scores)
    return torch.where(torch.rand(rows, num_sources, generator=generator) < abstain, NAN, scores)


def weighted_total(scores: torch.Tensor, weights: list[float]) -> torch.Tensor:
    judged = ~scores.isnan()
    total = torch.where(judged, scores * torch.tensor(weights, dtype=scores.dtype), 0.0).sum(dim=1)
    return torch.where(judged.any(dim=1), total, NAN)


def gdpo_loop(scores, weights, k, *, scale, estimator, penalty, stopped, non_score):
    """GDPO written out with Python loops, one formula per step, rows k-major (row j * P + i)."""
    rows, sources = scores.shape
    prompts = rows // k
    group = [[j * prompts + i for j in range(k)] for i in range(prompts)]
    value = [[scores[row, source].item() for source in range(sources)] for row in range(rows)]
    # 1. each source normalised within its group over the completions it judged
    normalized = [[NAN] * sources for _ in range(rows)]
    for members in group:
        for source in range(sources):
            judged = [row for row in members if not math.isnan(value[row][source])]
            for row in judged:
                if len(judged) < 2:
                    normalized[row][source] = 0.0
                    continue
                mean = statistics.fmean(value[other][source] for other in judged)
                centred = value[row][source] - mean
                if scale:
                    centred /= statistics.stdev(value[other][source] for other in judged) + 1e-4
                normalized[row][source] = centred
    # 2. the weighted sum over the sources that judged, then the missing-EOS penalty and the KL in the reward
    reward = []
    for row in range(rows):
        parts = [w * n for w, n in zip(weights, normalized[row], strict=True) if not math.isnan(n)]
        total = sum(parts) if parts else NAN
        if penalty is not None and not stopped[row]:
            total -= penalty
        reward.append(total + non_score[row])
    # 3. the estimator's baseline, without a scale: leave-one-out (rloo) or the group mean (grpo)
    advantage = [0.0] * rows
    has = [False] * rows
    for members in group:
        judged = [row for row in members if not math.isnan(reward[row])]
        if len(judged) < 2:
            continue
        for row in judged:
            others = [reward[other] for other in judged if other != row]
            baseline = statistics.fmean(others if estimator == "rloo" else [reward[o] for o in judged])
            advantage[row], has[row] = reward[row] - baseline, True
    # 4. batch-wise normalisation over the judged completions (one without a judged sibling as its 0, as TRL)
    counted = [not math.isnan(reward[row]) for row in range(rows)]
    pooled = [advantage[row] for row in range(rows) if counted[row]]
    if len(pooled) >= 2:
        mean, std = statistics.fmean(pooled), statistics.stdev(pooled)
        advantage = [(a - mean) / (std + 1e-4) if counted[row] else 0.0 for row, a in enumerate(advantage)]
    else:
        advantage = [0.0] * rows
    return torch.tensor(advantage, dtype=torch.float64)


@settings(max_examples=120, deadline=None)
@given(
    k=st.integers(2, 5),
    num_prompts=st.integers(1, 4),
    num_sources=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    abstain=st.sampled_from([0.0, 0.3, 0.7]),
    estimator_scale=st.sampled_from([("rloo", None), ("rloo", "group"), ("grpo", "group"), ("grpo", "none")]),
    penalty=st.sampled_from([None, 1.5]),
    token_level_kl=st.booleans(),
)
def test_per_reward_is_the_papers_formulas(
    k, num_prompts, num_sources, seed, abstain, estimator_scale, penalty, token_level_kl
):
    rows = k * num_prompts
    scores = sources_for(seed, rows, num_sources, abstain)
    weights = [1.0, 0.5, 2.0][:num_sources]
    _, logprobs, ref_logprobs, mask, stopped = random_rollout(seed, rows, dtype=torch.float64)
    estimator, scale = estimator_scale
    shaped = shape_rewards(
        weighted_total(scores, weights),
        logprobs,
        ref_logprobs,
        mask,
        stopped,
        k=k,
        kl_coef=0.1,
        missing_eos_penalty=penalty,
        token_level_kl=token_level_kl,
        source_scores=scores,
        reward_weights=torch.tensor(weights),
        per_reward=per_reward(estimator, scale),
    )
    non_score = (
        [0.0] * rows if token_level_kl else (-0.1 * sequence_kl(logprobs, ref_logprobs, mask)).tolist()
    )
    expected = gdpo_loop(
        scores,
        weights,
        k,
        scale=scale == "group",
        estimator=estimator,
        penalty=penalty,
        stopped=stopped.tolist(),
        non_score=non_score,
    )
    torch.testing.assert_close(shaped.advantages, expected, rtol=1e-7, atol=1e-7)
    assert torch.isfinite(shaped.advantages).all()
    assert (shaped.advantages[~shaped.judged] == 0).all()  # every source abstained: unjudged as today


@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(2, 5),
    num_prompts=st.integers(2, 4),
    seed=st.integers(0, 10_000),
    abstain=st.sampled_from([0.0, 0.3]),
    setting=st.sampled_from(
        [("rloo", None, False), ("rloo", None, True), ("grpo", "group", True), ("grpo", "none", True)]
    ),
    penalty=st.sampled_from([None, 1.5]),
)
def test_one_reward_is_todays_advantage_z_scored_over_the_batch(
    k, num_prompts, seed, abstain, setting, penalty
):
    """The equality the module docstring states: one source of weight 1; rloo with the KL in the reward or
    the loss (and a missing-EOS penalty), grpo with the KL in the loss (with the group std: no penalty)."""
    estimator, scale, token_level_kl = setting
    if scale == "group":
        penalty = None
    rows = k * num_prompts
    scores = sources_for(seed, rows, 1, abstain)
    _, logprobs, ref_logprobs, mask, stopped = random_rollout(seed, rows, dtype=torch.float64)
    flags = dict(k=k, kl_coef=0.1, missing_eos_penalty=penalty, token_level_kl=token_level_kl)
    rollout = (scores[:, 0], logprobs, ref_logprobs, mask, stopped)
    todays = shape_rewards(
        *rollout,
        estimator=functools.partial(
            get_advantage_estimator(estimator), **({"scale_rewards": scale} if scale else {})
        ),
        **flags,
    )
    ours = shape_rewards(
        *rollout,
        **flags,
        source_scores=scores,
        reward_weights=torch.tensor([1.0]),
        per_reward=per_reward(estimator, scale),
    )
    # today's advantages, z-scored over the judged completions, std + 1e-4 (TRL's epsilon)
    expected = standardize(todays.advantages, todays.judged, None, GDPO_STD_EPSILON)
    torch.testing.assert_close(ours.advantages, expected, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(ours.scores, todays.scores, equal_nan=True)  # the logged score is the raw one


def test_two_rewards_differ_from_the_sum_where_one_source_spreads_more():
    """Why per_reward exists: under sum the wide source decides the ranking; per_reward weighs both."""
    # one prompt, k=4: source 0 spreads 100x wider than source 1, and they disagree
    scores = torch.tensor([[100.0, 1.0], [0.0, 2.0], [50.0, 4.0], [60.0, 3.0]], dtype=torch.float64)
    zero = torch.zeros(4, 1, dtype=torch.float64)
    flags = dict(k=4, kl_coef=0.0, source_scores=scores, reward_weights=torch.ones(2))
    rollout = (weighted_total(scores, [1.0, 1.0]), zero, zero, zero.bool(), torch.ones(4, dtype=torch.bool))
    summed = shape_rewards(*rollout, **flags, centring=rloo_advantages)
    gdpo = shape_rewards(
        *rollout, **flags, per_reward=per_reward("grpo", "group"), centring=advantage_centring("grpo")
    )
    assert summed.advantages.argmax() == 0 and gdpo.advantages.argmax() != 0
    shares = [
        parts.abs().sum(dim=0) / parts.abs().sum()
        for parts in (summed.source_advantages, gdpo.source_advantages)
    ]
    assert shares[0][0] > 0.95  # the wide source is almost all of the sum's advantage
    torch.testing.assert_close(shares[1], torch.tensor([0.5, 0.5], dtype=torch.float64), atol=0.1, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(2, 5),
    num_prompts=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    abstain=st.sampled_from([0.0, 0.4]),
    estimator=st.sampled_from(["rloo", "grpo"]),
)
def test_the_sources_parts_add_up_to_the_advantage_of_their_sum(k, num_prompts, seed, abstain, estimator):
    scores = sources_for(seed, k * num_prompts, 3, abstain)
    zero = torch.zeros(scores.shape[0], 1, dtype=torch.float64)
    weights = [1.0, -0.5, 2.0]
    shaped = shape_rewards(
        weighted_total(scores, weights),
        zero,
        zero,
        zero.bool(),
        torch.ones(scores.shape[0], dtype=torch.bool),
        k=k,
        kl_coef=0.0,
        estimator=advantage_centring(estimator),
        source_scores=scores,
        reward_weights=torch.tensor(weights),
        centring=advantage_centring(estimator),
    )
    torch.testing.assert_close(shaped.source_advantages.sum(dim=1), shaped.advantages, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("estimator_scale", [("rloo", None), ("grpo", "group")])
@pytest.mark.parametrize("seed", [0, 1])
def test_two_processes_normalise_like_one(estimator_scale, seed):
    """The batch-wise step gathers every process's advantages: two processes (threads whose gather
    concatenates) give what one process gives on the whole batch."""
    k, prompts = 3, 2
    settings_ = dict(
        k=k, kl_coef=0.1, per_reward=per_reward(*estimator_scale), reward_weights=torch.tensor([1.0, 3.0])
    )
    halves, sources = [], []
    for rank in range(2):
        scores = sources_for(seed + 7 * rank, k * prompts, 2, 0.3)
        sources.append(scores)
        halves.append(
            (
                weighted_total(scores, [1.0, 3.0]),
                *random_rollout(seed + rank, k * prompts, dtype=torch.float64)[1:],
            )
        )

    def interleave(parts):
        grouped = torch.stack([part.view(k, prompts, *part.shape[1:]) for part in parts], dim=1)
        return grouped.reshape(2 * k * prompts, *parts[0].shape[1:])

    whole = [interleave([half[part] for half in halves]) for part in range(5)]
    one = shape_rewards(*whole, source_scores=interleave(sources), **settings_)
    two = shape_in_lockstep(halves, [{"source_scores": scores} for scores in sources], **settings_)
    torch.testing.assert_close(interleave([shaped.advantages for shaped in two]), one.advantages)
    alone = shape_rewards(*halves[0], source_scores=sources[0], **settings_)
    assert not torch.allclose(alone.advantages, two[0].advantages)  # the gather matters


@pytest.mark.parametrize("lone", [False, True], ids=["all-judged", "a-lone-judged-completion"])
def test_per_reward_equals_trl_normalize_then_sum(tiny_llama_dir, tmp_path, lone):
    """TRL 1.16's GRPOTrainer with ``multi_objective_aggregation="normalize_then_sum"`` runs
    ``_generate_and_score_completions`` (real generation on the tiny model) with its ``_calculate_rewards``
    replaced on the instance by our table of two sources' scores; its advantages must equal per_reward's under
    grpo with the group scale. Every completion judged by every source: where a source abstains, marl's
    baseline re-centres the sum within the group and gives a completion without a judged sibling no advantage,
    which TRL does not. ``lone``: one completion of prompt 2 is the only one either source judged: it keeps
    advantage 0 and counts in the batch statistics as that 0, as in TRL."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from test_trl_parity import TOLERANCE, prompt_major_to_k_major, zero_reward

    k, prompts, weights = 4, 3, [1.0, 0.3]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=k * prompts,
        num_generations=k,
        max_completion_length=5,
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=weights,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=str(tiny_llama_dir),
            reward_funcs=[zero_reward, zero_reward],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a b", "c d", "e f"]}),
        )
    generator = torch.Generator().manual_seed(5)
    table = torch.randn(prompts * k, 2, generator=generator) * torch.tensor([1.0, 20.0])  # prompt-major
    table[:4, 1] = 3.0  # prompt 0: the second source gives all four the same score
    if lone:
        table[9:, :] = float("nan")  # prompt 2: only its first completion is judged, by both sources
    trainer._calculate_rewards = lambda *args, **kwargs: table.clone()
    inputs = [{"prompt": text} for text in ("a b", "c d", "e f") for _ in range(k)]
    with torch.no_grad():
        expected = prompt_major_to_k_major(trainer._generate_and_score_completions(inputs)["advantages"], k)
    scores = torch.stack([prompt_major_to_k_major(table[:, source], k) for source in range(2)], dim=1)
    zero = torch.zeros(k * prompts, 1)
    ours = shape_rewards(
        weighted_total(scores, weights),
        zero,
        zero,
        zero.bool(),
        torch.ones(k * prompts, dtype=torch.bool),
        k=k,
        kl_coef=0.0,
        source_scores=scores,
        reward_weights=torch.tensor(weights),
        per_reward=per_reward("grpo", "group"),
    )
    assert torch.allclose(ours.advantages, expected, atol=TOLERANCE, rtol=0)
    assert ours.advantages.abs().sum() > 0
    summed = get_advantage_estimator("grpo")(
        weighted_total(scores, weights), torch.ones(k * prompts).bool(), k
    )
    assert not torch.allclose(summed, expected, atol=1e-2)  # TRL's default path is another thing


@pytest.mark.parametrize(
    ("settings_", "named"),
    [
        (dict(algorithm="reinforce_pp"), "'reinforce_pp'"),
        (dict(algorithm="grpo", scale_rewards="batch"), "--scale_rewards batch"),
        (dict(normalize_advantage=True), "--normalize_advantage"),
        (dict(normalize_reward=True), "--normalize_reward"),
    ],
)
def test_undefined_combinations_are_refused_before_any_work(settings_, named):
    config = RLOOConfig(reward_normalization="per_reward", **settings_)
    with pytest.raises(ConfigError) as refused:
        check_components(config)  # what the command line runs right after parsing
    message = str(refused.value)
    assert named in message and "per_reward" in message and "\n" not in message
    check_components(RLOOConfig(**settings_))  # the same settings under the default are fine


def test_rloo_scales_each_source_only_under_per_reward():
    scaled = RLOOConfig(reward_normalization="per_reward", scale_rewards="group")
    check_components(scaled)
    assert scaled.advantage_estimator == "rloo" and reward_normalization(scaled).scale
    assert not reward_normalization(RLOOConfig(reward_normalization="per_reward")).scale
    with pytest.raises(ConfigError, match="or --reward_normalization per_reward"):
        check_components(RLOOConfig(scale_rewards="group"))  # under sum rloo has no scale to set


def test_an_unknown_choice_names_the_flag_and_the_choices():
    with pytest.raises(ConfigError, match=r"--reward_normalization 'gdpo' .*'per_reward'"):
        check_components(RLOOConfig(reward_normalization="gdpo"))
    assert RLOOConfig().reward_normalization == "sum" and reward_normalization(RLOOConfig()) is None


def test_a_normalisation_registered_from_outside_is_chosen_by_name():
    """The registry is the extension point: a choice registered by a user is what ``--reward_normalization``
    NAME selects, and the config refuses nothing about it."""
    from marl.algo.advantages import rloo_advantages
    from marl.algo.shaping import (
        REWARD_NORMALIZATIONS,
        PerRewardNormalization,
        register_reward_normalization,
        reward_normalization,
    )
    from marl.config import RLOOConfig

    unscaled = PerRewardNormalization(scale=False, estimator=rloo_advantages)
    register_reward_normalization("centred_unscaled", lambda config: unscaled)
    try:
        assert reward_normalization(RLOOConfig(reward_normalization="centred_unscaled")) is unscaled
    finally:
        del REWARD_NORMALIZATIONS["centred_unscaled"]
