"""The memory planner (:mod:`marl.plan`): what it counts as resident matches the memory card of the same
model really loaded, its working sets follow the settings the way they must, its advice fits, and it reads
nothing but ``config.json``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from marl.errors import ConfigError
from marl.model.multi_adapter import MultiAdapterModel
from marl.plan import PlanTarget, load_model_config, plan_memory
from marl.plan.advice import changes_that_fit
from marl.plan.phases import SYSTEMS
from marl.plan.planner import CPU_RUNTIME_BYTES, plan_for_trainer, with_changes

from support.tiny import tiny_rloo_config

TARGET = PlanTarget(device="cpu", prompt_length=24)


@pytest.fixture(scope="module")
def config_only(tiny_llama_dir, tmp_path_factory):
    """The tiny model's folder with its config.json and nothing else: the planner needs no weights."""
    folder = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("quantization", [None, "4bit", "8bit"])
def test_resident_weights_and_adapters_are_those_of_the_loaded_model(
    quantization, tiny_llama_dir, tiny_reward_adapter, tmp_path
):
    config = tiny_rloo_config(
        tmp_path, model_name_or_path=str(tiny_llama_dir), quantization=quantization,
        reward_adapter=[str(tiny_reward_adapter)],
    )  # fmt: skip
    plan = plan_memory(config, load_model_config(str(tiny_llama_dir)), TARGET)
    card = MultiAdapterModel.from_config(config).memory_report()
    assert plan.resident["policy LoRA (float32)"] == card.adapter_bytes["policy"]
    assert plan.resident["AdamW moments (float32)"] == 2 * card.adapter_bytes["policy"]
    reward = (
        sum(size for name, size in card.adapter_bytes.items() if name != "policy") + card.score_head_bytes
    )
    assert plan.resident["reward LoRAs + score heads"] == pytest.approx(reward, rel=0.01)
    assert plan.resident["base weights"] == pytest.approx(card.base_bytes, rel=0.05)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantizing_cpu_load_holds_the_checkpoints_map_and_a_gpu_load_one_tensor(
    quantization, tiny_llama_dir, tmp_path
):
    """On CPU the checkpoint's pages stay resident while the base is read and quantized or converted (the
    whole file, its size on disk); on a GPU only the tensor on its way is extra; an fp32 CPU base is the map
    itself."""
    config = tiny_rloo_config(tmp_path, model_name_or_path=str(tiny_llama_dir), quantization=quantization)
    model_config = load_model_config(str(tiny_llama_dir))
    on_cpu = plan_memory(config, model_config, TARGET).phase("load").parts
    checkpoint = (tiny_llama_dir / "model.safetensors").stat().st_size
    assert on_cpu["checkpoint memory map (read)"] == pytest.approx(checkpoint, rel=0.01)
    on_gpu = (
        plan_memory(config, model_config, PlanTarget(device="cuda", prompt_length=24)).phase("load").parts
    )
    assert "checkpoint memory map (read)" not in on_gpu
    assert 0 < on_gpu["largest tensor in transit"] < checkpoint
    unquantized = tiny_rloo_config(tmp_path, model_name_or_path=str(tiny_llama_dir))
    in_place = plan_memory(unquantized, model_config, TARGET).phase("load").parts
    assert not {"checkpoint memory map (read)", "largest tensor in transit"} & set(in_place)
    converted = PlanTarget(device="cpu", prompt_length=24, compute_dtype=torch.bfloat16)
    assert plan_memory(unquantized, model_config, converted).phase("load").parts[
        "checkpoint memory map (read)"
    ] == pytest.approx(checkpoint, rel=0.01)


def test_the_plan_reads_only_config_json(config_only, tmp_path):
    config = tiny_rloo_config(tmp_path, model_name_or_path=str(config_only))
    for source in (config_only, config_only / "config.json"):
        plan = plan_memory(config, load_model_config(str(source)), TARGET)
        assert plan.peak > CPU_RUNTIME_BYTES
    assert [phase.name for phase in plan.phases] == ["load", "sampling", "scoring", "update"]


