"""Prompt datasets from files and folders, and the checks on user reward functions and judges."""

from __future__ import annotations

import json
import math

import pytest

from marl.data.prompts import load_prompt_dataset, rotten_tomatoes_prompts
from marl.errors import DataError
from marl.rewards import load_judge, load_reward_fn
from marl.rewards.functions import check_scores

from support.tiny import write_jsonl

ROWS = [{"question": "Say something kind", "id": 1}, {"question": "Describe a film", "id": 2}]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_file_types_load_and_rename_the_prompt_column(tmp_path, suffix):
    import datasets

    path = tmp_path / f"prompts{suffix}"
    table = datasets.Dataset.from_list(ROWS)
    if suffix == ".jsonl":
        write_jsonl(path, ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path)
    prompts = load_prompt_dataset(str(path), prompt_column="question")
    # the other columns stay beside the prompt, for reward functions (as TRL passes them)
    assert sorted(prompts.column_names) == sorted(
        ["prompt", *(name for name in ROWS[0] if name != "question")]
    )
    assert prompts["prompt"] == ["Say something kind", "Describe a film"]


def test_folder_uses_split_names_from_file_names(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "test.jsonl", [{"question": "held out", "id": 3}])
    assert load_prompt_dataset(str(tmp_path), "test", "question")["prompt"] == ["held out"]
    assert len(load_prompt_dataset(str(tmp_path), "train", "question")) == 2
    with pytest.raises(DataError, match=r"no split 'validation'.*--dataset_train_split"):
        load_prompt_dataset(str(tmp_path), "validation", "question")


def test_conversational_prompts_are_accepted(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Review a film"}]}]
    prompts = load_prompt_dataset(str(write_jsonl(tmp_path / "chat.jsonl", rows)))
    assert prompts[0]["prompt"][0]["content"] == "Review a film"


def test_missing_prompt_column_lists_columns_and_names_the_flag(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(DataError, match=r"no column 'prompt'.*\['question', 'id'\].*--prompt_column"):
        load_prompt_dataset(str(path))


def test_column_without_text_is_not_a_usable_prompt_column(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    with pytest.raises(DataError, match=r"not a prompt.*--prompt_column"):
        load_prompt_dataset(str(path), prompt_column="id")


def test_unknown_file_type_names_the_supported_types(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Say something kind\n")
    expected = r"unknown dataset file type '\.txt'.*\.csv, \.json, \.jsonl, \.parquet"
    with pytest.raises(DataError, match=expected):
        load_prompt_dataset(str(path))


def test_missing_file_and_empty_folder_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such dataset file"):
        load_prompt_dataset(str(tmp_path / "absent.jsonl"))
    (tmp_path / "notes.md").write_text("not data")
    with pytest.raises(DataError, match="holds no dataset file"):
        load_prompt_dataset(str(tmp_path))


def test_bundled_rotten_tomatoes_splits_are_disjoint():
    train = rotten_tomatoes_prompts("train")
    held_out = load_prompt_dataset("rotten-tomatoes", split="test", max_prompts=300)
    assert len(held_out) == 300 and len(train) > 1000
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])
    with pytest.raises(DataError, match="--dataset_train_split"):
        rotten_tomatoes_prompts("dev")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        "def length(prompts, completions):\n"
        "    return [len(c) for c in completions]\n"
        "def one_short(prompts, completions):\n"
        "    return [1.0] * (len(completions) - 1)\n"
        "def words(prompts, completions):\n"
        "    return ['good' for c in completions]\n"
        "def not_finite(prompts, completions):\n"
        "    return [float('inf') for c in completions]\n"
        "def some_unjudged(prompts, completions):\n"
        "    return [None if 'skip' in c else 1.0 for c in completions]\n"
        "def exclamations(texts):\n"
        "    return [t.count('!') for t in texts]\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "user_rewards.py"


def test_reward_fn_from_module_and_from_file(user_module):
    assert load_reward_fn("user_rewards:length")(["p", "q"], ["ab", "abc"]) == [2.0, 3.0]
    assert load_reward_fn(f"{user_module}:length")(["p"], ["abcd"]) == [4.0]


def test_reward_fn_import_failures_are_clear(user_module):
    with pytest.raises(DataError, match=r"could not import 'no_such_module'.*PYTHONPATH"):
        load_reward_fn("no_such_module:score")
    with pytest.raises(DataError, match="has no attribute 'absent'"):
        load_reward_fn("user_rewards:absent")
    with pytest.raises(DataError, match="not a function"):
        load_reward_fn("user_rewards:NOT_CALLABLE")
    with pytest.raises(DataError, match="module:function"):
        load_reward_fn("user_rewards")


def test_reward_fn_wrong_length_or_non_numbers_name_the_function(user_module):
    with pytest.raises(DataError, match="'user_rewards:one_short' returned 1 scores for 2 completions"):
        load_reward_fn("user_rewards:one_short")(["p", "q"], ["a", "b"])
    with pytest.raises(DataError, match=r"'user_rewards:words' returned 'good' at position 0.*numbers"):
        load_reward_fn("user_rewards:words")(["p"], ["a"])
    with pytest.raises(DataError, match=r"'user_rewards:not_finite'.*finite"):
        load_reward_fn("user_rewards:not_finite")(["p"], ["a"])
    # None (as TRL allows) means "not judged", and is kept as None
    assert load_reward_fn("user_rewards:some_unjudged")(["p", "q"], ["skip me", "ok"]) == [None, 1.0]


def test_check_scores_accepts_arrays_and_tensors_and_rejects_bools():
    import numpy as np
    import torch

    assert check_scores(np.array([0.5, 1.5], dtype=np.float32), 2, "f") == [0.5, 1.5]
    assert check_scores(torch.tensor([1.0, -2.0]), 2, "f") == [1.0, -2.0]
    with pytest.raises(DataError, match="position 1"):
        check_scores([1.0, True], 2, "f")
    with pytest.raises(DataError, match="returned a float"):
        check_scores(math.pi, 1, "f")


def test_a_nan_as_a_numpy_scalar_or_a_0d_tensor_means_not_judged_like_a_python_nan():
    import numpy as np
    import torch

    nans = [np.float32("nan"), np.float64("nan"), np.array(np.nan), torch.tensor(math.nan), float("nan")]
    assert check_scores([*nans, None], 6, "f", allow_none=True) == [None] * 6
    # their finite values are numbers like any other, and a NaN is still refused where scores are required
    assert check_scores([np.float32(1.5), torch.tensor(2.0), np.int64(3)], 3, "f") == [1.5, 2.0, 3.0]
    for nan in nans:
        with pytest.raises(DataError, match="position 0; scores must be finite"):
            check_scores([nan], 1, "f")
    with pytest.raises(DataError, match="position 0; scores must be real numbers"):
        check_scores([np.bool_(True)], 1, "f", allow_none=True)


def test_default_judge_is_vader_and_custom_judges_are_checked(user_module):
    positive, negative = load_judge(None)(["a wonderful, moving film", "a dull, awful mess"])
    assert positive > 0 > negative
    assert load_judge("user_rewards:exclamations")(["wow!!", "ok"]) == [2.0, 0.0]
    with pytest.raises(DataError, match="could not import"):
        load_judge("no_such_module:judge")
