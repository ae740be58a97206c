"""Training exactly what was sampled, on every family of ``tests/support/families.py``.

For each family (Llama, Llama-3 style with pad == eos and three terminators, Qwen2 with biases and a
repetition penalty in its generation config, Mistral, GPT-NeoX, Gemma2 soft-capping, Granite
``logits_scaling``, Cohere ``logit_scale``, Phi3/OPT/GPT-2 with dropout, Falcon-H1, Gemma3, OLMo2, StableLM):

- the policy and reference log-probs equal ``log_softmax(forward logits / T)`` of the family's own forward;
- the rollout samples from exactly that distribution, whatever processors its generation config carries
  (checked against ``generate(..., output_scores=True)``), while a plain ``generate`` does not;
- the first micro-batch ratio of every update is 1 with 2 epochs × 2 mini-batches and a loaded adapter whose
  ``lora_dropout`` is 0.05;
- reward adapters are read where a transformers sequence classifier reads them, pad == eos included.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from marl import MultiAdapterModel, RLOOTrainer
from marl.errors import ModelError
from marl.model.sampling import SamplingSettings, eos_token_ids, generate_exactly, pad_token_id
from marl.rollout.collect import collect_rollout
from marl.rollout.completions import response_lengths, response_mask

from support.families import (
    DTYPES,
    FAMILIES,
    FAMILY_SPECS,
    REFUSED_FAMILIES,
    build_family,
    logprob_tolerance,
    position_ids_from_mask,
)
from support.tiny import save_reward_adapter, tiny_rloo_config, train_reward_adapter_with_trl

TEMPERATURE = 0.7
# Ordinary token ids, away from the special tokens (0-6) and the ids the families suppress (300, 301).
# The first row ends by repeating a bigram, so that no_repeat_ngram_size=3 bans a token at the first step.
PROMPT_ROWS = [
    [20, 31, 42, 53, 64, 20, 31],
    [90, 101, 112, 123],
    [130, 141, 152, 163, 174, 185, 196, 207, 218],
]
CLASSIFIER_FAMILIES = [name for name in FAMILIES if FAMILY_SPECS[name].sequence_classification]


def policy_lora(family: str, **overrides) -> LoraConfig:
    exclude = list(FAMILY_SPECS[family].lora_exclude_modules) or None
    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=exclude,
        task_type="CAUSAL_LM",
        **overrides,
    )


def load(family_dir, family: str, **kwargs) -> MultiAdapterModel:
    kwargs.setdefault("policy_adapter", policy_lora(family))
    return MultiAdapterModel.from_pretrained(family_dir(family), **kwargs)


def move_policy(model: MultiAdapterModel, seed: int = 0) -> None:
    """Random LoRA B matrices: a policy that differs from the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.peft_model.named_parameters():
            if "lora_B" in name and ".policy." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return ids, mask