def test_the_model_config_is_left_as_it_was(config_only, tmp_path):
    model_config = load_model_config(str(config_only))
    before = model_config.to_dict()
    plan_memory(tiny_rloo_config(tmp_path), model_config, TARGET)
    assert model_config.to_dict() == before


def test_settings_move_the_phase_they_should(config_only, tmp_path):
    model_config = load_model_config(str(config_only))
    config = tiny_rloo_config(
        tmp_path, rloo_k=4, per_device_train_batch_size=8, local_rollout_forward_batch_size=8
    )
    base = plan_memory(config, model_config, TARGET)

    def working(plan, phase):
        return plan.phase(phase).total - plan.phase(phase).parts["resident"]

    longer = plan_memory(config, model_config, PlanTarget(device="cpu", prompt_length=96))
    assert all(working(longer, phase) > working(base, phase) for phase in ("sampling", "scoring", "update"))
    checkpointed = plan_memory(with_changes(config, gradient_checkpointing=True), model_config, TARGET)
    assert working(checkpointed, "update") < working(base, "update")
    assert working(checkpointed, "sampling") == working(base, "sampling")
    unshared = plan_memory(with_changes(config, share_prompt_prefix=False), model_config, TARGET)
    assert working(unshared, "scoring") > working(base, "scoring")
    smaller = plan_memory(with_changes(config, local_rollout_forward_batch_size=4), model_config, TARGET)
    assert working(smaller, "sampling") < working(base, "sampling")
    assert working(smaller, "update") == working(base, "update")
    quantized = plan_memory(with_changes(config, quantization="4bit"), model_config, TARGET)
    assert quantized.resident["base weights"] < base.resident["base weights"]


def test_bf16_autocast_on_cuda_is_planned_and_nowhere_else(config_only, tmp_path):
    """--bf16 on CUDA: autocast's copy of the policy LoRA through the passes without gradients, and the LoRA
    inputs kept in bf16 (a smaller update on a bf16 base than without autocast). On CPU, where marl runs
    float32, the flag changes nothing."""
    model_config = load_model_config(str(config_only))
    # the device settings given, so that the CUDA plans differ by --bf16 alone (unset, CUDA would choose bf16)
    config = tiny_rloo_config(
        tmp_path, quantization="4bit", bf16=False, fp16=False, gradient_checkpointing=False
    )
    cuda = PlanTarget(device="cuda", prompt_length=24)
    plain = plan_memory(config, model_config, cuda)
    mixed = plan_memory(with_changes(config, bf16=True), model_config, cuda)
    copy = "policy LoRA cast to bfloat16 (autocast)"
    assert [copy in phase.parts for phase in mixed.phases] == [False, True, True, False]
    assert not any(copy in phase.parts for phase in plain.phases)
    # a bf16 base: the LoRA inputs kept in bf16, not float32 (no head copy: the head is bf16 already)
    working, bf16_base = "activations + gradients (micro-batch)", with_changes(config, quantization=None)
    with_autocast = plan_memory(with_changes(bf16_base, bf16=True), model_config, cuda)
    assert (
        with_autocast.phase("update").parts[working]
        < plan_memory(bf16_base, model_config, cuda).phase("update").parts[working]
    )
    on_cpu = plan_memory(with_changes(config, bf16=True), model_config, TARGET)
    assert [p.parts for p in on_cpu.phases] == [
        p.parts for p in plan_memory(config, model_config, TARGET).phases
    ]


def test_fsdp2_shards_what_stays_over_the_processes(config_only, tmp_path):
    model_config = load_model_config(str(config_only))
    config = tiny_rloo_config(tmp_path, parallelism="fsdp2")
    one = plan_memory(config, model_config, TARGET)
    four = plan_memory(config, model_config, PlanTarget(device="cpu", prompt_length=24, num_processes=4))
    assert four.resident["base weights"] == one.resident["base weights"] // 4
    assert "gathered layers (fsdp2)" in four.phase("update").parts


