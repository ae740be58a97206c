"""A table of tiny model families whose behaviour differs in ways the library must handle.

Each family is a 2-layer random model of a real transformers architecture, built from a config with a fixed
seed and saved with ``save_pretrained`` (model, tokenizer, ``generation_config.json``), so tests load it
through the real ``from_pretrained`` path. What makes a family different from the plain ``llama`` control is
stated as data in its :class:`FamilySpec`, so tests can parametrize on the table and assert per-family
expectations; ``tests/model/test_families_fixture.py`` proves every stated quirk is really active.

Sizes: hidden 64, MLP 128, 4 heads (2 key/value heads where the family has grouped-query attention), 2 layers.
The 4-bit CPU path of bitsandbytes needs every quantized Linear's input features to be a multiple of 64 and,
on CPUs with AVX512-BF16 (where it repacks weights for inference), its output features a multiple of 32.

Usage::

    from support.families import FAMILIES, FAMILY_SPECS, build_family

    @pytest.mark.parametrize("family", FAMILIES)
    def test_something(family, tmp_path):
        model_dir = build_family(family, tmp_path / family)
        spec = FAMILY_SPECS[family]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

PAD, EOS, UNK, BOS = "<pad>", "<eos>", "<unk>", "<bos>"
EOT, EOM = "<|eot_id|>", "<|eom_id|>"

# Ordinary (non-special) token ids that generation configs suppress or ban; the same ids in every family.
SUPPRESSED_TOKEN_ID = 300
BAD_WORD_TOKEN_ID = 301

# Written to every family's generation config before its own ``generation_processors``. ``generate`` fills a
# field the generation config leaves unset from transformers' global defaults, and those include top_k=50
# (``GenerationConfig._get_default_generation_params``): a config that never mentions top_k still truncates
# sampling to 50 tokens. Every family therefore states top_k=0, so that its ``generation_processors`` are the
# only non-neutral ones; saving top_k requires do_sample=True (``GenerationConfig.validate`` refuses
# sampling flags on a greedy config).
NEUTRAL_SAMPLING = {"do_sample": True, "top_k": 0}

_TRAINING_TEXT = [
    "the movie was great and fun to watch",
    "a dull boring film with terrible acting",
    "good good great wonderful lovely charming",
    "awful bad worse worst dreadful mess",
    "an honest story, well told and moving",
    "the plot falls apart and the jokes are stale",
    "review of the film: a small delight",
    "write a short review of this movie",
]

_COMMON_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class FamilySpec:
    """What one tiny family is and how it differs from the plain ``llama`` control.

    ``config`` holds the family's exact config values on top of the shared sizes and token ids
    (``_COMMON_SIZES``); for families whose config names sizes differently (gpt2, opt) it holds all sizes.
    Mapping fields are read-only views, so no test can change the table for the tests after it.
    """

    name: str
    model_type: str
    config: Mapping[str, Any] = field(default_factory=dict)
    # Dropout is active in ``model.train()``: two forwards on the same input differ.
    has_dropout: bool = False
    # ``logits = transform(lm_head(final_hidden))``: None, "softcap" (cap * tanh(x / cap)),
    # "divide" (x / value) or "multiply" (x * value); see :meth:`apply_logit_transform`.
    logit_transform: str | None = None
    logit_transform_value: float | None = None
    # The tokenizer has no pad token of its own: pad is eos (config, generation config and tokenizer).
    pad_is_eos: bool = False
    # Tokens that end generation, in the order of ``generation_config.eos_token_id``; the first is the eos.
    terminators: tuple[str, ...] = (EOS,)
    # Non-neutral logits processors/warpers written to ``generation_config.json``; ``generate`` applies them
    # unless the caller overrides each one.
    generation_processors: Mapping[str, Any] = field(default_factory=dict)
    # Loads in bitsandbytes 4-bit (nf4) on CPU and runs a forward.
    quantizable_4bit: bool = True
    # Modules that ``LoraConfig(target_modules="all-linear")`` selects but PEFT refuses for this family
    # (``get_peft_model`` raises ValueError); pass them as ``exclude_modules``.
    lora_exclude_modules: tuple[str, ...] = ()
    # ``AutoModelForSequenceClassification`` has a class for this family (a reward head on the same base).
    sequence_classification: bool = True
    # A left-padded forward without ``position_ids`` gives other logits for the real tokens than the
    # unpadded forward; callers must pass ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)``.
    needs_position_ids: bool = False
    # The chat template closes each turn with this token.
    turn_end: str = EOS
    # marl refuses the family at load with an error matching this pattern (it cannot train it exactly); the
    # family is in REFUSED_FAMILIES, not in FAMILIES.
    refused_at_load: str | None = None
    # The chat template's layout, a key of ``CHAT_TEMPLATES``: "plain" (``<|role|>content`` + turn end),
    # "chatml" (Qwen, SmolLM) or "llama3" (Llama-3.x-Instruct: header tokens, trimmed content, BOS first).
    chat_template: str = "plain"
    notes: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "generation_processors", MappingProxyType(dict(self.generation_processors)))

    @property
    def extra_special_tokens(self) -> tuple[str, ...]:
        """Terminators other than the eos, and the chat template's own tokens: added to the tokenizer as
        single special tokens."""
        template_tokens = CHAT_TEMPLATES[self.chat_template][0]
        terminators = tuple(token for token in self.terminators if token != EOS)
        return terminators + tuple(token for token in template_tokens if token not in terminators)

    def apply_logit_transform(self, raw_logits: torch.Tensor) -> torch.Tensor:
        """The documented transform of ``lm_head(final_hidden)`` into the logits ``forward`` returns."""
        if self.logit_transform is None:
            return raw_logits
        value = self.logit_transform_value
        if self.logit_transform == "softcap":
            return value * torch.tanh(raw_logits / value)
        if self.logit_transform == "divide":
            return raw_logits / value
        if self.logit_transform == "multiply":
            return raw_logits * value
        raise ValueError(f"unknown logit transform {self.logit_transform!r}")


# Chat template layouts: (their special tokens, the template with ``{turn_end}`` where a turn closes).
CHAT_TEMPLATES: dict[str, tuple[tuple[str, ...], str]] = {
    "plain": (
        (),
        "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{turn_end}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    ),
    "chatml": (
        ("<|im_start|>", "<|im_end|>"),
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{turn_end}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    "llama3": (
        ("<|start_header_id|>", "<|end_header_id|>"),
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
        "<|end_header_id|>\n\n{{ message['content'] | trim }}{turn_end}{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
}

_SPECS = (
    FamilySpec(
        name="llama",
        model_type="llama",
        config=dict(num_key_value_heads=2),
        notes="control: pad != eos, one terminator, neutral generation config, no dropout, raw logits",
    ),
    FamilySpec(
        name="llama3",
        model_type="llama",
        config=dict(num_key_value_heads=2),
        pad_is_eos=True,
        terminators=(EOS, EOT, EOM),
        turn_end=EOT,
        chat_template="llama3",
        notes="Llama-3.x-Instruct style: no pad token (pad = eos), three terminators, turns end <|eot_id|>, "
        "Llama-3 chat template",
    ),
    FamilySpec(
        name="qwen2",
        model_type="qwen2",
        config=dict(num_key_value_heads=2),
        turn_end="<|im_end|>",
        chat_template="chatml",
        generation_processors=dict(
            repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20, do_sample=True
        ),
        notes="q/k/v projections have biases; Qwen2.5-Instruct sampling defaults in the generation config; "
        "ChatML chat template",
    ),
    FamilySpec(
        name="mistral",
        model_type="mistral",
        config=dict(num_key_value_heads=2),
        generation_processors=dict(min_p=0.05, no_repeat_ngram_size=3),
    ),
    FamilySpec(
        name="gpt_neox",
        model_type="gpt_neox",
        generation_processors=dict(typical_p=0.9, suppress_tokens=[SUPPRESSED_TOKEN_ID], min_new_tokens=2),
        notes="fused qkv with biases, partial rotary (rotary_pct 0.25), parallel residual",
    ),
    FamilySpec(
        name="gemma2",
        model_type="gemma2",
        config=dict(
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=1.0
        ),
        logit_transform="softcap",
        logit_transform_value=1.0,
        generation_processors=dict(bad_words_ids=[[BAD_WORD_TOKEN_ID]]),
        notes="embeddings scaled by sqrt(hidden); eager attention (soft-capped attention scores)",
    ),
    FamilySpec(
        name="granite",
        model_type="granite",
        config=dict(num_key_value_heads=2, logits_scaling=4.0),
        logit_transform="divide",
        logit_transform_value=4.0,
        sequence_classification=False,
    ),
    FamilySpec(
        name="cohere",
        model_type="cohere",
        config=dict(num_key_value_heads=2, logit_scale=0.0625),
        logit_transform="multiply",
        logit_transform_value=0.0625,
        sequence_classification=False,
        notes="LayerNorm without bias, parallel attention/MLP block, interleaved rotary",
    ),
    FamilySpec(
        name="phi3",
        model_type="phi3",
        config=dict(num_key_value_heads=2, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1),
        has_dropout=True,
        notes="fused qkv_proj and gate_up_proj; the model never reads embd_pdrop",
    ),
    FamilySpec(
        name="opt",
        model_type="opt",
        config=dict(
            hidden_size=64,
            ffn_dim=128,
            word_embed_proj_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            dropout=0.1,
            attention_dropout=0.1,
            tie_word_embeddings=False,
        ),
        has_dropout=True,
        notes="functional dropout with a float self.dropout (no nn.Dropout module); learned positions "
        "(offset 2) computed from the attention mask",
    ),
    FamilySpec(
        name="gpt2",
        model_type="gpt2",
        config=dict(
            n_embd=64,
            n_inner=128,
            n_layer=2,
            n_head=4,
            n_positions=256,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            tie_word_embeddings=False,
        ),
        has_dropout=True,
        needs_position_ids=True,
        notes="Conv1D layers (weights stored transposed); learned absolute positions default to arange",
    ),
    FamilySpec(
        name="falcon_h1",
        model_type="falcon_h1",
        # Mamba in_proj outputs 2 * d_ssm + 2 * d_state + n_heads = 160 features, a multiple of 32.
        config=dict(
            num_key_value_heads=2,
            lm_head_multiplier=0.25,
            mamba_d_ssm=64,
            mamba_n_heads=8,
            mamba_d_head=8,
            mamba_d_state=12,
            mamba_chunk_size=16,
        ),
        logit_transform="multiply",
        logit_transform_value=0.25,
        sequence_classification=False,
        lora_exclude_modules=("out_proj",),
        notes="hybrid attention + Mamba2 in every layer (reference PyTorch scan on CPU); PEFT refuses LoRA "
        "on the Mamba out_proj, which target_modules='all-linear' selects",
    ),
    FamilySpec(
        name="gemma3_text",
        model_type="gemma3_text",
        config=dict(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            final_logit_softcapping=1.0,
            sliding_window=16,
        ),
        logit_transform="softcap",
        logit_transform_value=1.0,
    ),
    FamilySpec(
        name="olmo2",
        model_type="olmo2",
        config=dict(num_key_value_heads=2),
        notes="norm after attention/MLP, q/k RMSNorm over all heads",
    ),
    FamilySpec(
        name="stablelm",
        model_type="stablelm",
        config=dict(num_key_value_heads=2, use_qkv_bias=True),
        notes="LayerNorm with bias, q/k/v biases, partial rotary (factor 0.25)",
    ),
    FamilySpec(
        name="llama_dynamic_rope",
        model_type="llama",
        # positions past max_position_embeddings (32) raise the rotary base
        config=dict(
            num_key_value_heads=2,
            max_position_embeddings=32,
            rope_scaling=dict(rope_type="dynamic", factor=4.0),
        ),
        refused_at_load="rope_type='dynamic'",
        notes="dynamic NTK rotary scaling: frequencies follow the longest position of each forward pass",
    ),
    FamilySpec(
        name="phi3_longrope",
        model_type="phi3",
        # head_dim 16: 8 rotary frequencies; long factors once a position passes 32
        config=dict(
            num_key_value_heads=2,
            original_max_position_embeddings=32,
            rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8),
        ),
        refused_at_load="rope_type='longrope'",
        notes="Phi-3.5 style longrope: a whole batch switches to the long factors when one row is long",
    ),
)

FAMILY_SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in _SPECS}
# The families marl trains, and those it refuses at load (each with the reason in ``refused_at_load``).
FAMILIES: tuple[str, ...] = tuple(name for name, spec in FAMILY_SPECS.items() if spec.refused_at_load is None)
REFUSED_FAMILIES: tuple[str, ...] = tuple(name for name in FAMILY_SPECS if name not in FAMILIES)


# The exactness tests run in the dtype the CPU tests use and in the one CUDA users train in.
DTYPES = (torch.float32, torch.bfloat16)


def logprob_tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance on log-probs when two paths compute the same function in ``dtype``.

    In float32 only the order of accumulation differs: 1e-5 (observed up to 1.4e-6 on the table). In a
    16-bit dtype the hidden states and logits are stored rounded (8 significant bits in bf16), and paths that
    round at different places (the whole forward vs the LM head on chunks of positions, ``generate``'s cached
    steps vs one forward, a packed vs an unshared sequence) differ by about eps times the logits' scale:
    4 eps, i.e. 3.1e-2 in bf16 (observed up to 9.5e-3 = 1.2 eps on the table). A wrong distribution (a
    processor left in, another temperature, another position) moves log-probs by 1e-1 or more.

    Example:
        >>> logprob_tolerance(torch.float32), logprob_tolerance(torch.bfloat16)
        (1e-05, 0.03125)
    """
    return 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


