"""marl's reward adapter on a TRL trainer's own PeftModel (:mod:`marl.integrations.trl`), against TRL.

- Scores: a real ``GRPOTrainer`` holds both the marl reward function and TRL's separately loaded reward model
  (``AutoModelForSequenceClassification`` + ``PeftModel.from_pretrained``); its own ``_calculate_rewards``
  computes both columns on the same completions, plain and conversational, on every family of the table with
  a sequence classifier (Llama-3 pad == eos, Qwen2 biases, Gemma soft-capping, GPT-2/OPT/Phi-3 dropout, ...),
  on a 4-bit base and on the bundled SmolLM2.
- What the call leaves: the policy adapter active, every ``requires_grad`` and train/eval flag as they were
  (after an exception too); the reference (``disable_adapter()``) is the base alone.
- Bad input: one line each, before the model is touched.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.errors import AdapterError, ConfigError, ModelError
from marl.integrations.trl import reward_adapter_function
from marl.model.rows import probe_tolerance

from support.families import FAMILIES, FAMILY_SPECS
from support.trl_reward import (
    grpo_config,
    policy_model,
    random_reward_adapter,
    separate_reward_model,
    trl_scores,
)

CLASSIFIER_FAMILIES = [name for name in FAMILIES if FAMILY_SPECS[name].sequence_classification]
PROMPTS = ["the movie was", "a dull", "review of the film:", "good"]
TEXTS = [" great fun to watch", " boring film", " a small delight, well told and moving", " good great"]
CHATS = [
    [{"role": "user", "content": "write a short review of this movie"}],
    [{"role": "user", "content": "go"}],
]
CHAT_TEXTS = ["a lovely charming film", "awful bad worse"]


def both_scores(
    base_dir, adapter_dir, tmp_path, prompts, texts, family=None, quantization=None, dtype=torch.float32
):
    """Column 0: marl's reward function on the policy's PeftModel; column 1: TRL's separate reward model;
    both computed by the trainer's own ``_calculate_rewards`` (bf16 mixed precision on a bf16 base)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    policy = policy_model(base_dir, family, quantization, dtype=dtype)
    ours = reward_adapter_function(policy, adapter_dir, tokenizer)
    theirs = separate_reward_model(base_dir, adapter_dir, quantization, dtype)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[ours, theirs],
        reward_processing_classes=[None, tokenizer],
        args=grpo_config(tmp_path / "run", bf16=dtype == torch.bfloat16),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    return trl_scores(trainer, tokenizer, prompts, texts)


@pytest.mark.parametrize("family", CLASSIFIER_FAMILIES)
def test_scores_equal_trls_separate_reward_model_on_every_family(family, family_dir, tmp_path):
    base_dir = family_dir(family)
    adapter = random_reward_adapter(base_dir, tmp_path / "reward", family)
    # one text ends in the EOS: with pad == eos (Llama-3) both read the token before it
    texts = [*TEXTS[:3], TEXTS[3] + AutoTokenizer.from_pretrained(base_dir).eos_token]
    scores = both_scores(base_dir, adapter, tmp_path, PROMPTS, texts, family)
    torch.testing.assert_close(scores[:, 0], scores[:, 1], rtol=0, atol=1e-5)
    assert scores[:, 1].std() > 1e-3  # the rows really score differently


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma2"])
def test_conversations_read_as_trl_renders_them_for_a_reward_model(family, family_dir, tmp_path):
    """Llama-3 (turns end with <|eot_id|>, pad == eos), ChatML (Qwen), the plain template (Gemma row)."""
    base_dir = family_dir(family)
    adapter = random_reward_adapter(base_dir, tmp_path / "reward", family)
    scores = both_scores(base_dir, adapter, tmp_path, CHATS, CHAT_TEXTS, family)
    torch.testing.assert_close(scores[:, 0], scores[:, 1], rtol=0, atol=1e-5)


