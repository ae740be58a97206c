"""The ``static`` sampler is exact: on every family of ``tests/support/families.py`` it samples from the
distribution the log-probs score (its ``scores`` checked as the ``output_scores`` of ``generate`` are in
tests/model/test_families.py), draws the very tokens the ``transformers`` sampler draws with the same seed
(rows that stop early included), and trains and resumes to the same numbers; 4-bit and 8-bit bases too."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer

from marl import MultiAdapterModel
from marl.algo.metrics import SAMPLER_GAP_MAX, SAMPLER_GAP_MEAN
from marl.model.generation import SamplingSettings, generate_exactly, pad_token_id
from marl.model.static_decode import sample_static, static_decode_problem
from marl.rollout import stops
from marl.rollout.prompts import Prompt
from marl.rollout.samplers import SamplerSettings, get_sampler
from marl.rollout.static_sampler import StaticSampler
from marl.train.memory_guard import is_measurement

from support.families import DTYPES, FAMILIES, FAMILY_SPECS, logprob_tolerance, position_ids_from_mask
from support.runs import build, tiny_config

TEMPERATURE = 0.7
# Ordinary ids (away from the special tokens and the suppressed ones); the last prompt with its completion is
# longer than Gemma3's sliding window (16), so the windowed layers wrap around.
PROMPT_ROWS = [
    [20, 31, 42, 53, 64, 20, 31],
    [90, 101, 112, 123],
    [130, 141, 152, 163, 174, 185, 196, 207, 218, 229, 240, 251, 30, 41, 52, 63, 74, 85],
]
STATIC_FAMILIES = [name for name in FAMILIES if name != "falcon_h1"]


def load(family_dir, family: str, **kwargs) -> MultiAdapterModel:
    """The family with a policy LoRA whose B matrices are random: a policy that differs from the base."""
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude, task_type="CAUSAL_LM"
    )
    model = MultiAdapterModel.from_pretrained(family_dir(family), policy_adapter=lora, **kwargs)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name and ".policy." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype) * 0.2)
    return model


def draw(model, tokenizer, name: str, stop_token_id: int | None, seed: int = 0, k: int = 2):
    """Samples of the three prompts, k each, from the sampler ``name``: 4 rows per pass (two chunks)."""
    settings = SamplerSettings(TEMPERATURE, 10, stop_token_id=stop_token_id, rows_per_pass=4)
    sampler = get_sampler(name)(model, tokenizer, settings)
    torch.manual_seed(seed)
    return sampler.sample(sampler.batch([Prompt(tuple(row), "p") for row in PROMPT_ROWS]), k)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_seed_draws_the_tokens_of_the_transformers_sampler(family, family_dir):
    model = load(family_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    # stop at the token drawn most often without a stop, so that rows end at different steps
    free = draw(model, tokenizer, "transformers", None).response_ids
    stop = int(free.flatten().mode().values)
    old = draw(model, tokenizer, "transformers", stop)
    new = draw(model, tokenizer, "static", stop)
    assert 0 < int(old.contains_stop.sum()) < old.contains_stop.numel()
    assert torch.equal(new.response_ids, old.response_ids)
    assert torch.equal(new.response_mask, old.response_mask)
    assert new.completions == old.completions
    # the same seed, a second time; another seed draws others
    assert torch.equal(draw(model, tokenizer, "static", stop).response_ids, new.response_ids)
    assert not torch.equal(draw(model, tokenizer, "static", stop, seed=1).response_ids, new.response_ids)


def test_a_model_with_recurrent_states_samples_with_generate_and_says_why(family_dir, caplog):
    model = load(family_dir, "falcon_h1")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("falcon_h1"))
    with caplog.at_level(logging.WARNING, logger="marl.rollout.static_sampler"):
        sampler = StaticSampler(model, tokenizer, SamplerSettings(TEMPERATURE, 4))
    assert "LinearAttention" in sampler.fallback_reason
    assert "--sampler static samples with generate for this model" in caplog.text
    assert all(static_decode_problem(load(family_dir, name).peft_model) is None for name in ("llama", "gpt2"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_static_decode_samples_from_the_distribution_it_scores(family, dtype, family_dir):
    """``scores`` of the static decode (``logits / T`` at every step) against the family's own forward and
    marl's log-probs, as generate's ``output_scores`` are checked; and generate's tokens for the same seed."""
    model = load(family_dir, family, dtype=dtype)
    tolerance = logprob_tolerance(dtype)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    pad = pad_token_id(tokenizer)
    width = max(len(row) for row in PROMPT_ROWS)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in PROMPT_ROWS])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in PROMPT_ROWS])
    # the first row's third token ends completions: some rows stop, and leave the decode batch
    torch.manual_seed(0)
    with model.policy():
        free = model.sample_static(ids, mask, SamplingSettings(TEMPERATURE, 8, (), pad))
    settings = SamplingSettings(TEMPERATURE, 8, (int(free[0, 2]),), pad)

    scores: list[torch.Tensor] = []
    torch.manual_seed(0)
    with model.policy(), torch.no_grad():
        completions = sample_static(model.peft_model.eval(), ids, mask, settings, scores=scores)
        lengths = stops.response_lengths(completions, settings.stop_token_ids)
        valid = stops.response_mask(lengths, completions.shape[1])
        sequences = torch.cat([ids, completions], dim=1)
        full_mask = torch.cat([mask, valid.long()], dim=1)
        scored = model.token_logprobs(sequences, full_mask, response_start=width, temperature=TEMPERATURE)
        forward = model.peft_model(
            input_ids=sequences, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
        ).logits[:, width - 1 : -1]
    assert bool((lengths < completions.shape[1]).any())
    sampled = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in scores], dim=1)
    valid = valid[:, : sampled.shape[1]]
    expected = torch.log_softmax(forward[:, : sampled.shape[1]].float() / TEMPERATURE, dim=-1)
    torch.testing.assert_close(sampled[valid], expected[valid], rtol=0, atol=tolerance)
    drawn = sampled.gather(-1, completions[:, : sampled.shape[1], None]).squeeze(-1)
    torch.testing.assert_close(scored[:, : sampled.shape[1]][valid], drawn[valid], rtol=0, atol=tolerance)
    if dtype == torch.float32:
        torch.manual_seed(0)
        with model.policy(), torch.no_grad():
            generated = generate_exactly(model.peft_model, ids, mask, settings)[:, width:]
        assert torch.equal(
            stops.truncate_after_stop_token(completions, settings.stop_token_ids, pad)[0][
                :, : generated.shape[1]
            ],
            stops.truncate_after_stop_token(generated, settings.stop_token_ids, pad)[0],
        )


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantized_bases_draw_the_same_tokens_as_the_transformers_sampler(quantization, tiny_llama_dir):
    model = MultiAdapterModel.from_pretrained(tiny_llama_dir, quantization=quantization)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    old = draw(model, tokenizer, "transformers", None, k=3)
    new = draw(model, tokenizer, "static", None, k=3)
    assert torch.equal(new.response_ids, old.response_ids)


