"""Rows sharing one pass. Each prompt computed once for its k completions: the packed rows give the unshared
numbers (log-probs, rewards, gradients, a whole update) on every family where packing is allowed, and it is
refused where not. Rows of several policies in one forward and one backward pass
(``MultiAdapterModel.routed``): on every family of the table each row's log-probs, and each policy's adapter
gradients, equal those of the same rows computed alone under the row's own view, in train mode and with
gradient checkpointing."""

from __future__ import annotations

import copy
from typing import Any

import datasets
import pytest
import torch
from peft import LoraConfig
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)

from marl import MultiAdapterModel, RLOOTrainer
from marl.data.prompts import Prompt
from marl.errors import ConfigError
from marl.model.adapters import BASE_VIEW
from marl.model.rows import pack_rows, probe_tolerance, read_slots
from marl.rollout.collect import collect_rollout
from marl.rollout.samplers import SamplerSettings, TransformersSampler
from marl.rollout.scoring import Scorer
from marl.train.trainer import update_policies
from marl.train.training_parts import UpdatePart

from support.families import DTYPES, FAMILIES, FAMILY_SPECS, logprob_tolerance
from support.tiny import save_reward_adapter, tiny_rloo_config

CLASSIFIER_FAMILIES = [name for name in FAMILIES if FAMILY_SPECS[name].sequence_classification]
# Prompts of unequal lengths (left padding) and 3 completions each; ordinary token ids (the families keep 0-6
# for special tokens and suppress 300 and 301).
PROMPTS = [
    Prompt(tuple(range(20, 29)), "long"),
    Prompt((40, 41, 42), "short"),
    Prompt((50, 51, 52, 53, 54), "mid"),
]


def policy_lora(family: str) -> LoraConfig:
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    return LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude, task_type="CAUSAL_LM"
    )


