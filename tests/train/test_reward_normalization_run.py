"""Training with several reward sources on a tiny real model: per_reward trains and logs each source's share
of the advantage and the flat groups; a reward that never varies is named by a warning, once."""

from __future__ import annotations

import json
import math

import pytest
import torch

from marl.algo.group_spread import ZERO_SPREAD_METRIC, ZERO_SPREAD_PATIENCE

from support.runs import build, count_e, tiny_config


def length(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(completion)) for completion in completions]


def same_for_all(prompts: list[str], completions: list[str]) -> list[float]:
    return [1.0] * len(completions)


@pytest.mark.parametrize("algorithm", ["rloo", "grpo"])
def test_per_reward_trains_and_logs_each_sources_share(tiny_llama_dir, tmp_path, algorithm):
    config = tiny_config(
        tmp_path / "run", algorithm=algorithm, reward_normalization="per_reward", reward_weights=[1.0, 0.05]
    )
    trainer = build(tiny_llama_dir, config, reward_fn=[count_e, length])
    before = [parameter.detach().clone() for parameter in trainer.model.policy_parameters()]
    history = trainer.train()
    for record in history:
        shares = [record["advantage_share/count_e"], record["advantage_share/length"]]
        assert all(0 <= share <= 1 for share in shares) and sum(shares) == pytest.approx(1.0)
        for key in (ZERO_SPREAD_METRIC, "zero_spread_groups/count_e", "zero_spread_groups/length"):
            assert 0 <= record[key] <= 1 or math.isnan(record[key])
    after = trainer.model.policy_parameters()
    assert any(not torch.equal(old, new) for old, new in zip(before, after, strict=True))
    saved = json.loads((tmp_path / "run" / "rloo_config.json").read_text())
    assert "per_reward" in json.dumps(saved)  # the run records how its rewards were combined


def test_a_reward_that_never_varies_is_named_once(tiny_llama_dir, tmp_path):
    config = tiny_config(tmp_path / "run", total_episodes=16 * (ZERO_SPREAD_PATIENCE + 1))
    trainer = build(tiny_llama_dir, config, reward_fn=same_for_all)
    with pytest.warns(RuntimeWarning, match="teach nothing") as caught:
        history = trainer.train()
    assert [record[ZERO_SPREAD_METRIC] for record in history] == [1.0] * len(history)
    (named,) = [str(w.message) for w in caught if "teach nothing" in str(w.message)]  # once
    assert "100% of the prompt groups" in named and "--rloo_k" in named