def metrics(directory) -> list[dict]:
    """The logged records without the time, and without the sampler/trainer log-prob gap, which a sampler
    that keeps its log-probs logs and ``generate`` does not (test_sampler_logprobs.py)."""
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    gaps = (SAMPLER_GAP_MEAN, SAMPLER_GAP_MAX)
    return [
        {key: value for key, value in record.items() if not is_measurement(key) and key not in gaps}
        for record in records
    ]


def test_training_with_the_static_sampler_reproduces_the_transformers_sampler_and_resumes(
    tiny_llama_dir, tmp_path
):
    old = tmp_path / "transformers"
    build(tiny_llama_dir, tiny_config(old, total_episodes=32, sampler="transformers")).train()
    new = tmp_path / "static"
    build(tiny_llama_dir, tiny_config(new, total_episodes=32, sampler="static")).train()
    assert metrics(new) == metrics(old)
    assert (new / "adapter_model.safetensors").read_bytes() == (
        old / "adapter_model.safetensors"
    ).read_bytes()

    # checkpointed after every update and killed after the first checkpoint: the resumed run samples
    # update 2 again, from the restored random state, the same way
    resumed = tmp_path / "resumed"
    config = tiny_config(resumed, total_episodes=32, save_steps=1, sampler="static")
    build(tiny_llama_dir, config).train()
    shutil.rmtree(resumed / "checkpoint-2")
    (resumed / "metrics.jsonl").write_text((resumed / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    build(tiny_llama_dir, config).train(resume_from_checkpoint=True)
    assert metrics(resumed) == metrics(new)
