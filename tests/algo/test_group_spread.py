"""Groups that teach nothing: counted per update (overall and per source), logged as shares, and a warning
once, with the fix, when they stay above half; each source's share of the advantage in the logged metrics."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from hypothesis import given, settings
from hypothesis import strategies as st

from marl.algo.advantages import advantage_centring
from marl.algo.group_spread import (
    ZERO_SPREAD_LIMIT,
    ZERO_SPREAD_METRIC,
    ZERO_SPREAD_PATIENCE,
    ZeroSpreadWatch,
    flat_groups,
)
from marl.algo.metrics import RolloutStats, rollout_metrics
from marl.algo.shaping import shape_rewards
from marl.train.parallel import sum_over_processes


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(2, 5),
    num_prompts=st.integers(1, 4),
    sources=st.integers(1, 3),
    data=st.data(),
)
def test_flat_groups_counts_groups_whose_judged_values_are_all_equal(k, num_prompts, sources, data):
    rows = k * num_prompts
    cells = st.one_of(st.just(math.nan), st.sampled_from([0.0, 1.0, 2.5]))  # few values: ties are common
    values = torch.tensor(
        data.draw(st.lists(st.lists(cells, min_size=sources, max_size=sources), min_size=rows, max_size=rows))
    )
    flat, counted = flat_groups(values, k)
    for source in range(sources):
        expected_flat = expected_counted = 0
        for prompt in range(num_prompts):
            judged = [values[j * num_prompts + prompt, source].item() for j in range(k)]
            judged = [value for value in judged if not math.isnan(value)]
            if len(judged) >= 2:
                expected_counted += 1
                expected_flat += len(set(judged)) == 1
        assert (flat[source].item(), counted[source].item()) == (expected_flat, expected_counted)
    single_flat, single_counted = flat_groups(values[:, 0], k)  # one column given as [B]
    assert (single_flat.item(), single_counted.item()) == (flat[0].item(), counted[0].item())


def watch_warnings(shares: list[float], **metrics: float) -> list[warnings.WarningMessage]:
    watch = ZeroSpreadWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for share in shares:
            watch(None, {ZERO_SPREAD_METRIC: share, **metrics})
    return [warning for warning in caught if issubclass(warning.category, RuntimeWarning)]


def test_the_watch_warns_once_with_the_fix_when_most_groups_stay_flat():
    high = ZERO_SPREAD_LIMIT + 0.1
    caught = watch_warnings([high] * (3 * ZERO_SPREAD_PATIENCE), **{"zero_spread_groups/accuracy": 0.9})
    assert len(caught) == 1  # once, however long it stays
    message = str(caught[0].message)
    assert "--rloo_k" in message and "--temperature" in message  # the fix
    assert "zero_spread_groups/accuracy 90%" in message  # which source does not vary


def test_the_watch_waits_for_several_updates_in_a_row():
    high, low = ZERO_SPREAD_LIMIT + 0.1, ZERO_SPREAD_LIMIT
    assert not watch_warnings([high] * (ZERO_SPREAD_PATIENCE - 1))
    assert not watch_warnings(([high] * (ZERO_SPREAD_PATIENCE - 1) + [low]) * 3)  # a dip starts again
    assert not watch_warnings([math.nan] * (2 * ZERO_SPREAD_PATIENCE))  # no group with two judged scores
    assert len(watch_warnings([low, *[high] * ZERO_SPREAD_PATIENCE])) == 1


def test_rollout_metrics_log_flat_groups_and_each_sources_share_of_the_advantage():
    nan = math.nan
    # k=2, 3 prompts (k-major rows j * 3 + i); source 0 judges all, source 1 all but prompt 2's first sample
    sources = torch.tensor([[1.0, 5.0], [2.0, 7.0], [4.0, nan], [1.0, 5.0], [3.0, 7.0], [6.0, 2.0]])
    weights = torch.tensor([1.0, 0.5])
    total = (sources.nan_to_num() * weights).sum(dim=1)
    zero = torch.zeros(6, 1)
    shaped = shape_rewards(
        total,
        zero,
        zero,
        zero.bool(),
        torch.ones(6, dtype=torch.bool),
        k=2,
        kl_coef=0.0,
        source_scores=sources,
        reward_weights=weights,
        centring=advantage_centring("rloo"),
    )
    ended = torch.ones(6).bool()
    rollout = SimpleNamespace(
        logprobs=zero,
        response_mask=zero.bool(),
        contains_eos=ended,
        contains_stop=ended,
        scores=total,
        source_scores=sources,
    )
    stats = sum_over_processes(RolloutStats.of(rollout, shaped, k=2), Accelerator(cpu=True))
    metrics = rollout_metrics(stats, ["tone", "length"])
    assert metrics[ZERO_SPREAD_METRIC] == pytest.approx(1 / 3)  # prompt 0: 1 + 2.5 twice
    assert metrics["zero_spread_groups/tone"] == pytest.approx(1 / 3)  # prompt 0: 1 and 1
    assert metrics["zero_spread_groups/length"] == 1.0  # prompts 0 and 1 (prompt 2 has one judged score)
    # leave-one-out with k=2: A = r − r_other. tone: prompt 0: 0, 0; prompt 1: ∓1; prompt 2: ∓2 (Σ|A| = 6).
    # length × 0.5 (its abstention counts 0 in the sum): prompts 0 and 1: 0; prompt 2: 0 − 1 = ∓1 (Σ|A| = 2).
    assert metrics["advantage_share/tone"] == pytest.approx(6 / 8)
    assert metrics["advantage_share/length"] == pytest.approx(2 / 8)
