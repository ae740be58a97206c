"""What TRL's vLLM path sends with marl's reward adapter on the policy's PeftModel, without vLLM.

TRL 1.16 syncs weights to vLLM (colocated or server) through ``VLLMGeneration._iter_named_params``: on a PEFT
model it calls ``merge_adapter()`` (PEFT merges the *active* adapters: the policy, which every reward call
leaves active), sends each parameter under its name with PEFT's prefixes removed, skips every name holding
``model.prefix`` (``lora_``: all adapters' LoRA tensors) and ``original_module``, then ``unmerge_adapter()``.
Here TRL's own walk runs on a real ``GRPOTrainer``'s model; only the engine's start (``_init_vllm``, which
needs vLLM and a GPU) is skipped. What vLLM does with the tensors it receives is not run."""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.integrations.trl import reward_adapter_function

from support.trl_reward import grpo_config, policy_model, random_reward_adapter

PROMPTS = ["the movie was", "a dull"]
TEXTS = [" great fun", " boring"]


def sent_weights(tokenizer, model, tmp_path, reward=None) -> dict[str, torch.Tensor]:
    """The (name, tensor) pairs TRL's weight sync would send to vLLM for a ``GRPOTrainer`` on ``model``."""
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    class WeightWalk(VLLMGeneration):
        def _init_vllm(self) -> None:  # no engine here: only the walk over the weights runs
            pass

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward or (lambda completions, **kwargs: [0.0] * len(completions)),
        args=grpo_config(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    walk = WeightWalk(model=trainer.model, accelerator=trainer.accelerator, processing_class=tokenizer)
    return {name: tensor.detach().clone() for name, tensor in walk._iter_named_params()}


def test_the_weights_sent_to_vllm_are_the_merged_policy_alone(tiny_llama_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with_reward = policy_model(tiny_llama_dir)
    reward = reward_adapter_function(
        with_reward, random_reward_adapter(tiny_llama_dir, tmp_path / "reward"), tokenizer
    )
    ids = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits_before = with_reward(**ids).logits
    scores_before = reward(prompts=PROMPTS, completions=TEXTS)

    sent = sent_weights(tokenizer, with_reward, tmp_path / "with-reward", reward)
    policy_alone = sent_weights(tokenizer, policy_model(tiny_llama_dir), tmp_path / "policy-alone")
    merged = policy_model(tiny_llama_dir).merge_and_unload()  # PEFT's own merge of the policy adapter

    # the checkpoint's names, as vLLM loads them: no adapter, score head or PEFT prefix among them
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert sorted(sent) == sorted(name for name, _ in plain.named_parameters())
    assert sent.keys() == policy_alone.keys()
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, policy_alone[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(tensor, merged.get_parameter(name), rtol=0, atol=1e-6, msg=name)
    base = dict(plain.named_parameters())
    assert max((sent[name] - base[name]).abs().max() for name in sent) > 1e-3  # the policy was merged in

    # unmerged after the walk: the policy and the reward score as before
    assert with_reward.active_adapter == "default"
    with torch.no_grad():
        torch.testing.assert_close(with_reward(**ids).logits, logits_before, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        torch.tensor(reward(prompts=PROMPTS, completions=TEXTS)),
        torch.tensor(scores_before),
        rtol=0,
        atol=1e-5,
    )