def test_4bit_scores_equal_trls_separate_4bit_reward_model(family_dir, tmp_path):
    """Both sides quantize the same checkpoint the same way (NF4, float32 compute); they differ by padding
    side and batching only: within what marl allows float32 rounding of hidden states (probe_tolerance)."""
    base_dir = family_dir("llama")
    adapter = random_reward_adapter(base_dir, tmp_path / "reward")
    scores = both_scores(base_dir, adapter, tmp_path, PROMPTS, TEXTS, quantization="4bit")
    tolerance = probe_tolerance(torch.float32) * (1 + scores[:, 1].abs().max())
    torch.testing.assert_close(scores[:, 0], scores[:, 1], rtol=0, atol=float(tolerance))


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_scores_equal_trls_separate_16_bit_reward_model(family, dtype, family_dir, tmp_path):
    """A base loaded in 16 bits on both sides (as a GPU user loads it for ``bf16=True``; PEFT keeps every
    LoRA tensor in float32). TRL's reward model applies its score head in the base's dtype, marl's in float32,
    and the rows are padded on other sides: within marl's tolerance for 16-bit rounding (probe_tolerance;
    observed up to 2.0e-3 in bf16 and 1.6e-4 in fp16 against 4.0e-2 and 5.0e-3)."""
    base_dir = family_dir(family)
    adapter = random_reward_adapter(base_dir, tmp_path / "reward", family)
    scores = both_scores(base_dir, adapter, tmp_path, PROMPTS, TEXTS, family, dtype=dtype)
    tolerance = probe_tolerance(dtype) * (1 + scores[:, 1].abs().max())
    torch.testing.assert_close(scores[:, 0], scores[:, 1], rtol=0, atol=float(tolerance))
    assert scores[:, 1].std() > 10 * (scores[:, 0] - scores[:, 1]).abs().max()  # rows differ beyond it


