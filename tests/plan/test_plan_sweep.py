"""The planner's sweep (issue 44): N policies trained at once on one base hold N LoRAs, N AdamW states, N
policies' rollout records and the other policies' gradients through the update, decode N times the rows per
pass, and keep scoring's chunks and the update's micro-batch (one policy's at a time), as the sweep trainer
runs them; one policy is the plan of a run."""

from __future__ import annotations

import pytest

from marl.errors import ConfigError
from marl.model.multi_adapter import MultiAdapterModel
from marl.plan import PlanTarget, load_model_config, plan_memory
from marl.plan.advice import changes_that_fit
from marl.plan.planner import with_changes

from support.tiny import tiny_rloo_config

TARGET = PlanTarget(device="cpu", prompt_length=24)
DECODE, SCORING = "KV cache + sampling", "activations + log-softmax (no grad)"
UPDATE = "activations + gradients (micro-batch)"


def sweep_config(tmp_path, base, reward, **overrides):
    settings = dict(rloo_k=4, per_device_train_batch_size=8, local_rollout_forward_batch_size=8)
    return tiny_rloo_config(
        tmp_path, model_name_or_path=str(base), reward_adapter=[str(reward)], **{**settings, **overrides}
    )


@pytest.mark.parametrize(
    "overrides, target",
    [({}, TARGET), ({"quantization": "4bit"}, TARGET), ({"gradient_checkpointing": True}, TARGET),
     ({"quantization": "4bit", "bf16": True}, PlanTarget(device="cuda", prompt_length=24))],
    ids=["fp32", "4bit", "checkpointing", "4bit-bf16-cuda"],
)  # fmt: skip
def test_one_policy_is_the_plan_of_a_run(overrides, target, tiny_llama_dir, tiny_reward_adapter, tmp_path):
    config = sweep_config(tmp_path, tiny_llama_dir, tiny_reward_adapter, **overrides)
    model_config = load_model_config(str(tiny_llama_dir))
    run = plan_memory(config, model_config, target)
    assert plan_memory(config, model_config, target, policies=1) == run
    assert "policies (sweep)" not in run.settings
    assert all("other policies" not in name for phase in run.phases for name in phase.parts)


def test_four_policies_hold_four_loras_and_optimizers_and_decode_four_times_the_rows(
    tiny_llama_dir, tiny_reward_adapter, tmp_path
):
    """Against the model itself: the LoRA bytes of four policies really loaded on the base (memory card);
    the decode of one run whose chunks hold four times the rows (as the sweep trainer decodes), the decode's
    growth at least the KV cache of the extra rows (from the model's config); the update's working set one
    run's micro-batch (the sweep trainer runs one policy's micro-batch at a time), so that the update phase
    grows by exactly the extra LoRAs, optimizer states, waiting gradients and records."""
    config = sweep_config(tmp_path, tiny_llama_dir, tiny_reward_adapter)
    model_config = load_model_config(str(tiny_llama_dir))
    one = plan_memory(config, model_config, TARGET)
    four = plan_memory(config, model_config, TARGET, policies=4)
    model = MultiAdapterModel.from_config(config)
    for name in ("second", "third", "fourth"):
        model.add_policy(name, config.policy_lora_config())
    card = model.memory_report()
    loras = sum(card.adapter_bytes[name] for name in model.policies)
    assert loras == 4 * card.adapter_bytes["policy"]
    assert four.resident["policy LoRA (float32)"] == loras
    assert four.resident["AdamW moments (float32)"] == 2 * loras
    for shared in ("base weights", "reward LoRAs + score heads"):
        assert four.resident[shared] == one.resident[shared]
    assert four.settings["policies (sweep)"] == 4
    # the decode: every policy's rows at once, as a run whose chunks hold 4x the rows
    wider = with_changes(config, local_rollout_forward_batch_size=32, per_device_train_batch_size=32)
    wider = plan_memory(wider, model_config, TARGET)
    assert four.phase("sampling").parts[DECODE] == wider.phase("sampling").parts[DECODE]
    # the update: one policy's micro-batch at a time, a run's working set, not 4x the rows (which is larger)
    assert four.phase("update").parts[UPDATE] == one.phase("update").parts[UPDATE]
    assert wider.phase("update").parts[UPDATE] > one.phase("update").parts[UPDATE]
    text = model_config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_per_row = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * (24 + 6) * 4
    grown = four.phase("sampling").parts[DECODE] - one.phase("sampling").parts[DECODE]
    assert grown >= (32 - 8) * kv_per_row
    # scoring's chunks are a run's (rows of several policies share a chunk); every policy's gradients wait
    # for its step
    assert four.phase("scoring").parts[SCORING] == one.phase("scoring").parts[SCORING]
    gradients = four.phase("update").parts["LoRA gradients of the other policies"]
    assert gradients == 3 * card.adapter_bytes["policy"]
    records = one.phase("update").parts["rollout records"]
    assert four.phase("update").parts["rollout records"] == 4 * records
    extra_resident = sum(four.resident.values()) - sum(one.resident.values())
    assert extra_resident == 3 * (1 + 2) * card.adapter_bytes["policy"]  # 3 more LoRAs, their AdamW moments
    grown = four.phase("update").total - one.phase("update").total
    assert grown == extra_resident + gradients + 3 * records
    assert four.peak > one.peak


def test_a_sweep_is_planned_for_marl_only_and_its_advice_plans_every_policy(
    tiny_llama_dir, tiny_reward_adapter, tmp_path
):
    config = sweep_config(tmp_path, tiny_llama_dir, tiny_reward_adapter)
    model_config = load_model_config(str(tiny_llama_dir))
    with pytest.raises(ConfigError, match="planned for marl, not 'trl-rloo'"):
        plan_memory(config, model_config, TARGET, system="trl-rloo", policies=2)
    with pytest.raises(ConfigError, match="policies=0"):
        plan_memory(config, model_config, TARGET, policies=0)
    four = plan_memory(config, model_config, TARGET, policies=4)
    tight = PlanTarget(device="cpu", prompt_length=24, memory_gb=(four.peak - 1000) / 1e9 / 0.9)
    changes = changes_that_fit(config, model_config, tight, policies=4)
    assert changes and all(change.plan.settings["policies (sweep)"] == 4 for change in changes)
    assert all(change.plan.fits for change in changes)
