"""Reward source kinds (marl.rewards.reward_kinds): the registry, the kinds marl ships, and a kind registered
from outside the package that trains through RLOOTrainer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from marl import MultiAdapterModel, RewardAdapterFunction, RLOOTrainer
from marl.errors import ConfigError, DataError
from marl.rewards import (
    REWARD_KINDS,
    AdapterReward,
    EosTerminatedAdapterReward,
    FunctionReward,
    RewardParts,
    RewardSetting,
    ScoringBatch,
    get_reward_kind,
    plan_rewards,
    register_reward_kind,
)

from support.runs import prompt_dataset, tiny_config


class VowelShare:
    """A test-only reward source: the share of vowels in each completion times a factor, and a record of
    every score it returned (so a test can compare them with what the trainer logged)."""

    def __init__(self, factor: float, parts: RewardParts) -> None:
        self.name = "vowels"
        self.factor = factor
        self.parts = parts
        self.returned: list[torch.Tensor] = []

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        shares = [sum(letter in "aeiou" for letter in text) / max(len(text), 1) for text in batch.completions]
        scores = self.factor * torch.tensor(shares, dtype=torch.float32, device=batch.input_ids.device)
        self.returned.append(scores.clone())
        return scores


def vowel_kind(spec: str):
    """The test kind's factory: the spec is the factor, checked before any model loads."""
    factor = float(spec)
    return lambda parts: VowelShare(factor, parts)


@pytest.fixture
def vowels_registered():
    register_reward_kind("vowels", vowel_kind)
    yield
    del REWARD_KINDS["vowels"]


def test_unknown_kind_names_the_known_kinds():
    with pytest.raises(
        ConfigError,
        match=r"--reward 'nope' is not a registered reward source kind.*'adapter', 'eos_adapter', 'function'",
    ):
        get_reward_kind("nope")
    with pytest.raises(ConfigError, match=r"'nope'.*register_reward_kind"):
        plan_rewards([RewardSetting("nope", "x")])


def test_registering_refuses_a_taken_name_or_a_non_callable(vowels_registered):
    with pytest.raises(ConfigError, match=r"'vowels' is already registered"):
        register_reward_kind("vowels", vowel_kind)
    with pytest.raises(ConfigError, match=r"factory must be callable"):
        register_reward_kind("other", "not a factory")
    assert "other" not in REWARD_KINDS
    assert get_reward_kind("vowels") is vowel_kind


def test_specs_are_checked_when_planned_and_a_builder_must_make_a_source(vowels_registered):
    with pytest.raises(ValueError, match="could not convert"):
        plan_rewards([RewardSetting("vowels", "lots")])
    with pytest.raises(DataError, match=r"--reward_fn 'no_such_module:f': could not import"):
        plan_rewards([RewardSetting("function", "no_such_module:f")])
    register_reward_kind("broken", lambda spec: lambda parts: 42)
    try:
        with pytest.raises(ConfigError, match=r"kind 'broken' built a int for 'x', not a reward source"):
            plan_rewards([("broken", "x")]).build(RewardParts(model=None, tokenizer=None))
    finally:
        del REWARD_KINDS["broken"]


def test_the_shipped_kinds_build_the_shipped_sources(tiny_llama_dir, tiny_reward_adapter):
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapters={"rm": tiny_reward_adapter})
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    plan = plan_rewards(
        [
            RewardSetting("adapter", "rm"),
            RewardSetting("eos_adapter", "rm"),
            RewardSetting("function", "math:fsum"),
        ]
    )
    adapter, eos_adapter, function = plan.build(RewardParts(model, tokenizer, rows_per_pass=2))
    assert isinstance(adapter, AdapterReward) and (adapter.name, adapter.rows_per_pass) == ("rm", 2)
    assert isinstance(eos_adapter, EosTerminatedAdapterReward) and eos_adapter.rows_per_pass == 2
    assert isinstance(function, FunctionReward) and function.name == "fsum"

    # The shared chunked loop gives every row the score it has alone, whatever the chunking.
    prompts, completions = ["the movie", "a dull", "an honest"], [" was great", " boring film", " story"]
    texts = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    alone = [
        model.compute_reward_score(
            torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), "rm"
        ).item()
        for ids in (tokenizer(text)["input_ids"] for text in texts)
    ]
    batch = ScoringBatch(prompts, completions, encoded["input_ids"], encoded["attention_mask"])
    assert adapter.score(batch).tolist() == pytest.approx(alone, abs=1e-5)
    deprecated = "marl.integrations.trl.reward_adapter_function"
    with pytest.warns(DeprecationWarning, match=deprecated):
        as_trl_reads = RewardAdapterFunction(model, name="rm", rows_per_pass=2)
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    alone = [
        model.compute_reward_score(
            torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), "rm"
        ).item()
        for ids in rows
    ]
    assert as_trl_reads(prompts, completions) == pytest.approx(alone, abs=1e-5)


