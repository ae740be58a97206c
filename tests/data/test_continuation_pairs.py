"""The continuation pairs: on topic, an opening's real continuation against the base model's own, a drifted
policy's or another film's, and the models' continuations themselves; for sentiment, the base's continuation
asked for a glowing review against the one asked for a scathing review, and the chat prompts that ask it."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from trl.data_utils import apply_chat_template

from marl.data import assets
from marl.data.continuation_pairs import (
    BASE_TEXT,
    CUED_BASE_TEXT,
    DRIFTED_TEXT,
    FILM_DATASET,
    FILM_REVIEW_CUE,
    OTHER_FILM,
    PAN_INSTRUCTION,
    PRAISE_DATASET,
    PRAISE_INSTRUCTION,
    PRAISED_BASE_TEXT,
    TOPIC_DATASET,
    build_film_pairs,
    build_praise_pairs,
    build_topic_pairs,
    topic_pair_parts,
)
from marl.data.preferences import describe_preference_data, load_preference_data
from marl.data.prompts import tokenize_prompt
from marl.model.loading import load_tokenizer
from marl.model.multi_adapter import MultiAdapterModel
from marl.train.reward_training import MAX_SAMPLED_TOKENS, model_continuer

from support.families import FAMILIES


def reviews():
    return datasets.Dataset.from_dict(
        {
            "text": [
                "The film is a quiet triumph of craft and feeling",
                "This movie has no idea what it wants to be",
                "The film is a loud mess of noise and nothing",
                "A charming cast makes the old plot sing again",
                "A warm and funny picture about growing up well",
                "Too short",
            ],
            "label": [1, 0, 0, 1, 1, 1],
            "movie": ["a", "b", "c", "d", "e", "f"],
        }
    )


class Recorder:
    """A ``continue_like`` that writes ``<n words>`` (or ``<n drifted words>``) for each opening and keeps
    what it was asked."""

    def __init__(self, word="words"):
        self.calls, self.word = [], word

    def __call__(self, openings, continuations):
        self.calls.append((list(openings), list(continuations)))
        return [f" <{len(c.split())} {self.word}>" for c in continuations]


def test_fresh_snippets_face_the_base_model_and_rotten_ones_another_film():
    data, recorder = reviews(), Recorder()
    pairs = build_topic_pairs(data, recorder, seed=3)
    by_text = dict(zip(data["text"], zip(data["label"], data["movie"], strict=True), strict=True))
    assert len(pairs) == 5  # the snippet with no continuation is skipped
    ((openings, continuations),) = recorder.calls  # one call, for every fresh snippet at once
    assert len(openings) == 3
    for row in pairs:
        label, movie = by_text[row["chosen"]]
        opening = " ".join(row["chosen"].split()[:4])
        assert row["rejected"].startswith(opening + " ") and row["chosen"] != row["rejected"]
        if row["kind"] == BASE_TEXT:
            # The base model continues the opening, measured against the snippet's own continuation.
            assert label == 1
            continuation = " " + " ".join(row["chosen"].split()[4:])
            assert (opening, continuation) in zip(openings, continuations, strict=True)
            assert row["rejected"] == f"{opening} <{len(continuation.split())} words>"
        else:
            # Another movie's rotten continuation, so sentiment is no cue.
            assert row["kind"] == OTHER_FILM and label == 0
            tail = row["rejected"].split()[4:]
            donors = [t for t in by_text if t.split()[4:] == tail]
            assert donors and all(by_text[t][0] == 0 and by_text[t][1] != movie for t in donors)


def test_a_drifted_policy_writes_every_second_fresh_snippets_rejected_text():
    """With a drifted policy, fresh snippets alternate (in the shuffled order) between the base's text and the
    policy's, each writer called once with its own openings; rotten snippets keep another film's text."""
    data, base, drift = reviews(), Recorder(), Recorder("drifted words")
    pairs = build_topic_pairs(data, base, drift_like=drift, seed=3)
    alone = build_topic_pairs(data, Recorder(), seed=3)
    assert pairs["chosen"] == alone["chosen"]  # the same pairs in the same order; only who wrote differs
    fresh = [(row["kind"], row["rejected"]) for row in pairs if row["kind"] != OTHER_FILM]
    assert [kind for kind, _ in fresh] == [BASE_TEXT, DRIFTED_TEXT, BASE_TEXT]
    assert all(text.endswith("drifted words>") == (kind == DRIFTED_TEXT) for kind, text in fresh)
    assert [len(openings) for openings, _ in base.calls] == [2]
    assert [len(openings) for openings, _ in drift.calls] == [1]
    assert [row["rejected"] for row in pairs if row["kind"] == OTHER_FILM] == [
        row["rejected"] for row in alone if row["kind"] == OTHER_FILM
    ]
    description = describe_preference_data(TOPIC_DATASET, 0.1, 0, drifted_policy="runs/one-reward/policy")
    assert "every second one, that of the policy adapter `runs/one-reward/policy`" in description


def test_the_cap_is_applied_before_any_text_is_sampled():
    recorder = Recorder()
    pairs = build_topic_pairs(reviews(), recorder, max_pairs=2, seed=3)
    full = build_topic_pairs(reviews(), Recorder(), seed=3)
    assert pairs.to_dict() == full.select(range(2)).to_dict()
    assert sum(len(openings) for openings, _ in recorder.calls) == pairs["kind"].count(BASE_TEXT)


def test_a_continuer_that_drops_openings_is_refused():
    with pytest.raises(ValueError, match="returned 1 texts for 3 openings"):
        build_topic_pairs(reviews(), lambda openings, continuations: [" only one"], seed=3)


def test_the_bundled_topic_pairs_hold_out_other_movies():
    recorder = Recorder()
    train, held_out = load_preference_data(
        TOPIC_DATASET, max_train_pairs=300, max_eval_pairs=100, continue_like=recorder
    )
    assert (len(train), len(held_out)) == (300, 100)
    assert set(train["movie"]).isdisjoint(held_out["movie"])
    assert set(train["kind"]) == set(held_out["kind"]) == {BASE_TEXT, OTHER_FILM}
    parts = assets.split_rotten_tomatoes(seed=0)
    assert set(held_out["movie"]) <= set(parts["eval"]["movie"])
    assert "the base model's own continuation" in describe_preference_data(TOPIC_DATASET, 0.1, 0)


class CueRecorder(Recorder):
    """A ``continue_like`` that also says whether it was given the film-review cue."""

    def __call__(self, openings, continuations):
        texts = super().__call__(openings, continuations)
        cued = [opening.startswith(FILM_REVIEW_CUE) for opening in openings]
        return [text + (" cued" if is_cued else "") for text, is_cued in zip(texts, cued, strict=True)]


def test_film_pairs_have_the_base_write_both_sides_told_and_not_told_it_is_a_film_review():
    data, recorder = reviews(), CueRecorder()
    pairs = build_film_pairs(data, recorder, max_pairs=4, seed=3)
    assert len(pairs) == 4 and set(pairs["kind"]) == {CUED_BASE_TEXT}
    (cued_openings, cued_lengths), (bare_openings, bare_lengths) = recorder.calls
    # The same openings, once after the cue and once bare, each measured against its snippet's own words.
    assert cued_openings == [FILM_REVIEW_CUE + opening for opening in bare_openings]
    assert cued_lengths == bare_lengths
    for row, opening, real in zip(pairs, bare_openings, bare_lengths, strict=True):
        assert opening + real in data["text"]
        words = len(real.split())
        # The chosen side is the cued text, the rejected the bare one; the cue itself is in neither.
        assert row["chosen"] == f"{opening} <{words} words> cued"
        assert row["rejected"] == f"{opening} <{words} words>"
    assert pairs.to_dict() == build_film_pairs(data, CueRecorder(), seed=3).select(range(4)).to_dict()
    with pytest.raises(ValueError, match=r"continue_like \(cued\) returned 1 texts for 5 openings"):
        build_film_pairs(data, lambda openings, continuations: [" only one"], seed=3)
    with pytest.raises(ValueError, match="written by the base alone"):
        topic_pair_parts(recorder, dataset=FILM_DATASET, drift_like=recorder)


def test_the_bundled_film_pairs_hold_out_other_movies():
    train, held_out = load_preference_data(
        FILM_DATASET, max_train_pairs=30, max_eval_pairs=10, continue_like=Recorder()
    )
    assert (len(train), len(held_out)) == (30, 10)
    assert set(train["movie"]).isdisjoint(held_out["movie"])
    assert set(held_out["movie"]) <= set(assets.split_rotten_tomatoes(seed=0)["eval"]["movie"])
    assert FILM_REVIEW_CUE in describe_preference_data(FILM_DATASET, 0.1, 0)


def test_base_continuations_are_seeded_and_cut_to_the_real_length(tiny_llama_dir: Path, monkeypatch):
    loads = []
    load = MultiAdapterModel.from_pretrained.__func__

    def counted(cls, name, **kwargs):
        loads.append(name)
        return load(cls, name, **kwargs)

    monkeypatch.setattr(MultiAdapterModel, "from_pretrained", classmethod(counted))
    openings = ["the film is", "a warm and funny", "too long to match"]
    short = [" a quiet triumph", " picture about", " word" * (MAX_SAMPLED_TOKENS + 9)]
    longer = [
        " a quiet triumph of craft and feeling",
        " picture about growing up well and true",
        " word" * 99,
    ]
    continue_like = model_continuer(str(tiny_llama_dir), quantization=None, seed=5, threads=1)
    cut, uncut = continue_like(openings, short), continue_like(openings, longer)
    assert cut == continue_like(openings, short)  # seeded
    # The same draws, cut where the real continuation ends: a longer real text gives a longer prefix of
    # them, and past the cap every length gives the same text. (The tiny tokenizer's byte tokens may cut a
    # character in two: its bytes decode as replacement characters.)
    for row in range(2):
        assert uncut[row].startswith(cut[row].rstrip("\ufffd")) and len(uncut[row]) > len(cut[row]) > 0
    assert cut[2] == uncut[2]
    assert loads == [str(tiny_llama_dir)]  # training and held-out pairs share one loaded base
    other_seed = model_continuer(str(tiny_llama_dir), quantization=None, seed=6, threads=1)
    assert other_seed(openings, short) != cut
    assert torch.get_num_threads() == 1


def test_a_used_output_folder_is_refused_before_any_text_is_sampled(tmp_path: Path, monkeypatch):
    from marl.errors import RunFolderError
    from marl.train import reward_training
    from marl.train.reward_settings import RewardAdapterArguments

    (tmp_path / "kept.txt").write_text("the user's file")

    def no_sampling(*args, **kwargs):
        raise AssertionError("the base model was set up to sample before the output folder was checked")

    monkeypatch.setattr(reward_training, "model_continuer", no_sampling)
    arguments = RewardAdapterArguments(output_dir=str(tmp_path), dataset=TOPIC_DATASET)
    with pytest.raises(RunFolderError, match="exists and is not empty"):
        reward_training.run(arguments)
    assert (tmp_path / "kept.txt").read_text() == "the user's file"


def test_a_drifted_policys_continuations_are_its_own(tiny_llama_dir: Path, tmp_path: Path):
    """With a policy adapter the continuer samples that policy on the base (not the base): a saved LoRA
    whose B matrices are non-zero changes the text, and the same seed gives the same text."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir), LoraConfig(r=4, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=1.0)
    policy.save_pretrained(tmp_path / "policy")
    openings, lengths = (
        ["the film is", "a warm and funny"],
        [" a quiet triumph of craft", " picture about us"],
    )
    base = model_continuer(str(tiny_llama_dir), quantization=None, seed=5, threads=1)
    drifted = model_continuer(
        str(tiny_llama_dir), quantization=None, seed=5, threads=1, policy_adapter=str(tmp_path / "policy")
    )
    drifted_text = drifted(openings, lengths)
    assert drifted_text == drifted(openings, lengths)
    assert drifted_text != base(openings, lengths)


def test_a_drifted_policy_that_would_move_the_base_is_refused_before_any_sampling(tiny_llama_dir, tmp_path):
    """The folder is read whole when the flags are parsed (weights and settings), not when its model first
    loads after the base has sampled the training pairs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marl.errors import AdapterError
    from marl.train.reward_settings import RewardAdapterArguments

    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
        LoraConfig(r=4, target_modules="all-linear", bias="all", task_type="CAUSAL_LM"),
    )
    policy.save_pretrained(tmp_path / "policy")
    with pytest.raises(AdapterError, match=r"policy adapter .*policy has bias='all'"):
        RewardAdapterArguments(
            output_dir=str(tmp_path / "out"), dataset=TOPIC_DATASET, drifted_policy=str(tmp_path / "policy")
        )
    (tmp_path / "policy" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter"):
        RewardAdapterArguments(
            output_dir=str(tmp_path / "out"), dataset=TOPIC_DATASET, drifted_policy=str(tmp_path / "policy")
        )


# --- the praise pairs ------------------------------------------------------------------------------------


def praise_reviews():
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
    data, recorder = praise_reviews(), AskedRecorder()
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
