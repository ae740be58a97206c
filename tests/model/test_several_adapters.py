"""Several policies and several rewards on one base: named policies trained in turn, weighted reward sources,
per-source metrics, TRL interop, several trainers in one process, and the errors of each."""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from marl import MultiAdapterModel, RewardAdapterFunction, RLOOConfig, RLOOTrainer
from marl.errors import AdapterError, ConfigError
from marl.rewards import AdapterReward, FunctionReward, ScoringBatch, WeightedRewards

from support.tiny import save_reward_adapter, tiny_rloo_config

PROMPTS = ["the movie", "a film about", "review:", "good", "bad acting", "the plot", "write a", "an honest"]


@pytest.fixture(scope="module")
def two_rewards(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rewards")
    return {
        "sentiment": save_reward_adapter(tiny_llama_dir, root / "sentiment", seed=1),
        "fluency": save_reward_adapter(tiny_llama_dir, root / "fluency", seed=2),
    }


def run_config(output_dir, policy: str, **overrides) -> RLOOConfig:
    settings = dict(
        policy_adapter_name=policy,
        num_mini_batches=2,
        num_ppo_epochs=1,
        total_episodes=16,
        learning_rate=2e-2,
        lora_r=16,  # RLOOConfig's default LoRA, not the tiny one
        lora_alpha=32,
        seed=0,
    )
    return tiny_rloo_config(output_dir, **{**settings, **overrides})


def snapshot(model: MultiAdapterModel, policy: str) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.policy_parameters(policy)]


def test_two_policies_trained_in_turn_leave_each_other_bit_identical(tiny_llama_dir, two_rewards, tmp_path):
    model = MultiAdapterModel.from_pretrained(
        tiny_llama_dir, policy_name="positive", reward_adapters=two_rewards
    )
    model.add_policy("negative")
    assert list(model.policies) == ["positive", "negative"] and list(model.rewards) == [
        "sentiment",
        "fluency",
    ]
    flags = {name: parameter.requires_grad for name, parameter in model.peft_model.named_parameters()}
    assert {name for name, trainable in flags.items() if trainable} == {
        name for name in flags if ".positive." in name or ".negative." in name
    }
    report = model.memory_report()
    assert set(report.adapter_bytes) == {"positive", "negative", "sentiment", "fluency"}
    assert report.num_policies == 2 and report.num_rewards == 2 and report.separate_copies == 6

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = datasets.Dataset.from_dict({"prompt": PROMPTS})
    for trained, frozen, weights in (
        ("positive", "negative", [1.0, 0.5]),
        ("negative", "positive", [-1.0, 0.5]),
    ):
        before_trained, before_frozen = snapshot(model, trained), snapshot(model, frozen)
        config = run_config(tmp_path / trained, trained, reward_weights=weights)
        RLOOTrainer(config, model, tokenizer, prompts).train()
        assert all(torch.equal(a, b) for a, b in zip(snapshot(model, frozen), before_frozen, strict=True))
        assert any(
            not torch.equal(a, b) for a, b in zip(snapshot(model, trained), before_trained, strict=True)
        )
        now = {name: parameter.requires_grad for name, parameter in model.peft_model.named_parameters()}
        assert now == flags  # no requires_grad flag ever flipped
    # each run saved its own policy as a standard PEFT folder
    for name in ("positive", "negative"):
        saved = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert saved["task_type"] == "CAUSAL_LM"
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert {"rewards/sentiment", "rewards/fluency"} <= set(records[-1])


def test_weighted_sources_equal_the_hand_computed_sum(tiny_llama_dir, two_rewards):
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapters=two_rewards)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    texts = ["a lovely film", "a dull mess", "skip this one", "good good"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    batch = ScoringBatch(["p"] * 4, texts, encoded["input_ids"], encoded["attention_mask"])

    def length(prompts, completions):
        return [None if "skip" in text else float(len(text)) for text in completions]

    rewards = WeightedRewards(
        [AdapterReward(model, "sentiment"), AdapterReward(model, "fluency"), FunctionReward(length)],
        [1.0, -0.5, 0.1],
    )
    scores = rewards.score(batch)
    sentiment = model.compute_reward_score(encoded["input_ids"], encoded["attention_mask"], "sentiment")
    fluency = model.compute_reward_score(encoded["input_ids"], encoded["attention_mask"], "fluency")
    lengths = torch.tensor([13.0, 11.0, 0.0, 9.0])  # the unjudged completion adds nothing
    torch.testing.assert_close(scores.total, sentiment - 0.5 * fluency + 0.1 * lengths, rtol=0, atol=1e-6)
    assert math.isnan(scores.per_source[2, 2]) and rewards.names == ["sentiment", "fluency", "length"]
    assert (sentiment - fluency).abs().max() > 1e-3  # two different adapters, not one read twice

    nobody = WeightedRewards([FunctionReward(lambda p, c: [None] * len(c), "never")])
    assert torch.isnan(nobody.score(batch).total).all()


def test_per_source_metrics_and_the_objective_score_agree(tiny_llama_dir, two_rewards, tmp_path):
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapters=two_rewards)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def length(prompts, completions):
        return [float(len(text)) for text in completions]

    config = run_config(tmp_path / "run", "policy", reward_weights=[1.0, -0.5, 0.1], total_episodes=8)
    trainer = RLOOTrainer(
        config,
        model,
        tokenizer,
        datasets.Dataset.from_dict({"prompt": PROMPTS}),
        reward_funcs=["sentiment", "fluency", length],
    )
    (record,) = trainer.train()
    weighted = record["rewards/sentiment"] - 0.5 * record["rewards/fluency"] + 0.1 * record["rewards/length"]
    assert record["objective/scores"] == pytest.approx(weighted, abs=1e-5)


