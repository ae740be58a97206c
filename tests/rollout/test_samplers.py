"""The sampler extension point: a sampler registered from outside marl runs the real training loop, and hears
of every optimizer step through ``policy_weights_changed``; an unknown name is refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from marl import RLOOConfig
from marl.errors import ConfigError
from marl.rollout.samplers import SAMPLERS, SamplerSettings, get_sampler, register_sampler
from marl.rollout.static_sampler import StaticSampler
from marl.rollout.transformers_sampler import TransformersSampler
from marl.train.training_parts import check_components

from support.runs import build, tiny_config


def test_an_unknown_sampler_is_refused_naming_the_flag_and_the_known_ones():
    with pytest.raises(
        ConfigError, match=r"--sampler 'nope' is not a registered sampler.*'transformers'"
    ) as refused:
        get_sampler("nope")
    assert "register_sampler" in str(refused.value)
    assert RLOOConfig(output_dir="x").sampler is None  # chosen for the device (marl.config.device)


class CountingSampler:
    """A test-only sampler: the transformers sampler, counting what the trainer asks of it and recording the
    policy weights each time (a sampler with its own copy of the weights would refresh it when told)."""

    def __init__(self, model, tokenizer, settings: SamplerSettings) -> None:
        self.inner = TransformersSampler(model, tokenizer, settings)
        self.parameters = model.policy_parameters(settings.policy)
        self.settings = settings
        self.known_weights = self._weights()  # what a copy taken at construction would hold
        self.sampled: list[tuple[int, int, str, bool]] = []  # (prompts, k, view, weights were current)
        self.notified: list[torch.Tensor] = []

    def _weights(self) -> torch.Tensor:
        return torch.cat([parameter.detach().flatten().clone() for parameter in self.parameters])

    def batch(self, prompts):
        return self.inner.batch(prompts)

    def sample(self, prompts, k, *, view="policy"):
        current = torch.equal(self.known_weights, self._weights())
        self.sampled.append((prompts.ids.shape[0], k, view, current))
        return self.inner.sample(prompts, k, view=view)

    def policy_weights_changed(self) -> None:
        weights = self._weights()
        assert not torch.equal(weights, self.known_weights), "told of a change when the weights did not move"
        self.known_weights = weights
        self.notified.append(weights)


@pytest.fixture
def counting_sampler():
    register_sampler("counting", CountingSampler)
    yield "counting"
    del SAMPLERS["counting"]


def test_a_registered_sampler_samples_every_rollout_and_hears_of_every_optimizer_step(
    tiny_llama_dir, tmp_path, counting_sampler
):
    # 2 updates of 8 prompts x k=2; 2 epochs x 2 mini-batches: 4 optimizer steps per update
    config = tiny_config(tmp_path / "run", total_episodes=32, sampler=counting_sampler)
    trainer = build(tiny_llama_dir, config)
    sampler = trainer.parts.sampler
    assert isinstance(sampler, CountingSampler)
    assert sampler.settings.temperature == config.temperature and sampler.settings.rows_per_pass == 64
    history = trainer.train()

    assert len(history) == 2
    # every rollout came from the registered sampler, under the policy, with weights it had been told of
    assert sampler.sampled == [(8, 2, "policy", True), (8, 2, "policy", True)]
    steps_taken = trainer.global_step - trainer.state.skipped_optimizer_steps
    assert steps_taken == 2 * 4
    assert len(sampler.notified) == steps_taken
    # the last notice holds the weights the run ended with
    assert torch.equal(sampler.notified[-1], sampler._weights())


def test_skipped_optimizer_steps_do_not_notify_the_sampler(tiny_llama_dir, tmp_path, counting_sampler):
    config = tiny_config(tmp_path / "run", total_episodes=16, sampler=counting_sampler)
    trainer = build(tiny_llama_dir, config, reward_fn=lambda prompts, completions: [None] * len(completions))
    with pytest.warns(RuntimeWarning, match="no reward source judged"):
        trainer.train()
    assert trainer.state.skipped_optimizer_steps == 4
    assert len(trainer.parts.sampler.sampled) == 1 and trainer.parts.sampler.notified == []


class OutsideStaticSampler(StaticSampler):
    """A sampler registered from outside the package that keeps the log-probs it draws with (it inherits
    ``keeps_logprobs = True`` with the static decode)."""


def test_the_sampler_correction_takes_a_registered_sampler_only_if_it_keeps_its_log_probs(
    tiny_llama_dir, tmp_path, counting_sampler
):
    correction = dict(algorithm="grpo", vllm_importance_sampling_correction=True)
    with pytest.raises(ConfigError, match=r"--sampler 'counting' keeps none.*set keeps_logprobs = True"):
        check_components(RLOOConfig(sampler=counting_sampler, **correction))
    register_sampler("outside-static", OutsideStaticSampler)
    try:
        config = tiny_config(tmp_path / "run", total_episodes=16, sampler="outside-static", **correction)
        history = build(tiny_llama_dir, config).train()
    finally:
        del SAMPLERS["outside-static"]
    assert history[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