def build_family_tokenizer(
    extra_special_tokens: tuple[str, ...] = (),
    pad_is_eos: bool = False,
    turn_end: str = EOS,
    with_bos: bool = True,
    chat_template: str = "plain",
):
    """A byte-level BPE tokenizer trained in milliseconds, wrapped as a transformers fast tokenizer.

    ``extra_special_tokens`` become single special tokens (extra terminators); with ``pad_is_eos`` the
    vocabulary has no pad token at all and ``pad_token`` is set to the eos, as users do for such models;
    ``with_bos=False`` leaves the BOS token out (the vocabulary of the plain tiny models in conftest);
    ``chat_template`` names the layout in ``CHAT_TEMPLATES`` (its tokens must be among the special tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = (
        ([] if pad_is_eos else [PAD]) + [EOS, UNK] + ([BOS] if with_bos else []) + [*extra_special_tokens]
    )
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_TRAINING_TEXT * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS if with_bos else None,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=EOS if pad_is_eos else PAD,
        additional_special_tokens=list(extra_special_tokens) or None,
    )
    tokenizer.chat_template = CHAT_TEMPLATES[chat_template][1].replace("{turn_end}", turn_end)
    return tokenizer


def build_family_config(
    spec: FamilySpec, vocab_size: int, pad_token_id: int, eos_token_id: int | list[int], bos_token_id: int
):
    """The family's transformers config: shared sizes and token ids, then the family's own values."""
    from transformers import AutoConfig

    values: dict[str, Any] = dict(_COMMON_SIZES)
    if spec.model_type in ("gpt2", "opt"):
        values = {}
    values.update(
        vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id
    )
    values.update(spec.config)
    return AutoConfig.for_model(spec.model_type, **values)


def build_family(name: str, directory: Path, seed: int = 0) -> Path:
    """Build the tiny ``name`` family with ``seed`` and save model, tokenizer and generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = FAMILY_SPECS[name]
    tokenizer = build_family_tokenizer(
        spec.extra_special_tokens, spec.pad_is_eos, spec.turn_end, chat_template=spec.chat_template
    )
    stop_ids = terminator_ids(tokenizer, spec)
    eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    config = build_family_config(
        spec, len(tokenizer), tokenizer.pad_token_id, eos_token_id, tokenizer.bos_token_id
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**NEUTRAL_SAMPLING, **spec.generation_processors},
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def terminator_ids(tokenizer, spec: FamilySpec) -> list[int]:
    """The ids of ``spec.terminators`` in ``tokenizer``, in order (the eos first)."""
    return tokenizer.convert_tokens_to_ids(list(spec.terminators))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as ``generate`` derives them (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


__all__ = [
    "BAD_WORD_TOKEN_ID",
    "CHAT_TEMPLATES",
    "DTYPES",
    "FAMILIES",
    "FAMILY_SPECS",
    "NEUTRAL_SAMPLING",
    "REFUSED_FAMILIES",
    "SUPPRESSED_TOKEN_ID",
    "FamilySpec",
    "build_family",
    "build_family_config",
    "build_family_tokenizer",
    "logprob_tolerance",
    "position_ids_from_mask",
    "terminator_ids",
]
