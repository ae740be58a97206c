"""Self-tests of the tiny-family table in ``tests/support/families.py``.

Every quirk a :class:`support.families.FamilySpec` states is checked against the saved model as loaded by
``from_pretrained``, both ways: a family that claims a quirk must show it (so the fixture can never go
neutral without a failing test), and a family that does not claim it must not show it.
"""

from __future__ import annotations

import pytest
import torch

from support.families import (
    BAD_WORD_TOKEN_ID,
    FAMILIES,
    FAMILY_SPECS,
    NEUTRAL_SAMPLING,
    REFUSED_FAMILIES,
    SUPPRESSED_TOKEN_ID,
    build_family,
    position_ids_from_mask,
    terminator_ids,
)

# Ordinary byte-level tokens in every family's vocabulary. The repeated bigram (20, 21) makes
# ``no_repeat_ngram_size=3`` ban token 22 at the first generated step; repetition penalties touch all of them.
PROMPT_IDS = [20, 21, 22, 20, 21]


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    """``family_dir(name) -> Path`` of the saved family, built once per session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_family(name, tmp_path_factory.mktemp(f"family-{name}"))
        return cache[name]

    return get


def load_causal_lm(directory, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)


def load_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def left_padded_batch(tokenizer):
    batch = tokenizer(
        ["the movie was great and fun to watch, well told", "a dull film"],
        return_tensors="pt",
        padding=True,
        padding_side="left",
    )
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum(), "row 1 must be padded"
    return batch["input_ids"], batch["attention_mask"]


def test_table_lists_the_required_families():
    required = {"llama", "llama3", "qwen2", "mistral", "gpt_neox", "gemma2", "granite", "cohere", "phi3"}
    required |= {"opt", "gpt2"}
    assert required <= set(FAMILIES)
    assert tuple(FAMILY_SPECS) == FAMILIES + REFUSED_FAMILIES
    assert all(FAMILY_SPECS[name].name == name for name in FAMILIES)
    for spec in FAMILY_SPECS.values():
        assert (spec.logit_transform is None) == (spec.logit_transform_value is None), spec.name
        assert spec.terminators[0] == "<eos>", spec.name


@pytest.mark.parametrize("name", FAMILIES)
def test_build_is_seeded_and_saved_for_from_pretrained(name, tmp_path, family_dir):
    from transformers import GenerationConfig

    spec = FAMILY_SPECS[name]
    directory = family_dir(name)
    for file in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (directory / file).is_file(), file

    model = load_causal_lm(directory)
    tokenizer = load_tokenizer(directory)
    assert model.config.model_type == spec.model_type
    assert model.config.vocab_size == len(tokenizer) <= 512
    assert not model.config.tie_word_embeddings
    for key, value in spec.config.items():
        assert getattr(model.config, key) == value, key

    # Token ids agree across config, generation config and tokenizer.
    ids = terminator_ids(tokenizer, spec)
    eos = ids if len(ids) > 1 else ids[0]
    generation = GenerationConfig.from_pretrained(directory)
    for holder in (model.config, generation):
        assert holder.eos_token_id == eos
        assert holder.pad_token_id == tokenizer.pad_token_id
        assert holder.bos_token_id == tokenizer.bos_token_id
    assert tokenizer.eos_token_id == ids[0]

    same = load_causal_lm(build_family(name, tmp_path / "same", seed=0)).state_dict()
    other = load_causal_lm(build_family(name, tmp_path / "other", seed=1)).state_dict()
    reference = model.state_dict()
    assert all(torch.equal(reference[key], same[key]) for key in reference)
    assert any(not torch.equal(reference[key], other[key]) for key in reference)


@pytest.mark.parametrize("name", FAMILIES)
def test_logit_transform_is_active_exactly_where_stated(name, family_dir):
    spec = FAMILY_SPECS[name]
    model = load_causal_lm(family_dir(name)).eval()
    input_ids, attention_mask = left_padded_batch(load_tokenizer(family_dir(name)))
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        raw = model.get_output_embeddings()(out.hidden_states[-1])
    real = attention_mask.bool()
    logits, raw = out.logits[real], raw[real]
    if spec.logit_transform is None:
        torch.testing.assert_close(logits, raw, rtol=0, atol=1e-6)
    else:
        assert (logits - raw).abs().max() > 1e-3, "the logit transform is too weak to tell apart"
        torch.testing.assert_close(logits, spec.apply_logit_transform(raw), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_dropout_is_active_in_train_mode_exactly_where_stated(name, family_dir):
    spec = FAMILY_SPECS[name]
    model = load_causal_lm(family_dir(name))
    input_ids, attention_mask = left_padded_batch(load_tokenizer(family_dir(name)))
    real = attention_mask.bool()

    def forward():
        with torch.no_grad():
            return model(input_ids, attention_mask=attention_mask).logits[real]

    model.eval()
    torch.testing.assert_close(forward(), forward(), rtol=0, atol=0)
    model.train()
    torch.manual_seed(0)
    first, second = forward(), forward()
    if spec.has_dropout:
        assert (first - second).abs().max() > 1e-3
    else:
        torch.testing.assert_close(first, second, rtol=0, atol=1e-6)


def _differs(processed: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether two log-probability rows differ: in which entries are -inf, or on the finite ones."""
    finite = processed.isfinite()
    if not torch.equal(finite, reference.isfinite()):
        return True
    return bool((processed[finite] - reference[finite]).abs().max() > 1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_generation_config_processors_leak_into_generate(name, family_dir):
    """Given only ``temperature``, ``generate`` samples from scores the generation config processed."""
    spec = FAMILY_SPECS[name]
    model = load_causal_lm(family_dir(name)).eval()
    for key, value in {**NEUTRAL_SAMPLING, **spec.generation_processors}.items():
        assert getattr(model.generation_config, key) == value, key

    temperature = 0.9
    prompt = torch.tensor([PROMPT_IDS])
    torch.manual_seed(0)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        temperature=temperature,
        max_new_tokens=4,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequence = out.sequences
    with torch.no_grad():
        logits = model(sequence, attention_mask=torch.ones_like(sequence)).logits[0]
    steps = []
    for step, scores in enumerate(out.scores):
        processed = torch.log_softmax(scores[0], dim=-1)
        reference = torch.log_softmax(logits[len(PROMPT_IDS) - 1 + step] / temperature, dim=-1)
        steps.append(_differs(processed, reference))
    if spec.generation_processors:
        assert any(steps), "the generation config's processors changed no step's scores"
    else:
        assert not any(steps), "a neutral generation config changed the sampling distribution"

    processed = torch.log_softmax(out.scores[0][0], dim=-1)
    if SUPPRESSED_TOKEN_ID in spec.generation_processors.get("suppress_tokens", []):
        assert processed[SUPPRESSED_TOKEN_ID] == -torch.inf
    if [BAD_WORD_TOKEN_ID] in spec.generation_processors.get("bad_words_ids", []):
        assert processed[BAD_WORD_TOKEN_ID] == -torch.inf
    if spec.generation_processors.get("no_repeat_ngram_size") == 3:
        assert processed[PROMPT_IDS[2]] == -torch.inf
    if spec.generation_processors.get("min_new_tokens", 0) > 0:
        assert processed[terminator_ids(load_tokenizer(family_dir(name)), spec)[0]] == -torch.inf


def test_unset_top_k_falls_back_to_the_global_default_of_50(family_dir):
    """Why every family states top_k=0: a generation config without top_k samples from the top 50 only."""
    model = load_causal_lm(family_dir("llama")).eval()
    model.generation_config.top_k = None
    prompt = torch.tensor([PROMPT_IDS])
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        temperature=1.0,
        max_new_tokens=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert model.config.vocab_size > 50
    assert all(int(scores.isfinite().sum()) == 50 for scores in out.scores)


@pytest.mark.parametrize("name", FAMILIES)
def test_pad_eos_and_terminators(name, family_dir):
    spec = FAMILY_SPECS[name]
    directory = family_dir(name)
    model = load_causal_lm(directory).eval()
    tokenizer = load_tokenizer(directory)
    ids = terminator_ids(tokenizer, spec)
    assert len(set(ids)) == len(ids) and tokenizer.unk_token_id not in ids
    for token, token_id in zip(spec.terminators, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]

    if spec.pad_is_eos:
        assert tokenizer.pad_token_id == tokenizer.eos_token_id
        assert "<pad>" not in tokenizer.get_vocab()
        assert model.generation_config.pad_token_id == tokenizer.eos_token_id
    else:
        assert tokenizer.pad_token_id != tokenizer.eos_token_id
    if len(spec.terminators) > 1:
        assert model.generation_config.eos_token_id == ids
    else:
        assert model.generation_config.eos_token_id == ids[0]

    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.rstrip("\n").endswith(spec.turn_end)

    # Each terminator ends generation; an ordinary token does not.
    prompt = torch.tensor([[30, 31]])

    def generate_with_bias(token_id):
        torch.manual_seed(0)
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            max_new_tokens=3,
            min_new_tokens=0,
            sequence_bias={(token_id,): 1e4},
        )[0, prompt.shape[1] :].tolist()

    for token_id in ids:
        assert generate_with_bias(token_id) == [token_id]
    assert generate_with_bias(PROMPT_IDS[0]) == [PROMPT_IDS[0]] * 3