def test_errors_name_the_problem(tiny_llama_dir, tiny_model_factory, two_rewards, tmp_path):
    missing_base = "/nonexistent/base"  # name checks run before the base would load
    with pytest.raises(ConfigError, match="'policy' is already used"):
        MultiAdapterModel.from_pretrained(missing_base, reward_adapters={"policy": two_rewards["sentiment"]})
    with pytest.raises(ConfigError, match="'reference' is reserved"):
        MultiAdapterModel.from_pretrained(missing_base, policy_name="reference")
    with pytest.raises(ConfigError, match="'policy-reference' is reserved"):
        MultiAdapterModel.from_pretrained(
            missing_base, reward_adapters={"policy-reference": two_rewards["fluency"]}
        )
    with pytest.raises(ConfigError, match="reward_adapter=DIR or reward_adapters"):
        MultiAdapterModel.from_pretrained(
            missing_base, reward_adapter=two_rewards["fluency"], reward_adapters=two_rewards
        )
    with pytest.raises(ConfigError, match="two reward adapters are named 'fluency'"):
        RLOOConfig(reward_adapter=["fluency=a", "fluency=b"]).reward_adapter_folders()

    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapters=two_rewards)
    with pytest.raises(ConfigError, match="'sentiment' is already used"):
        model.add_policy("sentiment")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = datasets.Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ConfigError, match=r"no policy named 'negative'.*'policy'"):
        RLOOTrainer(run_config(tmp_path / "a", "negative"), model, tokenizer, prompts)
    with pytest.raises(
        ConfigError, match=r"3 reward weights for 2 reward sources \['sentiment', 'fluency'\]"
    ):
        RLOOTrainer(run_config(tmp_path / "b", "policy", reward_weights=[1, 2, 3]), model, tokenizer, prompts)
    with pytest.raises(ConfigError, match="no reward adapter named 'style'"):
        RLOOTrainer(run_config(tmp_path / "c", "policy"), model, tokenizer, prompts, reward_funcs=["style"])

    # one of several reward adapters was made for another base: the error names that one
    other = save_reward_adapter(tiny_model_factory("gpt_neox"), tmp_path / "other-base")
    with pytest.raises(AdapterError, match="other-base"):
        MultiAdapterModel.from_pretrained(tiny_llama_dir, reward_adapters={**two_rewards, "style": other})


def test_rloo_runs_after_a_trl_reward_trainer_in_the_same_process(tiny_llama_dir, tmp_path):
    """TRL's RewardTrainer with its defaults leaves accelerate's process-wide state in bf16; an RLOO run that
    follows in the same process must still start (as transformers' own trainers do)."""
    from peft import LoraConfig
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    pairs = datasets.Dataset.from_dict({"chosen": ["good film"] * 4, "rejected": ["bad film"] * 4})
    arguments = RewardConfig(
        output_dir=str(tmp_path / "rm-run"), max_steps=1, per_device_train_batch_size=2, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    assert arguments.bf16  # TRL's default, on CPU too
    reward_trainer = RewardTrainer(
        model=str(tiny_llama_dir), args=arguments, train_dataset=pairs, processing_class=tokenizer,
        peft_config=LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"),
    )  # fmt: skip
    reward_trainer.train()
    reward_trainer.save_model(str(tmp_path / "rm"))

    config = run_config(tmp_path / "run", "policy", total_episodes=8, reward_adapter=str(tmp_path / "rm"))
    config.model_name_or_path = str(tiny_llama_dir)
    model = MultiAdapterModel.from_config(config)
    history = RLOOTrainer(config, model, tokenizer, datasets.Dataset.from_dict({"prompt": PROMPTS})).train()
    assert len(history) == 1 and math.isfinite(history[0]["objective/scores"])


@pytest.mark.slow
def test_trl_rloo_trainer_logs_the_scores_of_a_marl_reward_adapter(tiny_llama_dir, two_rewards, tmp_path):
    """RewardAdapterFunction in TRL 1.16's RLOOTrainer: the rewards TRL logs for its completions equal what
    transformers + PEFT give for the same texts."""
    from trl import RLOOConfig as TrlRLOOConfig
    from trl import RLOOTrainer as TrlRLOOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    sentiment = RewardAdapterFunction(str(tiny_llama_dir), str(two_rewards["sentiment"]), name="sentiment")
    arguments = TrlRLOOConfig(
        output_dir=str(tmp_path / "trl"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = TrlRLOOTrainer(
        model=str(tiny_llama_dir),
        reward_funcs=[sentiment],
        args=arguments,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/sentiment/mean" in entry]
    assert len(logged) == 2
    prompts, completions = list(trainer._logs["prompt"]), list(trainer._logs["completion"])
    trl_rewards = torch.tensor(list(trainer._logs["rewards"]["sentiment"]))

    texts = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
    encoded = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
    )
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1)
    classifier.config.pad_token_id = tokenizer.pad_token_id
    reference = PeftModel.from_pretrained(classifier, str(two_rewards["sentiment"])).eval()
    with torch.no_grad():
        expected = reference(**encoded).logits.squeeze(-1)
    torch.testing.assert_close(trl_rewards, expected, rtol=0, atol=1e-5)
    assert logged[-1]["rewards/sentiment/mean"] == pytest.approx(trl_rewards.mean().item(), abs=1e-5)