def test_a_kind_registered_outside_marl_trains_through_the_trainer(
    tiny_llama_dir, tmp_path, vowels_registered
):
    config = tiny_config(tmp_path / "run", total_episodes=32, reward_weights=[2.0])  # 2 updates of 16
    config.model_name_or_path = str(tiny_llama_dir)
    plan = plan_rewards([RewardSetting("vowels", "3.0")])
    torch.manual_seed(0)
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    (source,) = plan.build(RewardParts(model, tokenizer, config.local_rollout_forward_batch_size))
    trainer = RLOOTrainer(config, model, tokenizer, prompt_dataset(), reward_funcs=[source])
    history = trainer.train()

    assert source.parts.model is model and source.factor == 3.0
    assert len(history) == len(source.returned) == 2
    for record, scores in zip(history, source.returned, strict=True):
        assert record["rewards/vowels"] == pytest.approx(scores.mean().item(), abs=1e-6)
        assert record["objective/scores"] == pytest.approx(2.0 * scores.mean().item(), abs=1e-6)
    assert not math.isnan(history[-1]["objective/rlhf_reward"])


def test_the_reward_flag_picks_a_registered_kind_and_how_an_adapter_is_read(tmp_path, vowels_registered):
    """``--reward KIND:SPEC`` reaches every registered kind, a test-only one included; an adapter it names is
    read by that kind instead of the default one, and the order is the order of ``--reward_weights``."""
    from marl.apps.train_rloo import parse_train_rloo_args, reward_settings

    words = ["--reward_adapter", "tone=rm", "--reward_adapter", "topic=tm", "--reward_fn", "math:fsum"]
    words += ["--reward", "vowels:2.5", "--reward", "eos_adapter:topic"]
    script, config = parse_train_rloo_args(words)
    assert [tuple(setting) for setting in reward_settings(script, config)] == [
        ("adapter", "tone"),
        ("function", "math:fsum"),
        ("vowels", "2.5"),
        ("eos_adapter", "topic"),
    ]
    script, config = parse_train_rloo_args(["--reward", "vowels:1"])  # a --reward alone is a reward
    assert [tuple(setting) for setting in reward_settings(script, config)] == [("vowels", "1")]


def test_a_registered_kind_chosen_by_the_flag_trains_through_the_command(
    tiny_llama_dir, tmp_path, vowels_registered
):
    from marl.apps.cli import train_rloo_main

    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "{text}"}}\n' for text in ["a", "b"] * 4))
    train_rloo_main(
        [
            "--model_name_or_path", str(tiny_llama_dir), "--dataset_name", str(tmp_path / "prompts.jsonl"),
            "--reward", "vowels:3.0", "--output_dir", str(tmp_path / "run"), "--rloo_k", "2",
            "--per_device_train_batch_size", "4", "--total_episodes", "8", "--response_length", "4",
            "--num_ppo_epochs", "1", "--num_sample_generations", "0", "--save_steps", "0",
        ]
    )  # fmt: skip
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 2
    assert [record["objective/scores"] for record in history] == [
        pytest.approx(record["rewards/vowels"]) for record in history
    ]
    assert all(0.0 <= record["rewards/vowels"] <= 3.0 for record in history)


def test_evaluation_scores_each_text_ending_in_eos(tiny_llama_dir, tiny_reward_adapter):
    """``marl evaluate`` builds its reward through the ``eos_adapter`` kind and scores the rollout's batch:
    each completion's score is the adapter's score of prompt + completion + EOS."""
    from marl.apps.evaluate import generate_and_score
    from marl.rewards import load_judge

    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapter=tiny_reward_adapter)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = ["the movie", "a film about", "review:"]
    samples = generate_and_score(
        model,
        tokenizer,
        prompts,
        load_judge(None),
        with_policy=False,
        response_length=4,
        batch_size=2,
        progress=False,
    )["base"]
    expected = EosTerminatedAdapterReward(model, tokenizer).score_texts(prompts, samples.completions)
    assert samples.reward_scores == pytest.approx(expected.tolist(), abs=1e-5)
