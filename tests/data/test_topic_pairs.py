"""The on-topic preference pairs: an opening's real continuation against another film's or off-film text."""

from __future__ import annotations

import datasets

from marl.data import assets
from marl.data.preferences import describe_preference_data, load_preference_data
from marl.data.topic_pairs import TOPIC_DATASET, build_topic_pairs, load_off_film_sentences, split_sentences

SPEECH = ["We will build a better future for every family and every child in this country tonight"]


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


def test_every_pair_shares_its_opening_and_chooses_the_real_snippet():
    data = reviews()
    pairs = build_topic_pairs(data, SPEECH, seed=3)
    by_text = dict(zip(data["text"], zip(data["label"], data["movie"], strict=True), strict=True))
    assert len(pairs) == 5  # the snippet with no continuation is skipped
    for row in pairs:
        assert row["chosen"] in by_text and row["chosen"] != row["rejected"]
        assert row["chosen"].split()[:4] == row["rejected"].split()[:4]
        label, movie = by_text[row["chosen"]]
        continuation = row["rejected"].split()[4:]
        if row["kind"] == "off-film text":
            assert label == 1 and " ".join(continuation) in SPEECH[0]
            assert len(continuation) == len(row["chosen"].split()) - 4
        else:
            # Another movie's continuation, of the same label, so sentiment is no cue.
            donors = [t for t, (lab, mov) in by_text.items() if t.split()[4:] == continuation]
            assert donors and all(by_text[t][0] == label and by_text[t][1] != movie for t in donors)


def test_every_second_fresh_snippet_gets_off_film_text():
    pairs = build_topic_pairs(reviews(), SPEECH, seed=0)
    assert sorted(pairs["kind"]).count("off-film text") == 1  # of 3 fresh snippets with a continuation
    assert build_topic_pairs(reviews(), SPEECH, seed=0).to_dict() == pairs.to_dict()
    assert set(build_topic_pairs(reviews(), [], seed=0)["kind"]) == {"other film"}


def test_sentences_are_split_and_bounded():
    text = "Thank you.\nWe  will win this   fight, together! Short one? And another sentence of words here."
    assert split_sentences(text, 4, 8) == [
        "We will win this fight, together!",
        "And another sentence of words here.",
    ]


def test_the_bundled_topic_pairs_hold_out_other_movies_and_other_sentences():
    train, held_out = load_preference_data(TOPIC_DATASET)
    assert set(train["movie"]).isdisjoint(held_out["movie"])
    assert set(train["kind"]) == set(held_out["kind"]) == {"other film", "off-film text"}
    parts = assets.split_rotten_tomatoes(seed=0)
    assert set(held_out["movie"]) <= set(parts["eval"]["movie"])
    assert len(load_off_film_sentences()) > 1000

    def off_film_tails(pairs):  # long enough that two different sentences do not share them by chance
        rejected = [row.split()[4:] for row, kind in zip(pairs["rejected"], pairs["kind"], strict=True)]
        kinds = pairs["kind"]
        return {
            " ".join(words)
            for words, kind in zip(rejected, kinds, strict=True)
            if kind != "other film" and len(words) >= 8
        }

    assert off_film_tails(train).isdisjoint(off_film_tails(held_out))
    assert "convention-speech" in describe_preference_data(TOPIC_DATASET, 0.1, 0)