def load(family_dir, family: str, **kwargs) -> MultiAdapterModel:
    model = MultiAdapterModel.from_pretrained(
        family_dir(family), policy_adapter=policy_lora(family), **kwargs
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy that differs from the base
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name and ".policy." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model


def sampled(model: MultiAdapterModel, tokenizer, stop_at_eos: bool = True):
    """A scorer of ``model`` and 3 completions of each of ``PROMPTS``."""
    sampler = TransformersSampler(
        model, tokenizer, SamplerSettings(temperature=1.0, response_length=7, stop_at_eos=stop_at_eos)
    )
    torch.manual_seed(0)
    return Scorer(model, tokenizer, temperature=1.0), sampler.sample(sampler.batch(PROMPTS), k=3)


def test_pack_rows_stores_each_prompt_once_and_masks_other_completions():
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    response_ids = torch.tensor([[10, 11], [12, 0], [13, 14]])
    response_mask = torch.tensor([[1, 1], [1, 0], [1, 1]]).bool()
    packed = pack_rows(
        prompt_ids, prompt_mask, response_ids, response_mask, torch.tensor([4, 4, 1]), torch.bool
    )
    assert packed.input_ids.tolist() == [[5, 6, 10, 11, 12, 0], [7, 8, 9, 13, 14, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 3], [0, 1, 2, 3, 4, 0]]
    mask = packed.attention_mask[0, 0]
    assert mask[4].tolist() == [True, True, False, False, True, False]  # 2nd completion: prompt + itself
    assert mask[3].tolist() == [True, True, True, True, False, False]
    assert mask[1, 5] == False and packed.attention_mask[1, 0, 5].tolist() == [False] * 5 + [True]  # noqa: E712
    # token 0 of a completion is predicted by the prompt's last token
    assert packed.predictors.tolist() == [[1, 2], [1, 4], [6 + 2, 6 + 3]]
    # positions in the unpacked rows map to their packed slot (left padding has none)
    assert read_slots(packed, torch.tensor([4, 2, 3])).tolist() == [3, 1, 6 + 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logprobs_equal_the_unshared_ones(family, dtype, family_dir):
    """In fp32 and in bf16: packing stays on in bf16 for every family that packs in fp32."""
    model = load(family_dir, family, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    scorer, samples = sampled(model, tokenizer)
    if FAMILY_SPECS[family].model_type == "falcon_h1":
        assert "carry state" in model.packing_problem and scorer.pack(samples) is None
        return
    assert model.packing_problem is None
    window = FAMILY_SPECS[family].config.get("sliding_window")
    packed = samples.pack(torch.bool if model.config._attn_implementation == "sdpa" else model.dtype)
    if window is not None and packed.input_ids.shape[1] > window:
        # a window the packed positions would exceed changes what a completion sees: computed unshared
        assert scorer.pack(samples) is None
        return
    assert scorer.pack(samples) is not None
    valid = samples.response_mask
    for view in (model.policy, model.reference):
        with view(), torch.no_grad():
            unshared = model.token_logprobs(
                samples.query_responses, samples.attention_mask, response_start=samples.prompt_length
            )
            shared = model.packed_token_logprobs(packed)
        torch.testing.assert_close(shared[valid], unshared[valid], rtol=0, atol=logprob_tolerance(dtype))
    # fewer forward tokens: 3 prompts once instead of 9 times
    assert packed.input_ids.numel() < samples.query_responses.numel()


@pytest.mark.parametrize("family", CLASSIFIER_FAMILIES)
def test_packed_reward_scores_equal_the_unshared_ones(family, family_dir, tmp_path):
    if FAMILY_SPECS[family].model_type == "falcon_h1":
        pytest.skip("no packing on a Mamba hybrid (see the log-prob test)")
    model = load(family_dir, family, reward_adapter=save_reward_adapter(family_dir(family), tmp_path / "rm"))
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    scorer, samples = sampled(model, tokenizer)
    packed = scorer.pack(samples)
    if packed is None:
        pytest.skip("sliding window shorter than the packed rows")
    ids, mask = samples.query_responses, samples.attention_mask
    unshared = model.compute_reward_score(ids, mask)
    torch.testing.assert_close(
        model.compute_reward_score(ids, mask, packed=packed), unshared, rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gemma2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_the_unshared_ones(family, checkpointing, family_dir):
    model = load(family_dir, family, gradient_checkpointing=checkpointing)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    scorer, samples = sampled(model, tokenizer)
    weights = torch.linspace(-1.0, 1.0, samples.response_ids.numel()).view_as(samples.response_ids)

    def gradients(packed):
        model.train()
        try:
            with model.policy():
                logprobs = scorer.completion_logprobs(samples, packed)
            (logprobs * weights * samples.response_mask).sum().backward()
        finally:
            model.eval()
        grads = [parameter.grad.clone() for parameter in model.policy_parameters()]
        for parameter in model.policy_parameters():
            parameter.grad = None
        return grads

    unshared, shared = gradients(None), gradients(scorer.pack(samples))
    assert sum(float(g.abs().sum()) for g in unshared) > 1e-3
    for a, b in zip(shared, unshared, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_whole_update_is_the_same_with_and_without_sharing(checkpointing, tiny_llama_dir, tmp_path):
    """Same rollout, same seed: 2 epochs × 2 mini-batches give the same adapter with sharing on or off."""

    def trainer_for(share: bool, output_dir) -> RLOOTrainer:
        config = tiny_rloo_config(
            output_dir, model_name_or_path=str(tiny_llama_dir), num_mini_batches=2, num_ppo_epochs=2,
            total_episodes=8, learning_rate=1e-2, share_prompt_prefix=share,
            gradient_checkpointing=checkpointing,
        )  # fmt: skip
        torch.manual_seed(0)
        model = MultiAdapterModel.from_config(config)
        prompts = datasets.Dataset.from_dict({"prompt": ["the movie", "a film about the", "review:", "good"]})
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        return RLOOTrainer(config, model, tokenizer, prompts, reward_funcs=lambda p, c: [len(x) for x in c])

    shared, unshared = trainer_for(True, tmp_path / "a"), trainer_for(False, tmp_path / "b")
    assert (
        shared.parts.policy_update.grouped_micro_batches
        and unshared.parts.policy_update.grouped_micro_batches
    )
    assert shared.parts.scorer.share_prompt_prefix and not unshared.parts.scorer.share_prompt_prefix
    with torch.no_grad():  # one starting point
        for a, b in zip(
            shared.parts.policy_update.parameters, unshared.parts.policy_update.parameters, strict=True
        ):
            b.copy_(a)
    torch.manual_seed(1)
    rollout = collect_rollout(
        unshared.parts.sampler, unshared.parts.scorer, unshared.parts.train_prompts, 2, unshared.parts.reward
    )
    advantages = torch.linspace(-1.0, 1.0, rollout.prompt_index.shape[0])
    results = []
    for trainer in (shared, unshared):
        torch.manual_seed(2)
        part = UpdatePart(trainer.parts.policy_update, copy.deepcopy(rollout), advantages)
        stats = update_policies([part], trainer.phases, update=1)[0][0]
        results.append(([p.detach().clone() for p in trainer.parts.policy_update.parameters], stats))
    (shared_weights, shared_stats), (unshared_weights, unshared_stats) = results
    assert float(shared_stats.first_ratio) == pytest.approx(float(unshared_stats.first_ratio), abs=1e-5)
    # Adam divides by the gradient's own scale: a coordinate whose gradient is ~0 turns summation-order noise
    # into a step of up to the learning rate; 1% of one lr-sized step is far below what a wrong update moves.
    for a, b in zip(shared_weights, unshared_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    moved = [p for p in shared_weights if p.abs().max() > 0]
    assert moved


def test_the_rows_order_of_an_update_does_not_depend_on_packing(tiny_llama_dir, tmp_path):
    """Whether the packing probe passes (it depends on the dtype, so on the hardware) must not change which
    rows train together: the same seed gives the same order with sharing on and off."""

    def order(share: bool, per_device: int) -> list[int]:
        config = tiny_rloo_config(
            tmp_path / f"{share}-{per_device}", model_name_or_path=str(tiny_llama_dir),
            per_device_train_batch_size=per_device, gradient_accumulation_steps=2, total_episodes=24,
            response_length=4, share_prompt_prefix=share,
        )  # fmt: skip
        prompts = datasets.Dataset.from_dict({"prompt": ["the movie", "a film", "review:", "good"] * 3})
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        trainer = RLOOTrainer(
            config,
            MultiAdapterModel.from_config(config),
            tokenizer,
            prompts,
            reward_funcs=lambda p, c: [0.0] * len(c),
        )
        torch.manual_seed(1)
        rollout = collect_rollout(
            trainer.parts.sampler,
            trainer.parts.scorer,
            trainer.parts.train_prompts[:12],
            2,
            trainer.parts.reward,
        )
        torch.manual_seed(2)
        return trainer.parts.policy_update.shuffled_rows(rollout).tolist()

    grouped = order(True, 4)
    assert order(False, 4) == grouped
    # whole prompt groups stay together (rows r and r + 12 share a prompt: the rollout is k-major)
    assert all(abs(a - b) == 12 for a, b in zip(grouped[::2], grouped[1::2], strict=True))
    # micro-batches that cannot hold whole groups shuffle single rows, with sharing on or off
    assert order(True, 3) == order(False, 3)


# ---------------------------------------------------------------------- the probe decides structure
# Real transformers model classes under new model types, each breaking one thing packing relies on.


class _MaskIgnoringConfig(LlamaConfig):
    model_type = "marl_test_mask_ignoring"


class _MaskIgnoringLlamaModel(LlamaModel):
    """Drops a 4-D attention mask and attends causally over the whole packed sequence."""

    def forward(self, *args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


class _MaskIgnoringForCausalLM(LlamaForCausalLM):
    config_class = _MaskIgnoringConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = _MaskIgnoringLlamaModel(config)
        self.post_init()


class _PositionIgnoringConfig(GPT2Config):
    model_type = "marl_test_position_ignoring"


class _PositionIgnoringGPT2Model(GPT2Model):
    """Ignores explicit position ids and counts positions from the start of each sequence."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


class _PositionIgnoringLMHeadModel(GPT2LMHeadModel):
    config_class = _PositionIgnoringConfig

    def __init__(self, config):
        super().__init__(config)
        self.transformer = _PositionIgnoringGPT2Model(config)
        self.post_init()


@pytest.fixture(scope="module")
def broken_model_dir(tmp_path_factory):
    def save(config: Any, model_class) -> str:
        AutoConfig.register(config.model_type, type(config), exist_ok=True)
        AutoModelForCausalLM.register(type(config), model_class, exist_ok=True)
        directory = tmp_path_factory.mktemp(config.model_type)
        torch.manual_seed(0)
        model_class(config).save_pretrained(directory)
        return str(directory)

    return save


PROBE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", PROBE_DTYPES, ids=str)
def test_the_probe_refuses_a_model_that_ignores_the_4d_mask_in_every_dtype(dtype, broken_model_dir):
    config = _MaskIgnoringConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    model = MultiAdapterModel.from_pretrained(broken_model_dir(config, _MaskIgnoringForCausalLM), dtype=dtype)
    assert model.packing_problem is not None and "packed rows differ" in model.packing_problem


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_the_probe_refuses_a_quantized_bf16_model_that_ignores_the_4d_mask(quantization, broken_model_dir):
    """A quantized base in bf16 is allowed bf16's rounding (its activations are float32, its layers compute
    in bf16: :func:`marl.model.rows.coarser_dtype`); a structural failure is still far above that."""
    config = _MaskIgnoringConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    model = MultiAdapterModel.from_pretrained(
        broken_model_dir(config, _MaskIgnoringForCausalLM), quantization=quantization, dtype=torch.bfloat16
    )
    assert model.packing_problem is not None and "packed rows differ" in model.packing_problem
    assert "torch.bfloat16 explains" in model.packing_problem


@pytest.mark.parametrize("dtype", PROBE_DTYPES, ids=str)
def test_the_probe_refuses_a_model_that_ignores_explicit_positions_in_every_dtype(dtype, broken_model_dir):
    config = _PositionIgnoringConfig(vocab_size=64, n_embd=64, n_inner=128, n_layer=2, n_head=4)
    model = MultiAdapterModel.from_pretrained(
        broken_model_dir(config, _PositionIgnoringLMHeadModel), dtype=dtype
    )
    assert model.packing_problem is not None and "packed rows differ" in model.packing_problem


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_passes_in_half_precision_where_it_passes_in_fp32(family, dtype, family_dir):
    """Rounding in bf16/fp16 does not switch packing off: the probe allows what the dtype's epsilon explains
    (bf16 ~3e-2 relative, fp16 ~4e-3), far below what a structural failure gives (see the two tests above)."""
    model = MultiAdapterModel.from_pretrained(
        family_dir(family), policy_adapter=policy_lora(family), dtype=dtype
    )
    if FAMILY_SPECS[family].model_type == "falcon_h1":
        assert "carry state" in model.packing_problem
    else:
        assert model.packing_problem is None, model.packing_problem
    assert probe_tolerance(dtype) < 0.05


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_the_probe_passes_on_a_quantized_bf16_base(quantization, tiny_llama_dir):
    """A quantized base in bf16 keeps float32 activations where bitsandbytes computes in float32: the probe
    must build the mask the training path builds (boolean for SDPA), not one in the weights' dtype, which SDPA
    refuses (and packing was switched off on every quantized bf16 run)."""
    model = MultiAdapterModel.from_pretrained(
        str(tiny_llama_dir), quantization=quantization, dtype=torch.bfloat16
    )
    assert model.packing_problem is None, model.packing_problem


# ------------------------------------------------------------------ rows routed by adapter

RESPONSE_START = 4
# Rows of two policies and of the base, interleaved, with left padding of two lengths.
ROW_TOKENS = [
    [5, 6, 7, 8, 9, 10, 11],
    [12, 13, 14, 15, 16, 17],
    [5, 6, 7, 8, 9, 10, 11],
    [7, 8, 9, 10, 11, 12, 13],
]
ROW_ADAPTERS = ["first", "second", BASE_VIEW, "second"]


def two_policies(directory, family: str, dtype: torch.dtype = torch.float32, **options) -> MultiAdapterModel:
    model = MultiAdapterModel.from_pretrained(
        directory, policy_name="first", policy_adapter=policy_lora(family), dtype=dtype, **options
    )
    model.add_policy("second", policy_lora(family))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # policies that differ from the base and from each other
        for parameter in model.policy_parameters("first") + model.policy_parameters("second"):
            parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype) * 0.2)
    return model


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return ids, mask


def loss_of(logprobs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A loss whose weight differs per row, so that a gradient sent to the wrong adapter shows."""
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])[rows]
    return (logprobs.float().sum(dim=1) * weights).sum()


def routed_pass(
    model: MultiAdapterModel, ids, mask, stacked: bool = False
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """The rows in one routed pass: PEFT's mixed batch, or (``stacked``) the GPU's stacked LoRA."""
    model.train()
    for policy in ("first", "second"):
        for parameter in model.policy_parameters(policy):
            parameter.grad = None
    with model.routed(ROW_ADAPTERS, stacked=stacked):
        assert stacked == any(hasattr(layer, "_marl_stack") for layer in model.peft_model.modules())
        logprobs = model.token_logprobs(ids, mask, response_start=RESPONSE_START)
        loss_of(logprobs, [0, 1, 2, 3]).backward()
    return logprobs.detach(), gradients(model)


def solo_pass(model: MultiAdapterModel, ids, mask) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Each view's rows alone, in its own view, the gradients of all views summed (as one loss would)."""
    model.train()
    for policy in ("first", "second"):
        for parameter in model.policy_parameters(policy):
            parameter.grad = None
    logprobs = torch.zeros(ids.shape[0], ids.shape[1] - RESPONSE_START)
    for view in dict.fromkeys(ROW_ADAPTERS):
        rows = [index for index, name in enumerate(ROW_ADAPTERS) if name == view]
        with model.view(view):
            view_logprobs = model.token_logprobs(ids[rows], mask[rows], response_start=RESPONSE_START)
            loss = loss_of(view_logprobs, rows)
            if loss.requires_grad:
                loss.backward()
        logprobs[rows] = view_logprobs.detach().float()
    return logprobs, gradients(model)


def gradients(model: MultiAdapterModel) -> dict[str, list[torch.Tensor]]:
    return {
        policy: [parameter.grad.clone() for parameter in model.policy_parameters(policy)]
        for policy in ("first", "second")
    }


def assert_close(routed, solo, tolerance: float) -> None:
    """Log-probs within ``tolerance``; each adapter gradient within ``tolerance`` of its largest entry (a
    gradient sent to the wrong adapter is off by about its own size: the rows' weights differ)."""
    routed_logprobs, routed_grads = routed
    solo_logprobs, solo_grads = solo
    torch.testing.assert_close(routed_logprobs.float(), solo_logprobs, atol=tolerance, rtol=tolerance)
    for policy in ("first", "second"):
        for routed_grad, solo_grad in zip(routed_grads[policy], solo_grads[policy], strict=True):
            scale = solo_grad.abs().max().clamp(min=1e-6)
            assert (routed_grad.float() - solo_grad.float()).abs().max() / scale <= tolerance


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_routed_rows_equal_each_view_alone(family_dir, family, stacked):
    model = two_policies(family_dir(family), family)
    ids, mask = left_padded(ROW_TOKENS)
    routed = routed_pass(model, ids, mask, stacked)
    solo = solo_pass(model, ids, mask)
    assert_close(routed, solo, tolerance=1e-5)
    # The rows of the base and of each policy really differ: the routing is not a no-op.
    assert not torch.allclose(routed[0][0], routed[0][2])
    assert all(grad.abs().sum() > 0 for grad in routed[1]["first"] + routed[1]["second"] if grad.numel())


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_routed_rows_with_gradient_checkpointing(family_dir, family, stacked):
    """The backward pass of a checkpointed layer computes its forward again: still routed."""
    model = two_policies(family_dir(family), family)
    model.enable_gradient_checkpointing()
    ids, mask = left_padded(ROW_TOKENS)
    assert_close(routed_pass(model, ids, mask, stacked), solo_pass(model, ids, mask), tolerance=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
@pytest.mark.parametrize("dtype", [dtype for dtype in DTYPES if dtype != torch.float32])
def test_routed_rows_in_low_precision(family_dir, dtype, stacked):
    """In bf16 the base's products round where they are stored, and the routed pass adds each LoRA delta into
    the batch's rounded output where the solo pass adds it into its own: the two differ by rounding. Log-probs
    stay within the family table's 4 eps; each gradient, measured against the float32 model's, is no further
    from it than twice the solo pass's own bf16 error (or 8 eps of its largest entry)."""
    ids, mask = left_padded(ROW_TOKENS)
    exact = solo_pass(two_policies(family_dir("llama"), "llama"), ids, mask)
    model = two_policies(family_dir("llama"), "llama", dtype=dtype)
    routed, solo = routed_pass(model, ids, mask, stacked), solo_pass(model, ids, mask)
    torch.testing.assert_close(routed[0], solo[0], atol=logprob_tolerance(dtype), rtol=0)
    eps = torch.finfo(dtype).eps
    for policy in ("first", "second"):
        for exact_grad, routed_grad, solo_grad in zip(
            exact[1][policy], routed[1][policy], solo[1][policy], strict=True
        ):
            scale = exact_grad.abs().max()
            routed_error = (routed_grad.float() - exact_grad).abs().max() / scale
            solo_error = (solo_grad.float() - exact_grad).abs().max() / scale
            assert routed_error <= max(2 * solo_error, 8 * eps)


@pytest.mark.parametrize("stacked", [False, True], ids=["peft", "stacked"])
def test_routed_rows_on_a_4bit_base(family_dir, stacked):
    """A 4-bit base (float32 compute, so that only the routing can differ): the routed LoRA layers wrap
    bitsandbytes' layers, and each row still gets its own view's log-probs and gradients."""
    model = two_policies(family_dir("llama"), "llama", quantization="4bit")
    assert any(type(layer).__name__ == "Linear4bit" for layer in model.peft_model.modules())
    ids, mask = left_padded(ROW_TOKENS)
    assert_close(routed_pass(model, ids, mask, stacked), solo_pass(model, ids, mask), tolerance=1e-5)


def test_routing_restores_the_view_and_the_trainable_flags(family_dir):
    model = two_policies(family_dir("llama"), "llama")
    flags = [parameter.requires_grad for parameter in model.peft_model.parameters()]
    active = model.peft_model.active_adapter
    ids, mask = left_padded(ROW_TOKENS)
    with model.base(), model.routed(ROW_ADAPTERS):
        model.token_logprobs(ids, mask, response_start=RESPONSE_START)
    assert [parameter.requires_grad for parameter in model.peft_model.parameters()] == flags
    assert model.peft_model.active_adapter == active
    with model.reference("first"):  # outside the routed context nothing is routed any more
        base = model.token_logprobs(ids, mask, response_start=RESPONSE_START)
    with model.routed([BASE_VIEW] * 4):
        torch.testing.assert_close(model.token_logprobs(ids, mask, response_start=RESPONSE_START), base)


def test_bad_routes_are_refused_with_the_names(family_dir):
    model = two_policies(family_dir("llama"), "llama")
    ids, mask = left_padded(ROW_TOKENS)
    with (
        pytest.raises(ConfigError, match=r"\['third'\].*'first', 'second'"),
        model.routed(["first", "third"]),
    ):
        pass
    with pytest.raises(ConfigError, match="one adapter name per row"), model.routed([]):
        pass
    with pytest.raises(ValueError, match="same as the number of inputs"), model.routed(["first", "second"]):
        model.token_logprobs(ids, mask, response_start=RESPONSE_START)