def family_logits(model: MultiAdapterModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The family's own forward under the active view, with positions as ``generate`` derives them."""
    with torch.no_grad():
        return model.peft_model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_policy_and_reference_logprobs_equal_the_family_forward(family, dtype, family_dir):
    model = load(family_dir, family, dtype=dtype)
    move_policy(model)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    ids, mask = left_padded(PROMPT_ROWS, pad_token_id(tokenizer))
    start = 3
    # a target counts where it and the token before it are real (left padding hides the rest)
    valid = (mask[:, start:] * mask[:, start - 1 : -1]).bool()
    differences = {}
    for name, view in (("policy", model.policy), ("reference", model.reference)):
        with view(), torch.no_grad():
            ours = model.token_logprobs(ids, mask, response_start=start, temperature=TEMPERATURE)
            logits = family_logits(model, ids, mask)
        theirs = torch.log_softmax(logits[:, start - 1 : -1].float() / TEMPERATURE, dim=-1)
        theirs = theirs.gather(-1, ids[:, start:, None]).squeeze(-1)
        differences[name] = float((ours - theirs)[valid].abs().max())
    assert max(differences.values()) <= logprob_tolerance(dtype), differences
    # the policy really differs from the reference, so the two comparisons are not the same one
    with model.policy():
        policy = model.token_logprobs(ids, mask, response_start=start)
    with model.reference():
        reference = model.token_logprobs(ids, mask, response_start=start)
    assert (policy - reference)[valid].abs().max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_samples_from_the_distribution_it_scores(family, dtype, family_dir):
    spec = FAMILY_SPECS[family]
    model = load(family_dir, family, dtype=dtype)
    tolerance = logprob_tolerance(dtype)
    move_policy(model)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    stop_ids = eos_token_ids(tokenizer, model.generation_config)
    settings = SamplingSettings(TEMPERATURE, 8, stop_ids, pad_token_id(tokenizer))
    ids, mask = left_padded(PROMPT_ROWS, settings.pad_token_id)
    prompt_length = ids.shape[1]

    torch.manual_seed(0)
    with model.policy(), torch.no_grad():
        output = generate_exactly(
            model.peft_model, ids, mask, settings, output_scores=True, return_dict_in_generate=True
        )
        completions = output.sequences[:, prompt_length:]
        steps = completions.shape[1]
        valid = response_mask(response_lengths(completions, stop_ids), steps)
        full_mask = torch.cat([mask, valid.long()], dim=1)
        scored = model.token_logprobs(
            output.sequences, full_mask, response_start=prompt_length, temperature=TEMPERATURE
        )
        forward = family_logits(model, output.sequences, full_mask)[:, prompt_length - 1 : -1]
    sampled = torch.stack([torch.log_softmax(score.float(), dim=-1) for score in output.scores], dim=1)
    # every step's whole sampling distribution is softmax(forward logits / T) ...
    expected = torch.log_softmax(forward.float() / TEMPERATURE, dim=-1)
    torch.testing.assert_close(sampled[valid], expected[valid], rtol=0, atol=tolerance)
    # ... and the log-probs marl trains on are those of the tokens drawn from it
    drawn = sampled.gather(-1, completions[:, :, None]).squeeze(-1)
    torch.testing.assert_close(scored[valid], drawn[valid], rtol=0, atol=tolerance)
    # the same seed through marl's sampling gives the same completions
    torch.manual_seed(0)
    with model.policy():
        again = model.sample(ids, mask, settings)
    assert torch.equal(again[:, :steps], completions)

    if spec.generation_processors:
        # A plain generate with only the sampling temperature (what marl used to do) still applies the
        # generation config's processors: its distribution is another one.
        torch.manual_seed(0)
        with model.policy(), torch.no_grad():
            plain = model.peft_model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                max_new_tokens=steps,
                output_scores=True,
                return_dict_in_generate=True,
            )
        plain_sampled = torch.log_softmax(plain.scores[0].float(), dim=-1)
        assert not torch.allclose(plain_sampled, expected[:, 0], atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_microbatch_ratio_is_one_with_a_loaded_dropout_adapter(family, family_dir, tmp_path):
    """2 epochs × 2 mini-batches, an adapter saved with lora_dropout=0.05 and a base that may have dropout:
    the update must see the function the rollout scored, so the first ratio of each update is 1."""
    base = AutoModelForCausalLM.from_pretrained(family_dir(family))
    torch.manual_seed(0)
    starting = get_peft_model(base, policy_lora(family, lora_dropout=0.05, init_lora_weights=False))
    starting.save_pretrained(tmp_path / "sft")
    config = tiny_rloo_config(
        tmp_path / "run",
        model_name_or_path=str(family_dir(family)),
        policy_adapter=str(tmp_path / "sft"),
        num_mini_batches=2,
        num_ppo_epochs=2,
        total_episodes=16,
        learning_rate=1e-2,
        temperature=1.0,
        seed=0,
    )
    model = MultiAdapterModel.from_config(config)
    assert model.reference_mode == "initial-policy"
    tokenizer = AutoTokenizer.from_pretrained(family_dir(family))
    prompts = datasets.Dataset.from_dict({"prompt": ["the movie", "a film", "review:", "good"]})
    trainer = RLOOTrainer(
        config, model, tokenizer, prompts, reward_funcs=lambda p, c: [float(len(text)) for text in c]
    )
    history = trainer.train()
    assert len(history) == 2
    for record in history:
        assert abs(record["val/ratio_first"] - 1.0) <= 1e-4
    # the policy moved within each update, so later micro-batches are not trivially 1
    assert any(record["val/ratio_var"] > 0 for record in history)


def scoring_batch(tokenizer, side: str, with_eos: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts of unequal lengths, ending in EOS or not, padded on ``side`` with the tokenizer's pad id."""
    texts = ["a lovely charming film", "dull", "the plot falls apart and the jokes are stale"]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    if with_eos:
        rows = [[*row, tokenizer.eos_token_id] for row in rows]
    pad = pad_token_id(tokenizer)
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[index, span] = torch.tensor(row)
        mask[index, span] = 1
    return ids, mask


def transformers_scores(base_dir, adapter_dir, pad: int, ids, mask) -> torch.Tensor:
    classifier = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=1, dtype=torch.float32
    )
    classifier.config.pad_token_id = pad  # what TRL's RewardTrainer sets
    reference = PeftModel.from_pretrained(classifier, str(adapter_dir)).eval()
    with torch.no_grad():
        return reference(input_ids=ids, attention_mask=mask).logits.squeeze(-1)


@pytest.fixture(scope="module")
def llama3_trl_reward(family_dir, tmp_path_factory):
    """A reward adapter made by TRL's RewardTrainer on the pad == eos family (it pads with the EOS)."""
    return train_reward_adapter_with_trl(family_dir("llama3"), tmp_path_factory.mktemp("llama3-reward"))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("with_eos", [True, False])
def test_trl_reward_adapter_with_pad_equal_to_eos_reads_like_transformers(
    side, with_eos, family_dir, llama3_trl_reward
):
    base_dir = family_dir("llama3")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    model = MultiAdapterModel.from_pretrained(base_dir, reward_adapter=llama3_trl_reward)
    ids, mask = scoring_batch(tokenizer, side, with_eos)
    ours = model.compute_reward_score(ids, mask)
    theirs = transformers_scores(base_dir, llama3_trl_reward, tokenizer.pad_token_id, ids, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    if with_eos:
        # Read AT the final EOS (the last attended token, marl's former rule) the scores are other numbers.
        with model.use_adapter("reward"), torch.no_grad():
            hidden = model._hidden_states(ids, mask)
            last_attended = (mask.shape[1] - 1) - mask.flip(dims=[1]).argmax(dim=1)
            at_eos = model.rewards["reward"].head(hidden[torch.arange(3), last_attended]).squeeze(-1)
        assert (at_eos - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("family", CLASSIFIER_FAMILIES)
def test_reward_adapters_read_like_transformers_on_every_family(family, family_dir, tmp_path):
    base_dir = family_dir(family)
    adapter = save_reward_adapter(base_dir, tmp_path / "reward")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = load(family_dir, family, reward_adapter=adapter)
    ids, mask = scoring_batch(tokenizer, "right", with_eos=True)
    theirs = transformers_scores(base_dir, adapter, pad_token_id(tokenizer), ids, mask)
    torch.testing.assert_close(model.compute_reward_score(ids, mask), theirs, rtol=0, atol=1e-5)


def test_several_terminators_all_stop_the_rollout(family_dir, tmp_path):
    """Llama-3 style: generation_config.eos_token_id lists three ids; each ends a completion, counts as the
    stop token and as an EOS."""
    tokenizer = AutoTokenizer.from_pretrained(family_dir("llama3"))
    config = tiny_rloo_config(
        tmp_path / "run",
        model_name_or_path=str(family_dir("llama3")),
        per_device_train_batch_size=16,
        total_episodes=16,
        response_length=64,
        temperature=3.0,
        stop_token="eos",
    )
    model = MultiAdapterModel.from_config(config)
    move_policy(model)
    words = ["the movie", "a film", "review:", "good", "bad", "the plot", "write a", "an honest"]
    prompts = datasets.Dataset.from_dict({"prompt": words})
    trainer = RLOOTrainer(config, model, tokenizer, prompts, reward_funcs=lambda p, c: [0.0] * len(c))
    terminators = set(FAMILY_SPECS["llama3"].terminators)
    terminator_ids = set(tokenizer.convert_tokens_to_ids(sorted(terminators)))
    assert set(trainer.parts.sampler.sampling.stop_token_ids) == terminator_ids and len(terminator_ids) == 3
    torch.manual_seed(0)
    rollout = collect_rollout(
        trainer.parts.sampler, trainer.parts.scorer, trainer.parts.train_prompts, 2, trainer.parts.reward
    )
    ended_by = set()
    for row, valid, stopped in zip(
        rollout.response_ids, rollout.response_mask, rollout.contains_stop, strict=True
    ):
        length = int(valid.sum())
        is_stop = [int(token) in terminator_ids for token in row[:length]]
        assert not any(is_stop[:-1])  # no terminator before the end of the valid tokens
        assert stopped == is_stop[-1]
        if stopped:
            ended_by.add(int(row[length - 1]))
    assert len(ended_by) >= 2, "the test needs completions ended by different terminators"
    assert torch.equal(rollout.contains_eos, rollout.contains_stop)


# ---------------------------------------------------------------------- families marl refuses
# Real transformers model classes registered under new model types: each differs from Llama in one way that
# marl must notice at load time, instead of training on another distribution than the one it samples.


class _ScaledHeadConfig(LlamaConfig):
    model_type = "marl_test_scaled_head"


class _ScaledHeadForCausalLM(LlamaForCausalLM):
    """Multiplies its logits by 3 inside forward, a transform marl's head does not know."""

    config_class = _ScaledHeadConfig

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 3.0
        return output


class _NoisyConfig(LlamaConfig):
    model_type = "marl_test_noisy"


class _NoisyForCausalLM(LlamaForCausalLM):
    """Adds noise to its logits in train mode only, like router jitter: not a dropout marl can switch off."""

    config_class = _NoisyConfig

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        if self.training:
            output.logits = output.logits + 0.1 * torch.randn_like(output.logits)
        return output


class _ForcedPenaltyConfig(LlamaConfig):
    model_type = "marl_test_forced_penalty"


class _ForcedPenaltyForCausalLM(LlamaForCausalLM):
    """Always adds a repetition penalty to generation, whatever the generation config says."""

    config_class = _ForcedPenaltyConfig

    def _get_logits_processor(self, *args, **kwargs):
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

        processors = super()._get_logits_processor(*args, **kwargs)
        processors.append(RepetitionPenaltyLogitsProcessor(1.3))
        return processors


@pytest.fixture(scope="module")
def unusual_model_dir(tmp_path_factory):
    def save(config_class, model_class) -> str:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        directory = tmp_path_factory.mktemp(config_class.model_type)
        config = config_class(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
        )
        torch.manual_seed(0)
        model_class(config).save_pretrained(directory)
        return str(directory)

    return save


def test_a_family_whose_forward_transforms_logits_unknown_to_marl_is_refused(unusual_model_dir):
    directory = unusual_model_dir(_ScaledHeadConfig, _ScaledHeadForCausalLM)
    with pytest.raises(ModelError, match="computes its logits in a way marl does not reproduce"):
        MultiAdapterModel.from_pretrained(directory)


def test_a_model_that_computes_differently_in_train_mode_is_refused(unusual_model_dir):
    directory = unusual_model_dir(_NoisyConfig, _NoisyForCausalLM)
    with pytest.raises(ModelError, match="differently in train mode than in eval mode"):
        MultiAdapterModel.from_pretrained(directory)


def test_sampling_refuses_a_processor_the_logprobs_cannot_reproduce(unusual_model_dir):
    model = MultiAdapterModel.from_pretrained(
        unusual_model_dir(_ForcedPenaltyConfig, _ForcedPenaltyForCausalLM)
    )
    ids, mask = left_padded([[5, 6, 7], [8, 9]], 0)
    with (
        model.policy(),
        pytest.raises(ModelError, match=r"generate would apply \['RepetitionPenaltyLogitsProcessor'\]"),
    ):
        model.sample(ids, mask, SamplingSettings(0.7, 4, (), pad_token_id=0))


def test_dropout_is_off_after_loading_and_the_model_config_says_so(family_dir):
    """Phi3, OPT and GPT-2 configure dropout; after loading, train-mode forwards are deterministic."""
    for family in ("phi3", "opt", "gpt2"):
        assert FAMILY_SPECS[family].has_dropout
        model = load(family_dir, family)
        base = model.peft_model.get_base_model()
        ids = torch.tensor([PROMPT_ROWS[2]])
        model.train()
        try:
            with torch.no_grad():
                first, second = base(input_ids=ids).logits, base(input_ids=ids).logits
        finally:
            model.eval()
        assert torch.equal(first, second), family


# ---------------------------------------------------------------------- rotary scalings


@pytest.mark.parametrize("family", REFUSED_FAMILIES)
def test_batch_dependent_rotary_scalings_are_refused_at_load_naming_the_fix(family, family_dir):
    with pytest.raises(ModelError, match=FAMILY_SPECS[family].refused_at_load) as refused:
        load(family_dir, family)
    assert "config.json" in str(refused.value) and "'linear', 'yarn' or 'llama3'" in str(refused.value)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        dict(rope_type="linear", factor=2.0),
        dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=128),
        dict(
            rope_type="llama3",
            factor=2.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        ),
    ],
    ids=lambda scaling: scaling["rope_type"],
)
def test_static_rotary_scalings_load_and_pack(rope_scaling, tmp_path, monkeypatch):
    """Static scalings fix their frequencies at init: marl loads them and packs their prompts."""
    from support import families

    spec = families.FamilySpec(
        name="llama_static_rope",
        model_type="llama",
        config=dict(num_key_value_heads=2, rope_scaling=rope_scaling),
    )
    monkeypatch.setitem(families.FAMILY_SPECS, spec.name, spec)
    model = MultiAdapterModel.from_pretrained(build_family(spec.name, tmp_path / "model"))
    assert model.config.rope_parameters["rope_type"] == rope_scaling["rope_type"]
    assert model.packing_problem is None
