"""The ``graph`` sampler on CUDA, what a CPU cannot show (marked ``cuda``; ``bash scripts/gpu-check.sh`` runs
them): the decode step compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` and captured
in CUDA graphs draws from the distribution the log-probs score while rows stop and are compacted, compiles
once per bucket and never again when the LoRA weights change in place, in bf16 and fp16 and on 4-bit and
8-bit bases; and a training run samples on that path. The same for the eager step captured in plain CUDA
graphs (``--graph_capture cuda_graphs``), under autocast too."""

from __future__ import annotations

import pytest
import torch
from test_samplers import assert_decode_samples_what_it_scores, load
from torch._dynamo.utils import counters

from marl.model.graph_decode import BucketedDecoder, CapturedStep, capture_cuda_graphs
from marl.rollout.samplers import capture_step

from support.runs import build, tiny_config

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


def check_captured_decode(model, family_dir, family: str, dtype: torch.dtype, compile_step=capture_step):
    """The compiled decoder samples what the model scores, compiles one graph per bucket it decodes in, and
    none after the policy's LoRA weights change in place (while it then samples what they score)."""
    failures: list[BaseException] = []
    decoder = BucketedDecoder(model.peft_model, 9, compile_step, on_fallback=failures.append)
    graphs = counters["stats"]["unique_graphs"]
    assert_decode_samples_what_it_scores(model, family_dir, family, dtype, decoder)
    assert not failures and decoder.compiled_step is not None, failures
    assert counters["stats"]["unique_graphs"] - graphs == len(decoder.steps_per_bucket), (
        decoder.steps_per_bucket
    )
    with torch.no_grad():  # an optimizer step: in place
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name and ".policy." in name:
                parameter.mul_(-1.5)
    assert_decode_samples_what_it_scores(model, family_dir, family, dtype, decoder)
    assert not failures, failures
    assert counters["stats"]["unique_graphs"] - graphs == len(decoder.steps_per_bucket), (
        decoder.steps_per_bucket
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_captured_decode_samples_what_it_scores_and_compiles_once_per_bucket(family, dtype, family_dir):
    torch._dynamo.reset()
    model = load(family_dir, family, dtype=dtype)
    assert model.device.type == "cuda"
    check_captured_decode(model, family_dir, family, dtype)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantized_bases_are_captured_too(quantization, family_dir):
    torch._dynamo.reset()
    model = load(family_dir, "llama", quantization=quantization, dtype=torch.bfloat16)
    check_captured_decode(model, family_dir, "llama", torch.bfloat16)


def test_a_bf16_run_with_the_graph_sampler_samples_on_cuda_graphs(tiny_llama_dir, tmp_path):
    torch._dynamo.reset()
    trainer = build(
        tiny_llama_dir, tiny_config(tmp_path / "run", bf16=True, total_episodes=32, sampler="graph")
    )
    history = trainer.train()
    assert trainer.parts.sampler.path == "compiled+graphs", trainer.parts.sampler.path_reason
    assert all(torch.isfinite(torch.tensor(record["objective/rlhf_reward"])) for record in history)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16-autocast"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_plain_cuda_graphs_sample_what_the_model_scores_before_and_after_an_in_place_update(
    family, autocast, family_dir
):
    """The eager step captured in plain CUDA graphs: one capture per bucket decoded in, none after the LoRA
    weights change in place, and the replays read the new weights (under autocast too, whose cache of cast
    weights is off while recording)."""
    model = load(family_dir, family, dtype=torch.bfloat16)
    failures: list[BaseException] = []
    decoder = BucketedDecoder(model.peft_model, 9, capture_cuda_graphs(), on_fallback=failures.append)
    context = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)
    with context:
        assert_decode_samples_what_it_scores(model, family_dir, family, torch.bfloat16, decoder)
    assert not failures and isinstance(decoder.compiled_step, CapturedStep), failures
    captures = len(decoder.compiled_step.captures)
    assert captures == len(decoder.steps_per_bucket), decoder.steps_per_bucket
    with torch.no_grad():  # an optimizer step: in place
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name and ".policy." in name:
                parameter.mul_(-1.5)
    with context:
        assert_decode_samples_what_it_scores(model, family_dir, family, torch.bfloat16, decoder)
    assert not failures and len(decoder.compiled_step.captures) == len(decoder.steps_per_bucket) >= captures


def test_a_bf16_run_with_graph_capture_cuda_graphs_samples_on_plain_cuda_graphs(tiny_llama_dir, tmp_path):
    config = tiny_config(
        tmp_path / "run", bf16=True, total_episodes=32, sampler="graph", graph_capture="cuda_graphs"
    )
    trainer = build(tiny_llama_dir, config)
    history = trainer.train()
    assert trainer.parts.sampler.path == "eager+graphs", trainer.parts.sampler.path_reason
    assert trainer.parts.sampler.capture_seconds and all(
        s > 0 for s in trainer.parts.sampler.capture_seconds.values()
    )
    assert all(torch.isfinite(torch.tensor(record["objective/rlhf_reward"])) for record in history)
