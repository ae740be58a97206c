"""The base that every view shares never moves: adapters that would train or rewrite it are refused before the
base is loaded, and training leaves the reward and the reference exactly as they were."""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl import MultiAdapterModel, RLOOTrainer
from marl.errors import AdapterError
from marl.model.loading import _check_only_policies_train

from support.tiny import save_reward_adapter, tiny_rloo_config

MISSING_BASE = "/nonexistent/base-model"  # the adapter checks must fail before this folder is ever opened


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"init_lora_weights": "pissa_niter_4"}, "rewrites the base weights"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
        ({"init_lora_weights": "corda"}, "init_lora_weights='corda'"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ],
)
def test_policy_settings_that_move_the_base_are_refused_before_loading(settings, message):
    config = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM", **settings)
    with pytest.raises(AdapterError, match=message):
        MultiAdapterModel.from_pretrained(MISSING_BASE, policy_adapter=config)


def test_saved_adapters_that_carry_base_biases_are_refused(family_dir, tmp_path):
    """Qwen2 has q/k/v biases: an adapter saved with bias='all' holds trained copies of them, which loading
    would write into the shared base."""
    base = AutoModelForCausalLM.from_pretrained(family_dir("qwen2"))
    policy = get_peft_model(
        base, LoraConfig(r=4, target_modules="all-linear", bias="all", task_type="CAUSAL_LM")
    )
    policy.save_pretrained(tmp_path / "policy")
    with pytest.raises(AdapterError, match=r"policy adapter .*policy has bias='all'"):
        MultiAdapterModel.from_pretrained(MISSING_BASE, policy_adapter=tmp_path / "policy")

    reward = save_reward_adapter(family_dir("qwen2"), tmp_path / "reward")
    config_file = reward / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace('"bias": "none"', '"bias": "all"'))
    with pytest.raises(AdapterError, match=r"reward adapter .*reward has bias='all'"):
        MultiAdapterModel.from_pretrained(MISSING_BASE, reward_adapter=reward)


def test_a_trainable_base_tensor_is_refused(family_dir):
    """The last line of defence behind the settings checks: a trainable tensor outside the policy adapter."""
    model = MultiAdapterModel.from_pretrained(family_dir("qwen2"))
    bias = model.peft_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.bias
    bias.requires_grad_(True)
    policy = {id(parameter) for parameter in model.policy_parameters()}
    with pytest.raises(AdapterError, match=r"would train 1 tensor\(s\) outside its LoRA weights.*q_proj"):
        _check_only_policies_train(model.peft_model, policy)


@pytest.mark.parametrize("quantization", [None, "4bit"])
def test_reward_scores_and_reference_logprobs_are_bit_identical_after_training(
    quantization, family_dir, tmp_path
):
    """Qwen2 (biases in q/k/v) in float32 and 4-bit: a fixed batch's reward scores and reference log-probs
    before and after a run with a large learning rate."""
    base_dir = family_dir("qwen2")
    config = tiny_rloo_config(
        tmp_path / "run",
        model_name_or_path=str(base_dir),
        quantization=quantization,
        reward_adapter=str(save_reward_adapter(base_dir, tmp_path / "reward")),
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=16,
        learning_rate=5e-2,
    )
    model = MultiAdapterModel.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    batch = tokenizer(["a lovely film<eos>", "dull and stale"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def observe():
        with model.reference():
            reference = model.token_logprobs(ids, mask, response_start=1)
        with model.policy():
            policy = model.token_logprobs(ids, mask, response_start=1)
        return model.compute_reward_score(ids, mask), reference, policy

    scores, reference, policy = observe()
    prompts = datasets.Dataset.from_dict({"prompt": ["the movie", "a film", "review:", "good"]})
    RLOOTrainer(config, model, tokenizer, prompts).train()
    scores_after, reference_after, policy_after = observe()
    assert torch.equal(scores_after, scores)
    assert torch.equal(reference_after, reference)
    assert (policy_after - policy).abs().max() > 1e-3  # the policy did train