@pytest.mark.parametrize("name", FAMILIES)
def test_left_padding_needs_position_ids_exactly_where_stated(name, family_dir):
    """``generate`` derives positions from the mask; a plain left-padded forward does not always agree."""
    spec = FAMILY_SPECS[name]
    model = load_causal_lm(family_dir(name)).eval()
    input_ids, attention_mask = left_padded_batch(load_tokenizer(family_dir(name)))
    row = 1
    real_ids = input_ids[row, attention_mask[row].bool()].unsqueeze(0)
    n = real_ids.shape[1]
    positions = position_ids_from_mask(attention_mask)
    with torch.no_grad():
        unpadded = model(real_ids).logits[0]
        without = model(input_ids, attention_mask=attention_mask).logits[row, -n:]
        with_positions = model(input_ids, attention_mask=attention_mask, position_ids=positions).logits[
            row, -n:
        ]
    torch.testing.assert_close(with_positions, unpadded, rtol=0, atol=1e-5)
    if spec.needs_position_ids:
        assert (without - unpadded).abs().max() > 1e-3
    else:
        torch.testing.assert_close(without, unpadded, rtol=0, atol=1e-5)

    # The first step of generate scores the prompt as the forward with mask-derived positions does.
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=1,
        min_new_tokens=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        forward = model(input_ids, attention_mask=attention_mask, position_ids=positions).logits[:, -1]
    torch.testing.assert_close(out.logits[0], forward, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_sequence_classification_head_on_the_same_base(name, family_dir):
    from transformers import AutoModelForSequenceClassification

    spec = FAMILY_SPECS[name]
    directory = family_dir(name)
    if not spec.sequence_classification:
        with pytest.raises(ValueError, match="Unrecognized configuration class"):
            AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1)
        return
    tokenizer = load_tokenizer(directory)
    model = AutoModelForSequenceClassification.from_pretrained(
        directory, num_labels=1, dtype=torch.float32
    ).eval()
    # The score is pooled at the last token that is not ``config.pad_token_id``, whatever the attention mask.
    assert model.config.pad_token_id == tokenizer.pad_token_id
    input_ids, attention_mask = left_padded_batch(tokenizer)
    with torch.no_grad():
        scores = model(input_ids, attention_mask=attention_mask).logits
        assert scores.shape == (2, 1)
        text = input_ids[:1]
        with_eos = torch.cat([text, torch.tensor([[tokenizer.eos_token_id]])], dim=1)
        plain, ended = model(text).logits, model(with_eos).logits
    if spec.pad_is_eos:
        # pad == eos: a trailing eos counts as padding, so the score comes from the token before it.
        torch.testing.assert_close(ended, plain, rtol=0, atol=1e-6)
    else:
        assert (ended - plain).abs().max() > 1e-6