def test_separate_copies_hold_more_than_one_base(config_only, tmp_path):
    model_config = load_model_config(str(config_only))
    config = tiny_rloo_config(tmp_path, rloo_k=4, per_device_train_batch_size=8)
    plans = {system: plan_memory(config, model_config, TARGET, system=system) for system in SYSTEMS}
    resident = {system: sum(plan.resident.values()) for system, plan in plans.items()}
    assert resident["marl"] < resident["trl-rloo"] < resident["ppo"]
    assert plans["trl-rloo"].peak > plans["marl"].peak
    assert any("not a measurement" in note for note in plans["ppo"].notes)


def test_the_advice_fits_and_is_empty_when_nothing_can(config_only, tmp_path):
    model_config = load_model_config(str(config_only))
    config = tiny_rloo_config(
        tmp_path, rloo_k=4, per_device_train_batch_size=16, local_rollout_forward_batch_size=16
    )
    plan = plan_memory(config, model_config, TARGET)
    roomy = changes_that_fit(config, model_config, PlanTarget(device="cpu", prompt_length=24, memory_gb=100))
    assert [change.flags for change in roomy] == ["(none: it fits as it is)"]
    # a budget between the resident part and the peak: some changes fit, each really under the budget
    usable = (sum(plan.resident.values()) + CPU_RUNTIME_BYTES + plan.peak) / 2
    tight = PlanTarget(device="cpu", prompt_length=24, memory_gb=usable / 1e9 / 0.9)
    changes = changes_that_fit(config, model_config, tight)
    assert changes, "some change should fit"
    assert all(change.plan.peak <= change.plan.budget_bytes for change in changes)
    assert all(change.plan.fits for change in changes)
    impossible = PlanTarget(device="cpu", prompt_length=24, memory_gb=0.001)
    assert changes_that_fit(config, model_config, impossible) == []


def test_a_model_with_recurrent_layers_is_refused_by_name(family_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"falcon_h1"):
        config = tiny_rloo_config(tmp_path, lora_target_modules=["q_proj", "v_proj"])
        plan_memory(config, load_model_config(str(family_dir("falcon_h1"))), TARGET)


def test_a_folder_without_config_json_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match=r"has no config\.json"):
        load_model_config(str(tmp_path / "empty"))
    broken = tmp_path / "broken.json"
    broken.write_text("{oops")
    with pytest.raises(ConfigError, match="cannot read the model config"):
        load_model_config(str(broken))


def test_the_trainer_plan_uses_the_longest_prompt_and_the_card_shows_it(tiny_llama_dir, tmp_path):
    from marl.apps.train_rloo import memory_card_with_plan
    from marl.model.loading import load_tokenizer
    from marl.train.trainer import RLOOTrainer

    config = tiny_rloo_config(tmp_path, model_name_or_path=str(tiny_llama_dir))
    model = MultiAdapterModel.from_config(config)
    prompts = ["a film", "the movie was great and fun to watch and then some more words"]
    trainer = RLOOTrainer(config, model, load_tokenizer(model.name_or_path), [{"prompt": p} for p in prompts],
                          reward_funcs=lambda prompts, completions, **_: [1.0] * len(prompts))  # fmt: skip
    plan = plan_for_trainer(trainer)
    assert plan.target.prompt_length == max(len(prompt.ids) for prompt in trainer.parts.train_prompts)
    card = str(memory_card_with_plan(trainer))
    assert "predicted peak" in card and "marl plan" in card
    assert "the predicted peak includes activations and KV cache" in card


def test_json_round_trip_of_a_config_file_folder(config_only):
    assert json.loads((config_only / "config.json").read_text())["model_type"] == "llama"
    assert load_model_config(str(config_only)).model_type == "llama"
    assert torch.float32 == PlanTarget(device="cpu").dtype


@pytest.mark.parametrize("quantization, offered", [(None, True), ("4bit", True), ("8bit", False)])
def test_the_advice_offers_fsdp2_for_the_bases_it_can_shard(quantization, offered, tmp_path):
    from marl.plan.advice import _candidates

    config = tiny_rloo_config(tmp_path, quantization=quantization)
    flags = [flags for flags, *_ in _candidates(config, TARGET)]
    assert any(flag.startswith("--parallelism fsdp2 on") for flag in flags) == offered, flags


