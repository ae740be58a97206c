"""Rows of several policies in one decode (``sample_routed``, a sweep's rollout): on every family each row is
drawn from its own policy's distribution while finished rows leave the static decode's batch, and the static
decode draws the very tokens the routed ``generate`` draws with the same seed."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer

from marl import MultiAdapterModel
from marl.data.prompts import Prompt
from marl.model.rows import RowRoutes
from marl.model.sampling import SamplingSettings, pad_token_id, sample_static
from marl.rollout.completions import response_lengths, response_mask
from marl.rollout.samplers import SamplerSettings, get_sampler

from support.families import FAMILIES, FAMILY_SPECS, logprob_tolerance, position_ids_from_mask

TEMPERATURE = 0.7
PROMPT_ROWS = [[20, 31, 42, 53, 64, 20, 31], [90, 101, 112, 123], [130, 141, 152, 163, 174, 185]]
POLICIES = ["first", "second", "first"]  # one per prompt
STATIC_FAMILIES = [name for name in FAMILIES if name != "falcon_h1"]  # falcon_h1 samples with generate


def two_policies(family_dir, family: str) -> MultiAdapterModel:
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None

    def lora() -> LoraConfig:
        return LoraConfig(
            r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude, task_type="CAUSAL_LM"
        )

    model = MultiAdapterModel.from_pretrained(family_dir(family), policy_name="first", policy_adapter=lora())
    model.add_policy("second", lora())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # two policies that differ from the base and from each other
        for parameter in model.policy_parameters("first") + model.policy_parameters("second"):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


@pytest.mark.parametrize("family", STATIC_FAMILIES)
def test_each_row_is_drawn_from_its_own_policy_while_rows_leave(family, family_dir):
    model = two_policies(family_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    pad = pad_token_id(tokenizer)
    width = max(len(row) for row in PROMPT_ROWS)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in PROMPT_ROWS])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in PROMPT_ROWS])
    copies = 2
    routes = RowRoutes(POLICIES)
    torch.manual_seed(0)
    with model.routed(routes):
        free = model.sample_static(
            ids, mask, SamplingSettings(TEMPERATURE, 8, (), pad), copies, routes=routes
        )
    settings = SamplingSettings(TEMPERATURE, 8, (int(free[0, 2]),), pad)  # some rows stop, and leave

    scores: list[torch.Tensor] = []
    routes = RowRoutes(POLICIES)
    torch.manual_seed(0)
    with model.routed(routes), torch.no_grad():
        completions = sample_static(
            model.peft_model.eval(), ids, mask, settings, copies, scores=scores, routes=routes
        )
    lengths = response_lengths(completions, settings.stop_token_ids)
    assert bool((lengths < completions.shape[1]).any())
    valid = response_mask(lengths, completions.shape[1])[:, : len(scores)]
    sampled = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in scores], dim=1)
    sequences = torch.cat([ids.repeat_interleave(copies, dim=0), completions], dim=1)
    full_mask = torch.cat([mask.repeat_interleave(copies, dim=0), valid.long()], dim=1)
    full_mask = torch.nn.functional.pad(full_mask, (0, sequences.shape[1] - full_mask.shape[1]))
    row_policy = [POLICIES[row // copies] for row in range(sequences.shape[0])]

    def expected_under(policy: str) -> torch.Tensor:
        with model.policy(policy), torch.no_grad():
            logits = model.peft_model(
                input_ids=sequences, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
            ).logits[:, width - 1 : width - 1 + len(scores)]
        return torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)

    expected = {policy: expected_under(policy) for policy in ("first", "second")}
    for policy in ("first", "second"):
        rows = [row for row, name in enumerate(row_policy) if name == policy]
        other = "second" if policy == "first" else "first"
        torch.testing.assert_close(
            sampled[rows][valid[rows]],
            expected[policy][rows][valid[rows]],
            rtol=0,
            atol=logprob_tolerance(torch.float32),
        )
        # the other policy's distribution is far off: a row routed to the wrong adapter would fail above
        assert (sampled[rows][valid[rows]] - expected[other][rows][valid[rows]]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_the_static_decode_draws_the_tokens_of_the_routed_generate(family, family_dir):
    """Two prompts a chunk (rows_per_pass 2 per policy): the first chunk holds both policies and is routed,
    the second holds one policy and runs in its own view."""
    model = two_policies(family_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    prompts = [Prompt(tuple(row), "p") for row in PROMPT_ROWS]

    def draw(name: str, stop: int | None):
        settings = SamplerSettings(TEMPERATURE, 8, stop_token_id=stop, rows_per_pass=2)
        sampler = get_sampler(name)(model, tokenizer, settings)
        torch.manual_seed(0)
        return sampler.sample_routed(sampler.batch(prompts), 2, POLICIES)

    free = draw("transformers", None).response_ids
    stop = int(free.flatten().mode().values)
    old, new = draw("transformers", stop), draw("static", stop)
    assert 0 < int(old.contains_stop.sum()) < old.contains_stop.numel()
    assert torch.equal(new.response_ids, old.response_ids)
    assert new.completions == old.completions


def test_a_compiled_sweep_decode_draws_the_static_tokens_and_compiles_once_per_bucket(family_dir):
    """The graph sampler's rows of several policies: one compiled step per row bucket for every policy (the
    stacked LoRA layers read each slot's adapter from the decode's buffer, which moves with the rows as they
    finish), never again when the LoRA weights change in place, drawing the routed static decode's tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from marl.rollout.samplers import GraphSampler

    model = two_policies(family_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama"))
    prompts = [Prompt(tuple(row), "p") for row in PROMPT_ROWS]
    free = get_sampler("static")(model, tokenizer, SamplerSettings(TEMPERATURE, 8, rows_per_pass=4))
    torch.manual_seed(0)
    stop = int(free.sample_routed(free.batch(prompts), 2, POLICIES).response_ids.flatten().mode().values)
    settings = SamplerSettings(TEMPERATURE, 8, stop_token_id=stop, rows_per_pass=4)
    counter = CompileCounterWithBackend("aot_eager")  # dynamo's graph through AOTAutograd, as inductor does
    compile_step = lambda step: torch.compile(step, backend=counter, fullgraph=True, dynamic=False)  # noqa: E731
    compiled = GraphSampler(model, tokenizer, settings, compile_step=compile_step)
    static = get_sampler("static")(model, tokenizer, settings)
    batch = compiled.batch(prompts)
    parameters = model.policy_parameters("first") + model.policy_parameters("second")
    optimizer = torch.optim.AdamW(parameters, lr=0.05)
    drawn, compilations, buckets = [], [], []
    for update in range(2):
        torch.manual_seed(update)
        samples = compiled.sample_routed(batch, 2, POLICIES)
        torch.manual_seed(update)
        assert torch.equal(samples.response_ids, static.sample_routed(batch, 2, POLICIES).response_ids)
        drawn.append(samples.response_ids)
        compilations.append(counter.frame_count)
        buckets.append(len(compiled.decoder.steps_per_bucket))
        for parameter in parameters:  # an optimizer step: the LoRA weights change in place
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
    assert compiled.path == "compiled" and compiled.decoder.compactions  # rows finished and moved
    assert 0 < int(samples.contains_stop.sum()) < samples.contains_stop.numel()
    assert buckets[-1] > 1 and compilations == buckets, (compilations, compiled.decoder.steps_per_bucket)
    assert not torch.equal(drawn[0], drawn[1])
