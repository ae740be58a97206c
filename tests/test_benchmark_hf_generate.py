"""The ``hf-generate`` system of the GPU benchmark (examples/benchmarks/hf_generate.py): marl's policy sampled
with transformers' ``generate`` over its static cache draws the very tokens of marl's ``transformers`` sampler
with the same seed on every family of ``tests/support/families.py`` that has a static cache (rows that stop
early included), and its path names why it ran eager on a CPU. Its GPU figures come from the GPU sequence."""

from __future__ import annotations

import doctest

import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer

from marl import MultiAdapterModel
from marl.data.prompts import Prompt
from marl.rollout.samplers import SAMPLERS, SamplerSettings, get_sampler

from support.benchmark_scripts import benchmark_modules
from support.families import FAMILIES, FAMILY_SPECS

NAME = "hf-generate"
# falcon_h1's Mamba layers have no static cache (generate refuses cache_implementation="static" there)
STATIC_CACHE_FAMILIES = [name for name in FAMILIES if name != "falcon_h1"]
PROMPT_ROWS = [[20, 31, 42, 53, 64, 20, 31], [90, 101, 112, 123], [130, 141, 152, 163, 174, 185, 196]]


@pytest.fixture(scope="module")
def modules():
    with benchmark_modules("hf_generate", "gpu_sequence", "vs_trl", "setups") as imported:
        imported["hf_generate"].register_sampler(NAME)
        yield imported
        del SAMPLERS[NAME]


def test_examples_run_and_the_system_is_known(modules):
    for name in ("hf_generate", "gpu_sequence"):
        result = doctest.testmod(modules[name], optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0 and result.attempted > 0, name
    vs_trl, sequence = modules["vs_trl"], modules["gpu_sequence"]
    assert vs_trl.MARL_SAMPLERS[NAME] == NAME
    cpu = modules["setups"].BenchConfig("cpu-short", "m", "cpu", "float32", 1, 4, 8, 2)
    assert vs_trl.setup_systems(cpu, ["marl", NAME, "trl"], None) == ["marl", "trl"]  # a GPU baseline only
    bf16 = [stage for stage in sequence.STAGES if stage.quantization == "none" and stage.script == "vs_trl"]
    assert bf16 and all(stage.systems[-1] == NAME for stage in bf16)
    assert all(NAME not in stage.systems for stage in sequence.STAGES if stage.quantization == "4bit")


def _draw(model, tokenizer, name: str, stop_token_id: int | None, seed: int = 0):
    settings = SamplerSettings(0.7, 10, stop_token_id=stop_token_id, rows_per_pass=4)
    sampler = get_sampler(name)(model, tokenizer, settings)
    torch.manual_seed(seed)
    return sampler, sampler.sample(sampler.batch([Prompt(tuple(row), "p") for row in PROMPT_ROWS]), 2)


@pytest.mark.parametrize("family", STATIC_CACHE_FAMILIES)
def test_the_same_seed_draws_the_tokens_of_the_transformers_sampler(modules, family, family_dir):
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude)
    model = MultiAdapterModel.from_pretrained(family_dir(family), policy_adapter=lora)
    with torch.no_grad():  # a policy that differs from the base
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    free = _draw(model, tokenizer, "transformers", None)[1].response_ids
    stop = int(free.flatten().mode().values)  # rows end at different steps
    _, reference = _draw(model, tokenizer, "transformers", stop)
    sampler, drawn = _draw(model, tokenizer, NAME, stop)
    assert 0 < int(reference.contains_stop.sum()) < reference.contains_stop.numel()
    assert torch.equal(drawn.response_ids, reference.response_ids)
    assert torch.equal(drawn.response_mask, reference.response_mask)
    assert sampler.path.startswith("eager (") and "this ran on cpu" in sampler.path
    # generate built its static cache (transformers/generation/utils.py, _prepare_static_cache, records its
    # length): the draws above went through the cache that compiles on a GPU, not a dynamic one
    assert model.peft_model.get_base_model()._previous_max_cache_length > len(PROMPT_ROWS[0])
