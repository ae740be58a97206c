"""Reward-adapter training with TRL's RewardTrainer on the tiny model: files, score head, accuracy, errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from marl.apps.cli import train_reward_main
from marl.train import reward_training
from marl.train.reward_training import (
    RewardAdapterArguments,
    load_preference_data,
    pairwise_accuracy,
    train_reward_adapter,
)

POSITIVE = [
    "the movie was great and fun to watch",
    "good good great wonderful lovely charming",
    "an honest story, well told and moving",
    "review of the film: a small delight",
]
NEGATIVE = [
    "a dull boring film with terrible acting",
    "awful bad worse worst dreadful mess",
    "the plot falls apart and the jokes are stale",
    "a dull mess, awful and stale",
]
FAST = dict(num_train_epochs=4, learning_rate=5e-3, batch_size=4, max_length=32, logging_steps=1)


def _plain_pairs() -> tuple[datasets.Dataset, datasets.Dataset]:
    train = datasets.Dataset.from_dict(
        {"chosen": [good for good in POSITIVE for _ in NEGATIVE], "rejected": NEGATIVE * len(POSITIVE)}
    )
    held_out = datasets.Dataset.from_dict({"chosen": POSITIVE, "rejected": NEGATIVE[::-1]})
    return train, held_out


def _scores(base_dir: Path, adapter_dir: Path, texts: list[str]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = tokenizer.pad_token_id
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    batch = tokenizer([text + tokenizer.eos_token for text in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits.squeeze(-1)


def test_trains_and_saves_a_seq_cls_adapter_with_its_score_head(tiny_llama_dir: Path, tmp_path: Path) -> None:
    train, held_out = _plain_pairs()
    output = tmp_path / "reward"
    summary = train_reward_adapter(str(tiny_llama_dir), train, held_out, output, quantization=None, **FAST)

    assert sorted(p.name for p in output.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "marl_reward.json",
        "training_summary.json",
    ]
    # the padding id of training is recorded: it decides where the score is read
    reading = json.loads((output / "marl_reward.json").read_text())
    assert reading["pad_token_id"] == AutoTokenizer.from_pretrained(tiny_llama_dir).pad_token_id
    config = json.loads((output / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS"
    assert "score" in config["modules_to_save"]
    assert config["base_model_name_or_path"] == str(tiny_llama_dir)
    with safe_open(output / "adapter_model.safetensors", "pt") as weights:
        keys = set(weights.keys())
        assert weights.get_tensor("base_model.model.score.weight").shape == (1, 64)
    assert any(".lora_A." in key for key in keys)
    assert json.loads((output / "training_summary.json").read_text()) == summary

    assert summary["train_pairs_used"] == len(train)
    assert summary["eval_pairs_used"] == len(held_out)
    assert summary["eval_accuracy"] == 1.0
    assert summary["eval_accuracy_before"] < 1.0
    assert summary["train_loss_last_logged"] < summary["train_loss_first_logged"]

    # The saved adapter, loaded the standard PEFT way, ranks the held-out pairs as reported.
    scores = _scores(tiny_llama_dir, output, list(held_out["chosen"]) + list(held_out["rejected"]))
    chosen, rejected = scores.chunk(2)
    assert (chosen > rejected).float().mean().item() == summary["eval_accuracy"]


def test_four_bit_base_trains_a_float32_head(tiny_llama_dir: Path, tmp_path: Path) -> None:
    train, held_out = _plain_pairs()
    summary = train_reward_adapter(
        str(tiny_llama_dir), train, held_out, tmp_path / "rm", quantization="4bit", **FAST
    )
    assert summary["quantization"] == "4bit"
    assert summary["eval_accuracy"] > summary["eval_accuracy_before"]
    with safe_open(tmp_path / "rm" / "adapter_model.safetensors", "pt") as weights:
        assert weights.get_tensor("base_model.model.score.weight").dtype == torch.float32


def test_conversational_pairs_go_through_the_chat_template(tiny_llama_dir: Path, tmp_path: Path) -> None:
    def conversation(reply: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": "review the film"}, {"role": "assistant", "content": reply}]

    train = datasets.Dataset.from_dict(
        {
            "chosen": [conversation(good) for good in POSITIVE for _ in NEGATIVE],
            "rejected": [conversation(bad) for bad in NEGATIVE * len(POSITIVE)],
        }
    )
    held_out = datasets.Dataset.from_dict(
        {"chosen": [conversation(t) for t in POSITIVE], "rejected": [conversation(t) for t in NEGATIVE]}
    )
    summary = train_reward_adapter(
        str(tiny_llama_dir), train, held_out, tmp_path / "rm", quantization=None, **{**FAST, "max_length": 64}
    )
    assert summary["eval_pairs_used"] == len(held_out)
    assert summary["eval_accuracy"] >= 0.75


def test_pairwise_accuracy_counts_strict_wins(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1)
    model.config.pad_token_id = 0
    model.train()
    same = datasets.Dataset.from_dict(
        {"chosen_ids": [[5, 6, 7], [8, 9]], "rejected_ids": [[5, 6, 7], [8, 9]]}
    )
    assert pairwise_accuracy(model, same, pad_token_id=0) == 0.0  # ties are not wins
    assert model.training, "the model's mode is restored"
    swapped = datasets.Dataset.from_dict(
        {"chosen_ids": [[5, 6, 7], [9, 9]], "rejected_ids": [[9, 9], [5, 6, 7]]}
    )
    assert pairwise_accuracy(model, swapped, pad_token_id=0, batch_size=1) == 0.5


def test_bad_input_fails_early_with_the_fix(tiny_llama_dir: Path, tmp_path: Path) -> None:
    train, held_out = _plain_pairs()
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['rejected'\]"):
        train_reward_adapter(str(tiny_llama_dir), train.remove_columns("rejected"), held_out, tmp_path / "a")
    with pytest.raises(ValueError, match="quantization"):
        train_reward_adapter(str(tiny_llama_dir), train, held_out, tmp_path / "b", quantization="3bit")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not empty"):
        train_reward_adapter(str(tiny_llama_dir), train, held_out, occupied)
    assert (occupied / "keep.txt").read_text() == "user data"
    with pytest.raises(ValueError, match="longer than max_length"):
        train_reward_adapter(
            str(tiny_llama_dir), train, held_out, tmp_path / "c", quantization=None, max_length=2
        )
    with pytest.raises(ValueError, match="quantization"):
        RewardAdapterArguments(output_dir="x", quantization="2bit")


def test_rotten_tomatoes_pairs_hold_out_whole_movies() -> None:
    train, held_out = load_preference_data("rotten-tomatoes", max_train_pairs=100, seed=0)
    assert len(train) == 100
    assert len(held_out) > 200
    assert not set(train["movie"]) & set(held_out["movie"])
    again, _ = load_preference_data("rotten-tomatoes", max_train_pairs=100, seed=0)
    assert train["chosen"] == again["chosen"]


def test_full_rotten_tomatoes_pairs_train_on_more_movies_and_hold_out_the_same_pairs() -> None:
    from marl.data import assets

    train, held_out = load_preference_data("rotten-tomatoes-full", seed=0)
    small_train, small_held_out = load_preference_data("rotten-tomatoes", seed=0)
    assert held_out["chosen"] == small_held_out["chosen"]
    assert held_out["rejected"] == small_held_out["rejected"]
    assert len(train) > 4 * len(small_train)
    # No movie and no text of the RL prompts or of the held-out pairs reaches training.
    parts = assets.split_rotten_tomatoes(seed=0)
    for name in ("rl", "eval"):
        assert not set(train["movie"]) & set(parts[name]["movie"])
        assert not (set(train["chosen"]) | set(train["rejected"])) & set(parts[name]["text"])
    assert set(small_train["movie"]) < set(train["movie"])


def test_a_drifted_policy_adds_one_pair_per_four_fresh_snippets_to_both_parts() -> None:
    asked: list[tuple[str, str]] = []

    def drift_like(openings, continuations):
        asked.extend(zip(openings, continuations, strict=True))
        return [" I'm thrilled to help" for _ in openings]

    plain_train, plain_held_out = load_preference_data("rotten-tomatoes-full", seed=0)
    train, held_out = load_preference_data("rotten-tomatoes-full", seed=0, drift_like=drift_like)
    for plain, drifted in ((plain_train, train), (plain_held_out, held_out)):
        added = drifted.select(range(len(plain), len(drifted)))
        assert drifted.select(range(len(plain)))["chosen"] == plain["chosen"]
        assert 0.2 * len(plain) < len(added) <= len(plain) / 4 + 1
        assert set(added["chosen"]) <= set(plain["chosen"])  # fresh snippets of the same part
        for chosen, rejected in zip(added["chosen"], added["rejected"], strict=True):
            opening = " ".join(chosen.split()[:4])
            assert rejected == opening + " I'm thrilled to help"
    # The policy reads the 4-word opening; the rest of the same snippet only sets the length.
    snippets = {" ".join(text.split()) for part in (plain_train, plain_held_out) for text in part["chosen"]}
    assert all(len(opening.split()) == 4 for opening, _ in asked)
    assert all(" ".join((opening + continuation).split()) in snippets for opening, continuation in asked)


def test_local_file_is_split_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    rows = [{"chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    train, held_out = load_preference_data(str(path), eval_fraction=0.25, seed=0)
    assert (len(train), len(held_out)) == (15, 5)
    assert not set(train["chosen"]) & set(held_out["chosen"])
    with pytest.raises(FileNotFoundError, match=r"is not 'rotten-tomatoes'.* or an existing file"):
        load_preference_data(str(tmp_path / "missing.jsonl"))
    (tmp_path / "pairs.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_preference_data(str(tmp_path / "pairs.txt"))


def test_main_parses_arguments_and_records_the_command(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "pairs.jsonl"
    train, held_out = _plain_pairs()
    rows = [*train.to_list(), *held_out.to_list()]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    argv = [
        "--model_name_or_path", str(tiny_llama_dir), "--dataset", str(path),
        "--output_dir", str(tmp_path / "rm"), "--quantization", "none", "--eval_fraction", "0.2",
        "--num_train_epochs", "2", "--learning_rate", "5e-3",
        "--batch_size", "4", "--lora_r", "4", "--lora_alpha", "8", "--target_modules", "q_proj", "v_proj",
    ]  # fmt: skip
    summary = train_reward_main(argv, prog="marl train-reward")
    assert summary["command"].startswith("marl train-reward --model_name_or_path")
    assert summary["settings"]["target_modules"] == ["q_proj", "v_proj"]
    assert summary["quantization"] == "none"
    config = json.loads((tmp_path / "rm" / "adapter_config.json").read_text())
    assert config["r"] == 4
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert summary["command"] in (tmp_path / "rm" / "README.md").read_text()
    assert "held-out pairwise accuracy" in capsys.readouterr().out


def test_module_exposes_the_command_line_entry_points() -> None:
    assert callable(reward_training.parse_arguments)
    arguments = reward_training.parse_arguments(["--output_dir", "out", "--quantization", "8bit"])
    assert arguments.quantization == "8bit"
    assert arguments.dataset == "rotten-tomatoes"
    assert arguments.model_name_or_path == "smollm2-135m-instruct"


def _first_layer_lora_grad(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.train()
    model.zero_grad()
    model(input_ids=input_ids).logits.sum().backward()
    return model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.grad.clone()


@pytest.mark.parametrize("keep_differentiable", [True, False])
def test_scoring_a_4bit_base_does_not_break_later_gradients(
    tiny_llama_dir: Path, keep_differentiable: bool
) -> None:
    from bitsandbytes.functional import has_avx512bf16
    from peft import LoraConfig, get_peft_model

    if not keep_differentiable and not has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16, so bitsandbytes never repacks the weights")
    model, _ = reward_training._load_reward_base(str(tiny_llama_dir), "4bit", torch.float32)
    if not keep_differentiable:  # undo the fix to show what it prevents
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = True
    torch.manual_seed(0)
    model = get_peft_model(
        model, LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear", init_lora_weights=False)
    )
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    before_scoring = _first_layer_lora_grad(model, input_ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=input_ids)
    after_scoring = _first_layer_lora_grad(model, input_ids)
    assert torch.equal(before_scoring, after_scoring) == keep_differentiable


def test_lora_last_layers_limits_the_adapter_to_the_top_layers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    train, held_out = _plain_pairs()
    summary = train_reward_adapter(
        str(tiny_llama_dir), train, held_out, tmp_path / "rm", quantization=None, lora_last_layers=1, **FAST
    )
    assert summary["settings"]["lora_last_layers"] == 1
    config = json.loads((tmp_path / "rm" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1]
    with safe_open(tmp_path / "rm" / "adapter_model.safetensors", "pt") as weights:
        lora_keys = [key for key in weights.keys() if "lora_" in key]  # noqa: SIM118 (safe_open is not iterable)
    assert lora_keys
    assert all(".layers.1." in key for key in lora_keys)
    assert {key.split(".")[-3] for key in lora_keys} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    }  # fmt: skip
    with pytest.raises(ValueError, match="lora_last_layers must be between 1 and 2"):
        train_reward_adapter(
            str(tiny_llama_dir), train, held_out, tmp_path / "x", quantization=None, lora_last_layers=3
        )


@pytest.fixture(scope="module")
def tiny_base_padding_with_eos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with SmolLM2's tokenizer convention: the pad token is the EOS token."""
    from transformers import AutoConfig, AutoTokenizer

    from support.tiny import save_tiny_model

    directory = save_tiny_model(tmp_path_factory.mktemp("pad-is-eos"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(directory)
    config = AutoConfig.from_pretrained(directory)
    config.pad_token_id = tokenizer.eos_token_id
    config.save_pretrained(directory)
    return directory


def test_pad_token_is_moved_off_eos_for_training() -> None:
    from support.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    reward_training._pad_with_a_token_other_than_eos(tokenizer)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.pad_token == "<unk>"


def test_training_reads_the_score_where_the_rl_model_reads_it(
    tiny_base_padding_with_eos: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from marl.model.multi_adapter import MultiAdapterModel

    train, held_out = _plain_pairs()
    output = tmp_path / "rm"
    summary = train_reward_adapter(
        str(tiny_base_padding_with_eos), train, held_out, output, quantization=None, **FAST
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_base_padding_with_eos)
    model = MultiAdapterModel.from_pretrained(str(tiny_base_padding_with_eos), reward_adapter=output)
    texts = [text + tokenizer.eos_token for text in [*held_out["chosen"], *held_out["rejected"]]]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert (batch["input_ids"][:, -1] == tokenizer.eos_token_id).all(), "right padding with pad == eos"
    rl_scores = model.compute_reward_score(batch["input_ids"], batch["attention_mask"])
    chosen, rejected = rl_scores.chunk(2)
    assert (chosen > rejected).float().mean().item() == summary["eval_accuracy"] == 1.0

    # The same texts scored the way the adapter was trained (padded with a different token) agree exactly.
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    reward_training._pad_with_a_token_other_than_eos(tokenizer)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_base_padding_with_eos, num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    trained_view = PeftModel.from_pretrained(base, output).eval()
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        training_scores = trained_view(**batch).logits.squeeze(-1)
    torch.testing.assert_close(training_scores, rl_scores, rtol=1e-4, atol=1e-5)
