"""The ``graph`` sampler cannot silently stop being exact or fast: on every family of the table its bucketed,
masked decode samples from the distribution the log-probs score and draws the tokens of the ``static`` and
``transformers`` samplers for the same seed; the compiled decode step of the main families (4-bit and 8-bit
bases too) traces as ONE graph with no break, and a compiled sampler compiles once per row bucket, never
again when the policy's LoRA weights change in place between updates (while it samples with the new ones)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_static_sampler import PROMPT_ROWS, STATIC_FAMILIES, TEMPERATURE, draw, load, metrics
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoTokenizer, StaticCache

from marl import MultiAdapterModel
from marl.model.generation import SamplingSettings, pad_token_id
from marl.model.graph_decode import BucketedDecoder, compile_problem
from marl.model.static_decode import _forward_step
from marl.rollout import stops
from marl.rollout.graph_sampler import GraphSampler
from marl.rollout.prompts import Prompt
from marl.rollout.samplers import SamplerSettings

from support.families import FAMILIES, logprob_tolerance, position_ids_from_mask
from support.runs import build, tiny_config

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
        lengths = stops.response_lengths(completions, settings.stop_token_ids)
        valid = stops.response_mask(lengths, completions.shape[1])
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
    with caplog.at_level(logging.INFO, logger="marl.rollout.graph_sampler"):
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
    with caplog.at_level(logging.INFO, logger="marl.rollout.graph_sampler"):
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
    with caplog.at_level(logging.INFO, logger="marl.rollout.graph_sampler"):
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
