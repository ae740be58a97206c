"""The samplers.

The extension point: a sampler registered from outside marl runs the real training loop, and hears of every
optimizer step through ``policy_weights_changed``; an unknown name is refused naming the flag.

The ``static`` sampler is exact: on every family of ``tests/support/families.py`` it samples from the
distribution the log-probs score (its ``scores`` checked as the ``output_scores`` of ``generate`` are in
tests/model/test_families.py), draws the very tokens the ``transformers`` sampler draws with the same seed
(rows that stop early included), and trains and resumes to the same numbers; 4-bit and 8-bit bases too.

The ``graph`` sampler cannot silently stop being exact or fast: on every family of the table its bucketed,
masked decode samples from the distribution the log-probs score and draws the tokens of the ``static`` and
``transformers`` samplers for the same seed; the compiled decode step of the main families (4-bit and 8-bit
bases too) traces as ONE graph with no break, and a compiled sampler compiles once per row bucket, never
again when the policy's LoRA weights change in place between updates (while it samples with the new ones)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from peft import LoraConfig
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoTokenizer, StaticCache

from marl import MultiAdapterModel, RLOOConfig
from marl.algo.metrics import SAMPLER_GAP_MAX, SAMPLER_GAP_MEAN
from marl.data.prompts import Prompt
from marl.errors import ConfigError
from marl.model.graph_decode import BucketedDecoder, compile_problem
from marl.model.sampling import (
    SamplingSettings,
    _forward_step,
    generate_exactly,
    pad_token_id,
    sample_static,
    static_decode_problem,
)
from marl.rollout.completions import response_lengths, response_mask, truncate_after_stop_token
from marl.rollout.samplers import (
    SAMPLERS,
    GraphSampler,
    SamplerSettings,
    StaticSampler,
    TransformersSampler,
    get_sampler,
    register_sampler,
)
from marl.train.memory_guard import is_measurement
from marl.train.training_parts import check_components

from support.families import DTYPES, FAMILIES, FAMILY_SPECS, logprob_tolerance, position_ids_from_mask
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


# --- the static sampler -------------------------------------------------------------------------------------


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
    with caplog.at_level(logging.WARNING, logger="marl.rollout.samplers"):
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
        lengths = response_lengths(completions, settings.stop_token_ids)
        valid = response_mask(lengths, completions.shape[1])
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
            truncate_after_stop_token(completions, settings.stop_token_ids, pad)[0][:, : generated.shape[1]],
            truncate_after_stop_token(generated, settings.stop_token_ids, pad)[0],
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


# --- the graph sampler --------------------------------------------------------------------------------------


# Sliding-window cache layers count their fill in a Python int: those families decode eager.
SLIDING = {"gemma2", "gemma3_text", "mistral"}


def compiled_with(backend):
    return lambda step: torch.compile(step, backend=backend, fullgraph=True, dynamic=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_seed_draws_the_tokens_of_the_static_and_transformers_samplers(family, family_dir):
    model = load(family_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    free = draw(model, tokenizer, "transformers", None).response_ids
    stop = int(free.flatten().mode().values)
    old = draw(model, tokenizer, "transformers", stop)
    new = draw(model, tokenizer, "graph", stop)
    assert 0 < int(old.contains_stop.sum()) < old.contains_stop.numel()
    assert torch.equal(new.response_ids, old.response_ids)
    assert new.completions == old.completions
    if family in STATIC_FAMILIES:
        assert torch.equal(draw(model, tokenizer, "static", stop).response_ids, new.response_ids)


# every family in fp32; bf16 on the main families (the static decode's own test covers bf16 on all of them)
@pytest.mark.parametrize(
    ("family", "dtype"),
    [(family, torch.float32) for family in STATIC_FAMILIES]
    + [(family, torch.bfloat16) for family in ("llama", "qwen2", "gemma3_text")],
    ids=str,
)
def test_bucketed_decode_samples_from_the_distribution_it_scores(family, dtype, family_dir):
    """Its ``scores`` (``logits / T`` of every step) against the family's own forward and marl's log-probs,
    while rows stop inside a bucket and the survivors are compacted into smaller ones."""
    model = load(family_dir, family, dtype=dtype)
    assert_decode_samples_what_it_scores(
        model, family_dir, family, dtype, BucketedDecoder(model.peft_model, 9)
    )


def assert_decode_samples_what_it_scores(model, family_dir, family, dtype, decoder: BucketedDecoder) -> None:
    """``decoder`` (9 rows: three prompts, k = 3) draws from the distribution the family's forward and marl's
    log-probs give, and compacts its rows as they stop (also the CUDA tests' check)."""
    tolerance = logprob_tolerance(dtype)
    pad = pad_token_id(AutoTokenizer.from_pretrained(family_dir(family)))
    width = max(len(row) for row in PROMPT_ROWS)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in PROMPT_ROWS], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(row)) + [1] * len(row) for row in PROMPT_ROWS], device=model.device
    )
    copies = 3  # 9 rows: a bucket of 16, then 8, 4, ... as rows stop
    torch.manual_seed(0)
    with model.policy(), model._inference():
        free = decoder.sample(ids, mask, SamplingSettings(TEMPERATURE, 8, (), pad), copies)
    # the token drawn most often ends completions: rows stop at different steps
    settings = SamplingSettings(TEMPERATURE, 8, (int(free.flatten().mode().values),), pad)

    scores: list[torch.Tensor] = []
    compactions = len(decoder.compactions)
    torch.manual_seed(0)
    with model.policy(), model._inference():
        completions = decoder.sample(ids, mask, settings, copies, scores=scores)
        lengths = response_lengths(completions, settings.stop_token_ids)
        valid = response_mask(lengths, completions.shape[1])
        sequences = torch.cat([ids.repeat_interleave(copies, dim=0), completions], dim=1)
        full_mask = torch.cat([mask.repeat_interleave(copies, dim=0), valid.long()], dim=1)
        scored = model.token_logprobs(sequences, full_mask, response_start=width, temperature=TEMPERATURE)
        forward = model.peft_model(
            input_ids=sequences, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
        ).logits[:, width - 1 : -1]
    assert len(decoder.compactions) > compactions, "the live rows never moved to a smaller bucket"
    sampled = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in scores], dim=1)
    valid = valid[:, : sampled.shape[1]]
    expected = torch.log_softmax(forward[:, : sampled.shape[1]].float() / TEMPERATURE, dim=-1)
    torch.testing.assert_close(sampled[valid], expected[valid], rtol=0, atol=tolerance)
    drawn = sampled.gather(-1, completions[:, : sampled.shape[1], None]).squeeze(-1)
    torch.testing.assert_close(scored[:, : sampled.shape[1]][valid], drawn[valid], rtol=0, atol=tolerance)