@pytest.mark.parametrize("name", FAMILIES)
def test_all_linear_lora_forward_and_backward(name, family_dir):
    from peft import LoraConfig, get_peft_model

    spec = FAMILY_SPECS[name]
    model = load_causal_lm(family_dir(name))
    if spec.lora_exclude_modules:
        with pytest.raises(ValueError, match="incompatible"):
            get_peft_model(model, LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM"))
        model = load_causal_lm(family_dir(name))
    torch.manual_seed(0)
    config = LoraConfig(
        target_modules="all-linear",
        exclude_modules=list(spec.lora_exclude_modules) or None,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    input_ids, attention_mask = left_padded_batch(load_tokenizer(family_dir(name)))
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    loss = peft_model(input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    trainable = {key: p for key, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in key for key in trainable)
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0 for key, p in trainable.items() if "lora_B" in key
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_4bit_cpu_load_and_forward_exactly_where_stated(name, family_dir):
    from transformers import BitsAndBytesConfig

    spec = FAMILY_SPECS[name]
    if not spec.quantizable_4bit:
        pytest.skip(f"{name} is not marked quantizable_4bit")
    import bitsandbytes as bnb

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = load_causal_lm(family_dir(name), quantization_config=quantization, device_map="cpu").eval()
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized
    assert all(m.in_features % 64 == 0 and m.out_features % 32 == 0 for m in quantized)
    input_ids, attention_mask = left_padded_batch(load_tokenizer(family_dir(name)))
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    assert logits.shape[-1] == model.config.vocab_size and logits.isfinite().all()


@pytest.mark.parametrize("name", REFUSED_FAMILIES)
def test_rotary_frequencies_follow_the_batch_exactly_where_stated(name, family_dir):
    """The refused rotary scalings really are batch-dependent in transformers: a short row's logits change
    when a row longer than the scaling's threshold (32 positions) shares its forward pass."""
    spec = FAMILY_SPECS[name]
    assert "rope_type=" in spec.refused_at_load
    model = load_causal_lm(family_dir(name)).eval()
    short = torch.arange(10, 20)[None]
    long = torch.arange(10, 58)[None]  # 48 positions, past the threshold
    padded = torch.cat([torch.zeros(1, long.shape[1] - short.shape[1], dtype=torch.long), short], dim=1)
    batch = torch.cat([padded, long])
    mask = torch.ones_like(batch)
    mask[0, : long.shape[1] - short.shape[1]] = 0
    with torch.no_grad():
        alone = model(input_ids=short).logits[0]
        together = model(input_ids=batch, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        beside_a_long_row = together.logits[0, -short.shape[1] :]
        alone_again = model(input_ids=short).logits[0]
    assert (beside_a_long_row - alone).abs().max() > 1e-4  # fp32 rounding: ~1e-6
    torch.testing.assert_close(alone_again, alone, rtol=0, atol=1e-6)
