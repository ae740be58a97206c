"""Supervised warm start of a policy LoRA with TRL's SFTTrainer on the tiny model: the examples' tokens, what
is trained, the saved folder as a starting policy with a frozen copy as its reference."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from marl.config.model import policy_lora_config
from marl.data.prompts import tokenize_prompt
from marl.model.multi_adapter import MultiAdapterModel
from marl.train.trl_trainers import tokenized_examples, warm_start_policy

EXAMPLES = datasets.Dataset.from_dict(
    {
        "prompt": ["The film is", "A story of", "It may not", "Every scene is"],
        "completion": [" a quiet triumph", " love and loss", " be perfect, but", " a small delight"],
    }
)


def _completion_logprob(model: MultiAdapterModel, tokenizer, rows: datasets.Dataset) -> float:
    """Mean log-prob of the completion tokens of ``rows`` (tokenized_examples) under the model's policy."""
    total, count = 0.0, 0
    with torch.no_grad(), model.policy():
        for input_ids, labels in zip(rows["input_ids"], rows["labels"], strict=True):
            start = labels.count(-100)
            ids = torch.tensor([input_ids])
            logprobs = model.token_logprobs(ids, torch.ones_like(ids), response_start=start)
            total, count = total + float(logprobs.sum()), count + logprobs.numel()
    return total / count


def test_tokenized_examples_read_the_prompt_as_rl_does_and_learn_only_the_cut_completion(
    tiny_llama_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    rows = tokenized_examples(tokenizer, EXAMPLES, max_completion_tokens=3)
    assert len(rows) == len(EXAMPLES)
    for prompt, completion, row in zip(EXAMPLES["prompt"], EXAMPLES["completion"], rows, strict=True):
        prompt_ids, _ = tokenize_prompt(tokenizer, prompt)
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"][:3]
        assert row["input_ids"] == prompt_ids + completion_ids  # no EOS: a cut snippet has not ended
        assert row["labels"] == [-100] * len(prompt_ids) + completion_ids
    empty = datasets.Dataset.from_dict({"prompt": ["The film is"], "completion": [""]})
    assert len(tokenized_examples(tokenizer, empty, max_completion_tokens=3)) == 0


def test_warm_start_raises_the_completions_likelihood_and_starts_a_policy_whose_reference_is_its_copy(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    rows = tokenized_examples(tokenizer, EXAMPLES, max_completion_tokens=8)
    folder = tmp_path / "warm-start"
    lora = policy_lora_config(r=8, alpha=16)
    summary = warm_start_policy(
        str(tiny_llama_dir),
        EXAMPLES,
        folder,
        lora_config=lora,
        quantization=None,
        learning_rate=1e-2,
        num_train_epochs=40,
        batch_size=2,
        max_completion_tokens=8,
        threads=1,
    )
    assert summary["examples"] == 4 and summary["optimizer_steps"] == 80
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["task_type"] == "CAUSAL_LM" and saved["r"] == 8
    assert saved["base_model_name_or_path"] == str(tiny_llama_dir)

    fresh = MultiAdapterModel.from_pretrained(tiny_llama_dir, policy_adapter=lora)
    warm = MultiAdapterModel.from_pretrained(tiny_llama_dir, policy_adapter=str(folder))
    # The fresh LoRA is the base (B = 0); the warm start makes the examples' completions far more likely.
    assert _completion_logprob(warm, tokenizer, rows) > _completion_logprob(fresh, tokenizer, rows) + 1.0
    # Started from the folder, the reference is a frozen copy of the warm start: no KL at the first rollout.
    assert warm.reference_mode == "initial-policy"
    ids = torch.tensor([rows["input_ids"][0]])
    with torch.no_grad():
        with warm.policy():
            policy = warm.token_logprobs(ids, torch.ones_like(ids), response_start=3)
        with warm.reference():
            reference = warm.token_logprobs(ids, torch.ones_like(ids), response_start=3)
    torch.testing.assert_close(policy, reference)


def test_warm_start_refuses_examples_without_completion_tokens(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from marl.errors import DataError

    empty = datasets.Dataset.from_dict({"prompt": ["The film is"], "completion": [""]})
    with pytest.raises(DataError, match="non-empty completions"):
        warm_start_policy(str(tiny_llama_dir), empty, tmp_path / "w", quantization=None, threads=1)
    assert not (tmp_path / "w").exists()


def test_warm_start_refuses_a_folder_that_holds_files_and_leaves_them(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from marl.errors import RunFolderError

    kept = tmp_path / "adapter" / "adapter_config.json"
    kept.parent.mkdir()
    kept.write_text("{}")
    with pytest.raises(RunFolderError, match="exists and is not empty"):
        warm_start_policy(str(tiny_llama_dir), EXAMPLES, kept.parent, quantization=None, threads=1)
    assert kept.read_text() == "{}"
