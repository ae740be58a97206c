"""Models, tokenizers and prompts the benchmark builds itself, so that its GPU setups need nothing but the
repository on a machine with torch, transformers, peft, trl, bitsandbytes and accelerate (no model hub, no
bundled model or data package).

- :func:`generated_text`: lines of made-up words (consonant-vowel syllables) from a seeded generator;
- :func:`build_tokenizer`: a byte-level BPE tokenizer trained with the ``tokenizers`` library on that text,
  to exactly the model's vocabulary size (Qwen2.5's 151,936), so that every id a model with random weights
  samples decodes to a word and encodes back to one token;
- :func:`build_prompts`: prompts of exactly ``tokens`` tokens of other generated text;
- :func:`build_model`: a Qwen2 model with Qwen2.5-0.5B's or 1.5B's shapes, or a Llama model with
  Llama-3.1-8B's (or a tiny one of each for a CPU dry run), with random weights, saved with its tokenizer.

Example:
    >>> generated_text(seed=0, lines=2, words_per_line=3)
    ['rodalo tiremote zukitu', 'zukitu tiremote rodalo']
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

EOS, PAD = "<|endoftext|>", "<|pad|>"
_SYLLABLES = [consonant + vowel for consonant in "bdfghklmnprstvz" for vowel in "aeiou"]

# Qwen2.5's shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B: tied embeddings, 2 key/value heads).
QWEN25_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shaped": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151_936,
    ),
    "qwen2.5-1.5b-shaped": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151_936,
    ),
    # every system's code path on a CPU in seconds (--dry-run); Linear inputs multiples of 64 for 4-bit
    "tiny-qwen2-shaped": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024,
    ),
}  # fmt: skip
_COMMON = dict(max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True)
# Llama-3.1-8B's shapes (its config.json: 32 layers, 8 key/value heads, untied head, vocabulary 128,256),
# built as a LlamaForCausalLM; and a tiny Llama for the CPU dry run of that step.
LLAMA31_SHAPES: dict[str, dict[str, Any]] = {
    "llama3.1-8b-shaped": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128_256,
    ),
    "tiny-llama-shaped": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024,
    ),
}  # fmt: skip
_LLAMA_COMMON = dict(max_position_embeddings=4096, rope_theta=500_000.0, tie_word_embeddings=False)
BUILT_SHAPES = {**QWEN25_SHAPES, **LLAMA31_SHAPES}


def generated_text(seed: int, lines: int, words_per_line: int = 20) -> list[str]:
    """``lines`` lines of distinct made-up words; each line's words come again reversed in the next line, so
    that the BPE trainer sees every word (and the pairs inside it) at least twice."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < lines * words_per_line // 2:
        words["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))] = None
    unique = list(words)
    text = []
    for start in range(0, len(unique), words_per_line):
        chunk = unique[start : start + words_per_line]
        text += [" ".join(chunk), " ".join(reversed(chunk))]
    return text[:lines]


def build_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens (``EOS`` id 0, ``PAD``
    id 1), trained on :func:`generated_text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # about 1.7 distinct words per token wanted: enough merges to reach the vocabulary
    tokenizer.train_from_iterator(generated_text(seed, lines=max(64, vocab_size // 6)), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        stopped = tokenizer.get_vocab_size()
        raise RuntimeError(f"the BPE trainer stopped at {stopped} tokens, not {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, bos_token=EOS)


def build_prompts(tokenizer: Any, count: int, tokens: int, seed: int = 1) -> list[str]:
    """``count`` prompts of exactly ``tokens`` tokens each (as ``tokenizer`` encodes them): words of generated
    text (another seed than the tokenizer's) while they fit, then syllables to fill the last tokens."""
    words = iter(" ".join(generated_text(seed, lines=count * (tokens // 10 + 2))).split())

    def length(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    prompts = []
    for _ in range(count):
        prompt = next(words)
        while (gap := tokens - length(prompt)) > 0:
            # the next word while far from the end; then a syllable, as a word or glued to the last one
            suffixes = [f" {next(words)}"] if gap > 4 else [*(f" {s}" for s in _SYLLABLES), *_SYLLABLES]
            fitting = [suffix for suffix in suffixes if length(prompt + suffix) <= tokens]
            if not fitting and gap <= 4:
                raise RuntimeError(f"no syllable fills the last {gap} tokens of a prompt of {tokens}")
            prompt += fitting[0] if fitting else ""
        if gap < 0:
            raise RuntimeError(f"a prompt's first word is longer than {tokens} tokens")
        prompts.append(prompt)
    return prompts


def build_model(shape: str, dtype: str, target: Path, seed: int = 0, device: str = "cpu") -> str:
    """A Qwen2 (or, for a Llama shape, Llama) model of the named shape with random weights and its tokenizer,
    saved to ``target``."""
    if (target / "config.json").is_file():
        return str(target)
    tokenizer = build_tokenizer(BUILT_SHAPES[shape]["vocab_size"], seed=seed)
    model = random_model(shape, dtype, device, seed, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return str(target)


def random_model(shape: str, dtype: str, device: str, seed: int = 0, eos: int = 0, pad: int = 1) -> Any:
    """A Qwen2 (or, for a Llama shape, Llama) model of the named shape with random weights, built on
    ``device`` in ``dtype`` (``eos`` and ``pad``: its token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = shape in LLAMA31_SHAPES
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, dtype=dtype,
        **(_LLAMA_COMMON if llama else _COMMON), **BUILT_SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):  # built in the compute dtype: an 8B model in fp32 would take 32 GB first
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            return model_class(config)
        finally:
            torch.set_default_dtype(torch.float32)
