"""Runs with the sampler correction on (``--vllm_importance_sampling_correction``): in fp32 on a CPU the
sampler and the trainer agree to rounding, so every ratio is 1 and a corrected run ends where the plain one
does; a mask whose bounds exclude 1 removes every token's policy term, so the policy does not move. The
ratio and the loss against TRL's own code: tests/algo/test_losses.py."""

from __future__ import annotations

import pytest
import torch

from marl.algo.metrics import RATIO_MAX, RATIO_MEAN, RATIO_MIN

from support.runs import build, tiny_config

GRPO = dict(algorithm="grpo", stop_token="eos", total_episodes=32)  # 2 updates, beta 0 (TRL's default)


def policy_weights(trainer) -> dict[str, torch.Tensor]:
    return {
        name: parameter.detach().clone()
        for name, parameter in trainer.model.peft_model.named_parameters()
        if parameter.requires_grad
    }


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_a_corrected_run_ends_where_the_plain_run_does_if_the_sampler_agrees(tiny_llama_dir, tmp_path, mode):
    plain = build(tiny_llama_dir, tiny_config(tmp_path / "plain", **GRPO))
    plain_history = plain.train()
    corrected = build(
        tiny_llama_dir,
        tiny_config(
            tmp_path / "corrected",
            **GRPO,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=mode,
        ),
    )
    history = corrected.train()
    for record, plain_record in zip(history, plain_history, strict=True):
        assert record["sampling/sampling_logp_difference/max"] < 1e-4  # fp32: the same weights, rounding
        for name in (RATIO_MIN, RATIO_MEAN, RATIO_MAX):
            assert record[name] == pytest.approx(1.0, abs=1e-4)
        assert record["reward"] == pytest.approx(plain_record["reward"], abs=1e-6)
        assert RATIO_MEAN not in plain_record
    before, after = policy_weights(plain), policy_weights(corrected)
    assert before.keys() == after.keys()
    for name, weight in after.items():  # Adam's steps (lr 1e-2) carry the ratio's rounding to about 1e-5
        torch.testing.assert_close(weight, before[name], atol=1e-4, rtol=1e-3)


def test_a_mask_that_excludes_every_ratio_leaves_the_policy_where_it_started(tiny_llama_dir, tmp_path):
    config = tiny_config(
        tmp_path / "masked",
        **GRPO,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=1.5,  # every ratio is about 1: each token is masked
        vllm_importance_sampling_clip_max=3.0,
    )
    trainer = build(tiny_llama_dir, config)
    start = policy_weights(trainer)
    history = trainer.train()
    assert all(record[RATIO_MAX] == 0.0 for record in history)  # TRL's metric of masked ratios: zeros
    for name, weight in policy_weights(trainer).items():
        assert torch.equal(weight, start[name]), name  # no policy term, beta 0: no gradient at all
