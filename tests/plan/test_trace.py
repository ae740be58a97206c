"""The meta-device byte count (:mod:`marl.plan.trace`) and the phase programs (:mod:`marl.plan.phases`): what
they count is what the same code allocates on real tensors, for every family of the table."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from marl.model.families import disable_dropout
from marl.plan.phases import PhaseShapes, logit_head_of, sampling_peak, scoring_peak, update_peak
from marl.plan.trace import (
    LiveBytes,
    as_under_autocast,
    autocast_weight_copies,
    meta_causal_lm,
    quantize_stand_in,
)

from support.families import FAMILIES, FAMILY_SPECS, build_family_config

# Falcon-H1's Mamba layers: the planner refuses them (tests/plan/test_planner.py).
PLANNED_FAMILIES = [name for name in FAMILIES if name != "falcon_h1"]
SHAPES = PhaseShapes(
    prompt_length=24,
    response_length=8,
    rloo_k=2,
    rows_per_pass=4,
    micro_batch_rows=4,
    share_prompt_prefix=True,
    gradient_checkpointing=False,
    temperature=0.7,
)


def test_live_bytes_counts_what_is_made_and_still_referenced():
    weight = torch.empty(1000)  # made before: never counted, nor are its views
    with LiveBytes() as live:
        view = weight.t()[:10]
        a = torch.empty(100)
        b = a[10:]  # a view: no new storage
        c = torch.empty(50, dtype=torch.float64)
        assert live.current == 400 + 400
        del a, b
        assert live.current == 400
        live.mark()
        d = torch.empty(25)
        assert (live.current, live.peak) == (500, 500)
    del view, c, d


def _heap_peak_while(call) -> int:
    """Bytes the C allocator hands out (the benchmarks' ``measure.heap_in_use``: glibc ``mallinfo2``) at most
    while ``call`` runs, above what it had before, read by a thread every fraction of a millisecond."""
    import importlib
    import sys
    import threading
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "benchmarks"))
    try:
        heap_in_use = importlib.import_module("measure").heap_in_use
    finally:
        sys.path.pop(0)
    before = heap_in_use()
    if before != before:  # NaN: not glibc >= 2.33
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    peak, running = [before], [True]

    def poll() -> None:
        while running[0]:
            peak[0] = max(peak[0], heap_in_use())
            time.sleep(0.0001)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        for _ in range(3):
            call()
    finally:
        running[0] = False
        thread.join()
    return int((peak[0] - before) * 2**20)


def test_live_bytes_counts_the_temporary_logsumexp_makes_inside_its_kernel():
    logits = torch.randn(512, 32768)  # 64 MiB, as a chunk of log-prob logits
    with LiveBytes() as live:
        torch.logsumexp(logits, dim=-1)
    assert live.peak >= logits.nbytes
    # the real allocator holds that much more while the kernel runs: the count is not a guess
    assert _heap_peak_while(lambda: torch.logsumexp(logits, dim=-1)) >= 0.9 * logits.nbytes


def test_live_bytes_does_not_mistake_a_new_storage_for_an_old_one_at_the_same_address():
    with LiveBytes() as live:
        for _ in range(50):
            outside = torch.ones(10) * 1  # made inside: counted, then freed
            del outside
        kept = [torch.empty(256) for _ in range(20)]
        assert live.current == 20 * 1024
    del kept


def _model(family: str, device: str, quantization: str | None = None, dtype: torch.dtype = torch.float32):
    config = build_family_config(FAMILY_SPECS[family], 512, 0, 1, 2)
    if device == "meta":
        base = meta_causal_lm(config, dtype)
        if quantization:
            quantize_stand_in(base, quantization, torch.float32)
    else:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()  # its own attention
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    disable_dropout(model)  # as marl loads every model
    return model


def _phases(model, shapes: PhaseShapes) -> tuple[int, int, int]:
    head = logit_head_of(model)
    return (
        sampling_peak(model, shapes),
        scoring_peak(model, head, shapes, 1),
        update_peak(model, head, shapes),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", PLANNED_FAMILIES)
def test_the_meta_trace_counts_what_the_same_passes_allocate_on_cpu(family, dtype):
    """The phase programs on the meta device count what they allocate with real CPU kernels, weights and the
    family's own attention, in fp32 and bf16 (sampling's drawn token ids are the only fp32 difference: a few
    bytes)."""
    meta = _phases(_model(family, "meta", dtype=dtype), SHAPES)
    real = _phases(_model(family, "cpu", dtype=dtype), SHAPES)
    # bf16: the families with LayerNorm differ by about 1 KB in the update (0.1%; the meta and CPU kernels
    # of layer norm keep their per-row statistics for the backward pass in different dtypes)
    tolerance = 64 if dtype == torch.float32 else 64 + 0.002 * max(real)
    for counted, allocated in zip(meta, real, strict=True):
        assert abs(counted - allocated) <= tolerance, (family, meta, real)


def test_the_attention_stand_in_saves_what_torch_sdpa_saves_on_cpu():
    """The stand-in's saved tensors (and their bytes) are those of torch's fused CPU kernel, grouped-query
    attention and a boolean mask (converted to a float one) included."""
    query = torch.randn(2, 4, 24, 16, requires_grad=True)
    key = torch.randn(2, 2, 24, 16, requires_grad=True)
    value = torch.randn(2, 2, 24, 16, requires_grad=True)
    mask = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
    from marl.plan.trace import fused_attention_stand_in

    def saved_by(call) -> list[tuple[tuple[int, ...], torch.dtype]]:
        saved: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

        def keep(tensor):
            saved[tensor.untyped_storage()._cdata] = (tuple(tensor.shape), tensor.dtype)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            call()
        return sorted(saved.values(), key=str)

    fused = saved_by(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, enable_gqa=True
        )
    )
    stand_in = saved_by(lambda: fused_attention_stand_in(None, query, key, value, mask))
    assert stand_in == fused


def test_gradient_checkpointing_and_packing_lower_what_the_update_holds():
    model = _model("llama", "meta")
    head = logit_head_of(model)
    plain = update_peak(model, head, SHAPES)
    unpacked = update_peak(model, head, PhaseShapes(**{**SHAPES.__dict__, "share_prompt_prefix": False}))
    model.get_base_model().activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}
    )
    checkpointed = update_peak(
        model, head, PhaseShapes(**{**SHAPES.__dict__, "gradient_checkpointing": True})
    )
    assert checkpointed < plain < unpacked


def test_a_quantized_stand_in_keeps_no_dequantized_weight_between_the_passes():
    """bitsandbytes dequantizes a frozen weight for each product and keeps none of it for the backward pass:
    the update of a quantized base holds no more than an unquantized one's (only transients differ)."""
    quantized = update_peak(_model("llama", "meta", "4bit"), logit_head_of(_model("llama", "meta")), SHAPES)
    plain = update_peak(_model("llama", "meta"), logit_head_of(_model("llama", "meta")), SHAPES)
    largest_linear = 128 * 64 * 4
    assert abs(quantized - plain) <= 2 * largest_linear