@pytest.mark.parametrize("family", ["llama3", "qwen2", "granite", "gemma3_text"])
def test_the_graph_samplers_buffers_are_planned_as_it_allocates_them(family, family_dir, tmp_path):
    """``--sampler graph`` keeps the key/value buffers of its largest row bucket (rows per pass rounded up to
    a power of two) at its cache length (the prompt width rounded up likewise, plus the response) for the
    run: planned in the scoring and update phases, as many bytes as a real sampler allocates (Gemma 3's
    sliding-window layers hold the window only)."""
    from transformers import AutoTokenizer

    from marl.data.prompts import Prompt
    from marl.rollout.samplers import GraphSampler, SamplerSettings

    from support.runs import build, tiny_config

    config = tiny_config(
        tmp_path / "run",
        rloo_k=3,
        per_device_train_batch_size=3,
        total_episodes=36,
        local_rollout_forward_batch_size=8,
        response_length=10,
        sampler="graph",
    )
    trainer = build(family_dir(family), config)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    sampler = GraphSampler(trainer.model, tokenizer, SamplerSettings(0.7, 10, rows_per_pass=8))
    rows = [[20, 31, 42, 53, 64, 20, 31], [90, 101, 112, 123], list(range(130, 148))]  # the longest: 18
    sampler.sample(sampler.batch([Prompt(tuple(row), "p") for row in rows]), 3)
    buffers = sampler.decoder._buffers
    assert (sampler.decoder.buckets[0], buffers.length) == (8, 32 + 10)  # 2 prompts x k=3 -> 8; 18 -> 32
    allocated = sum(t.nbytes for layer in buffers.full.layers for t in (layer.keys, layer.values))

    model_config = load_model_config(str(family_dir(family)))
    target = PlanTarget(device="cpu", prompt_length=18)
    graph = plan_memory(config, model_config, target)
    static = plan_memory(with_changes(config, sampler="static"), model_config, target)
    for phase in ("scoring", "update"):
        assert graph.phase(phase).parts["graph sampler's buffers"] == allocated
        assert graph.phase(phase).total == static.phase(phase).total + allocated
    # sampling: the static sampler's 6 rows of 28 positions are planned already; the rest of 8 x 42 is added
    rounding = graph.phase("sampling").parts["graph sampler's bucket rounding"]
    if family == "gemma3_text":  # windowed layers hold 16 positions either way: only their rows round up
        assert allocated * 6 * 28 // (8 * 42) < allocated - rounding <= allocated * 6 // 8
    else:
        assert rounding == allocated - allocated * 6 * 28 // (8 * 42)
    sharded = plan_memory(with_changes(config, parallelism="fsdp2"), model_config, target)
    assert "graph sampler's buffers" not in sharded.phase("update").parts  # decodes with the static loop


def test_a_run_with_tools_plans_a_later_turn_after_the_longest_conversation(config_only, tmp_path):
    """Each row of a later turn decodes on its own after up to prompt + response_length tokens: more than
    turn 1 (each prompt once for its k rows), even than prompts that long; scoring and the update, whose
    completions hold the tools' results within response_length, stay as they are."""
    import dataclasses

    model_config = load_model_config(str(config_only))
    config = tiny_rloo_config(
        tmp_path, rloo_k=4, per_device_train_batch_size=8, local_rollout_forward_batch_size=8
    )
    plain = plan_memory(config, model_config, TARGET)
    tools = plan_memory(config, model_config, dataclasses.replace(TARGET, tool_turns=True))
    longest = TARGET.prompt_length + config.response_length
    long_prompts = plan_memory(config, model_config, PlanTarget(device="cpu", prompt_length=longest))
    sampling = [plan.phase("sampling").parts["KV cache + sampling"] for plan in (plain, long_prompts, tools)]
    assert sampling[0] < sampling[1] < sampling[2]
    for phase in ("scoring", "update"):
        assert tools.phase(phase).total == plain.phase(phase).total
