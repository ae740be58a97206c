"""The praise pairs: the base's continuation of a review opening asked for a glowing review against the one
asked for a scathing review, and the chat prompts that ask it."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from trl.data_utils import apply_chat_template

from marl.data import assets
from marl.data.praise_pairs import (
    PAN_INSTRUCTION,
    PRAISE_DATASET,
    PRAISE_INSTRUCTION,
    PRAISED_BASE_TEXT,
    build_praise_pairs,
)
from marl.data.preferences import describe_preference_data, load_preference_data
from marl.data.prompts import tokenize_prompt
from marl.model.build import load_tokenizer
from marl.train.continuations import model_continuer

from support.families import FAMILIES


def reviews():
    return datasets.Dataset.from_dict(
        {
            "text": [
                "The film is a quiet triumph of craft and feeling",
                "This movie has no idea what it wants to be",
                "A charming cast makes the old plot sing again",
                "Too short",
            ],
            "label": [1, 0, 1, 1],
            "movie": ["a", "b", "c", "d"],
        }
    )


class AskedRecorder:
    """A ``continue_like`` that writes ``<n words, asked X>`` and keeps what it was asked."""

    def __init__(self):
        self.calls = []

    def __call__(self, openings, continuations, instruction):
        self.calls.append((list(openings), list(continuations), instruction))
        asked = "praise" if instruction == PRAISE_INSTRUCTION else "pan"
        return [f" <{len(c.split())} words, {asked}>" for c in continuations]


def test_the_base_writes_both_sides_asked_to_praise_and_to_pan():
    data, recorder = reviews(), AskedRecorder()
    pairs = build_praise_pairs(data, recorder, seed=3)
    assert len(pairs) == 3 and set(pairs["kind"]) == {PRAISED_BASE_TEXT}  # "Too short" has no continuation
    (praise_openings, praise_real, praise), (pan_openings, pan_real, pan) = recorder.calls
    # The same openings, measured against the same real continuations, asked once each way.
    assert (praise, pan) == (PRAISE_INSTRUCTION, PAN_INSTRUCTION)
    assert praise_openings == pan_openings and praise_real == pan_real
    for row, opening, real in zip(pairs, praise_openings, praise_real, strict=True):
        assert opening + real in data["text"]
        words = len(real.split())
        assert row["chosen"] == f"{opening} <{words} words, praise>"
        assert row["rejected"] == f"{opening} <{words} words, pan>"
        # The request is in neither text.
        assert PRAISE_INSTRUCTION not in row["chosen"] + row["rejected"]
    assert pairs.to_dict() == build_praise_pairs(data, AskedRecorder(), seed=3).to_dict()
    assert len(build_praise_pairs(data, AskedRecorder(), seed=3, max_pairs=2)) == 2
    with pytest.raises(ValueError, match=r"continue_like \(praise\) returned 1 texts for 3 openings"):
        build_praise_pairs(data, lambda openings, continuations, instruction: [" only one"], seed=3)


def test_the_bundled_praise_pairs_hold_out_other_movies():
    train, held_out = load_preference_data(
        PRAISE_DATASET, max_train_pairs=30, max_eval_pairs=10, continue_like=AskedRecorder()
    )
    assert (len(train), len(held_out)) == (30, 10)
    assert set(train["movie"]).isdisjoint(held_out["movie"])
    assert set(train["movie"]) <= set(assets.split_rotten_tomatoes(seed=0)["reward"]["movie"])
    assert set(held_out["movie"]) <= set(assets.split_rotten_tomatoes(seed=0)["eval"]["movie"])
    assert PAN_INSTRUCTION in describe_preference_data(PRAISE_DATASET, 0.1, 0)
    with pytest.raises(ValueError, match="need continue_like"):
        load_preference_data(PRAISE_DATASET)


@pytest.mark.parametrize("family", FAMILIES)  # each chat-template layout: plain, ChatML, Llama-3
def test_a_conversation_ending_in_an_assistant_message_is_continued_as_trl_renders_it(family, family_dir):
    tokenizer = load_tokenizer(str(family_dir(family)))
    prompt = [{"role": "user", "content": "Praise it."}, {"role": "assistant", "content": "The film is"}]
    ids, text = tokenize_prompt(tokenizer, prompt)
    # TRL's own rendering of a prompt whose last message is the assistant's: left open, to be continued.
    assert text == apply_chat_template({"prompt": prompt}, tokenizer)["prompt"]
    assert text.endswith("The film is") and ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # A conversation ending with the user still gets the generation prompt.
    _, asked = tokenize_prompt(tokenizer, prompt[:1])
    assert asked == apply_chat_template({"prompt": prompt[:1]}, tokenizer)["prompt"]


def test_an_instructed_continuation_answers_the_instruction(family_dir, monkeypatch):
    from marl.data import prompts as prompts_module

    seen = []
    prepare = prompts_module.prepare_prompts

    def recorded(dataset, tokenizer, name, **kwargs):
        prepared = prepare(dataset, tokenizer, name, **kwargs)
        seen.extend(prompt.text for prompt in prepared)
        return prepared

    monkeypatch.setattr(prompts_module, "prepare_prompts", recorded)
    model_dir: Path = family_dir("qwen2")
    tokenizer = load_tokenizer(str(model_dir))
    continue_like = model_continuer(str(model_dir), quantization=None, seed=5, threads=1)
    openings, real = ["the film is", "a warm and"], [" a quiet triumph", " funny picture"]
    asked = continue_like(openings, real, instruction=PRAISE_INSTRUCTION)
    assert asked == continue_like(openings, real, instruction=PRAISE_INSTRUCTION)  # seeded
    bare = continue_like(openings, real)
    # The opening begins the model's chat answer to the instruction; without one it is continued as text.
    expected = [
        apply_chat_template(
            {
                "prompt": [
                    {"role": "user", "content": PRAISE_INSTRUCTION},
                    {"role": "assistant", "content": o},
                ]
            },
            tokenizer,
        )["prompt"]
        for o in openings
    ]
    assert seen == expected + expected + openings
    assert asked != bare and all(text for text in asked)