def test_planning_leaves_torch_sdpa_as_it_was():
    """The stand-in replaces torch's SDPA only while a traced attention call runs."""
    kernel = torch.nn.functional.scaled_dot_product_attention
    model = _model("llama", "meta")
    update_peak(model, logit_head_of(model), SHAPES)
    assert torch.nn.functional.scaled_dot_product_attention is kernel


def _phases_under_autocast(model, dtype: torch.dtype) -> tuple[int, int, int]:
    """The phases, each in its own autocast region as the trainer runs them."""
    head = logit_head_of(model)
    with torch.autocast("cpu", dtype=dtype):
        sampling = sampling_peak(model, SHAPES)
    with torch.autocast("cpu", dtype=dtype):
        scoring = scoring_peak(model, head, SHAPES, 1)
    with torch.autocast("cpu", dtype=dtype):
        update = update_peak(model, head, SHAPES)
    return sampling, scoring, update


@pytest.mark.parametrize("family", PLANNED_FAMILIES)
def test_passes_traced_as_under_autocast_count_what_real_autocast_allocates(family):
    """Mixed precision on CUDA runs the passes under ``torch.autocast``, which the meta device does not apply.
    The planner makes the LoRA products and the LM head allocate what they allocate under autocast instead
    (:func:`as_under_autocast`), and adds the copies of the policy LoRA that autocast keeps through a pass
    without gradients (:func:`autocast_weight_copies`). The same passes on a bf16 base under CPU autocast,
    which casts ``linear`` as CUDA's does, allocate that within 5% (about 1.5 KB apart on most families,
    5.6 KB on gemma2; not traced further). A float32 base is left out: marl loads the base in the
    mixed-precision dtype, or quantized, whose layers do not autocast; the quantized path (a float32 LM head
    copied at every call) is validated on CUDA: benchmarks/results/*-memory-plan-cuda.md."""
    dtype = torch.bfloat16
    meta = _model(family, "meta", dtype=dtype)
    lora_parameters = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    as_under_autocast(meta, torch.bfloat16)
    sampling, scoring, update = _phases(meta, SHAPES)
    (copies,) = autocast_weight_copies(lora_parameters, torch.bfloat16).values()
    counted = (sampling + copies, scoring + copies, update)
    allocated = _phases_under_autocast(_model(family, "cpu", dtype=dtype), torch.bfloat16)
    for count, real in zip(counted, allocated, strict=True):
        assert abs(count - real) <= 0.05 * real, (family, counted, allocated)
    without = _phases(_model(family, "meta", dtype=dtype), SHAPES)
    assert without[2] > 1.05 * allocated[2], "the float32 copies of the LoRA inputs should be gone"
