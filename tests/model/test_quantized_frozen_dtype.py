"""A quantized base keeps its frozen non-quantized parts (embeddings, LM head, norms) in the compute dtype:
the values it held in float32 before (the load had already rounded them to the compute dtype), half the
bytes, and on every family of the table the same log-probs and rewards in bf16 as the float32 copies gave,
within bf16's rounding; the LoRA weights stay float32."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer

import marl.model.loading
from marl import MultiAdapterModel
from marl.model.quantization import prepare_quantized_base

from support.families import FAMILIES, FAMILY_SPECS, logprob_tolerance
from support.tiny import save_reward_adapter

# the main families run in every test run, the rest of the table with the slow tests
MAIN = ("llama", "qwen2", "gpt2")
TABLE = [family if family in MAIN else pytest.param(family, marks=pytest.mark.slow) for family in FAMILIES]
TEXTS = ["the movie was great and fun", "a dull film", "write a short review of this movie please"]


def load(family, model_dir, reward_dir, monkeypatch, frozen_float32: bool) -> MultiAdapterModel:
    """The 4-bit bf16 base as marl loads it now, or (``frozen_float32``) as it did before: PEFT's upcast."""

    def prepare(model, quantization, **_):
        return prepare_quantized_base(model, quantization, frozen_float32=frozen_float32)

    monkeypatch.setattr(marl.model.loading, "prepare_quantized_base", prepare)
    torch.manual_seed(0)
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude)
    model = MultiAdapterModel.from_pretrained(
        model_dir, quantization="4bit", dtype=torch.bfloat16, reward_adapter=reward_dir, policy_adapter=lora
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy that differs from the base
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name and ".policy." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def frozen_float_parameters(model: MultiAdapterModel) -> dict[str, torch.Tensor]:
    base = model.peft_model.get_base_model()
    return {
        name: parameter
        for name, parameter in base.named_parameters()
        if "lora_" not in name
        and parameter.is_floating_point()
        and not isinstance(parameter, bnb.nn.Params4bit)
    }


def outputs(model: MultiAdapterModel, tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(valid mask, policy log-probs, reward scores) of ``TEXTS`` under bf16 autocast, as a run computes."""
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), model.policy():
        logprobs = model.token_logprobs(ids, mask, response_start=1)
    if not model.has_reward_adapter:
        return mask[:, 1:].bool(), logprobs.float(), None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scores = model.compute_reward_score(ids, mask)
    return mask[:, 1:].bool(), logprobs.float(), scores.float()


@pytest.mark.parametrize("family", TABLE)
def test_frozen_parts_in_bf16_give_todays_logprobs_and_rewards(family, family_dir, tmp_path, monkeypatch):
    model_dir = family_dir(family)
    # a reward adapter where the family has a sequence classifier
    classifies = FAMILY_SPECS[family].sequence_classification
    reward_dir = save_reward_adapter(model_dir, tmp_path / "rm") if classifies else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    now = load(family, model_dir, reward_dir, monkeypatch, frozen_float32=False)
    before = load(family, model_dir, reward_dir, monkeypatch, frozen_float32=True)

    frozen_now, frozen_before = frozen_float_parameters(now), frozen_float_parameters(before)
    assert frozen_now.keys() == frozen_before.keys() and frozen_now
    embedding = now.peft_model.get_base_model().get_input_embeddings().weight
    assert embedding.dtype == torch.bfloat16
    assert before.peft_model.get_base_model().get_input_embeddings().weight.dtype == torch.float32
    for name, parameter in frozen_now.items():  # (bitsandbytes casts a 4-bit layer's bias to bf16 anyway)
        assert parameter.dtype == torch.bfloat16, name
        assert torch.equal(parameter.float(), frozen_before[name].float()), name  # the same values
    policy = now.policy_parameters()
    assert policy and all(parameter.dtype == torch.float32 for parameter in policy)

    mask, logprobs_now, scores_now = outputs(now, tokenizer)
    _, logprobs_before, scores_before = outputs(before, tokenizer)
    tolerance = logprob_tolerance(torch.bfloat16)
    torch.testing.assert_close(logprobs_now[mask], logprobs_before[mask], rtol=0, atol=tolerance)
    if classifies:
        scale = scores_before.abs().max().clamp(min=1.0)
        torch.testing.assert_close(scores_now, scores_before, rtol=0, atol=tolerance * scale)