@pytest.mark.slow
def test_bundled_smollm2_scores_equal_trls_separate_reward_model(tmp_path):
    from pathlib import Path

    from marl.data.assets import EMBEDDED_MODEL_ID, resolve_model_path

    from support.tiny import train_reward_adapter_with_trl

    base_dir = Path(resolve_model_path(EMBEDDED_MODEL_ID))
    adapter = train_reward_adapter_with_trl(base_dir, tmp_path / "reward")
    scores = both_scores(base_dir, adapter, tmp_path, PROMPTS, TEXTS)
    torch.testing.assert_close(scores[:, 0], scores[:, 1], rtol=0, atol=1e-5)
    chats = both_scores(base_dir, adapter, tmp_path, CHATS, CHAT_TEXTS)
    torch.testing.assert_close(chats[:, 0], chats[:, 1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- what a call leaves behind


def flags(model):
    return (
        model.active_adapter,
        [(name, p.requires_grad) for name, p in model.named_parameters()],
        [(name, m.training) for name, m in model.named_modules()],
    )


@pytest.mark.parametrize("training", [True, False])
def test_a_call_restores_the_policy_flags_and_modes_also_after_an_exception(training, family_dir, tmp_path):
    """GPT-2: learned positions, so a text longer than n_positions fails inside the forward pass."""
    base_dir = family_dir("gpt2")
    policy = policy_model(base_dir, "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    reward = reward_adapter_function(
        policy, random_reward_adapter(base_dir, tmp_path / "r", "gpt2"), tokenizer
    )
    policy.train(training)
    before = flags(policy)
    assert before[0] == "default"
    assert not any(p.requires_grad for name, p in policy.named_parameters() if ".reward." in name)
    with torch.enable_grad():
        scores = reward(prompts=PROMPTS, completions=TEXTS, completion_ids=None, trainer_state=None)
    assert len(scores) == 4 and all(isinstance(score, float) for score in scores)
    assert flags(policy) == before
    with pytest.raises(IndexError):
        reward(prompts=["a"], completions=[" good" * 400])
    assert flags(policy) == before


def test_loading_leaves_the_policy_as_built_and_the_reference_is_the_base_alone(tiny_llama_dir, tmp_path):
    """``disable_adapter()`` (TRL's reference for a fresh adapter) turns the reward adapter off too: the
    logits equal a plain copy of the base; with adapters on, the policy's logits are unchanged by the load."""
    from trl.trainer.utils import use_adapter

    policy = policy_model(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer(["the movie was great", "a dull"], return_tensors="pt", padding=True)
    with torch.no_grad():
        policy_logits = policy(**ids).logits
    before = flags(policy)
    reward_adapter_function(policy, random_reward_adapter(tiny_llama_dir, tmp_path / "r"), tokenizer)
    after = flags(policy)

    def policy_only(entries):  # the reward adapter's own modules and tensors are new
        return [(name, flag) for name, flag in entries if "reward" not in name.split(".")]

    assert after[0] == before[0] == "default"
    assert policy_only(after[1]) == before[1] and policy_only(after[2]) == before[2]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(policy(**ids).logits, policy_logits, rtol=0, atol=0)
        with policy.disable_adapter():
            reference = policy(**ids).logits
        with use_adapter(policy, adapter_name=None):
            trl_reference = policy(**ids).logits
        plain = base(**ids).logits
    torch.testing.assert_close(reference, plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(trl_reference, plain, rtol=0, atol=1e-6)
    assert (policy_logits - plain).abs().max() > 1e-3  # the policy is not the base


# ---------------------------------------------------------------------- bad input, one line each


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_folder_that_is_not_a_reward_adapter_is_refused(tiny_llama_dir, tmp_path):
    policy = policy_model(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    policy.save_pretrained(tmp_path / "policy-adapter")  # a causal-LM LoRA: no score head
    with pytest.raises(AdapterError) as error:
        reward_adapter_function(policy, tmp_path / "policy-adapter", tokenizer)
    assert "no score head" in one_line(error)
    with pytest.raises(AdapterError) as error:
        reward_adapter_function(policy, tiny_llama_dir, tokenizer)  # a model folder
    assert one_line(error) == (
        f"{tiny_llama_dir} is not a PEFT adapter (it has no adapter_config.json); pass the folder that "
        "`marl train-reward` (or TRL's RewardTrainer with a LoRA peft_config, task_type='SEQ_CLS') wrote"
    )
    assert list(policy.peft_config) == ["default"]


def test_a_name_trls_trainers_take_is_refused_with_the_reason(tiny_llama_dir, tiny_reward_adapter):
    policy = policy_model(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with pytest.raises(ConfigError) as error:
        reward_adapter_function(policy, tiny_reward_adapter, tokenizer, name="ref")
    assert one_line(error) == (
        "reward adapter name 'ref' is reserved: TRL's trainers add the frozen copy of the policy's starting "
        "weights under that name. Choose another name"
    )
    with pytest.raises(ConfigError) as error:
        reward_adapter_function(policy, tiny_reward_adapter, tokenizer, name="default")
    assert one_line(error) == (
        "reward adapter name 'default' is already used on this base (adapters: ['default']); choose another"
    )
    assert list(policy.peft_config) == ["default"]


def test_an_adapter_for_another_base_is_refused(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.hidden_size = 128  # another base: twice as wide
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other-base")
    adapter = random_reward_adapter(tmp_path / "other-base", tmp_path / "other-reward")
    policy = policy_model(tiny_llama_dir)
    with pytest.raises(AdapterError) as error:
        reward_adapter_function(policy, adapter, AutoTokenizer.from_pretrained(tiny_llama_dir))
    assert "different base" in one_line(error)
    assert list(policy.peft_config) == ["default"]


def test_a_model_that_is_not_a_peft_model_and_a_trainer_are_refused(tiny_llama_dir, tiny_reward_adapter):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(ModelError) as error:
        reward_adapter_function(plain, tiny_reward_adapter, tokenizer)
    assert "not a PEFT model" in one_line(error) and "get_peft_model" in one_line(error)


def test_a_built_trainer_is_refused_with_the_order_that_works(tiny_llama_dir, tiny_reward_adapter, tmp_path):
    from datasets import Dataset
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    trainer = GRPOTrainer(
        model=policy_model(tiny_llama_dir),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=grpo_config(tmp_path / "run"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    with pytest.raises(ConfigError) as error:
        reward_adapter_function(trainer, tiny_reward_adapter, tokenizer)
    assert "before the" in one_line(error) and "GRPOTrainer(model=" in one_line(error)


@pytest.mark.parametrize(
    "environment",
    [
        {"ACCELERATE_USE_FSDP": "true"},
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
    ],
    ids=["fsdp", "zero3"],
)
def test_a_sharded_launch_is_refused(environment, tiny_llama_dir, tiny_reward_adapter, monkeypatch):
    policy = policy_model(tiny_llama_dir)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as error:
        reward_adapter_function(policy, tiny_reward_adapter, AutoTokenizer.from_pretrained(tiny_llama_dir))
    assert "splits over the processes" in one_line(error)
    assert list(policy.peft_config) == ["default"]


def test_fsdp2_sharded_parameters_are_refused_at_the_call(tiny_llama_dir, tiny_reward_adapter, tmp_path):
    """A launch that says nothing in the environment, sharded by the trainer afterwards (FSDP2 turns the
    parameters into DTensors): the first call refuses, before the first optimizer step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    policy = policy_model(tiny_llama_dir)
    reward = reward_adapter_function(
        policy, tiny_reward_adapter, AutoTokenizer.from_pretrained(tiny_llama_dir)
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        fully_shard(policy.get_base_model().model.layers[0], mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ConfigError) as error:
            reward(prompts=PROMPTS, completions=TEXTS)
        assert "FSDP" in one_line(error)
    finally:
        dist.destroy_process_group()


def test_a_policy_adapter_that_trains_the_shared_base_is_refused(tiny_llama_dir, tiny_reward_adapter):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    policy = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], bias="all"))
    with pytest.raises(AdapterError) as error:
        reward_adapter_function(policy, tiny_reward_adapter, AutoTokenizer.from_pretrained(tiny_llama_dir))
    assert "bias='all'" in one_line(error)


def test_the_deprecated_reward_adapter_function_warns_and_scores_as_the_trainer_reward(
    tiny_llama_dir, tiny_reward_adapter
):
    """``marl.RewardAdapterFunction`` names its replacement in a DeprecationWarning and scores, on its own
    base, what :func:`reward_adapter_function` scores on the policy's PeftModel; ``append_eos`` reads each
    text ended with EOS."""
    from marl import RewardAdapterFunction

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ours = reward_adapter_function(policy_model(tiny_llama_dir), tiny_reward_adapter, tokenizer)
    with pytest.warns(DeprecationWarning, match=r"marl\.integrations\.trl\.reward_adapter_function"):
        alias = RewardAdapterFunction(str(tiny_llama_dir), str(tiny_reward_adapter), name="reward")
    assert alias.__name__ == "reward"
    assert alias(PROMPTS, TEXTS) == pytest.approx(ours(prompts=PROMPTS, completions=TEXTS), abs=1e-5)
    with pytest.warns(DeprecationWarning):
        ended = RewardAdapterFunction(alias.model, name="reward", append_eos=True)
    rows = [
        [*tokenizer(prompt + text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        for prompt, text in zip(PROMPTS, TEXTS, strict=True)
    ]
    mask = torch.ones(1, 1, dtype=torch.long)
    alone = [
        alias.model.compute_reward_score(torch.tensor([ids]), mask.expand(1, len(ids))).item() for ids in rows
    ]
    assert ended(PROMPTS, TEXTS) == pytest.approx(alone, abs=1e-5)
