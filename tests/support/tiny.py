"""Tiny real models, tokenizers, reward adapters and configs for the tests, built from configs and saved.

Every model here goes through the real ``from_pretrained`` path. Linear input features are multiples of 64
so that the 4-bit CPU path of bitsandbytes accepts them. ``tests/conftest.py`` turns these into fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_ARCHITECTURES = ("llama", "qwen2", "gpt_neox")


def build_tiny_tokenizer():
    """The byte-level BPE tokenizer of the family table without a BOS token (pad 0, eos 1, unk 2): trained in
    milliseconds, wrapped as a transformers fast tokenizer, with a chat template."""
    from support.families import build_family_tokenizer

    return build_family_tokenizer(with_bos=False)


def build_tiny_config(architecture: str, vocab_size: int, pad_token_id: int, eos_token_id: int):
    """A 2-layer config of the given family; hidden 64, MLP 128 (both multiples of the 4-bit block size)."""
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    if architecture == "llama":
        return LlamaConfig(num_key_value_heads=2, **common)
    if architecture == "qwen2":
        return Qwen2Config(num_key_value_heads=2, **common)
    if architecture == "gpt_neox":
        return GPTNeoXConfig(**common)
    raise ValueError(f"unknown tiny architecture {architecture!r}; known: {TINY_ARCHITECTURES}")


def save_tiny_model(
    directory: Path, architecture: str = "llama", seed: int = 0, tie_word_embeddings: bool = False
) -> Path:
    """Build a tiny causal LM + tokenizer with a fixed seed and save both to ``directory`` (with
    ``tie_word_embeddings`` its LM head is its input embeddings)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = build_tiny_config(architecture, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_reward_adapter(base_dir: Path | str, directory: Path, seed: int = 1) -> Path:
    """A PEFT SEQ_CLS adapter (LoRA + score head) on ``base_dir``, the layout TRL's RewardTrainer writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    classifier = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    peft_model = get_peft_model(classifier, LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"))
    peft_model.save_pretrained(directory)
    return directory


# The settings every tiny RLOO run of the tests shares: 2 completions per prompt, 4 completions per device
# step, 6 new tokens, a rank-4 policy LoRA, and no sample tables or checkpoints unless a test asks for them.


TINY_RLOO_SETTINGS: dict[str, object] = dict(
    rloo_k=2,
    per_device_train_batch_size=4,
    response_length=6,
    lora_r=4,
    lora_alpha=8,
    num_sample_generations=0,
    save_steps=0,
)


def tiny_rloo_config(output_dir: Path | str, **overrides):
    """An ``RLOOConfig`` writing into ``output_dir`` with :data:`TINY_RLOO_SETTINGS`; ``overrides`` (any
    config field, e.g. ``model_name_or_path=str(tiny_llama_dir)``) say what a test is about."""
    from marl.config import RLOOConfig

    return RLOOConfig(output_dir=str(output_dir), **{**TINY_RLOO_SETTINGS, **overrides})


def train_reward_adapter_with_trl(base_dir: Path, output_dir: Path) -> Path:
    """A reward adapter made the way users make one: TRL's RewardTrainer with a SEQ_CLS LoRA, a few steps."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pairs = Dataset.from_dict(
        {
            "chosen": ["good great film", "a lovely charming story", "wonderful and moving"] * 4,
            "rejected": ["bad awful film", "a dull boring mess", "dreadful and stale"] * 4,
        }
    )
    args = RewardConfig(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = RewardTrainer(
        model=str(base_dir),
        args=args,
        train_dataset=pairs,
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear"),
    )
    trainer.train()
    trainer.save_model(str(output_dir))
    return output_dir


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` as a JSON-lines file (a dataset file as users give them)."""
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def refused(capsys: pytest.CaptureFixture, entry, words: list[str]) -> str:
    """Run a command's entry point (e.g. ``marl.apps.cli.main``) on input it must refuse: it exits with code
    2 and
    one ``prog: error: ...`` line on stderr, without a traceback. Returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        entry(words)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]
