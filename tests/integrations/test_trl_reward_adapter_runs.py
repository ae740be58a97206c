"""Whole TRL runs: a ``GRPOTrainer`` (and an ``RLOOTrainer``) of a few steps with marl's reward function ends
with the same policy adapter and logs the same rewards as the same run with TRL's separately loaded reward
model (same seed), up to float rounding: with several generation steps per generation, several weighted
reward functions under ``normalize_then_sum``, gradient checkpointing, a KL term (TRL then adds its
``"ref"`` adapter beside the reward adapter), and bf16 mixed precision. The reward adapter stays frozen and
outside the optimizer.

bf16 (``GRPOConfig(bf16=True)``, float32 weights): the policy's forward and backward passes run under
accelerate's bf16 autocast in both runs alike; both rewards score in float32 (marl's passes bypass the
prepared model's forward; TRL prepares only a ``PreTrainedModel`` reward, not a ``PeftModel``) and agree to
float rounding (observed <= 1.2e-7). That rounding does not stay at the float32 scale in the adapters: it
moves the advantages by ~1e-6, which flips bf16 roundings in the autocast backward (gradient elements differ
by ~2^-8 of their size, 4.8e-3 observed in the first step), and AdamW's first steps, about the learning rate
times the gradient's sign, turn a near-zero element whose sign flips into a difference of up to twice the
learning rate (observed 9.9e-3; TRL's own run against itself with its rewards scaled by 1 + 1e-7 ends 4.3e-4
apart). So the bf16 run trains on the same rewards in both runs: each generation's rewards of marl's run are
compared with those TRL's run computed for the same completions (REWARD_TOLERANCE), then replaced by them
(``replaying``); what the adapters then compare is the training itself, which ends the same (observed
bit-equal). fp16 is not run here: on a CPU accelerate turns ``fp16=True`` into no autocast and no loss scaling
(``native_amp`` stays off), so it would repeat the float32 run. On a base loaded in 16 bits the scores differ
by 16-bit rounding (``test_16_bit_scores_*``); through the advantages that reaches the adapter at the learning
rate's scale (observed on a bf16 tiny Llama: 1.1e-2 after 3 steps of up to 5e-3 each), where a run comparison
says nothing."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from marl.integrations.trl import reward_adapter_function

from support.trl_reward import grpo_config, policy_model, random_reward_adapter, separate_reward_model

PROMPTS = [
    "the movie was",
    "a dull",
    "review of the film:",
    "good",
    "an honest",
    "the plot",
    "write a",
    "bad",
]
# The scores agree to float rounding (observed <= 1.5e-8 in the logged means). Through the group-normalised
# advantages and AdamW's normalised steps that rounding reaches the adapter tensors: observed up to 2.3e-6,
# and 4.1e-5 with steps_per_generation=2, whose second step clips some tokens' ratios. Each AdamW step moves a
# tensor by up to the learning rate (5e-3): a different reward shows at that scale.
ADAPTER_TOLERANCE = 2e-4
REWARD_TOLERANCE = 1e-5


def length_reward(completions, **kwargs):
    return [len(completion) / 10 for completion in completions]


def replaying(trainer_class, recorded: list[torch.Tensor], *, record: bool):
    """``trainer_class`` whose rewards (one ``[rows, funcs]`` tensor per generation) are appended to
    ``recorded`` (``record``), or compared with the recorded ones in order (REWARD_TOLERANCE) and replaced by
    them."""

    class Replaying(trainer_class):
        def _calculate_rewards(self, *args):
            rewards = super()._calculate_rewards(*args)
            if record:
                recorded.append(rewards.clone())
                return rewards
            theirs = recorded.pop(0)
            torch.testing.assert_close(rewards, theirs, rtol=0, atol=REWARD_TOLERANCE)
            return theirs

    return Replaying


def run(
    base_dir, adapter_dir, output_dir, *, with_marl: bool, trainer_kind: str = "grpo", replay=None, **settings
):
    """A TRL run with the adapter as marl's reward function (``with_marl``) or as TRL's separate reward
    model; returns the final policy tensors, the logged rewards and the trainer. With a ``replay`` list, TRL's
    run records its rewards into it and marl's run checks its own against them and trains on them."""
    from trl import GRPOTrainer, RLOOConfig, RLOOTrainer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    dtype = settings.pop("base_dtype", torch.float32)
    policy = policy_model(base_dir, dtype=dtype)
    if with_marl:
        reward, processing_class = reward_adapter_function(policy, adapter_dir, tokenizer), None
    else:
        reward, processing_class = separate_reward_model(base_dir, adapter_dir, dtype=dtype), tokenizer
    extra = settings.pop("extra_rewards", [])
    arguments = dict(max_steps=3, learning_rate=5e-3, **settings)
    trainer_class, config_class = (GRPOTrainer, None) if trainer_kind == "grpo" else (RLOOTrainer, RLOOConfig)
    if replay is not None:
        trainer_class = replaying(trainer_class, replay, record=not with_marl)
    config = grpo_config(output_dir, config_class, **arguments)
    trainer = trainer_class(
        model=policy,
        reward_funcs=[reward, *extra],
        reward_processing_classes=[processing_class, *[None] * len(extra)],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    adapter = {name: p.detach().clone() for name, p in policy.named_parameters() if ".default." in name}
    names = trainer.reward_func_names
    logged = [
        [entry["reward"], *(entry[f"rewards/{name}/mean"] for name in names)]
        for entry in trainer.state.log_history
        if "reward" in entry
    ]
    return adapter, torch.tensor(logged), trainer


VARIANTS = {
    "plain": {},
    "steps_per_generation": {"steps_per_generation": 2},
    "weighted_normalize_then_sum": {
        "extra_rewards": [length_reward],
        "reward_weights": [1.0, 0.5],
        "multi_objective_aggregation": "normalize_then_sum",
    },
    "checkpointing_and_kl": {"gradient_checkpointing": True, "beta": 0.04},
    "bf16": {"bf16": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_grpo_run_ends_as_the_run_with_the_separate_reward_model(variant, tiny_llama_dir, tmp_path):
    adapter_dir = random_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    settings = VARIANTS[variant]
    replay = [] if settings.get("bf16") else None  # the same rewards in both runs (module docstring)
    theirs, their_rewards, _ = run(
        tiny_llama_dir, adapter_dir, tmp_path / "theirs", with_marl=False, replay=replay, **dict(settings)
    )
    ours, our_rewards, trainer = run(
        tiny_llama_dir, adapter_dir, tmp_path / "ours", with_marl=True, replay=replay, **settings
    )
    assert not replay  # marl's run compared every generation's rewards with TRL's
    assert our_rewards.shape == their_rewards.shape and len(our_rewards) >= 2  # a log per generation
    torch.testing.assert_close(our_rewards, their_rewards, rtol=0, atol=REWARD_TOLERANCE)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=ADAPTER_TOLERANCE, msg=name)
    start = policy_model(tiny_llama_dir)
    moved = max((tensor - start.get_parameter(name)).abs().max() for name, tensor in ours.items())
    assert moved > 1e-3  # the policy trained
    model = trainer.accelerator.unwrap_model(trainer.model)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    for name, parameter in model.named_parameters():
        assert (id(parameter) in optimized) == (".default." in name), name
        assert parameter.requires_grad == (".default." in name), name
    if settings.get("bf16"):  # the policy's passes ran under bf16 autocast (accelerate's on a CPU too)
        assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp
    if settings.get("beta"):
        assert set(model.peft_config) == {"default", "ref", "reward"}


def test_an_rloo_run_ends_as_the_run_with_the_separate_reward_model(tiny_llama_dir, tmp_path):
    adapter_dir = random_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    theirs, their_rewards, _ = run(
        tiny_llama_dir, adapter_dir, tmp_path / "theirs", with_marl=False, trainer_kind="rloo"
    )
    ours, our_rewards, _ = run(
        tiny_llama_dir, adapter_dir, tmp_path / "ours", with_marl=True, trainer_kind="rloo"
    )
    torch.testing.assert_close(our_rewards, their_rewards, rtol=0, atol=REWARD_TOLERANCE)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=ADAPTER_TOLERANCE, msg=name)
