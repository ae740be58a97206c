"""Memory accounting checked against what torch, bitsandbytes and transformers actually allocate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from rich.console import Console
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

from marl.model.memory import (
    MemoryReport,
    adamw_training_bytes,
    format_bytes,
    kv_cache_bytes,
    logical_parameter_count,
    lora_parameter_count,
    quantized_weight_bytes,
    stored_bytes,
)
from marl.model.multi_adapter import MultiAdapterModel
from marl.model.quantization import release_checkpoint_mapping

from support.tiny import TINY_ARCHITECTURES, save_tiny_model


def test_adamw_estimate_matches_a_real_optimizer_step():
    layer = torch.nn.Linear(32, 16)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    params = list(layer.parameters())
    real = sum(
        p.numel() * p.element_size()
        + p.grad.numel() * p.grad.element_size()
        + sum(v.numel() * v.element_size() for k, v in optimizer.state[p].items() if k != "step")
        for p in params
    )
    assert adamw_training_bytes(sum(p.numel() for p in params)) == real


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_kv_cache_bound_matches_a_real_cache(architecture, tiny_model_factory):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(architecture), dtype=torch.float32)
    ids = torch.randint(3, 300, (2, 7))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    real = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    assert kv_cache_bytes(model.config, num_tokens=2 * 7, dtype=torch.float32) == real


def test_kv_cache_bytes_of_a_published_config_shape():
    config = AutoConfig.for_model(
        "llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
    )
    # 2 x 16 layers x 8 kv heads x 64 head dim x 2 bytes = 32 kB per token
    assert kv_cache_bytes(config, 1000, torch.bfloat16) == 32768 * 1000


def test_stored_bytes_counts_shared_storage_once():
    weight = torch.zeros(8, 4)
    assert stored_bytes([weight, weight.view(4, 8), weight[0]]) == 128
    seen: set[int] = set()
    assert stored_bytes([weight], seen) == 128 and stored_bytes([weight], seen) == 0


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantized_bytes_match_the_serialized_state(quantization, tiny_llama_dir):
    """bitsandbytes writes every tensor a quantized layer needs into its state dict: the bytes must agree."""
    config = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        if quantization == "4bit"
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=config, dtype=torch.float32
    )
    # The JSON-encoded quant-state descriptor (a uint8 blob) is metadata, not memory the layer holds.
    buffers = dict(model.named_buffers())
    serialized = sum(
        t.numel() * t.element_size()
        for key, t in model.state_dict().items()
        if key not in buffers and "quant_state.bitsandbytes" not in key and "weight_format" not in key
    )
    counted = stored_bytes(model.parameters())
    unquantized = sum(p.numel() * p.element_size() for p in model.parameters())
    assert counted > unquantized  # the quantization constants are counted
    assert counted == pytest.approx(serialized, rel=0.005)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert sum(logical_parameter_count(p) for p in model.parameters()) == plain.num_parameters()


def test_nf4_estimate_matches_measured_bytes(tiny_llama_dir):
    import bitsandbytes as bnb

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=config)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers
    for layer in layers:
        measured = stored_bytes([layer.weight])
        estimate = quantized_weight_bytes(logical_parameter_count(layer.weight), "4bit", torch.float32)
        # The estimate leaves out the fixed code books (16 + 256 float32 values and one offset per layer).
        assert 0 <= measured - estimate <= (16 + 256 + 1) * 4 + 4


def test_memory_report_of_a_loaded_model(tiny_llama_dir):
    model = MultiAdapterModel.from_pretrained(
        tiny_llama_dir,
        policy_adapter=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    report = model.memory_report()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    plain_bytes = sum(t.numel() * t.element_size() for t in [*plain.parameters(), *plain.buffers()])
    assert report.base_bytes == plain_bytes
    assert report.base_parameters == plain.num_parameters()
    # q_proj 64 -> 64 and v_proj 64 -> 32 (2 kv heads of 16) in each of 2 layers, rank 4.
    expected_lora = 2 * (lora_parameter_count(64, 64, 4) + lora_parameter_count(64, 32, 4))
    assert report.adapter_parameters == {"policy": expected_lora, "policy-reference": expected_lora}
    assert report.adapter_bytes["policy"] == 4 * expected_lora
    assert report.trainable_parameters == expected_lora
    assert report.optimizer_state_bytes + report.trainable_bytes == adamw_training_bytes(expected_lora)
    assert report.score_head_bytes == 0
    assert report.total_bytes == plain_bytes + 2 * 4 * expected_lora + 12 * expected_lora
    assert report.separate_rloo_bytes == report.total_bytes + 2 * plain_bytes
    assert report.separate_ppo_bytes > report.separate_rloo_bytes + plain_bytes


def test_quantized_bases_report_fewer_bytes(tiny_llama_dir):
    sizes = {
        q: MultiAdapterModel.from_pretrained(tiny_llama_dir, quantization=q).memory_report().base_bytes
        for q in (None, "8bit", "4bit")
    }
    assert sizes["4bit"] < sizes["8bit"] < sizes[None]


def test_memory_card_renders():
    report = MemoryReport(
        quantization="4bit",
        compute_dtype="bfloat16",
        base_parameters=134_515_008,
        base_bytes=120_000_000,
        adapter_parameters={"policy": 4_884_480, "reward": 1_221_120},
        adapter_bytes={"policy": 19_537_920, "reward": 2_442_240},
        score_head_bytes=1152,
        trainable_parameters=4_884_480,
        trainable_bytes=19_537_920,
        optimizer_state_bytes=58_613_760,
        notes=["reference = base with adapters disabled (no extra weights)"],
    )
    text = str(report)
    assert "adapter 'policy'" in text and "score head" in text and "120.0 MB" in text
    assert f"{report.separate_rloo_bytes / report.total_bytes:.2f}x" in text
    console = Console(width=120, record=True)
    console.print(report)
    assert "as separate copies" in console.export_text()


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1_500) == "1.5 kB"
    assert format_bytes(2_500_000_000) == "2.50 GB"


def _mapped_ranges(directory: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of files under ``directory`` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(directory)):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the memory maps from /proc (Linux)")
@pytest.mark.parametrize("quantization", [None, "4bit", "8bit"])
def test_a_quantized_base_keeps_no_pages_of_its_checkpoint(quantization, tmp_path):
    """transformers maps a safetensors checkpoint; a quantized base must not stay a view of that map (its
    float32 pages would stay resident next to the quantized weights). Unquantized, the map is the weights."""
    model_dir = save_tiny_model(tmp_path / "model").resolve()
    model = MultiAdapterModel.from_pretrained(model_dir, quantization=quantization)
    ranges = _mapped_ranges(model_dir)
    tensors = [*model.peft_model.named_parameters(), *model.peft_model.named_buffers()]
    file_backed = [
        name
        for name, tensor in tensors
        if any(start <= tensor.untyped_storage().data_ptr() < end for start, end in ranges)
    ]
    if quantization is None:
        assert file_backed  # the check sees the map: an unquantized CPU base is the mapped checkpoint
    else:
        assert file_backed == [] and ranges == []


def test_releasing_the_checkpoint_map_keeps_tied_weights_tied():
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = torch.nn.Sequential(embedding, head)
    before = embedding.weight.detach().clone()
    pointer = embedding.weight.data_ptr()
    assert release_checkpoint_mapping(model) == 1
    assert head.weight is embedding.weight and embedding.weight.data_ptr() != pointer
    assert torch.equal(embedding.weight, before)
