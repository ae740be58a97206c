"""--algorithm presets: what each sets, explicit fields win, the older token_level_kl flag, the CLI, the TRL
config conversion, and every preset training a tiny model end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import HfArgumentParser

from marl import RLOOConfig
from marl.algo.from_trl import rloo_config_from_trl
from marl.algo.losses import LossSettings, check_algorithm, policy_loss
from marl.config.algorithms import PRESETS
from marl.errors import ConfigError

from support.runs import build, tiny_config


def test_default_is_todays_rloo():
    config = RLOOConfig()
    assert (config.algorithm, config.advantage_estimator, config.loss_type) == ("rloo", "rloo", "sequence")
    assert (config.kl_coef, config.cliprange, config.num_ppo_epochs, config.kl_placement) == (
        0.05,
        0.2,
        4,
        "reward",
    )
    assert config.epsilon_high is None and config.importance_sampling_level is None
    assert not config.token_level_kl and not config.mask_truncated_completions


@pytest.mark.parametrize("algorithm", sorted(PRESETS))
def test_each_preset_sets_its_fields_and_given_fields_win(algorithm):
    config = RLOOConfig(algorithm=algorithm)
    for name, value in PRESETS[algorithm].items():
        assert getattr(config, name) == value, name
    check_algorithm(config)
    given = RLOOConfig(algorithm=algorithm, kl_coef=0.3, cliprange=0.1, num_ppo_epochs=2)
    assert (given.kl_coef, given.cliprange, given.num_ppo_epochs) == (0.3, 0.1, 2)


@pytest.mark.parametrize("algorithm", sorted(PRESETS))
def test_each_preset_works_as_typed_and_stops_at_eos(algorithm):
    """``marl train-rloo --algorithm X`` with nothing else parses and passes every check (dapo's
    mask_truncated_completions needs a stop token: the EOS is the default, as in TRL)."""
    from marl.apps.train_rloo import parse_train_rloo_args

    _, config = parse_train_rloo_args(["--algorithm", algorithm, "--reward_fn", "math:fsum"])
    assert config.stop_token == "eos" and config.has_stop_token
    check_algorithm(config)


def test_fixed_length_completions_are_asked_for_with_stop_token_none():
    assert not RLOOConfig(stop_token="none").has_stop_token
    assert RLOOConfig(stop_token_id=7).stop_token == "none" and RLOOConfig(stop_token_id=7).has_stop_token
    with pytest.raises(ConfigError, match="mask_truncated_completions=true without a stop token"):
        check_algorithm(RLOOConfig(algorithm="dapo", stop_token="none"))


def test_token_level_defaults_follow_the_loss_and_token_level_kl_means_kl_in_the_loss():
    config = RLOOConfig(loss_type="dapo")  # under rloo: a token-level loss gets TRL's defaults
    assert (config.importance_sampling_level, config.use_bias_correction_kl) == ("token", True)
    assert RLOOConfig(token_level_kl=True).kl_placement == "loss"
    assert RLOOConfig(kl_placement="loss").token_level_kl
    assert RLOOConfig(algorithm="grpo").token_level_kl  # GRPO's beta term sits in the loss


def test_scale_rewards_follows_the_preset_only_with_its_estimator():
    assert RLOOConfig(algorithm="grpo", advantage_estimator="reinforce_pp").scale_rewards is None
    with pytest.raises(ConfigError, match="estimator 'rloo' does not scale rewards"):
        check_algorithm(RLOOConfig(algorithm="rloo", scale_rewards="batch"))


def test_the_cli_takes_algorithm_and_explicit_flags():
    (config,) = HfArgumentParser(RLOOConfig).parse_args_into_dataclasses(
        ["--algorithm", "gspo", "--epsilon_high", "0.001", "--use_bias_correction_kl", "false"]
    )
    assert (config.loss_type, config.importance_sampling_level, config.cliprange) == (
        "grpo",
        "sequence",
        3e-4,
    )
    assert (config.epsilon_high, config.use_bias_correction_kl) == (0.001, False)


def test_the_sequence_path_of_policy_loss_is_todays_loss_bit_for_bit():
    from marl.algo.losses import clipped_policy_loss, token_level_k3_kl
    from marl.algo.tensors import masked_sum

    generator = torch.Generator().manual_seed(0)
    new, old, ref = (-torch.rand(4, 3, generator=generator) for _ in range(3))
    mask, advantages = torch.rand(4, 3, generator=generator) < 0.8, torch.randn(4, generator=generator)
    config = RLOOConfig(token_level_kl=True)
    record, loss = policy_loss(LossSettings.from_config(config), new, old, ref, advantages, mask)
    today = clipped_policy_loss(masked_sum(new, mask), masked_sum(old, mask), advantages, config.cliprange)
    k3 = token_level_k3_kl(new, ref, mask)
    assert torch.equal(loss, today.loss + config.kl_coef * k3.sum(dim=1).mean())
    assert torch.equal(record.loss, today.loss)


def test_a_trl_config_converts_and_what_marl_does_not_honour_is_refused(tmp_path):
    from trl import GRPOConfig
    from trl import RLOOConfig as TRLRLOOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    grpo = rloo_config_from_trl(
        GRPOConfig(**common, loss_type="dr_grpo", scale_rewards="batch", epsilon_high=0.3, max_steps=5)
    )
    assert (grpo.algorithm, grpo.loss_type, grpo.scale_rewards, grpo.epsilon_high) == (
        "grpo",
        "dr_grpo",
        "batch",
        0.3,
    )
    assert grpo.total_episodes == 5 * 8  # max_steps × per_device_train_batch_size × accumulation × processes
    rloo = rloo_config_from_trl(
        TRLRLOOConfig(**common, beta=0.1, normalize_advantages=True, num_generations=4)
    )
    assert (rloo.loss_type, rloo.kl_coef, rloo.normalize_advantage, rloo.rloo_k) == ("sequence", 0.1, True, 4)
    assert rloo.num_train_epochs == 3.0 * 4  # TRL's epoch: every prompt with its k completions
    gdpo = rloo_config_from_trl(GRPOConfig(**common, multi_objective_aggregation="normalize_then_sum"))
    assert (gdpo.reward_normalization, gdpo.scale_rewards) == ("per_reward", "group")  # parity tested
    assert (grpo.reward_normalization, rloo.reward_normalization) == ("sum", "sum")
    with pytest.raises(ConfigError, match=r"does not honour: loss_type='cispo'|marl does not implement"):
        check_algorithm(rloo_config_from_trl(GRPOConfig(**common, loss_type="cispo")))
    with pytest.raises(
        ConfigError, match=r"does not honour: off_policy_mask_threshold=0.5 \(.*\), top_entropy_quantile"
    ):
        rloo_config_from_trl(GRPOConfig(**common, top_entropy_quantile=0.2, off_policy_mask_threshold=0.5))


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp"])
def test_every_preset_trains_a_tiny_model(tiny_llama_dir, tmp_path, algorithm):
    config = tiny_config(tmp_path / algorithm, algorithm=algorithm, stop_token="eos", kl_coef=0.05)
    trainer = build(tiny_llama_dir, config)
    before = [parameter.detach().clone() for parameter in trainer.parts.policy_update.parameters]
    history = trainer.train()
    assert len(history) == trainer.parts.sizes.num_total_batches
    assert all(torch.isfinite(torch.tensor(record["loss/policy_avg"])) for record in history)
    assert any(
        not torch.equal(a, b) for a, b in zip(before, trainer.parts.policy_update.parameters, strict=True)
    )


def test_an_update_whose_completions_are_mostly_truncated_and_masked_warns(tiny_llama_dir, tmp_path):
    """Under dapo (mask_truncated_completions) a tiny random model rarely writes its EOS in 3 tokens: the
    completions reach --response_length, the loss masks them, and each update says so instead of training
    on nothing in silence. Without the mask nothing is said."""
    config = tiny_config(tmp_path / "dapo", algorithm="dapo", response_length=3, total_episodes=16)
    trainer = build(tiny_llama_dir, config)
    with pytest.warns(RuntimeWarning, match=r"update 1: \d+ of 16 completions reached --response_length=3"):
        trainer.train()
    assert trainer.log_history  # it trained on, only warned
    plain = build(tiny_llama_dir, tiny_config(tmp_path / "grpo", algorithm="grpo", response_length=3,
                                              total_episodes=16))  # fmt: skip
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plain.train()