def decode_step_inputs(model: MultiAdapterModel, rows: int = 4, width: int = 6, length: int = 16):
    """A decode step's inputs over a static cache that a prefill filled, as the bucketed decoder calls it."""
    peft_model = model.peft_model
    cache = StaticCache(config=peft_model.get_base_model().config, max_cache_len=length)
    ids = torch.randint(20, 200, (rows, width), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(width).expand(rows, width)
    _forward_step(peft_model)(ids, torch.ones_like(ids), positions, cache)
    return ids[:, -1:], torch.ones(rows, length, dtype=torch.long), torch.full((rows, 1), width), cache


@pytest.mark.parametrize(
    ("family", "quantization"),
    [
        ("llama", None),
        ("qwen2", None),
        ("llama", "4bit"),
        pytest.param("llama", "8bit", marks=pytest.mark.slow),
        pytest.param("gpt2", None, marks=pytest.mark.slow),
    ],
)
def test_the_compiled_decode_step_is_one_graph_with_the_policy_active(family, quantization, family_dir):
    # With gradient checkpointing on, as training runs load the model. Traced with gradients enabled: the
    # sampler traces under no_grad, where torch 2.13 lets a `requires_grad_` call through but torch 2.11
    # breaks the graph on it (seen on CUDA: transformers' input-gradient hook made the decode fall back to
    # eager); with gradients on, every torch version breaks on it, so this is the stricter check.
    kwargs = {} if quantization is None else dict(quantization=quantization, dtype=torch.bfloat16)
    model = load(family_dir, family, gradient_checkpointing=True, **kwargs)  # bitsandbytes: bf16 compute
    with model.policy(), model._inference():
        inputs = decode_step_inputs(model)
        with torch.enable_grad():
            explained = torch._dynamo.explain(_forward_step(model.peft_model))(*inputs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    lora_weights = sum(
        "lora_B" in str(name) for graph in explained.graphs for name, _ in graph.named_parameters()
    ) + sum("lora_B" in str(node.target) for graph in explained.graphs for node in graph.graph.nodes)
    assert lora_weights > 0, "the traced step does not read the policy's LoRA weights"


@pytest.mark.slow
def test_a_compiled_sampler_compiles_once_per_bucket_across_updates_that_change_the_lora_in_place(
    family_dir, caplog
):
    model = load(family_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama"))
    # dynamo's graph through AOTAutograd (functionalized cache writes into bucket views), as inductor gets it
    counter = CompileCounterWithBackend("aot_eager")
    free = draw(model, tokenizer, "transformers", None, k=3).response_ids
    settings = SamplerSettings(
        TEMPERATURE, 10, stop_token_id=int(free.flatten().mode().values), rows_per_pass=8
    )
    with caplog.at_level(logging.INFO, logger="marl.rollout.samplers"):
        compiled = GraphSampler(model, tokenizer, settings, compile_step=compiled_with(counter))
        eager = GraphSampler(model, tokenizer, settings, compile_step=None)
        prompts = compiled.batch([Prompt(tuple(row), "p") for row in PROMPT_ROWS])
        policy = model.policy_parameters()
        optimizer = torch.optim.AdamW(policy, lr=0.05)
        drawn, compilations, buckets = [], [], []
        for update in range(3):
            torch.manual_seed(update)
            samples = compiled.sample(prompts, 3)
            torch.manual_seed(update)
            assert torch.equal(samples.response_ids, eager.sample(prompts, 3).response_ids)
            drawn.append(samples.response_ids)
            compilations.append(counter.frame_count)
            buckets.append(len(compiled.decoder.steps_per_bucket))  # the buckets decoded in so far
            for parameter in policy:  # an optimizer step: the LoRA weights change in place
                parameter.grad = torch.randn_like(parameter)
            optimizer.step()
    assert (compiled.path, eager.path) == ("compiled", "eager")
    assert (
        "--sampler graph decodes compiled" in caplog.text and "--sampler graph decodes eager" in caplog.text
    )
    # one compilation per bucket ever decoded in, none per update
    assert buckets[-1] > 1 and compilations == buckets, (compilations, compiled.decoder.steps_per_bucket)
    assert not torch.equal(drawn[0], drawn[2])  # the new weights were sampled
    # the reference view decodes eager: no compilation of another view
    torch.manual_seed(0)
    compiled.sample(prompts, 3, view="reference")
    assert counter.frame_count == compilations[-1]


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_families_decode_eager_and_say_why(family, family_dir, caplog):
    model = load(family_dir, family)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    sampler = GraphSampler(
        model, tokenizer, SamplerSettings(TEMPERATURE, 4), compile_step=compiled_with("eager")
    )
    assert sampler.path == "eager" and "Python int" in sampler.path_reason
    config = model.peft_model.get_base_model().config
    assert compile_problem(StaticCache(config=config, max_cache_len=8)) == sampler.path_reason
    with caplog.at_level(logging.INFO, logger="marl.rollout.samplers"):
        sampler.sample(sampler.batch([Prompt((20, 31, 42), "p")]), 2)
    assert "--sampler graph decodes eager: its ['StaticSlidingWindowLayer'] cache layers" in caplog.text


def test_a_model_with_recurrent_states_samples_with_generate(family_dir):
    model = load(family_dir, "falcon_h1")
    sampler = GraphSampler(
        model, AutoTokenizer.from_pretrained(family_dir("falcon_h1")), SamplerSettings(0.7, 4)
    )
    assert (sampler.path, sampler.decoder) == ("generate", None) and "LinearAttention" in sampler.path_reason


def test_a_base_sharded_over_processes_decodes_with_the_static_decode(family_dir):
    model = load(family_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama"))
    sampler = GraphSampler(model, tokenizer, SamplerSettings(TEMPERATURE, 4, synced_processes=True))
    assert (sampler.path, sampler.decoder) == ("static", None) and "sharded" in sampler.path_reason


@pytest.mark.slow
def test_training_with_the_graph_sampler_reproduces_the_static_sampler(tiny_llama_dir, tmp_path):
    static = tmp_path / "static"
    build(tiny_llama_dir, tiny_config(static, total_episodes=32, sampler="static")).train()
    graph = tmp_path / "graph"
    trainer = build(tiny_llama_dir, tiny_config(graph, total_episodes=32, sampler="graph"))
    trainer.train()
    assert trainer.parts.sampler.path == "eager"  # on a CPU
    assert metrics(graph) == metrics(static)
    adapter = "adapter_model.safetensors"
    assert (graph / adapter).read_bytes() == (static / adapter).read_bytes()


def test_cuda_graphs_on_a_cpu_decode_eager_and_draw_the_tokens_of_the_default(family_dir):
    model = load(family_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama"))
    settings = SamplerSettings(TEMPERATURE, 6, rows_per_pass=4, graph_capture="cuda_graphs")
    sampler = GraphSampler(model, tokenizer, settings)
    assert (sampler.path, sampler.decoder.compiled_step) == ("eager", None)
    assert sampler.path_reason == "the decode step is not captured on cpu (CUDA graphs need a CUDA device)"
    default = GraphSampler(model, tokenizer, SamplerSettings(TEMPERATURE, 6, rows_per_pass=4))
    assert default.path_reason == "the decode step is not compiled on cpu"
    prompts = sampler.batch([Prompt(tuple(row), "p") for row in PROMPT_ROWS])
    torch.manual_seed(0)
    drawn = sampler.sample(prompts, 2).response_ids
    torch.manual_seed(0)
    assert torch.equal(drawn, default.sample(prompts, 2).response_ids)


def test_a_capture_that_fails_decodes_eager_and_logs_why(family_dir, caplog):
    """Plain CUDA graphs asked for where torch has no CUDA: the capture really fails (no stand-in for it),
    the sampler says so once and draws what the eager decode draws."""
    model = load(family_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama"))
    settings = SamplerSettings(TEMPERATURE, 6, rows_per_pass=4)
    captured = GraphSampler(model, tokenizer, settings, compile_step="cuda_graphs")
    assert captured.path == "eager+graphs" and "torch.cuda.CUDAGraph" in captured.path_reason
    eager = GraphSampler(model, tokenizer, settings, compile_step=None)
    prompts = captured.batch([Prompt(tuple(row), "p") for row in PROMPT_ROWS])
    with caplog.at_level(logging.INFO, logger="marl.rollout.samplers"):
        torch.manual_seed(0)
        drawn = captured.sample(prompts, 2).response_ids
    assert captured.path == "eager" and captured.path_reason.startswith("capturing the decode step failed: ")
    assert captured.decoder.compiled_step is None and captured.capture_seconds == {}
    warned = "--sampler graph decodes eager from now on: capturing the decode step failed: RuntimeError"
    assert caplog.text.count(warned) == 1
    torch.manual_seed(0)
    assert torch.equal(drawn, eager.sample(prompts, 2).response_ids)


def test_the_trainer_passes_graph_capture_to_the_graph_sampler(tiny_llama_dir, tmp_path):
    config = tiny_config(tmp_path / "run", sampler="graph", graph_capture="cuda_graphs")
    trainer = build(tiny_llama_dir, config)
    assert trainer.parts.sampler.settings.graph_capture == "cuda_graphs"
    assert (
        trainer.parts.sampler.path == "eager"
        and "CUDA graphs need a CUDA device" in trainer.parts.sampler.path_reason
    )
